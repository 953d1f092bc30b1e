"""OpenBLAS's idle threads (flowctl/__init__.py, flowctl/openblas.py): they spin ~0.1 s after each
threaded product unless OPENBLAS_THREAD_TIMEOUT was set when OpenBLAS loaded; importing flowctl
sets it, in time or (numpy imported first) by asking the loaded library to read it again."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# One subprocess per case: what is imported first is the point. It prints the process's CPU
# seconds while it sleeps 0.3 s right after each of five threaded products (spinning threads
# burn ~0.1 s of it), then runs two rounds of intra-op tasks.
_PROBE = """
import os, sys, time
{first}
from threadpoolctl import threadpool_limits
a = np.ones((1500, 1500), np.float32)
with threadpool_limits(2):
    a @ a
    idle = []
    for _ in range(5):
        a @ a
        t = time.process_time(); time.sleep(0.3); idle.append(time.process_time() - t)
print(sorted(idle)[2], os.environ.get("OPENBLAS_THREAD_TIMEOUT"))
if "flowctl" in sys.modules:
    from flowctl.kernels import intra
    assert intra.run([lambda: 1, lambda: 2]) == [1, 2] and intra.run([lambda: 3, lambda: 4]) == [3, 4]
"""
# A flowctl.openblas whose fix fails (OpenBLAS keeps spinning): the real module, loaded from its
# file without importing flowctl (numpy must still come first), with sleep_at_once failing.
_BROKEN = ("import importlib.util, os\n"
           "spec = importlib.util.find_spec('flowctl')\n"
           "path = os.path.join(os.path.dirname(spec.origin), 'openblas.py')\n"
           "real = importlib.util.module_from_spec(importlib.util.spec_from_file_location('flowctl.openblas', path))\n"
           "real.__spec__.loader.exec_module(real)\n"
           "real.sleep_at_once = lambda: False\n"
           "sys.modules['flowctl.openblas'] = real\n")
_NUMPY_FIRST = "import numpy as np\nimport flowctl\n"
_FLOWCTL_FIRST = "import flowctl\nimport numpy as np\n"


def _probe(first: str, timeout: str | None = None) -> tuple[float, str | None, str]:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env["FLOWCTL_INTRA_OP"] = "2"
    if timeout is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = timeout
    done = subprocess.run([sys.executable, "-c", _PROBE.format(first=first)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    idle, value = done.stdout.split()
    return float(idle), (None if value == "None" else value), done.stderr


def _openblas_threads() -> bool:
    from threadpoolctl import threadpool_info

    return (os.cpu_count() or 1) >= 2 and any(i["internal_api"] == "openblas" for i in threadpool_info())


needs_threads = pytest.mark.skipif(not _openblas_threads(), reason="needs numpy on OpenBLAS and two cores")


@needs_threads
def test_without_flowctl_openblas_threads_spin_after_a_product():
    idle, value, _ = _probe("import numpy as np\n")
    assert value is None and idle > 0.03  # what the rest guards against: ~0.1 s of CPU while asleep


@needs_threads
@pytest.mark.parametrize("first", [_NUMPY_FIRST, _FLOWCTL_FIRST], ids=["numpy_first", "flowctl_first"])
def test_importing_flowctl_puts_them_to_sleep_whichever_came_first(first):
    idle, value, stderr = _probe(first)
    assert value == "4" and idle < 0.02  # Ray workers inherit the variable too
    assert "numpy was imported before flowctl" not in stderr


@needs_threads
def test_where_the_fix_fails_importing_flowctl_says_so_once():
    idle, value, stderr = _probe("import sys\n" + _BROKEN + _NUMPY_FIRST)
    assert idle > 0.03
    assert stderr.count("numpy was imported before flowctl") == 1, stderr
    assert "OPENBLAS_THREAD_TIMEOUT=4" in stderr and "Import flowctl before numpy" in stderr


@needs_threads
def test_a_timeout_the_user_set_is_kept():
    idle, value, stderr = _probe(_NUMPY_FIRST, timeout="6")
    assert value == "6" and "numpy was imported before flowctl" not in stderr
