"""A training step of a dynamic (while-loop) two-layer LSTM, placed many ways over 2 virtual CPU
devices, runs to the end and equals the one-device run exactly (§4.4 across devices, §3.2.2).

Random placements assign each colocation group (a loop's control is one, a Variable and the ops
that update it another) to a device at random with a fixed seed, which puts Enters, loop bodies,
accumulators and their readers on either side of every kind of frame boundary; the placers add
the placements a user gets. A step that would deadlock fails by the session's step timeout."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.cluster import Cluster
from flowctl.engine.frames import assign_frames
from flowctl.engine.placement import StaticCostModel, feasible_sets, place
from flowctl.engine.runtime import DistributedSession
from test_control_flow_devices import DYNAMIC_LM

STEP_TIMEOUT_S = 60.0  # generous on a shared 2-core machine; a deadlock never finishes at all
STEPS = 2

# test_control_flow_devices' dynamic two-LSTM language model, under its own name.
SPEC = DYNAMIC_LM.replace("name: placed_lm", "name: loops_anywhere")


class _Model:
    """The step graph, its feeds, and the one-device reference (losses and variables after STEPS)."""

    def __init__(self) -> None:
        from flowctl.spec.loader import load_text
        from flowctl.spec.model import build_model
        from flowctl.training.measure import step_feeds
        from flowctl.training.program import build_step, step_config

        self.loaded = load_text(SPEC)
        self.config = step_config(self.loaded)
        self.step = build_step(build_model(self.loaded), self.config)
        self.feeds = step_feeds(self.step, self.loaded)
        self.feeds[self.step.lr] = np.float32(0.1)
        self.cluster = Cluster.local(2)
        self.want = self.train(None)

    def train(self, placement: dict[str, str] | None, recv_schedule: str = "asap"
              ) -> tuple[list[Any], dict[str, np.ndarray]]:
        g, st = self.step.graph, self.step
        store = fc.ContainerStore()
        fc.Session(g, store=store).run(st.init.node)
        sess: Any = fc.Session(g, store=store) if placement is None else \
            DistributedSession(g, self.cluster, placement, store=store, step_timeout=STEP_TIMEOUT_S,
                               recv_schedule=recv_schedule)
        try:
            losses = [sess.run([st.train.loss, st.train.train_op], self.feeds)[0] for _ in range(STEPS)]
        finally:
            if placement is not None:
                sess.close()
        return losses, sess.variable_values()

    def random_placement(self, seed: int, whole_loops: bool) -> dict[str, str]:
        """Each colocation group on a random device; with `whole_loops`, every node running in a
        loop goes with its loop's (random) device instead, as a placer keeps a loop together,
        while the Enters (run in the frame around the loop), the loop's inputs and the readers of
        its results still go anywhere."""
        g = self.step.graph
        feas = feasible_sets(g, self.cluster)
        frames = assign_frames(g)
        rng = np.random.default_rng(seed)
        by_frame = {f: feas.devices[int(rng.integers(2))] for f in sorted(frames.parent)}
        pick: dict[int, str] = {}
        for gid in sorted(feas.members):
            loops = [frames.exec_frame[feas.order[m]] for m in feas.members[gid]]
            inside = [f for f in loops if f]
            pick[gid] = by_frame[inside[0]] if whole_loops and inside else feas.devices[int(rng.integers(2))]
        return {name: pick[feas.group_of[i]] for i, name in enumerate(feas.order)}

    def check(self, placement: dict[str, str], recv_schedule: str = "asap") -> None:
        losses, values = self.train(placement, recv_schedule)
        want_losses, want_values = self.want
        assert [float(x) for x in losses] == [float(x) for x in want_losses]
        assert values.keys() == want_values.keys()
        for k in want_values:
            np.testing.assert_array_equal(values[k], want_values[k], err_msg=k)


@pytest.fixture(scope="module")
def model() -> _Model:
    return _Model()


def _spans_loops(model: _Model, placement: dict[str, str]) -> bool:
    """Whether some loop's nodes (its Enters counted in) sit on both devices."""
    g = model.step.graph
    frames = assign_frames(g)
    seen: dict[str, set[str]] = {}
    for n, node in g.nodes.items():
        f = frames.out_frame[n] if node.op == "Enter" else frames.exec_frame[n]
        if f:
            seen.setdefault(f, set()).add(placement[n])
    return any(len(d) > 1 for d in seen.values())


@pytest.mark.parametrize("whole_loops", [True, False], ids=["whole-loops", "any-node"])
@pytest.mark.parametrize("seed", range(3))
def test_random_placements_run_and_equal_one_device(model: _Model, seed: int, whole_loops: bool) -> None:
    placement = model.random_placement(seed, whole_loops)
    assert _spans_loops(model, placement)
    model.check(placement)


@pytest.mark.parametrize("whole_loops", [True, False], ids=["whole-loops", "any-node"])
def test_random_placements_with_alap_receives_equal_one_device(model: _Model, whole_loops: bool) -> None:
    model.check(model.random_placement(0, whole_loops), recv_schedule="alap")


@pytest.mark.slow
@pytest.mark.parametrize("whole_loops", [True, False], ids=["whole-loops", "any-node"])
@pytest.mark.parametrize("seed", range(3, 15))
def test_more_random_placements_run_and_equal_one_device(model: _Model, seed: int, whole_loops: bool) -> None:
    model.check(model.random_placement(seed, whole_loops))


@pytest.mark.parametrize("alg", ["greedy", "heft", "mincut", "auto"])
def test_each_placer_runs_and_equals_one_device(model: _Model, alg: str) -> None:
    st = model.step
    pl = place(st.graph, model.cluster, StaticCostModel(model.cluster, batch=st.batch), alg,
               targets=st.targets, rules=model.config.expert_rules(), layers=st.model.layer_of(), time_budget=2.0)
    frames = assign_frames(st.graph)
    for frame in frames.parent:  # coarsening places each loop as a unit (its Enters may go elsewhere)
        assert len({pl.assignment[n] for n, f in frames.exec_frame.items() if f == frame}) == 1, frame
    model.check(pl.assignment)
