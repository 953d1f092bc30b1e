"""`flowctl bench dataparallel` (issue 33): one process against two Ray workers per scheme, in one
sitting, written in the form `bench scaling` calibrates on. Slow: it starts Ray and four workers."""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

SPEC = """\
version: 1
name: lstm_lm
model:
  layers:
    - {name: x, type: input, shape: [32]}
    - {name: h, type: dense, units: 64, activation: relu}
    - {name: logits, type: dense, units: 4}
    - {name: y, type: input, shape: [], dtype: int32, classes: 4}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
data: {source: synthetic, task: learnable, seed: 0}
training: {optimizer: {type: sgd}, learning_rate: 0.1, batch_size: 16, steps: 10}
"""


@pytest.mark.slow
def test_dataparallel_measures_each_row_and_bench_scaling_reads_it(tmp_path: Path, monkeypatch):
    from flowctl.bench.dataparallel import dataparallel_benchmark
    from flowctl.bench.scaling import read_measured

    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="dp", dir="/tmp"))
    spec = tmp_path / "mlp.yaml"
    spec.write_text(SPEC)
    r = dataparallel_benchmark(steps=2, rounds=1, spec=spec)
    assert r["one_process"]["batch"] == 16 and r["two_workers"]["allreduce"]["batch"] == 32  # weak scaling
    for row in (r["one_process"], r["one_process_all_threads"], r["two_processes"], *r["two_workers"].values()):
        assert row["examples_per_s"] > 0 and row["step_s"] > 0
    # the ceiling: both processes' steps, each at the spec's batch; its rounds are timed like the others'
    assert r["two_processes"]["batch"] == 32 and len(r["two_processes"]["rounds_examples_per_s"]) == 1
    assert r["ratios"]["allreduce_vs_two_processes"] == pytest.approx(
        r["two_workers"]["allreduce"]["examples_per_s"] / r["two_processes"]["examples_per_s"])
    assert r["ratios"]["allreduce_vs_one_process"] == pytest.approx(
        r["two_workers"]["allreduce"]["examples_per_s"] / r["one_process"]["examples_per_s"])
    assert r["links"]["allreduce"]["bandwidth_Bps"] > 0 and r["link_rates"]["64_MiB"]["GBps"] > 0
    # Ray's own processes (raylet, GCS, the two idle actors at least) were found and use some CPU
    assert r["ray_idle"]["processes"] >= 4 and 0 < r["ray_idle"]["ms_per_s"] < 1000 * r["cores"]
    path = tmp_path / "dataparallel-cpu.json"
    path.write_text(json.dumps(r))
    measured = read_measured(path)
    assert measured is not None and measured.two_workers.keys() == {"allreduce", "parameter_device"}
    assert os.environ.get("RAY_ADDRESS") is None


def test_cpu_seconds_reads_a_process_s_own_time_and_none_for_a_gone_one():
    from flowctl.bench.dataparallel import _cpu_seconds

    before = _cpu_seconds(os.getpid())
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    after = _cpu_seconds(os.getpid())
    assert before is not None and after is not None and 0.1 < after - before < 5
    assert _cpu_seconds(2 ** 22 + 12345) is None  # above the kernel's largest pid


def test_a_companion_that_dies_is_one_line():
    """The two_processes row's companion dying mid-sitting stops the bench with a FlowctlError
    naming it and its exit code, not a bare EOFError or BrokenPipeError from its pipe."""
    from flowctl.bench.dataparallel import _TwoProcesses
    from flowctl.engine.errors import FlowctlError

    pair = _TwoProcesses(SPEC, 16, 1)
    try:
        assert len(pair.block(1)) == 2  # both sides ran their step
        pair.proc.kill()
        pair.proc.join(10)
        with pytest.raises(FlowctlError, match=r"companion failed: it exited \(exit code -9\)"):
            pair.block(1)
    finally:
        pair.close()


def test_the_link_is_timed_after_twice_the_object_store_has_crossed():
    from flowctl.bench.ray import WARM_RUNS_MAX, _warm_runs

    store = 512 << 20
    assert _warm_runs(4 * (64 << 20), store) == 4  # four 64 MiB crossings a run: 1 GiB in four runs
    assert _warm_runs(3 * (64 << 20), store) == 6  # rounded up
    assert _warm_runs(16, store) == WARM_RUNS_MAX  # a 4-byte chain: as many as allowed
    assert _warm_runs(4 * (64 << 20), 0) == 1  # no store known: the one run that builds the plans
