"""Restart and restore after a lost worker (whitepaper §3.3 "Fault Tolerance"): "the entire graph
execution is aborted and restarted from scratch", the Variables coming back from the last Save.

A training loop over a `RaySession` catches `WorkerLostError` and hands it to `Recovery.handle`,
which counts the failure against `max_failures`, has the session replace the lost workers, calls
the loop's `restore` (put the last checkpoint back: `checkpoint.apply` on the session, plus the
loop's own data cursor and schedule) and returns a `Restart` record saying where the loop resumes
and how many steps it replays. Past `max_failures`, or when a worker cannot be restarted, the error
is raised again (exit 5, naming the task and its node); nothing here writes a checkpoint, so the
last one is left as it was, ready for `flowctl resume`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

from flowctl.engine.errors import WorkerLostError


@dataclass
class Restart:
    """One recovery, for the run's metrics."""

    failure: int  # 1 for the first failure of the run
    failed_step: int  # the step that was running when the worker was lost
    tasks: list[int]  # the worker tasks restarted
    node: str | None  # where the lost worker ran
    resumed_step: int  # the step of the checkpoint restored
    error: str

    @property
    def replayed(self) -> int:
        """Steps done since the checkpoint that are done again."""
        return self.failed_step - self.resumed_step

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "replayed": self.replayed}


class Recovery:
    def __init__(self, session: Any, max_failures: int, restore: Callable[[], int]) -> None:
        """`session`: a RaySession. `restore()`: load the last checkpoint into the session and the
        loop, returning its step."""
        self.session = session
        self.max_failures = max_failures
        self.restore = restore
        self.restarts: list[Restart] = []

    def handle(self, error: WorkerLostError, step: int) -> Restart:
        """Recover from `error`, raised while step `step` ran; or raise it again when the run must end."""
        if len(self.restarts) >= self.max_failures:
            raise WorkerLostError(f"{error} (at step {step}, after {len(self.restarts)} restart(s), "
                                  f"cluster.max_failures is {self.max_failures}; the last checkpoint is intact: "
                                  f"resume from it)",
                                  task=error.task, node=error.node) from None
        try:
            tasks = self.session.restart_lost_workers()
        except WorkerLostError as e:
            raise WorkerLostError(f"{e} (at step {step}; the last checkpoint is intact: resume from it)", task=e.task,
                                  node=e.node) from None
        record = Restart(len(self.restarts) + 1, step, tasks, error.node, self.restore(), str(error))
        self.restarts.append(record)
        return record
