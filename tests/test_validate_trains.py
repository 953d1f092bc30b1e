"""`flowctl validate` says OK only to a spec that `flowctl train` starts: every spec in specs/ and
tests/cases/ that validates trains one step with the same overrides (the big models at batch 2, so
the default suite stays fast; NMT and the full batches run under -m slow)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").glob("*.yaml")) + sorted((ROOT / "tests" / "cases").glob("*.yaml"))
BIG = {"inception_v3"}  # seconds per step on two cores: at batch 2 in the default suite
# nmt: 129M parameters, a minute and more to initialise, step and checkpoint; transformer_lm (GPT-2
# small, 124M): its step at batch 8 × 1024 tokens holds ~42 GiB, more than a CI machine has.
SLOW = {"nmt", "transformer_lm"}


def _validate_then_train(spec: Path, tmp_path: Path, overrides: list[str]) -> None:
    sets = [a for o in overrides for a in ("--set", o)]
    v = CliRunner().invoke(cli, ["validate", str(spec), *sets])
    if v.exit_code != 0:
        assert "Traceback" not in v.output and isinstance(v.exception, SystemExit), v.output
        return  # an error case: validate refused it with its exit code
    t = CliRunner().invoke(cli, ["train", str(spec), "--steps", "1", "--run-dir", str(tmp_path / "run"),
                                 "--prefetch", "0", *sets])
    assert t.exit_code == 0, f"validate passed {spec.name} but train failed:\n{t.output}"
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()


@pytest.mark.parametrize("spec", [s for s in SPECS if s.stem not in BIG | SLOW], ids=lambda p: p.stem)
def test_a_spec_that_validates_trains(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _validate_then_train(spec, tmp_path, [])


@pytest.mark.parametrize("spec", [s for s in SPECS if s.stem in BIG], ids=lambda p: p.stem)
def test_a_big_spec_that_validates_trains_at_batch_2(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _validate_then_train(spec, tmp_path, ["training.batch_size=2"])


# transformer_lm plans for a 48 GiB host (its spec says so): its own batch trains only on one.
NEEDS_GIB = {"transformer_lm": 48}


def _memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


@pytest.mark.slow
@pytest.mark.parametrize("spec", [s for s in SPECS if s.stem in BIG | SLOW], ids=lambda p: p.stem)
def test_a_big_spec_trains_at_its_own_batch(spec, tmp_path, monkeypatch):
    need = NEEDS_GIB.get(spec.stem, 0)
    if _memory_gib() < need:  # it would be killed by the kernel's OOM killer, taking pytest with it
        pytest.skip(f"{spec.stem} at its own batch needs a {need} GiB host; this one has {_memory_gib():.0f} GiB")
    monkeypatch.chdir(tmp_path)
    _validate_then_train(spec, tmp_path, [])


@pytest.mark.slow
def test_gpt2_small_trains_a_step_at_batch_1(tmp_path, monkeypatch):
    """GPT-2 small's step at batch 1 (1,024 tokens: ~5 GiB), on any machine the slow set runs on."""
    monkeypatch.chdir(tmp_path)
    _validate_then_train(ROOT / "specs" / "transformer_lm.yaml", tmp_path, ["training.batch_size=1"])


def test_validate_refuses_what_train_would_refuse(tmp_path):
    """A spec whose placement cannot be met (a constraint on a device the machine-independent
    checks accept, but a colocation group split across two devices) fails validate with exit 4."""
    spec = tmp_path / "s.yaml"
    spec.write_text("""\
version: 1
model:
  layers:
    - {name: x, type: input, shape: [4]}
    - {name: a, type: dense, units: 4}
    - {name: b, type: dense, units: 2}
    - {name: y, type: input, shape: [], dtype: int32, classes: 2}
    - {name: loss, type: softmax_cross_entropy, inputs: [b, y]}
devices: [cpu:0, cpu:1]
placement:
  constraints: [{match: a, device: cpu:0}, {match: b, device: cpu:1}]
  colocate: [[a, b]]
""")
    r = CliRunner().invoke(cli, ["validate", str(spec)])
    assert r.exit_code == 4, r.output
    assert "Traceback" not in r.output
    r2 = CliRunner().invoke(cli, ["validate", "--no-build", str(spec)])
    assert r2.exit_code == 0, r2.output  # the static checks alone cannot see it
