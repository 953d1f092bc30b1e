"""What a command imports before it does anything: ml_dtypes only where bfloat16 is used (its
extension took 1.2-1.7 s to import on a 2-core host), and PyTorch never through tensorboardX's
package (4.9 s). Each check runs in a fresh interpreter: this one has imported both long ago."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _python(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_a_float32_step_does_not_import_ml_dtypes_and_a_bfloat16_one_does():
    out = _python("""
        import sys
        import numpy as np
        import flowctl as fc
        import flowctl.cli.main  # every command's imports
        g = fc.Graph()
        with g.as_default():
            x = fc.placeholder("float32", (None, 3), name="x")
            y = fc.reduce_sum(fc.add_n([x, x * 2.0]))
        s = fc.Session(g)
        assert float(s.run(y, {x: np.ones((2, 3), np.float32)})) == 18.0
        print("ml_dtypes" in sys.modules)
        from flowctl.engine.dtypes import BFLOAT16, DTYPES, as_dtype, itemsize, np_dtype
        assert itemsize("bfloat16") == 2 and np_dtype("bfloat16") == BFLOAT16 == DTYPES["bfloat16"]
        assert as_dtype(BFLOAT16) == "bfloat16" and list(DTYPES)[:3] == ["float16", "bfloat16", "float32"]
        with g.as_default():
            z = fc.reduce_sum(fc.cast(fc.add_n([fc.cast(x, "bfloat16")] * 2), "float32"))
        print(float(s.run(z, {x: np.full((2, 3), 1.5, np.float32)})))
        print("ml_dtypes" in sys.modules)
    """)
    assert out.split() == ["False", "18.0", "True"]


def test_event_files_are_written_without_importing_pytorch(tmp_path):
    pytest.importorskip("torch")
    out = _python(f"""
        import sys
        from pathlib import Path
        from flowctl.training.events import EventWriter
        w = EventWriter(Path({str(tmp_path)!r}))
        w.scalars(1, {{"loss": 0.5}})
        w.close()
        print("torch" in sys.modules, "tensorboardX" in sys.modules)
        import torch  # and PyTorch still imports afterwards
        import tensorboardX.writer
        print(type(torch.zeros(1)).__name__)
    """)
    assert out.split() == ["False", "True", "Tensor"]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
