"""The spinning helper team (kernels/cpu/team.py, team_jit.py) that shares the packed recurrent
product: every piece is made once whoever takes it, so its output is the one-thread kernel's bits
whatever the helpers do: asleep when the product is posted, woken late, with a second caller
holding the team, across the job counter's wrap, in a forked child (which has no helpers of its
parent's)."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

import numpy as np
import pytest

pytest.importorskip("numba")

from flowctl.kernels import intra  # noqa: E402
from flowctl.kernels.cpu import recurrent  # noqa: E402
from flowctl.kernels.cpu import team as team_module  # noqa: E402


def _case(m: int, k: int, n: int, lanes: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype("float32")
    wp = recurrent.pack(rng.standard_normal((k, n)).astype("float32"), lanes, False)
    with intra.fixed(1):  # the one-thread kernel, the team never asked
        want = recurrent.panel_matmul(a, wp, n, False)
    return a, wp, want


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("m,k,n,lanes", [(20, 650, 2600, 16), (1, 3, 16, 16), (7, 65, 200, 8), (64, 40, 1000, 16)])
def test_the_teams_product_is_the_one_thread_kernels_bits(threads, m, k, n, lanes) -> None:
    a, wp, want = _case(m, k, n, lanes)
    out, tail = np.full((m, n), np.nan, np.float32), np.empty((m, lanes), np.float32)
    assert team_module.team().product(a, wp, out, tail, threads)
    np.testing.assert_array_equal(out, want)
    with intra.fixed(threads):  # and through the kernel, as a plan runs it
        np.testing.assert_array_equal(recurrent.panel_matmul(a, wp, n, False), want)


def test_helpers_asleep_when_the_product_is_posted_still_make_it_whole() -> None:
    a, wp, want = _case(20, 650, 2600)
    t = team_module.team()
    with intra.fixed(2):
        recurrent.panel_matmul(a, wp, 2600, False)
        for pause in (0.0, 0.02, 0.0, 0.05):  # past the helpers' spin: they sleep until woken
            time.sleep(pause)
            np.testing.assert_array_equal(recurrent.panel_matmul(a, wp, 2600, False), want)
    assert all(h.is_alive() for h in t.helpers)


def test_a_second_caller_while_the_team_is_busy_runs_its_product_without_it() -> None:
    cases = [_case(20, 300, 1200, seed=s) for s in range(3)]
    errors: list[BaseException] = []

    def caller(i: int) -> None:
        a, wp, want = cases[i]
        try:
            for _ in range(60):
                np.testing.assert_array_equal(recurrent.panel_matmul(a, wp, 1200, False), want)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    with intra.fixed(2):  # process-wide: set once, around all three
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
    assert not errors and not any(th.is_alive() for th in threads)


def test_the_job_counter_wraps_without_mixing_jobs() -> None:
    a, wp, want = _case(10, 64, 320)
    t = team_module.team()
    t.job = team_module.JOBS - 3
    with intra.fixed(2):
        for _ in range(5):
            np.testing.assert_array_equal(recurrent.panel_matmul(a, wp, 320, False), want)
    assert 0 < t.job < 5


def _child(q: "multiprocessing.Queue[bool]") -> None:
    a, wp, want = _case(20, 100, 480)
    with intra.fixed(2):
        q.put(bool(np.array_equal(recurrent.panel_matmul(a, wp, 480, False), want)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_makes_its_own_team() -> None:
    a, wp, want = _case(20, 100, 480)
    with intra.fixed(2):
        recurrent.panel_matmul(a, wp, 480, False)  # the parent's team exists, its helpers spinning
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    try:
        assert q.get(timeout=60) is True
    finally:
        p.join(timeout=30)
    assert p.exitcode == 0


@pytest.mark.parametrize("p_len", [1, 2, 3, 41, 163, 164])
@pytest.mark.parametrize("pieces", [1, 2, 4, 8, 16])
def test_pieces_cover_the_panels_once_in_pairs_of_balanced_size(p_len, pieces) -> None:
    from flowctl.kernels.cpu.team_jit import piece_panels

    bounds = [piece_panels(p_len, i, pieces) for i in range(pieces)]
    covered = [p for p0, p1 in bounds for p in range(p0, p1)]
    assert covered == list(range(p_len))
    assert all(p0 % 2 == 0 for p0, p1 in bounds if p1 > p0)
    sizes = [max(0, p1 - p0) for p0, p1 in bounds]
    assert max(sizes) - min(sizes) <= 2
