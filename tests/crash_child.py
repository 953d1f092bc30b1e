"""Child process for tests/test_checkpoint.py's crash tests: saves checkpoint 1 cleanly, then saves
checkpoint 2 with FLOWCTL_CHECKPOINT_KILL_AT=<phase>, which SIGKILLs this process at that phase.

    python tests/crash_child.py DIRECTORY PHASE KEEP

Kept tiny (numpy and the checkpoint module only) because each phase costs one process start.
"""
from __future__ import annotations

import os
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


def main(argv: list[str]) -> None:
    from flowctl.engine.checkpoint import KILL_ENV, CheckpointManager

    directory, phase, keep = argv[1], argv[2], int(argv[3])
    manager = CheckpointManager(directory, keep=keep, spec_hash="spec-1")
    manager.save(1, tensors_for(1), state_for(1))
    print("saved 1", flush=True)
    os.environ[KILL_ENV] = phase
    manager.save(2, tensors_for(2), state_for(2))
    print("saved 2 (the kill never came)", flush=True)


if __name__ == "__main__":
    main(sys.argv)
