from __future__ import annotations

import os

import numpy as np
import pytest


def _device_present() -> bool:
    try:
        import cupy  # type: ignore[import-not-found]

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 -- no cupy, no driver, no device
        return False


# Without a GPU, flowctl's own GPU kernels (numba-cuda) run in numba's CUDA simulator: the flag
# must be set before anything imports numba.cuda.
if not _device_present():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def _gpu_available() -> bool:
    from flowctl.kernels.registry import cupy_or_none

    return cupy_or_none() is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _gpu_available():
        skip = pytest.mark.skip(reason="needs cupy and a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
