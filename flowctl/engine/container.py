"""Containers (whitepaper §4.7): where stateful ops keep their state between steps.

The default container ("") persists until the process ends; named containers can be reset, and any
session using the same `ContainerStore` shares their state, even across disjoint graphs.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Any

import numpy as np


class VariableSlot:
    """One variable's storage. `value` is replaced (never written into) by assignments."""

    __slots__ = ("name", "value")

    def __init__(self, name: str) -> None:
        self.name = name
        self.value: Any = None


class RngState:
    """Per-op random state: a counter-based generator keyed by the op's derived seed, so the
    numbers an op draws never depend on which other ops ran first (§ determinism).

    Host draws come from `generator` (numpy's Philox). A GPU kernel draws Philox4x32-10 keyed by
    `seed` itself (`kernels/cuda/philox.py`) and numbers its draws with a device counter
    (`device_counter`): a uint64 cell the kernel reads and a second launch increments, so a
    captured CUDA graph advances it on every replay without the host. `device_draws` is the
    host's mirror of that count: the kernel's Python adds 1 per call, a captured step's replay
    adds what its capture added (`engine/capture.py`), so a checkpoint (`get_state`, which carries
    it as "device_draws") reads no device memory; `set_state` writes it back into every cell."""

    __slots__ = ("name", "seed", "generator", "device_draws", "_cells", "_known")

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.seed = seed
        self.generator = np.random.Generator(np.random.Philox(key=seed))
        self.device_draws = 0
        self._cells: dict[int, Any] = {}  # id(array module) -> its shape-(1,) uint64 counter
        self._known = False  # a cell was made or a count restored: the state carries the count

    def device_counter(self, xp: Any) -> Any:
        """The shape-(1,) uint64 draw counter on `xp`'s device, made once per array module (when a
        plan binds its kernels, never inside a capture), starting at `device_draws`."""
        cell = self._cells.get(id(xp))
        if cell is None:
            cell = xp.zeros(1, dtype="uint64")
            if self.device_draws:
                cell[...] = self.device_draws
            self._cells[id(xp)] = cell
            self._known = True
        return cell

    def get_state(self) -> dict[str, Any]:
        state = dict(self.generator.bit_generator.state)
        if self._known:
            state["device_draws"] = int(self.device_draws)
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        draws = state.pop("device_draws", None)
        self.generator.bit_generator.state = state
        # A state without the count was taken where no GPU had drawn: its count is 0.
        self.device_draws = 0 if draws is None else int(draws)
        self._known = self._known or draws is not None
        for cell in self._cells.values():  # between steps: a host-to-device write
            cell[...] = self.device_draws


def derive_seed(graph_seed: int, node_name: str, op_seed: int = 0) -> int:
    """A 64-bit seed from the graph seed and the node's name (or the op's own seed when given)."""
    key = f"{graph_seed}/{op_seed if op_seed else node_name}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class Container:
    def __init__(self, name: str) -> None:
        self.name = name
        self.slots: dict[str, VariableSlot] = {}
        self._lock = threading.Lock()

    def slot(self, key: str) -> VariableSlot:
        with self._lock:
            s = self.slots.get(key)
            if s is None:
                s = self.slots[key] = VariableSlot(key)
            return s

    def reset(self) -> None:
        # Values are dropped but slot objects stay: compiled plans hold them, and must see the reset.
        with self._lock:
            for s in self.slots.values():
                s.value = None


class ContainerStore:
    def __init__(self) -> None:
        self.containers: dict[str, Container] = {}
        self._lock = threading.Lock()

    def get(self, name: str = "") -> Container:
        with self._lock:
            c = self.containers.get(name)
            if c is None:
                c = self.containers[name] = Container(name)
            return c

    def reset(self, name: str) -> None:
        """Clear a container of its contents entirely (§4.7)."""
        self.get(name).reset()


_process_store = ContainerStore()


def process_store() -> ContainerStore:
    """The store whose default container lives as long as the process."""
    return _process_store
