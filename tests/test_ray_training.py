"""Training on Ray worker tasks through the trainer (issue 15): the same numbers as a local run,
exact resume of a Ray run, and a worker killed mid-run restarted with the last checkpoint restored,
ending where an uninterrupted run ends; past cluster.max_failures the run ends with exit 5 and its
last checkpoint intact. One local Ray instance serves the module."""
from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from flowctl.engine.errors import WorkerLostError
from flowctl.spec.loader import load_text
from flowctl.training.trainer import Trainer

ray = pytest.importorskip("ray")

MODEL = """\
version: 1
name: mlp
model:
  layers:
    - {name: x, type: input, shape: [10]}
    - {name: h, type: dense, units: 16, activation: relu}
    - {name: logits, type: dense, units: 4}
    - {name: y, type: input, shape: [], dtype: int32, classes: 4}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
data: {source: synthetic, task: learnable, seed: 3}
training: {optimizer: {type: adam}, learning_rate: 0.05, batch_size: 16, steps: 8, seed: 2}
checkpoint: {every_steps: 3, keep: 3}
"""
RAY = "cluster: {type: ray, workers: 2, max_failures: %d}\ndevices: [worker0/cpu:0, worker1/cpu:0]\n"
LOCAL = "devices: [cpu:0, cpu:1]\n"
MODEL_PARALLEL = "parallelism: {strategy: model_parallel, groups: [{layers: [h], device: %s}, " \
                 "{layers: [logits, loss], device: %s}]}\n"
SYNC = "parallelism: {strategy: sync_data_parallel, replicas: 2}\n"


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20,
             _temp_dir=tmp)
    try:
        yield
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)


def trainer(text: str, run: Path, steps: int | None = None, resume: bool = False) -> Trainer:
    t = Trainer(load_text(text, filename="mlp.yaml"), run, steps=steps, prefetch=0)
    if resume:
        t.restore()
    else:
        t.start_fresh(text, "")
    return t


def train(text: str, run: Path, steps: int | None = None, resume: bool = False, on_step=None) -> dict:
    t = trainer(text, run, steps, resume)
    if on_step is not None:
        t.on_step = lambda e: on_step(t, e)
    try:
        t.train()
        return t.session.variable_values()
    finally:
        t.close()


def losses(run: Path) -> list[float]:
    import json

    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def test_model_parallel_over_two_workers_gives_the_single_device_losses(tmp_path):
    single = train(MODEL, tmp_path / "one")
    remote = train(MODEL + RAY % 3 + MODEL_PARALLEL % ("worker0/cpu:0", "worker1/cpu:0"), tmp_path / "ray")
    assert losses(tmp_path / "ray") == losses(tmp_path / "one")
    for k, v in single.items():
        np.testing.assert_array_equal(remote[k], v, err_msg=k)


def test_sync_data_parallel_over_two_workers_equals_it_on_two_local_devices(tmp_path):
    local = train(MODEL + LOCAL + SYNC, tmp_path / "local")
    remote = train(MODEL + RAY % 3 + SYNC, tmp_path / "ray")
    np.testing.assert_allclose(losses(tmp_path / "ray"), losses(tmp_path / "local"), rtol=1e-6)
    for k, v in local.items():
        np.testing.assert_allclose(remote[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


def test_allreduce_over_two_workers_resumes_exactly_and_survives_a_killed_worker_byte_for_byte(tmp_path):
    """Issue 33: 20 steps straight == 10 + resume + 10, and a run whose worker is killed at step 12
    ends with the uninterrupted run's final checkpoint, byte for byte."""
    spec = (MODEL.replace("steps: 8", "steps: 20").replace("every_steps: 3", "every_steps: 5") + RAY % 3
            + "parallelism: {strategy: sync_data_parallel, reduce: allreduce}\n")
    local = train(spec.replace(RAY % 3, LOCAL), tmp_path / "local")
    straight = train(spec, tmp_path / "full")
    train(spec, tmp_path / "split", steps=10)
    train(spec, tmp_path / "split", resume=True)
    train(spec, tmp_path / "killed", on_step=_killer({12}))
    assert "replica_1/h/kernel" in straight  # each worker held its own copy
    for k, v in local.items():  # the same numbers as two devices of one process, bit for bit
        np.testing.assert_array_equal(straight[k], v, err_msg=k)
    assert losses(tmp_path / "split") == losses(tmp_path / "killed") == losses(tmp_path / "full")
    final = "checkpoints/ckpt-00000020/tensors.safetensors"
    assert '"event": "restart"' in (tmp_path / "killed" / "metrics.jsonl").read_text()
    for run in ("split", "killed"):
        assert (tmp_path / run / final).read_bytes() == (tmp_path / "full" / final).read_bytes(), run


ALLREDUCE = "parallelism: {strategy: sync_data_parallel, reduce: allreduce}\n"


def traced(spec: str, run: Path, steps: int) -> dict:
    """Train `steps` steps with the last one traced (`train --trace`); the trace."""
    import json

    t = Trainer(load_text(spec, filename="spec.yaml"), run, steps=steps, prefetch=0, trace_step=steps)
    t.start_fresh(spec, "")
    try:
        t.train()
    finally:
        t.close()
    return json.loads((run / f"trace-{steps}.json").read_text())


def test_a_traced_step_of_an_allreduce_run_has_each_workers_tracks(tmp_path):
    """`train --trace` on Ray workers: the partitions are the workers' (the trace once looked for
    them in the master's own graph and failed with a KeyError)."""
    trace = traced(MODEL + RAY % 3 + ALLREDUCE, tmp_path / "run", 3)
    measured = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"
              and e["pid"] == 1}
    assert {"worker0/cpu:0 compute", "worker1/cpu:0 compute"} <= tracks
    devices = {e["args"]["device"] for e in measured}
    assert len(devices) == 2 and all("/job:worker/" in d for d in devices)
    assert any(e["cat"] == "Send" for e in measured) and any(e["cat"] == "Recv" for e in measured)
    assert set(trace["otherData"]["executor"]) == {"worker0/cpu:0", "worker1/cpu:0"}


LSTM = """\
version: 1
name: tiny_lm
model:
  layers:
    - {name: tokens, type: input, shape: [6], dtype: int32, classes: 50}
    - {name: embedding, type: embedding, vocab: 50, dim: 8, inputs: [tokens]}
    - {name: lstm, type: lstm, units: 8}
    - {name: softmax, type: dense, units: 50}
    - {name: targets, type: input, shape: [6], dtype: int32, classes: 50}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}
data: {source: synthetic, seed: 0}
training: {optimizer: {type: sgd}, learning_rate: 0.1, batch_size: 8, steps: 2}
"""


def test_a_workers_cpu_partition_runs_the_cpu_plan_passes_and_its_trace_shows_them(tmp_path):
    """Each worker's CPU partition goes through the CPU's plan passes (runtime.partition_graph): a
    recurrent weight packed once a step where the rule packs it, as one CPU device would, and the
    trace names those nodes (the master asks for the graphs its workers run)."""
    from flowctl.engine import recurrent_pack

    trace = traced(LSTM + RAY % 3 + ALLREDUCE, tmp_path / "run", 2)
    ops = {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1}
    packed = recurrent_pack.enabled()
    assert ("PackPanels" in ops) == packed and ("PanelMatMul" in ops) == packed
    assert "Send" in ops and "Recv" in ops


def test_a_ray_run_resumes_exactly(tmp_path):
    spec = MODEL + RAY % 3 + MODEL_PARALLEL % ("worker0/cpu:0", "worker1/cpu:0")
    straight = train(spec, tmp_path / "full")
    train(spec, tmp_path / "split", steps=5)
    again = train(spec, tmp_path / "split", resume=True)
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
    for k, v in straight.items():
        np.testing.assert_array_equal(again[k], v, err_msg=k)


def _killer(at: set[int]):
    def kill(t: Trainer, e) -> None:
        if e.step in at:
            at.discard(e.step)
            os.kill(t.session.workers[1].pid, signal.SIGKILL)
    return kill


def test_a_killed_worker_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path):
    spec = MODEL + RAY % 3 + MODEL_PARALLEL % ("worker0/cpu:0", "worker1/cpu:0")
    straight = train(spec, tmp_path / "full")
    survived = train(spec, tmp_path / "killed", on_step=_killer({5}))
    for k, v in straight.items():
        np.testing.assert_array_equal(survived[k], v, err_msg=k)
    metrics = (tmp_path / "killed" / "metrics.jsonl").read_text()
    assert '"event": "restart"' in metrics and '"failed_step": 6' in metrics and '"resumed_step": 3' in metrics
    assert losses(tmp_path / "killed") == losses(tmp_path / "full")  # the restore rewrote the lost steps


def test_past_max_failures_the_run_ends_with_exit_5_and_its_checkpoint_intact(tmp_path):
    spec = MODEL + RAY % 1 + MODEL_PARALLEL % ("worker0/cpu:0", "worker1/cpu:0")
    with pytest.raises(WorkerLostError) as e:
        train(spec, tmp_path / "run", on_step=_killer({4, 5}))
    assert e.value.exit_code == 5 and "max_failures is 1" in str(e.value) and "intact" in str(e.value)
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == "ckpt-00000003"
    again = train(spec, tmp_path / "run", resume=True)  # resumable: and it ends where a clean run does
    straight = train(spec, tmp_path / "full")
    for k, v in straight.items():
        np.testing.assert_array_equal(again[k], v, err_msg=k)


def test_the_banner_names_each_workers_device():
    """Two workers' cpu:0 are two devices: the banner says whose (it said 'cpu:0, cpu:0')."""
    from flowctl.engine.devices import spec_name
    from flowctl.training.program import place_for_training

    placed = place_for_training(load_text(MODEL + RAY % 3 + MODEL_PARALLEL % ("worker0/cpu:0", "worker1/cpu:0"),
                                          filename="mlp.yaml"))
    assert placed.step.describe(placed.devices_used()) == "model_parallel over worker0/cpu:0, worker1/cpu:0"
    assert [spec_name(d) for d in ("cpu:1", "/job:worker/task:2/device:gpu:0", "/job:ps/task:0/device:cpu:0")] == \
        ["cpu:1", "worker2/gpu:0", "ps0/cpu:0"]
    assert spec_name("/job:w1/task:0/device:cpu:0") == "/job:w1/task:0/device:cpu:0"  # 'w10/cpu:0' reads back wrong


def test_a_worker_lost_under_the_cli_is_one_step_number_and_flowctls_lines_with_rays_text_in_the_run_log(
        tmp_path, monkeypatch, capfd):
    """`flowctl train` on two workers, worker 1 killed after step 5: the person reads flowctl's
    lines (the banner naming both workers, the loss at step 6: the number the step lines count),
    on stderr; Ray's paragraph about the dead worker is in RUN/ray.log, on neither stream."""
    from click.testing import CliRunner

    import flowctl.cli.train as cli_train
    import flowctl.training.runs as runs
    from flowctl.cli.main import cli

    spec = tmp_path / "mlp.yaml"
    spec.write_text(MODEL.replace("seed: 2}", "seed: 2, log_every_steps: 1}") + RAY % 3
                    + MODEL_PARALLEL % ("worker0/cpu:0", "worker1/cpu:0"))
    started: list[Trainer] = []
    start_run = runs.start_run
    monkeypatch.setattr(runs, "start_run", lambda *a, **k: started.append(start_run(*a, **k)) or started[-1])
    show = cli_train._Display.step
    kill = _killer({5})
    monkeypatch.setattr(cli_train._Display, "step", lambda self, e: (show(self, e), kill(started[0], e)))
    run = tmp_path / "run"
    r = CliRunner().invoke(cli, ["train", str(spec), "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    fd = capfd.readouterr()
    err, out = r.stderr, r.stdout
    assert "model_parallel over worker0/cpu:0, worker1/cpu:0" in err
    lost = [line for line in err.splitlines() if re.search(r"\blost\b", line)]
    assert len(lost) == 2, lost  # the worker's state, and the warning with the recovery
    assert "worker 1: lost (ActorDiedError while running a step)" == lost[0]
    assert "worker task 1 lost at step 6 " in lost[1] and f"Ray's account in {run / 'ray.log'}" in lost[1]
    assert [int(n) for line in lost for n in re.findall(r"step (\d+)", line)] == [6]
    assert out.startswith("trained steps 1-8 in ") and out.count("\n") == 1
    for stream in (err, out, fd.out, fd.err):
        assert "A worker died" not in stream and "(raylet)" not in stream
    assert "A worker died or was killed" in (run / "ray.log").read_text()


def test_a_ray_log_takes_rays_text_while_open_and_gives_it_back(tmp_path, capfd):
    import logging

    import ray._private.worker as ray_worker

    from flowctl.engine.distributed.ray_log import RayLog

    printer, handlers = ray_worker.print_to_stdstream, list(logging.getLogger("ray").handlers)
    log = RayLog(tmp_path / "run" / "ray.log").open()
    logging.getLogger("ray.some_module").warning("a record of Ray's logger")
    ray_worker.print_to_stdstream({"lines": ["A worker died or was killed ..."], "pid": "raylet", "is_err": False},
                                  ignore_prefix=False)
    log.close()
    text = (tmp_path / "run" / "ray.log").read_text()
    assert "a record of Ray's logger" in text and "(raylet) A worker died or was killed ..." in text
    assert log.lines == 2 and capfd.readouterr() == ("", "")
    assert ray_worker.print_to_stdstream is printer and logging.getLogger("ray").handlers == handlers
