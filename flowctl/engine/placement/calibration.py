"""Calibrating the simulator on a measurement: the contention factor (`CostTable.contention`,
the simulator's processor sharing between synchronous devices of one process) that reproduces a
measured slow-down of two devices running at once. `flowctl bench SPEC` solves it from its
measured rows (bench/spec.py)."""
from __future__ import annotations

import dataclasses

from flowctl.engine.cluster import Cluster
from flowctl.engine.placement.cost import CostTable
from flowctl.engine.placement.simulator import simulate_table


def contention_for(table: CostTable, a: int, b: int, ratio: float, cluster: Cluster) -> float:
    """The contention factor under which the simulator reproduces a measurement: the whole step
    run on devices `a` and `b` (indices into `table.devices`, of one process) at the same time,
    each on its own copy of the state, took `ratio` times the step run on `a` alone. Found by
    bisection over [1, 8] (the simulated ratio grows with the factor); 1 where even no
    contention simulates slower than measured (the process's interpreter, the host lane, already
    explains it)."""
    n = len(table.names)
    alone = simulate_table(dataclasses.replace(table, contention=1.0), [a] * n, cluster).step_time
    if alone <= 0:
        return 1.0
    twice = dataclasses.replace(
        table, names=[f"{x}@{k}" for k in (0, 1) for x in table.names],
        index={f"{x}@{k}": i + k * n for k in (0, 1) for i, x in enumerate(table.names)},
        times=table.times * 2, flops=table.flops * 2, out_bytes=table.out_bytes * 2,
        inputs=table.inputs + [[(j + n, p) for j, p in ins] for ins in table.inputs],
        controls=table.controls + [[j + n for j in c] for c in table.controls],
        succ=table.succ + [[j + n for j in c] for c in table.succ],
        resident=table.resident * 2, host=(table.host * 2) if table.host else [],
        views=table.views + [None if v is None else (v[0] + n, v[1]) for v in table.views],
        forward=table.forward * 2, writes=table.writes + [j + n if j >= 0 else -1 for j in table.writes],
        issue=table.issue * 2 if table.issue else [], stream=table.stream * 2 if table.stream else [],
        built=table.built * 2)
    dev = [a] * n + [b] * n

    def simulated(k: float) -> float:
        return simulate_table(dataclasses.replace(twice, contention=k), dev, cluster).step_time / alone

    if simulated(1.0) >= ratio:
        return 1.0
    lo, hi = 1.0, 8.0
    if simulated(hi) < ratio:
        return hi
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulated(mid) < ratio else (lo, mid)
    return (lo + hi) / 2
