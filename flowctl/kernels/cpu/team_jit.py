"""Helper threads that wait for work spinning in compiled code, for kernels too short for a thread
pool's hand-over: the packed recurrent product (kernels/cpu/recurrent.py), 0.3-0.6 ms a call.

kernels/intra.py hands a kernel's pieces to Python pool threads, which sleep between kernels; waking
one costs 60-90 us on the 2-core VMs measured (a futex wake through the hypervisor), against a
product of 0.30 ms on two cores: lstm_lm's 136 products a step took 0.40-0.43 ms each. Eigen's
thread pool, TensorFlow's intra-op pool, spins a while before it parks for the same reason. Here
each helper runs `serve`, a nogil numba loop that polls a control word and takes pieces of the
posted product until none is left; after SPIN_CYCLES of nothing to do it returns to Python and
sleeps on an Event until the next post wakes it.

The control block `ctl` (int64) holds the product's arrays as addresses and shapes, and one word
NEXT = job << 40 | pieces << 20 | next piece, which the caller stores last (sequentially
consistent, so the arguments are visible before it). Whoever takes a piece (a compare-and-swap of
NEXT: helpers and the caller alike) runs it and adds one to DONE; the caller returns when DONE
counts every piece. A piece is never waited for unless someone has taken it, so a helper that is
asleep or slow to wake costs nothing: the caller takes what is left. The job number in NEXT keeps
a helper that finished late from taking a piece of the next job with the previous arguments.
A piece is a run of whole panels, each output made once, so the bits never depend on who ran it.

Measured (2-core Zen 4 EPYC, lstm_lm's 20 x 650 @ 650 x 2600): 0.40 -> 0.32 ms a product alone
(one thread 0.59), 0.43 -> 0.38 in the step, the step 2.5-3.7% faster (alternating in one
process). Spinning budgets of 0.05-0.6 ms and 2-8 pieces a thread measured alike. Pieces of
balanced size (`piece_panels`), and h read in place rather than copied transposed: in the step
(medians of 408 products) the forward's 340 -> 318 us, the backward's (20 x 2600 @ 2600 x 650) 365
-> 316, where one thread alone takes 600.

A module of its own with module-level helpers, so that numba's cache finds the code again.
"""
from __future__ import annotations

import platform
from typing import Any

from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from flowctl.kernels.cpu.gemm_jit import packed_matmul
from flowctl.kernels.cpu.jit import njit

# ctl's words
NEXT, DONE, STOP, SLEEPERS, ALLOWED = 0, 1, 2, 3, 4  # ALLOWED: helpers 0..ALLOWED-1 take pieces
H, K, M, WP, P, L, OUT, N, TAIL = range(5, 14)
WORDS = 16
FIELD = 20  # bits of NEXT's piece count and next piece
MASK = (1 << FIELD) - 1
SPIN_CYCLES = 600_000  # ~0.2 ms at 2.6-3.7 GHz: the gaps between lstm_lm's products are 0.05-0.15 ms

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _slot(builder: Any, context: Any, sig_arr: Any, arr: Any, idx: Any) -> Any:
    a = context.make_array(sig_arr)(context, builder, arr)
    return builder.gep(a.data, [idx])


@intrinsic
def load(typingctx: Any, arr: Any, idx: Any) -> Any:
    """arr[idx], a sequentially consistent atomic load (int64 array)."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _slot(builder, context, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "seq_cst", 8)
    return types.int64(arr, idx), codegen


@intrinsic
def store(typingctx: Any, arr: Any, idx: Any, val: Any) -> Any:
    """arr[idx] = val, a sequentially consistent atomic store."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _slot(builder, context, sig.args[0], args[0], args[1])
        builder.store_atomic(context.cast(builder, args[2], sig.args[2], types.int64), ptr, "seq_cst", 8)
        return context.get_dummy_value()
    return types.void(arr, idx, val), codegen


@intrinsic
def add(typingctx: Any, arr: Any, idx: Any, val: Any) -> Any:
    """arr[idx] += val atomically; the value before."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _slot(builder, context, sig.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, context.cast(builder, args[2], sig.args[2], types.int64), "seq_cst")
    return types.int64(arr, idx, val), codegen


@intrinsic
def cas(typingctx: Any, arr: Any, idx: Any, old: Any, new: Any) -> Any:
    """arr[idx] = new if it holds old, atomically; whether it did."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _slot(builder, context, sig.args[0], args[0], args[1])
        pair = builder.cmpxchg(ptr, args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)
    return types.boolean(arr, idx, old, new), codegen


@intrinsic
def relax(typingctx: Any) -> Any:
    """One spin-wait hint (x86's pause); the cycle counter after it."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if _X86:
            pause = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                   "llvm.x86.sse2.pause")
            builder.call(pause, [])
        clock = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                               "llvm.readcyclecounter")
        return builder.call(clock, [])
    return types.int64(), codegen


@intrinsic
def f32_at(typingctx: Any, addr: Any) -> Any:
    """The float32 pointer at address addr (an int64 from an array's ctypes.data)."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], ir.FloatType().as_pointer())
    return types.CPointer(types.float32)(addr), codegen


@njit
def piece_panels(p_len: int, piece: int, pieces: int) -> tuple[int, int]:
    """Piece `piece` of `pieces` of p_len panels: whole pairs of them (the last maybe one panel),
    the pieces' sizes differing by at most one pair. Cutting by a per-piece size rounded up to
    pairs left the backward's 41 panels (W_h^T's) in pieces of 6, 6, ..., 5, 0: 4 of them on one
    thread and 3 on the other, 0.333 against 0.306 ms a product alone."""
    pairs = (p_len + 1) // 2
    return 2 * (piece * pairs // pieces), min(p_len, 2 * ((piece + 1) * pairs // pieces))


@njit
def _piece(ctl: Any, piece: int, pieces: int) -> None:
    """Panels piece_panels(P, piece, pieces) of the posted product."""
    p_len, lanes, k_len, m, n = ctl[P], ctl[L], ctl[K], ctl[M], ctl[N]
    p0, p1 = piece_panels(p_len, piece, pieces)
    if p0 >= p1:
        return
    h_t = carray(f32_at(ctl[H]), (m, k_len)).T
    wp = carray(f32_at(ctl[WP]), (p_len, k_len, lanes))
    out = carray(f32_at(ctl[OUT]), (m, n))
    tail = carray(f32_at(ctl[TAIL]), (m, lanes))
    packed_matmul(h_t, wp, out, tail, p0, p1)


@njit
def _take(ctl: Any, job: int) -> bool:
    """Run one untaken piece of `job`; False when none is left (or a newer job replaced it)."""
    while True:
        v = load(ctl, NEXT)
        pieces = (v >> FIELD) & MASK
        piece = v & MASK
        if (v >> (2 * FIELD)) != job or piece >= pieces:
            return False
        if cas(ctl, NEXT, v, v + 1):
            _piece(ctl, piece, pieces)
            add(ctl, DONE, 1)
            return True


@njit
def serve(ctl: Any, spin: int, index: int) -> int:
    """Helper `index`'s loop: take pieces of whatever job is posted (while index < ALLOWED); 0
    after `spin` cycles with nothing taken (the caller then sleeps), -1 once STOP is set."""
    idle_since = relax()
    while True:
        if load(ctl, STOP):
            return -1
        if index < load(ctl, ALLOWED) and _take(ctl, load(ctl, NEXT) >> (2 * FIELD)):
            idle_since = relax()
            continue
        if relax() - idle_since > spin:
            return 0


@njit
def going_to_sleep(ctl: Any) -> bool:
    """Count this helper as asleep, unless a piece is waiting (then it serves on). Its add and the
    poster's store of NEXT are sequentially consistent: either it sees the post, or the poster
    sees it asleep and wakes it."""
    add(ctl, SLEEPERS, 1)
    v = load(ctl, NEXT)
    if (v & MASK) < ((v >> FIELD) & MASK):
        add(ctl, SLEEPERS, -1)
        return False
    return True


@njit
def woken(ctl: Any) -> None:
    add(ctl, SLEEPERS, -1)


@njit
def post(ctl: Any, job: int, pieces: int, h: Any, wp: Any, out: Any, tail: Any) -> int:
    """Post `job`, the product out = h @ wp's panels (h C-ordered) in `pieces` pieces; the helpers
    asleep as it was posted (the caller wakes them)."""
    ctl[H], ctl[K], ctl[M] = h.ctypes.data, h.shape[1], h.shape[0]
    ctl[WP], ctl[P], ctl[L] = wp.ctypes.data, wp.shape[0], wp.shape[2]
    ctl[OUT], ctl[N], ctl[TAIL] = out.ctypes.data, out.shape[1], tail.ctypes.data
    store(ctl, DONE, 0)
    store(ctl, NEXT, (job << (2 * FIELD)) | (pieces << FIELD))
    return load(ctl, SLEEPERS)


@njit
def run(ctl: Any, job: int, pieces: int) -> None:
    """Take `job`'s pieces until none is left, then wait for those the helpers took."""
    while _take(ctl, job):
        pass
    while load(ctl, DONE) < pieces:
        relax()
