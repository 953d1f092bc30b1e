from __future__ import annotations

import os

# Before numpy, so that OpenBLAS's idle threads sleep at once (flowctl/__init__.py), as in a run.
import flowctl  # noqa: F401 -- isort: skip
import numpy as np
import pytest




def _gpu_available() -> bool:
    from flowctl.kernels.registry import cupy_or_none

    return cupy_or_none() is not None


# Without a GPU, flowctl's own GPU kernels (numba-cuda) run in numba's CUDA simulator: the flag
# must be set before anything imports numba.cuda (flowctl imports it only when a kernel is wanted).
if not _gpu_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

# Tests build graphs by op name (`Graph().add_node("MatMul", ...)`), some without touching the
# `flowctl` API that would load the op library: register every op here, as `fc.` does.
import flowctl.engine.ops  # noqa: E402,F401


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _gpu_available():
        skip = pytest.mark.skip(reason="needs cupy and a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
