"""Hostile input that used to end in a traceback (issue 31, item 17): each is one clear message,
with the spec's file:line:col where there is a spec, and a non-zero exit -- a YAML file nested
thousands deep, a NUL byte, sizes no machine holds, a block repeated ten million times, an empty
spec, an empty .npz, and a Ctrl-C while the command line is still importing."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.spec.blocks import MAX_LAYERS, MAX_NESTING
from flowctl.spec.check import MAX_PARAMETERS
from flowctl.spec.source import MAX_DEPTH

ROOT = Path(__file__).resolve().parents[1]
DEMO = (ROOT / "flowctl" / "spec" / "builtin" / "demo.yaml").read_text()


def spec_error(tmp_path: Path, text: str, *needles: str, name: str = "hostile.yaml") -> str:
    """`validate --no-build` on `text`: exit 2 and one error, holding every needle."""
    path = tmp_path / name
    path.write_text(text)
    r = CliRunner().invoke(cli, ["validate", "--no-build", str(path)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert r.output.startswith("error: invalid spec:\n"), r.output  # one problem, not a list
    for n in needles:
        assert n.replace("{file}", str(path)) in r.output, r.output
    return r.output


def test_yaml_nested_thousands_deep_is_a_spec_error_at_the_level_past_the_bound(tmp_path):
    spec_error(tmp_path, "version: 1\nmodel: " + "[" * 3000 + "]" * 3000 + "\n",
               f"{{file}}:2:{len('model: ') + MAX_DEPTH}: mappings and lists nested more than {MAX_DEPTH} levels")
    # Block-style mappings, too (the bound counts levels, not brackets).
    deep = "version: 1\nmodel:\n" + "".join("  " * (i + 1) + "a:\n" for i in range(2000))
    spec_error(tmp_path, deep, f"nested more than {MAX_DEPTH} levels")


def test_a_nul_byte_is_a_spec_error_at_its_line_and_column(tmp_path):
    text = DEMO.replace("name: demo_mlp", "name: demo\x00mlp")
    line = text[: text.index("\x00")].count("\n") + 1
    col = text.index("\x00") - text.rfind("\n", 0, text.index("\x00"))
    spec_error(tmp_path, text, f"{{file}}:{line}:{col}: character NUL is not allowed in YAML")


def test_an_empty_spec_is_a_spec_error_at_line_1(tmp_path):
    spec_error(tmp_path, "", "{file}:1:1: the spec is empty", name="empty.yaml")
    spec_error(tmp_path, "# nothing but a comment\n", "{file}:1:1: the spec is empty", name="comment.yaml")


@pytest.mark.parametrize("units", ["1000000000", "1" + "0" * 30])
def test_a_layer_beyond_the_parameter_bound_is_a_spec_error_naming_it(tmp_path, units):
    """`units: 1000000000` was a MemoryError at validate, 10**30 a ValueError from numpy."""
    text = DEMO.replace("units: 64", f"units: {units}")
    line = text[: text.index(f"units: {units}")].count("\n") + 1
    out = spec_error(tmp_path, text, f"{{file}}:{line}:7: model.layers[hidden_1]: dense layer 'hidden_1' has",
                     f"kernel [16, {units}]", f"more than the {MAX_PARAMETERS:,} (2^31) a model may hold")
    assert "metric accuracy" not in out  # no second error about the loss the failed layer fed


def test_a_model_beyond_the_parameter_bound_in_all_is_a_spec_error_naming_its_largest_layers(tmp_path):
    text = DEMO.replace("units: 64", "units: 40000000").replace("units: 32", "units: 40")
    spec_error(tmp_path, text, "model.layers: the model has 2,280,000,204 parameters",
               "(largest: hidden_2 1,600,000,040, hidden_1 680,000,000")


def test_an_output_beyond_the_element_bound_is_a_spec_error(tmp_path):
    spec_error(tmp_path, DEMO.replace("shape: [16]", "shape: [100000, 100000]"),
               "input layer 'features' outputs 10,000,000,000 elements per example")


BLOCKS = """\
version: 1
model:
  blocks:
    inner:
      layers:
        - {name: d, type: dense, units: 8}
    outer:
      layers:
        - {name: i, block: inner, repeat: 1000}
  layers:
    - {name: x, type: input, shape: [8]}
    - {name: s, block: BLOCK, repeat: REPEAT}
"""


def test_a_block_repeated_ten_million_times_is_refused_before_it_expands(tmp_path):
    """It took more than a minute to expand (then to check) before; now the repeat counts are
    multiplied first. The error stands at the repeat and names the bound."""
    text = BLOCKS.replace("BLOCK", "inner").replace("REPEAT", "10000000")
    col = text.splitlines()[11].index("10000000") + 1
    spec_error(tmp_path, text, f"{{file}}:12:{col}: model.layers[s].repeat: the model would have 10,000,001 layers",
               f"more than the {MAX_LAYERS:,} a model may have", "block 'inner' × 10,000,000 expands to 10,000,000")
    # Nested repeats multiply: 1,000 outer × 1,000 inner.
    spec_error(tmp_path, BLOCKS.replace("BLOCK", "outer").replace("REPEAT", "1000"),
               "block 'outer' × 1,000 expands to 1,000,000")
    # Under the bound it expands as before.
    path = tmp_path / "ok.yaml"
    path.write_text(BLOCKS.replace("BLOCK", "outer").replace("REPEAT", "2").replace("repeat: 1000", "repeat: 3"))
    r = CliRunner().invoke(cli, ["validate", "--no-build", str(path)])
    assert r.exit_code == 0 and "7 layers" in r.output, r.output


def test_blocks_nested_past_the_bound_are_one_error(tmp_path):
    n = MAX_NESTING + 8
    lines = ["version: 1", "model:", "  blocks:"]
    for i in range(n):
        body = f"{{name: u, block: b{i + 1}}}" if i < n - 1 else "{name: d, type: dense, units: 4}"
        lines += [f"    b{i}:", "      layers:", f"        - {body}"]
    lines += ["  layers:", "    - {name: x, type: input, shape: [8]}", "    - {name: s, block: b0}"]
    spec_error(tmp_path, "\n".join(lines) + "\n", f"blocks nest more than {MAX_NESTING} deep: b0 -> b1")


def test_out_of_memory_under_the_bounds_is_one_line(tmp_path, monkeypatch):
    """A model within the bounds can still be more than the machine holds."""
    import numpy as np

    import flowctl.spec.check as check

    spec = tmp_path / "demo.yaml"
    spec.write_text(DEMO)

    def too_much(*args, **kw):
        return np.zeros((2**25, 2**25), np.float32)  # 4 PiB: numpy's own MemoryError and message

    monkeypatch.setattr(check, "_check_devices", too_much)
    r = CliRunner().invoke(cli, ["validate", "--no-build", str(spec)])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert r.output.startswith("error: out of memory: Unable to allocate"), r.output


def test_training_on_an_empty_npz_is_one_line_naming_the_file(tmp_path):
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    r = CliRunner().invoke(cli, ["train", "--data", str(empty), "--steps", "1", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "Aborted" not in r.output and "Traceback" not in r.output
    assert f"{empty}: cannot read arrays: the file is empty" in r.output


# A Ctrl-C that lands while the console script is still importing: the finder below sends the
# process SIGINT when numpy is first imported (the engine's first heavy import), in the sequence
# the installed `flowctl` script runs (`from flowctl.cli.main import main; sys.exit(main())`).
INTERRUPTED_IMPORT = textwrap.dedent("""
    import os, signal, sys

    class Interrupt:
        def find_spec(self, name, path=None, target=None):
            if name == "numpy":
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGINT)
            return None

    sys.meta_path.insert(0, Interrupt())
    sys.argv = ["flowctl", "validate", "--no-build", sys.argv[1]]
    from flowctl.cli.main import main
    sys.exit(main())
""")


def test_ctrl_c_while_the_cli_imports_exits_130_quietly(tmp_path):
    spec = tmp_path / "demo.yaml"
    spec.write_text(DEMO)
    # SIGINT at its default in the child, whatever this process inherited: Python installs its
    # KeyboardInterrupt handler only over the default, and a test run started in the background of
    # a non-interactive shell inherits SIGINT ignored (the child then ran to the end and exited 0)
    r = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT, str(spec)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == 130, (r.returncode, r.stderr)
    assert r.stderr == "" and r.stdout == ""


def test_the_console_scripts_module_imports_nothing_heavy():
    """What the script imports before `main` runs is outside its guard: only flowctl's root and
    its version, no numpy, click or engine."""
    code = ("import sys; import flowctl.cli.main; "
            "print(sorted(m for m in sys.modules if m.startswith(('flowctl', 'numpy', 'click', 'rich'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["['flowctl',", "'flowctl.cli',", "'flowctl.cli.main',", "'flowctl.version']"]
