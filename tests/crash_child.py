"""Child process for tests/test_checkpoint.py's crash tests: saves checkpoint 1 cleanly, then saves
checkpoint 2 with a fault hook that SIGKILLs this process at <phase> (one of SAVE_PHASES).

    python tests/crash_child.py DIRECTORY PHASE KEEP          # the checkpoint directory alone
    python tests/crash_child.py --cli PHASE FLOWCTL-ARGS...    # `flowctl ARGS`, killed in its first save at PHASE


Kept tiny (numpy and the checkpoint module only) because each phase costs one process start.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any

import numpy as np


def tensors_for(step: int) -> dict[str, np.ndarray]:
    """The tensors saved at `step`; the test recomputes them to check what it restored."""
    rng = np.random.default_rng(step)
    # ~256 KiB, so `mid_tensors` really tears the file in the middle of the data.
    return {"dense/w": rng.standard_normal((256, 128)).astype(np.float64),
            "dense/b": np.full((7,), step, dtype=np.int64)}


def state_for(step: int) -> dict[str, Any]:
    gen = np.random.Generator(np.random.Philox(key=step))
    gen.integers(0, 1 << 31, size=3, dtype=np.uint32)
    return {"data_cursor": (step * 10, step), "rng": {"dropout": gen.bit_generator.state}}


def kill_at(phase: str) -> Any:
    def fault(reached: str) -> None:
        if reached == phase:
            os.kill(os.getpid(), signal.SIGKILL)
    return fault


def main(argv: list[str]) -> None:
    from flowctl.engine.checkpoint import CheckpointDir

    directory, phase, keep = argv[1], argv[2], int(argv[3])
    checkpoints = CheckpointDir(directory, keep=keep, spec_hash="spec-1")
    checkpoints.save(1, tensors_for(1), state_for(1))
    print("saved 1", flush=True)
    checkpoints.fault = kill_at(phase)
    checkpoints.save(2, tensors_for(2), state_for(2))
    print("saved 2 (the kill never came)", flush=True)


def cli(phase: str, args: list[str]) -> None:
    """`flowctl ARGS` with every checkpoint directory it opens given the fault hook."""
    from flowctl.cli.main import cli as flowctl
    from flowctl.engine import checkpoint

    init = checkpoint.CheckpointDir.__init__

    def with_fault(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        self.fault = kill_at(phase)

    checkpoint.CheckpointDir.__init__ = with_fault  # type: ignore[method-assign]
    flowctl.main(args=args, prog_name="flowctl")


if __name__ == "__main__":
    if sys.argv[1] == "--cli":
        cli(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv)
