"""The error hierarchy every stage raises; the CLI maps each to one message and an exit code."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: object, choices: Iterable[object]) -> str:
    """"; did you mean 'X'?" for the choice closest to a mistyped `word`, or "" where none is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


class FlowctlError(Exception):
    """Base of every error a user can act on. The CLI prints `str(err)` and exits with `exit_code`."""

    exit_code = 1


class SpecError(FlowctlError):
    exit_code = 2


class GraphError(FlowctlError):
    """A malformed graph: names the node(s) involved, with shapes where they disagree."""

    exit_code = 3


class PlacementError(FlowctlError):
    """`details`: the whole story as plain data (every member of a conflicting colocation group,
    every node on a device that ran out of memory) where the message shows a few; `place --json`
    prints it."""

    exit_code = 4

    def __init__(self, message: str, details: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.details = details or {}


class ExecutionError(FlowctlError):
    """A kernel failed: names the node, its op and its device."""

    exit_code = 5

    def __init__(self, message: str, node: str | None = None, op: str | None = None,
                 device: str | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.op = op
        self.device = device


class NonFiniteError(ExecutionError):
    """CheckNumerics (§6 lesson 5): the first node whose output holds a NaN or Inf."""


class QueueClosedError(ExecutionError):
    """A queue op that can never complete because its queue is closed (TensorFlow's OutOfRange):
    a dequeue that finds too few elements left, or an enqueue after the close."""


class CheckpointError(FlowctlError):
    exit_code = 6


class WorkerLostError(ExecutionError):
    """A remote worker died, stopped answering health checks, or could not be reached by a transfer
    (§3.3): the step was aborted everywhere. `task` is the worker's task index, `node` where it ran."""

    def __init__(self, message: str, task: int | None = None, node: str | None = None) -> None:
        super().__init__(message, device=None if task is None else f"/job:worker/task:{task}")
        self.task = task
        self.node = node
