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
    numbers an op draws never depend on which other ops ran first (§ determinism)."""

    __slots__ = ("name", "seed", "generator")

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.seed = seed
        self.generator = np.random.Generator(np.random.Philox(key=seed))

    def get_state(self) -> dict[str, Any]:
        return dict(self.generator.bit_generator.state)

    def set_state(self, state: dict[str, Any]) -> None:
        self.generator.bit_generator.state = state


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
