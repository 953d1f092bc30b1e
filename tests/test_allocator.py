"""`flowctl.engine.allocator.tune()`: glibc is told to keep large freed buffers in the heap.

tune() changes process-wide malloc settings and caches its answer per process, so everything that
actually calls mallopt runs in a fresh interpreter (`_run`), never in the pytest process.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flowctl.engine import allocator

ROOT = Path(__file__).resolve().parents[1]

needs_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                 reason="tune() acts only on Linux with glibc")


def _run(code: str, malloc: str | None = None) -> dict:
    """Run `code` in a fresh interpreter (FLOWCTL_MALLOC set to `malloc`, or unset); it must print
    one JSON object as its last line."""
    env = dict(os.environ)
    env.pop("FLOWCTL_MALLOC", None)
    if malloc is not None:
        env["FLOWCTL_MALLOC"] = malloc
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


TUNE = """
import json
from flowctl.engine import allocator
print(json.dumps({"first": allocator.tune(), "second": allocator.tune(), "state": allocator._state}))
"""


@needs_glibc
def test_tune_takes_effect_on_glibc():
    r = _run(TUNE)
    assert r["first"] is True
    assert r["state"] == {"done": True}


@needs_glibc
@pytest.mark.parametrize("value", ["system", "SYSTEM"])
def test_flowctl_malloc_system_leaves_malloc_alone(value):
    r = _run(TUNE, malloc=value)
    assert r["first"] is False and r["second"] is False
    assert r["state"] == {"done": False}


@needs_glibc
@pytest.mark.parametrize("malloc", [None, "system"])
def test_tune_is_idempotent_and_cached_per_process(malloc):
    r = _run(TUNE, malloc=malloc)
    assert r["second"] == r["first"]
    # The answer is cached: changing the environment after the first call changes nothing.
    flipped = "" if malloc == "system" else "system"
    r = _run(f"""
        import json, os
        from flowctl.engine import allocator
        first = allocator.tune()
        os.environ["FLOWCTL_MALLOC"] = {flipped!r}
        print(json.dumps({{"first": first, "again": allocator.tune()}}))
        """, malloc=malloc)
    assert r["first"] == (malloc is None)
    assert r["again"] == r["first"]


@needs_glibc
def test_creating_a_session_tunes_malloc():
    r = _run("""
        import json
        import flowctl as fc
        from flowctl.engine import allocator
        before = dict(allocator._state)
        g = fc.Graph()
        with g.as_default():
            fc.constant(1.0, name="c")
        fc.Session(g, store=fc.ContainerStore())
        print(json.dumps({"before": before, "after": allocator._state}))
        """)
    assert r["before"] == {}
    assert r["after"] == {"done": True}


def test_off_linux_tune_is_a_no_op(monkeypatch):
    monkeypatch.setattr(allocator, "_state", {})
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    monkeypatch.delenv("FLOWCTL_MALLOC", raising=False)

    def no_libc(*a, **k):  # pragma: no cover - must not be reached
        raise AssertionError("tune() loaded libc off Linux")

    monkeypatch.setattr(allocator.ctypes, "CDLL", no_libc)
    assert allocator.tune() is False
    assert allocator._state == {"done": False}


def test_without_a_usable_libc_tune_returns_false(monkeypatch):
    """musl or a libc that cannot be loaded: OSError is caught, malloc is left as it is."""
    monkeypatch.setattr(allocator, "_state", {})
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.delenv("FLOWCTL_MALLOC", raising=False)

    def missing(*a, **k):
        raise OSError("no libc here")

    monkeypatch.setattr(allocator.ctypes, "CDLL", missing)
    assert allocator.tune() is False
    assert allocator._state == {"done": False}


# Two 13.6 MB arrays live at once, then both freed, 20 times (after one warm-up round). Plain glibc
# raises its mmap threshold to 13.6 MB on the first free (so a *single* array alone is already
# reused, with or without tune()), but its trim threshold is then 2x that, and two freed arrays at
# the top of the heap exceed it: the heap is trimmed and every round faults its pages in again
# (measured: ~19,700 minor faults on the main thread, ~1,500 on another thread's arena). After
# tune() nothing is trimmed and the same heap memory is reused: 0 faults, both places.
FAULTS = """
import json, resource, sys, threading
import numpy as np
from flowctl.engine import allocator

tuned = allocator.tune()

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def loop(n=20, size=1_700_000):
    a = np.ones(size); b = np.ones(size); del a, b  # warm-up: the heap grows once
    f0 = faults()
    for _ in range(n):
        a = np.ones(size)
        b = np.ones(size)
        del a, b
    out.append(faults() - f0)

out = []
if {thread!r}:
    t = threading.Thread(target=loop)
    t.start()
    t.join()
else:
    loop()
print(json.dumps({{"tuned": tuned, "faults": out[0]}}))
"""


@needs_glibc
@pytest.mark.parametrize("thread", [False, True], ids=["main_thread", "other_thread"])
def test_tuned_malloc_reuses_large_buffers_instead_of_faulting_them_in(thread):
    code = FAULTS.format(thread=thread)
    tuned = _run(code)
    plain = _run(code, malloc="system")  # tune() is called there too and does nothing
    assert tuned["tuned"] is True and plain["tuned"] is False
    assert tuned["faults"] * 4 < plain["faults"], (tuned, plain)
    # 20 rounds of 27 MB: plain malloc faults well over one page a round; tuned, hardly any.
    assert plain["faults"] > 20 * 10
    assert tuned["faults"] < 20 * 10
