"""A model's fetches run in a fresh Session, and the ops of the plan that ran them: what the tests
of the CPU plan passes compare with a pass on and off (test_recurrent_pack.py, test_xent_bias.py,
test_concat_products.py)."""
from __future__ import annotations

from typing import Any

import flowctl as fc


def run_plan(model: Any, fetches: list, feeds: dict, store: Any = None) -> tuple[Any, list, list[str]]:
    """(the session, the fetched values, the plan's ops in order). `store`: an earlier run's
    variables (else the model's initializer runs first)."""
    s = fc.Session(model.graph, store=store or fc.ContainerStore())
    if store is None:
        s.run(model.initializer())
    return s, s.run(fetches, feeds), [n.op for n in s.plan_for(fetches, feeds).nodes]
