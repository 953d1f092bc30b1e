"""The executors' memory accounting for `RunStats.peak_bytes`: the bytes of the distinct buffers a
step's live values hold, and their peak.

A value is a buffer or a view of one (a Reshape, a Slice, a Split part: the kernels hand back
their input's memory, as the simulator's `CostTable.views` assumes). A buffer counts once, from
the first live value on it to the release of the last, so a view costs nothing of its own and
keeps its base counted while it lives; two outputs that are one array (Identity, Merge) count
once. A buffer the step did not make -- a Variable's array, a Const's, a fed one, and views of
them -- does not count at all: that is resident state, as the simulator has it. An update that
writes into its variable returns that variable's own buffer, so it adds nothing; one that makes a
new array adds it while it lives in the step.
"""
from __future__ import annotations

import weakref
from typing import Any


def _root(v: Any) -> Any:
    """The array that owns `v`'s memory: `v` followed through `.base` while that is an array."""
    base = getattr(v, "base", None)
    while base is not None and hasattr(base, "nbytes") and hasattr(base, "base"):
        v, base = base, base.base
    return v


class Ledger:
    """Live buffers of one step on one device (one executor thread: no lock)."""

    __slots__ = ("held", "outside", "live", "peak", "__weakref__")

    def __init__(self) -> None:
        self.held: dict[int, list[int]] = {}  # id(root) -> [live values on it, its bytes]
        # Buffers from outside the step, by id, each with a weak reference whose callback forgets
        # the id when the array dies (an id can be reused by a later array: that one counts).
        self.outside: dict[int, Any] = {}
        self.live = self.peak = 0

    def resident(self, v: Any) -> None:
        """`v` (a source's output or a feed) and everything viewing it are not the step's memory."""
        r = _root(v)
        k = id(r)
        if k in self.outside or not hasattr(r, "nbytes"):
            return
        me = weakref.ref(self)

        def forget(_: Any, k: int = k) -> None:
            ledger = me()
            if ledger is not None:
                ledger.outside.pop(k, None)

        try:
            self.outside[k] = weakref.ref(r, forget)
        except TypeError:  # an array type without weak references: held for the step instead
            self.outside[k] = r

    def acquire(self, v: Any) -> None:
        """A live value `v` appeared (an op's output stored for its readers)."""
        r = _root(v)
        k = id(r)
        if k in self.outside:
            return
        h = self.held.get(k)
        if h is not None:
            h[0] += 1
            return
        n = int(getattr(r, "nbytes", 0))
        if not n:
            return
        self.held[k] = [1, n]
        self.live += n
        if self.live > self.peak:
            self.peak = self.live

    def release(self, v: Any) -> None:
        """The value `v` is dropped (its last reader ran): its buffer goes with the last value on it."""
        k = id(_root(v))
        h = self.held.get(k)
        if h is None:
            return
        h[0] -= 1
        if h[0] == 0:
            del self.held[k]
            self.live -= h[1]
