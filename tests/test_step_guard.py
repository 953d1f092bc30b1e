"""The step's guard (program.guard_state): every state write waits for a CheckNumerics of the loss,
so a step whose loss is not finite changes nothing, and the trainer holds no copy of the
variables before each step -- which let its CPU updates write in place again."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flowctl.engine.errors import NonFiniteError
from flowctl.engine.executor import needed_nodes
from flowctl.training.runs import load_training_spec
from flowctl.training.trainer import Trainer
from test_train_runs import SPEC


def _spec(tmp_path: Path, lr: str = "0.05") -> str:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 6)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32))
    p = tmp_path / "guard.yaml"
    p.write_text(SPEC.replace("initial: 0.05", f"initial: {lr}"))
    return str(p)


def _trainer(spec: str, run_dir: Path, steps: int) -> Trainer:
    loaded, text, path = load_training_spec(spec)
    tr = Trainer(loaded, run_dir, steps=steps, prefetch=0)
    tr.start_fresh(text, path)
    return tr


def test_every_state_write_of_the_step_waits_for_the_guard(tmp_path: Path) -> None:
    tr = _trainer(_spec(tmp_path), tmp_path / "run", 1)
    step = tr.program.step
    g = step.graph
    assert step.guard is not None and g.nodes[step.guard].op == "CheckNumerics"
    in_step = needed_nodes(g, [step.train.train_op.node], set())
    writers = [n for n in in_step if g.nodes[n].opdef.resource in ("variable_input", "variable_inputs")]
    assert writers and all(step.guard in g.nodes[n].control_inputs for n in writers)
    # The initializer's assignments do not wait for a loss.
    init = needed_nodes(g, [step.init.node], set())
    assert not any(step.guard in g.nodes[n].control_inputs for n in init)
    tr.close()


def test_the_trainers_steps_update_the_variables_in_place(tmp_path: Path) -> None:
    # No copy of the variables is held across a step, so each update writes into its array (the
    # CPU path of kernels/state.updatable_in_place) instead of making a new one.
    tr = _trainer(_spec(tmp_path), tmp_path / "run", 2)
    tr.train()
    store = tr.session
    names = [n for n, node in store.graph.nodes.items() if node.op == "Variable"]
    before = {n: id(store._resource(store.graph.nodes[n]).value) for n in names}
    tr.total_steps = 3
    tr.train()
    after = {n: id(store._resource(store.graph.nodes[n]).value) for n in names}
    kernel = [n for n in names if n.endswith("kernel")]
    assert kernel and all(before[n] == after[n] for n in kernel), (before, after)
    tr.close()


def test_a_step_with_a_non_finite_loss_changes_no_variable(tmp_path: Path) -> None:
    # A learning rate of 1e30: step 1 is finite and throws the weights far out; step 2's loss is
    # not finite. The guard stops step 2 before any update, so the variables are step 1's, bit for
    # bit, and the replay names the node.
    spec = _spec(tmp_path, "1.0e+30")
    one = _trainer(spec, tmp_path / "one", 1)
    one.train()
    want = one.session.variable_values()
    one.close()
    tr = _trainer(spec, tmp_path / "two", 2)
    with pytest.raises(NonFiniteError, match=r"step 2: the loss is not finite; .*node '") as e:
        tr.train()
    assert e.value.node != tr.program.step.guard
    got = tr.session.variable_values()
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    tr.close()
