"""Training steps timed on the cluster's devices: what `flowctl bench SPEC` measures each placement
with, and the learned placer's measured reward (Mirhoseini et al. 2017 trained on measured steps;
placement-notes.md).

A step is the spec's loss and train op, fed one batch from its input with the learning rate at 0,
so the variables stay as they are and every placement measured sees the same state. The state
lives in one ContainerStore, filled once by the initializer on the first device; every session
over that store finds the variables by name (§3.3: containers outlive a session).
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import numpy as np

import flowctl as fc
from flowctl.engine.cluster import Cluster
from flowctl.engine.container import ContainerStore
from flowctl.engine.errors import PlacementError
from flowctl.engine.runtime import DistributedSession, blas_limits
from flowctl.kernels.registry import gpu_count
from flowctl.spec.check import LoadedSpec
from flowctl.training.inputs import make_sources

if TYPE_CHECKING:  # program.py builds the meter: it imports this module
    from flowctl.training.program import Step


def step_fetches(step: Step) -> list[fc.Tensor]:
    assert step.train is not None
    return [step.train.loss, step.train.train_op]


def step_feeds(step: Step, loaded: LoadedSpec) -> dict[Any, Any]:
    assert step.train is not None
    # An accumulating step is timed as one micro-batch's run with the update (what the simulator
    # models, at the cost model's micro-batch): the other K-1 runs are that run less the update.
    batch = step.batch // step.train.micro_batches
    feeds: dict[Any, Any] = step.train.feeds(make_sources(loaded, 1, batch)[0].next_batch())
    feeds[step.lr] = np.asarray(0.0, dtype=step.lr.dtype)  # rate 0: the variables stay where they are
    return feeds


def timed_block(session: Any, step: Step, feeds: dict[Any, Any], steps: int) -> list[float]:
    """One untimed step (after another placement ran, caches and BLAS threads are someone else's),
    then `steps` timed ones."""
    fetches = step_fetches(step)
    session.run(fetches, feeds)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        session.run(fetches, feeds)
        times.append(time.perf_counter() - t0)
    return times


def check_local(cluster: Cluster, what: str) -> None:
    """Raise PlacementError unless every device of `cluster` can run here: CPU devices are this
    machine's (virtual) devices; a GPU needs one on this machine."""
    gpus = [d.name.split("/device:")[-1] for d in cluster.devices if d.type == "gpu"]
    others = [d.name.split("/device:")[-1] for d in cluster.devices if d.type not in ("cpu", "gpu")]
    if others or (gpus and gpu_count() < len(gpus)):
        missing = others or gpus
        raise PlacementError(f"{what} runs the step on the cluster's devices, and {', '.join(missing[:4])} "
                             f"{'is' if len(missing) == 1 else 'are'} not on this machine "
                             f"({gpu_count()} GPU(s) here); use virtual CPU devices (--devices cpu:0,cpu:1) "
                             f"or the simulator's reward")


class StepMeter:
    """Seconds per training step of a placement (an assignment node -> device), measured on the
    cluster's devices: `steps` timed steps after an untimed one, the median. Callable, so the
    learned placer takes it as its `measure`; `calls` counts the placements it ran."""

    def __init__(self, step: Step, loaded: LoadedSpec, cluster: Cluster, steps: int = 3) -> None:
        check_local(cluster, "a measured reward")
        if step.train is None:
            raise PlacementError(f"measured rewards time synchronous steps; {step.strategy} runs one client "
                                 f"thread per replica")
        self.step, self.cluster, self.steps = step, cluster, steps
        self.store = ContainerStore()
        free = step.graph.copy()  # the initializer runs on one device, whatever the constraints say
        for node in free.nodes.values():
            node.device = ""
        fc.Session(free, device=cluster.devices[0].name, store=self.store).run(step.init.node)
        self.feeds = step_feeds(step, loaded)
        self.calls = 0

    def __call__(self, assignment: dict[str, str]) -> float:
        self.calls += 1
        session = DistributedSession(self.step.graph, self.cluster, dict(assignment), store=self.store)
        try:
            with blas_limits(self.cluster):
                return statistics.median(timed_block(session, self.step, self.feeds, self.steps))
        finally:
            session.close()


__all__ = ["StepMeter", "check_local", "step_feeds", "step_fetches", "timed_block"]
