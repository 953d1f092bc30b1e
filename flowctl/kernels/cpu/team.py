"""The spinning helper threads of team_jit.py, for the packed recurrent product: started on first
use, as many as the intra-op threads less the caller (kernels/intra.py's count), one product at a
time (a second caller meanwhile, another device's thread, is told so and runs its product on
kernels/intra.py's pool); in a forked child, a team of its own. `team_jit` says how a product is
shared and what it gained."""
from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import numpy as np

JOBS = 1 << 23  # job numbers wrap here (NEXT holds 23 bits of them)
PIECES_PER_THREAD = 4


class Team:
    def __init__(self) -> None:
        from flowctl.kernels.cpu import team_jit as tj

        self.tj = tj
        self.ctl = np.zeros(tj.WORDS, np.int64)
        self.wake = threading.Event()
        self.busy = threading.Lock()
        self.job = 0
        self.helpers: list[threading.Thread] = []

    def stop(self) -> None:
        self.ctl[self.tj.STOP] = 1
        self.wake.set()

    def _grow(self, n: int) -> None:
        while len(self.helpers) < n:
            t = threading.Thread(target=self._helper, args=(len(self.helpers),), daemon=True,
                                 name=f"flowctl-spin-{len(self.helpers)}")
            self.helpers.append(t)
            t.start()

    def _helper(self, index: int) -> None:
        tj, ctl = self.tj, self.ctl
        while tj.serve(ctl, tj.SPIN_CYCLES, index) == 0:
            if tj.going_to_sleep(ctl):
                self.wake.wait()
                self.wake.clear()
                tj.woken(ctl)

    def product(self, h: Any, wp: Any, out: Any, tail: Any, threads: int) -> bool:
        """out = h @ wp's panels (h C-ordered) on `threads` threads (this one and threads - 1 helpers);
        False, having done nothing, while another caller's product runs."""
        if not self.busy.acquire(blocking=False):
            return False
        try:
            tj = self.tj
            self._grow(threads - 1)
            self.ctl[tj.ALLOWED] = threads - 1
            self.job = self.job % (JOBS - 1) + 1
            pieces = PIECES_PER_THREAD * threads
            if tj.post(self.ctl, self.job, pieces, h, wp, out, tail):
                self.wake.set()
            tj.run(self.ctl, self.job, pieces)
            return True
        finally:
            self.busy.release()


_state: dict[str, Any] = {"team": None, "pid": None}
_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child has none of the parent's helpers (and maybe a lock a parent thread held)."""
    global _lock
    _lock = threading.Lock()
    _state.update(team=None, pid=None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def team() -> Team:
    with _lock:
        if _state["team"] is None or _state["pid"] != os.getpid():
            _state["team"], _state["pid"] = Team(), os.getpid()
            atexit.register(_state["team"].stop)
        return _state["team"]
