"""GPU kernels of our own (issue 30: a training step captured as one CUDA graph), written once in
numba-cuda's Python (`jit.py`): on a GPU they run on cupy arrays on the current stream; with
NUMBA_ENABLE_CUDASIM=1 numba's simulator runs the same source on numpy arrays (tests).

This module holds the kernels' device code (`_kernels()`, compiled once numba is wanted) and the
launch helpers; the state writes that run them -- the updates, assignments, CheckNumerics and the
sparse rows, all under the step's guard -- are registered in `state.py`. Each replaces, on `gpu`
only, a generic kernel that would touch the host inside a step or launch many kernels where one
does:

- `Dropout`: the mask drawn on the device, Philox4x32-10 keyed by the op's seed and the element's
  index (`philox.py`), the draw number read from the op's device counter (`RngState.device_counter`)
  and advanced by a second tiny launch, so a captured graph draws afresh on every replay.
- `LSTMBlockCell`, `LSTMBlockCellGrad`: one launch each, a thread per (row, unit) doing all four
  gates.
- `L2Loss`: a two-launch block reduction in a fixed order (no cuBLAS dot per 64K block).

Scalars of the arithmetic are typed numpy scalars (a Python float literal would make numba compute
in float64), and each float32 result is rounded as numpy rounds it, so the simulator and the GPU
give the generic kernels' bits where the generic kernels are exactly rounded."""
from __future__ import annotations

import functools
import os
import math
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from flowctl.kernels import bf16
from flowctl.kernels.cuda import bfloat16, philox
from flowctl.kernels.cuda.jit import blocks, numba_cuda, simulated
from flowctl.kernels.recurrent import lstm_block_cell, lstm_block_cell_grad
from flowctl.kernels.registry import StepGuard, kernel
from flowctl.kernels.training import l2_loss

Fn = Callable[..., Any]

# Threads per block of every launch here (the reductions' shared arrays are this long). In numba's
# CUDA simulator, which runs a Python thread per CUDA thread, 32: a block's reduction order
# differs from the GPU's there, so its bits too, within float32 rounding.
THREADS = 32 if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else 256
_MAX_REDUCE_BLOCKS = 1024  # L2Loss's first pass: at most this many partial sums


# numba.cuda once a kernel is wanted. A module global, not a local of `_kernels`: the simulator
# swaps its own module in for every global that names numba.cuda while a kernel runs.
cuda: Any = None


@functools.cache
def _kernels() -> Any:
    """Every kernel of this module, compiled lazily by numba (imported here, not at module load)."""
    global cuda
    cuda = numba_cuda()
    if cuda is None:
        raise RuntimeError("numba-cuda is not installed: the GPU kernels of flowctl/kernels/cuda need it")
    from numba import float32 as nb_float32

    dev = philox.device_functions()
    d_philox, d_uniform = dev.philox, dev.to_uniform  # names numba can type (not a namespace's attributes)
    f32 = np.float32
    u64 = np.uint64
    ONE_U64 = u64(1)
    MASK32 = u64(0xFFFFFFFF)
    S32 = u64(32)
    HALF, ONE = f32(0.5), f32(1.0)
    ZERO32 = f32(0.0)

    # A float32 product rounded on its own: NVVM contracts a*b + c into one fused multiply-add by
    # default (fastmath or not), which rounds once where numpy rounds twice. libdevice's
    # __fmul_rn is never contracted; the simulator (numpy scalars) needs no such care.
    if simulated():
        @cuda.jit(device=True)
        def mul(a: Any, b: Any) -> Any:
            return a * b
    else:
        from numba.cuda import libdevice

        @cuda.jit(device=True)
        def mul(a: Any, b: Any) -> Any:
            return libdevice.fmul_rn(a, b)

    # ---------------------------------------------------------------- Dropout
    @cuda.jit(device=True)
    def drop_one(x: Any, y: Any, mask: Any, i: Any, word: Any, rate: Any, scale: Any, zero: Any) -> None:
        u = d_uniform(word)
        m = scale if u >= rate else zero
        mask[i] = m
        y[i] = x[i] * m

    @cuda.jit
    def dropout(x: Any, y: Any, mask: Any, counter: Any, size: Any, k0: Any, k1: Any, rate: Any, scale: Any,
                zero: Any) -> None:
        t = cuda.grid(1)
        base = t * 4
        if base >= size:
            return
        n = counter[0]
        tu = u64(t)
        w0, w1, w2, w3 = d_philox(tu & MASK32, tu >> S32, n & MASK32, n >> S32, k0, k1)
        drop_one(x, y, mask, base, w0, rate, scale, zero)
        if base + 1 < size:
            drop_one(x, y, mask, base + 1, w1, rate, scale, zero)
        if base + 2 < size:
            drop_one(x, y, mask, base + 2, w2, rate, scale, zero)
        if base + 3 < size:
            drop_one(x, y, mask, base + 3, w3, rate, scale, zero)

    @cuda.jit
    def bump(counter: Any) -> None:
        if cuda.grid(1) == 0:
            counter[0] = counter[0] + ONE_U64

    # ---------------------------------------------------------------- LSTM cell
    @cuda.jit(device=True)
    def sigmoid(v: Any) -> Any:  # 0.5 (1 + tanh(x/2)) as the generic kernel rounds it
        t = f32(math.tanh(mul(v, HALF)))
        return mul(t, HALF) + HALF

    # The cell and its gradient over arrays read with `ld`, written with `st`; `kept(arr, b, j, v)`: what
    # the cell goes on with after storing v (read back: float16's rounded gates, as the gradient reads).
    def cell_kernels(ld: Any, st: Any, kept: Any) -> tuple[Any, Any]:
        @cuda.jit(device=True)
        def gates(a: Any, b: Any, j: Any, units: Any) -> Any:  # the four gates' [b, j] of a [rows, 4 units] array
            return ld(a, b, j), ld(a, b, units + j), ld(a, b, 2 * units + j), ld(a, b, 3 * units + j)

        @cuda.jit
        def lstm_cell(xw: Any, hw: Any, has_hw: Any, c_prev: Any, has_c: Any, forget_bias: Any, add_bias: Any,
                      h: Any, c: Any, act: Any, rows: Any, units: Any) -> None:
            t, b, j = cell_index(units)
            if t >= rows * units:
                return
            ai, af, ag, ao = gates(xw, b, j, units)
            if has_hw:
                hi, hf, hg, ho = gates(hw, b, j, units)
                ai, af, ag, ao = ai + hi, af + hf, ag + hg, ao + ho
            if add_bias:
                af = af + forget_bias
            si, sf, tg, so = sigmoid(ai), sigmoid(af), f32(math.tanh(ag)), sigmoid(ao)
            st(act, b, j, si)
            st(act, b, units + j, sf)
            st(act, b, 2 * units + j, tg)
            st(act, b, 3 * units + j, so)
            gi, gf = kept(act, b, j, si), kept(act, b, units + j, sf)
            gg, go = kept(act, b, 2 * units + j, tg), kept(act, b, 3 * units + j, so)
            cv = mul(gi, gg)
            if has_c:
                cv = cv + mul(gf, ld(c_prev, b, j))
            st(c, b, j, cv)
            cv = kept(c, b, j, cv)
            st(h, b, j, mul(f32(math.tanh(cv)), go))

        @cuda.jit
        def lstm_cell_grad(dh: Any, dc: Any, act: Any, c: Any, c_prev: Any, has_c: Any, dz: Any, dc_prev: Any,
                           rows: Any, units: Any) -> None:
            t, b, j = cell_index(units)
            if t >= rows * units:
                return
            gi, gf, gg, go = gates(act, b, j, units)
            vdh = ld(dh, b, j)
            tc = f32(math.tanh(ld(c, b, j)))
            dct = mul(mul(ONE - mul(tc, tc), go), vdh) + ld(dc, b, j)
            st(dz, b, 3 * units + j, mul(mul(vdh, tc), mul(ONE - go, go)))
            st(dz, b, j, mul(mul(mul(ONE - gi, gi), gg), dct))
            st(dz, b, 2 * units + j, mul(mul(ONE - mul(gg, gg), gi), dct))
            if has_c:
                st(dz, b, units + j, mul(mul(mul(ONE - gf, gf), ld(c_prev, b, j)), dct))
                st(dc_prev, b, j, mul(dct, gf))
            else:
                st(dz, b, units + j, ZERO32)

        return lstm_cell, lstm_cell_grad

    @cuda.jit(device=True)
    def cell_index(units: Any) -> Any:  # (thread, row, unit) of a thread per (row, unit)
        t = cuda.grid(1)
        b = t // units
        return t, b, t - b * units

    @cuda.jit(device=True)
    def ld_float(a: Any, b: Any, j: Any) -> Any:
        return f32(a[b, j])

    @cuda.jit(device=True)
    def st_float(a: Any, b: Any, j: Any, v: Any) -> None:
        a[b, j] = v

    @cuda.jit(device=True)
    def kept_float(a: Any, b: Any, j: Any, v: Any) -> Any:
        return f32(a[b, j])

    b16 = bfloat16.device_functions()
    lstm_cell, lstm_cell_grad = cell_kernels(ld_float, st_float, kept_float)
    lstm_cell_bf16, lstm_cell_grad_bf16 = cell_kernels(b16.ld, b16.st, b16.kept)

    # ---------------------------------------------------------------- guarded updates
    # Each update's arithmetic is one device function, shared by the per-variable kernel (a thread
    # per element) and the multi-tensor kernel (state.py: a tuple of up to K variables, blockIdx.y
    # picking the variable, a grid-stride loop over its elements), so the two give the same bits.
    @cuda.jit(device=True)
    def sgd_at(var: Any, delta: Any, i: Any, a: Any) -> None:
        var[i] = var[i] - mul(delta[i], a)

    @cuda.jit(device=True)
    def momentum_at(var: Any, accum: Any, grad: Any, i: Any, lr: Any, m: Any, nesterov: Any) -> None:
        g = grad[i]
        a = mul(accum[i], m) + g
        accum[i] = a
        if nesterov:
            step = mul(lr, g + mul(a, m))
        else:
            step = mul(lr, a)
        var[i] = var[i] - step

    @cuda.jit(device=True)
    def adam_at(var: Any, m: Any, v: Any, grad: Any, i: Any, lr: Any, b1: Any, c1: Any, b2: Any, c2: Any,
                eps: Any) -> None:
        g = grad[i]
        mi = mul(m[i], b1) + mul(g, c1)
        vi = mul(v[i], b2) + mul(mul(g, g), c2)
        m[i] = mi
        v[i] = vi
        d = f32(math.sqrt(vi)) + eps
        var[i] = var[i] - mul(lr, mi) / d

    @cuda.jit
    def sgd(var: Any, delta: Any, a_arr: Any, a_val: Any, use_arr: Any, flag: Any, size: Any) -> None:
        i = cuda.grid(1)
        if i >= size or flag[0] == 0:
            return
        a = a_arr[0] if use_arr else a_val
        sgd_at(var, delta, i, a)

    @cuda.jit
    def momentum(var: Any, accum: Any, grad: Any, lr_arr: Any, lr_val: Any, use_arr: Any, m: Any, nesterov: Any,
                 flag: Any, size: Any) -> None:
        i = cuda.grid(1)
        if i >= size or flag[0] == 0:
            return
        lr = lr_arr[0] if use_arr else lr_val
        momentum_at(var, accum, grad, i, lr, m, nesterov)

    @cuda.jit
    def adam(var: Any, m: Any, v: Any, grad: Any, lr_arr: Any, lr_val: Any, use_arr: Any, b1: Any, c1: Any, b2: Any,
             c2: Any, eps: Any, flag: Any, size: Any) -> None:
        i = cuda.grid(1)
        if i >= size or flag[0] == 0:
            return
        lr = lr_arr[0] if use_arr else lr_val
        adam_at(var, m, v, grad, i, lr, b1, c1, b2, c2, eps)

    # The multi-tensor updates: arguments are tuples of K flat float32 arrays (the variables, their
    # slots, the gradients, the one-element step sizes; a chunk shorter than K padded with empty
    # arrays), one launch with gridDim.y = K.
    @cuda.jit
    def multi_sgd(vars: Any, deltas: Any, alphas: Any, flag: Any) -> None:
        if flag[0] == 0:
            return
        k = cuda.blockIdx.y
        var = vars[k]
        delta = deltas[k]
        a = alphas[k][0]
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < var.size:
            sgd_at(var, delta, i, a)
            i += stride

    @cuda.jit
    def multi_momentum(vars: Any, accums: Any, grads: Any, lrs: Any, m: Any, nesterov: Any, flag: Any) -> None:
        if flag[0] == 0:
            return
        k = cuda.blockIdx.y
        var = vars[k]
        accum = accums[k]
        grad = grads[k]
        lr = lrs[k][0]
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < var.size:
            momentum_at(var, accum, grad, i, lr, m, nesterov)
            i += stride

    @cuda.jit
    def multi_adam(vars: Any, ms: Any, vs: Any, grads: Any, lrs: Any, b1: Any, c1: Any, b2: Any, c2: Any, eps: Any,
                   flag: Any) -> None:
        if flag[0] == 0:
            return
        k = cuda.blockIdx.y
        var = vars[k]
        m = ms[k]
        v = vs[k]
        grad = grads[k]
        lr = lrs[k][0]
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < var.size:
            adam_at(var, m, v, grad, i, lr, b1, c1, b2, c2, eps)
            i += stride

    @cuda.jit
    def assign_arr(var: Any, val: Any, bcast: Any, sub: Any, flag: Any, size: Any) -> None:
        i = cuda.grid(1)
        if i >= size or flag[0] == 0:
            return
        x = val[0] if bcast else val[i]
        if sub:
            var[i] = var[i] - x
        else:
            var[i] = var[i] + x

    @cuda.jit
    def assign_val(var: Any, x: Any, sub: Any, flag: Any, size: Any) -> None:
        i = cuda.grid(1)
        if i >= size or flag[0] == 0:
            return
        if sub:
            var[i] = var[i] - x
        else:
            var[i] = var[i] + x

    # ---------------------------------------------------------------- CheckNumerics
    @cuda.jit
    def set_flag(flag: Any, value: Any) -> None:
        if cuda.grid(1) == 0:
            flag[0] = value

    @cuda.jit
    def finite_flag(bits: Any, exponent: Any, flag: Any, size: Any) -> None:
        # x's bits as unsigned integers: non-finite exactly where every exponent bit is set
        i = cuda.grid(1)
        if i >= size:
            return
        if (bits[i] & exponent) == exponent:
            flag[0] = 0

    # ---------------------------------------------------------------- sparse rows
    @cuda.jit
    def rank_sort(idx: Any, size: Any, n_rows: Any, order: Any, ids: Any) -> None:
        # rank of (id, position) among all positions: a stable sort of n indices by counting
        q = cuda.grid(1)
        if q >= size:
            return
        iq = idx[q]
        if iq < 0:
            iq = iq + n_rows
        rank = 0
        for r in range(size):
            ir = idx[r]
            if ir < 0:
                ir = ir + n_rows
            if ir < iq or (ir == iq and r < q):
                rank += 1
        order[rank] = q
        ids[rank] = iq

    @cuda.jit(device=True)
    def pairwise(dy: Any, order: Any, start: Any, n: Any, col: Any, zero: Any) -> Any:
        # numpy's pairwise summation (loops_utils.h, `pairwise_sum`) of dy[order[start:start+n], col],
        # the order numpy's add.reduceat (the CPU kernel) sums a run's rows after its first in
        if n < 8:
            res = zero
            for q in range(n):
                res = res + dy[order[start + q], col]
            return res
        if n <= 128:
            r0 = dy[order[start], col]
            r1 = dy[order[start + 1], col]
            r2 = dy[order[start + 2], col]
            r3 = dy[order[start + 3], col]
            r4 = dy[order[start + 4], col]
            r5 = dy[order[start + 5], col]
            r6 = dy[order[start + 6], col]
            r7 = dy[order[start + 7], col]
            q = 8
            lim = n - n % 8
            while q < lim:
                r0 = r0 + dy[order[start + q], col]
                r1 = r1 + dy[order[start + q + 1], col]
                r2 = r2 + dy[order[start + q + 2], col]
                r3 = r3 + dy[order[start + q + 3], col]
                r4 = r4 + dy[order[start + q + 4], col]
                r5 = r5 + dy[order[start + q + 5], col]
                r6 = r6 + dy[order[start + q + 6], col]
                r7 = r7 + dy[order[start + q + 7], col]
                q += 8
            res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
            while q < n:
                res = res + dy[order[start + q], col]
                q += 1
            return res
        n2 = n // 2
        n2 -= n2 % 8
        return pairwise(dy, order, start, n2, col, zero) + pairwise(dy, order, start + n2, n - n2, col, zero)

    @cuda.jit
    def segment_rows(dy: Any, order: Any, ids: Any, rows: Any, size: Any, inner: Any, zero: Any) -> None:
        # rows[p] = the sum of the dy rows of the run of equal ids that starts at p, in sorted
        # (stable) order as add.reduceat sums it: the first row plus the pairwise sum of the rest;
        # 0 where p is not a run's first position
        t = cuda.grid(1)
        if t >= size * inner:
            return
        p = t // inner
        col = t - p * inner
        if p > 0 and ids[p] == ids[p - 1]:
            rows[p, col] = zero
            return
        end = p + 1
        while end < size and ids[end] == ids[p]:
            end += 1
        if end == p + 1:
            rows[p, col] = dy[order[p], col]
        else:
            rows[p, col] = dy[order[p], col] + pairwise(dy, order, p + 1, end - p - 1, col, zero)

    @cuda.jit
    def sparse_sgd(var: Any, ids: Any, rows: Any, a_arr: Any, a_val: Any, use_arr: Any, flag: Any, size: Any,
                   inner: Any, n_rows: Any) -> None:
        t = cuda.grid(1)
        if t >= size * inner or flag[0] == 0:
            return
        p = t // inner
        col = t - p * inner
        if p > 0 and ids[p] == ids[p - 1]:  # a later position of a run: its row is zero, its write a race
            return
        r = ids[p]
        if r < 0:
            r = r + n_rows
        a = a_arr[0] if use_arr else a_val
        var[r, col] = var[r, col] - mul(rows[p, col], a)

    # ---------------------------------------------------------------- L2Loss
    @cuda.jit(device=True)
    def block_sum_squares(x: Any, i: Any, stride: Any, size: Any) -> Any:
        """This block's sum of x[i]^2 over its threads' grid-stride shares (thread 0's value is the
        block's): a fixed tree, so L2Loss and MultiL2Loss give a tensor the same bits."""
        s = cuda.shared.array(THREADS, nb_float32)
        tid = cuda.threadIdx.x
        acc = ZERO32
        while i < size:
            v = f32(x[i])
            acc = acc + mul(v, v)
            i += stride
        s[tid] = acc
        width = THREADS // 2
        while width > 0:
            cuda.syncthreads()
            if tid < width:
                s[tid] = s[tid] + s[tid + width]
            width //= 2
        return s[0]

    @cuda.jit
    def sum_squares(x: Any, partial: Any, size: Any) -> None:
        total = block_sum_squares(x, cuda.grid(1), cuda.gridsize(1), size)
        if cuda.threadIdx.x == 0:
            partial[cuda.blockIdx.x] = total

    @cuda.jit(device=True)
    def block_sum(partial: Any, off: Any, count: Any) -> Any:
        """This block's sum of partial[off:off + count] (thread 0's value is it): each thread's
        strided share, then a fixed tree, so L2Loss's finish and MultiL2Loss's give the same bits."""
        s = cuda.shared.array(THREADS, nb_float32)
        tid = cuda.threadIdx.x
        acc = ZERO32
        i = tid
        while i < count:
            acc = acc + partial[off + i]
            i += THREADS
        s[tid] = acc
        width = THREADS // 2
        while width > 0:
            cuda.syncthreads()
            if tid < width:
                s[tid] = s[tid] + s[tid + width]
            width //= 2
        return s[0]

    @cuda.jit
    def finish_l2(partial: Any, count: Any, out: Any) -> None:
        total = block_sum(partial, 0, count)
        if cuda.threadIdx.x == 0:
            out[0] = mul(total, HALF)


    # ---------------------------------------------------------------- MultiL2Loss
    # Many tensors' L2Loss and their sum (engine/multi_l2.py). The first pass is sum_squares for
    # up to K tensors at once (a tuple of flat arrays, blockIdx.y the tensor): each tensor gets
    # the grid its own L2Loss launch would have, the same grid-stride share per thread and the same
    # tree per block, so its partial sums are that launch's bits; its blocks past that grid (the
    # launch's grid.x is its chunk's largest) return at once. The partial sums of all N tensors lie
    # in one buffer, and each tensor's offset and count are written beside them for the finish.
    @cuda.jit(device=True)
    def reduce_grid(n: Any) -> Any:
        g = (n + THREADS - 1) // THREADS
        if g > _MAX_REDUCE_BLOCKS:
            g = _MAX_REDUCE_BLOCKS
        if g < 1:
            g = 1
        return g

    @cuda.jit
    def multi_sum_squares(xs: Any, ids: Any, count: Any, base: Any, partial: Any, offs: Any, cnts: Any) -> None:
        k = cuda.blockIdx.y
        if k >= count:  # a padding entry of the chunk
            return
        x = xs[k]
        n = x.size
        grid = reduce_grid(n)
        b = cuda.blockIdx.x
        if b >= grid:  # the whole block, before any barrier
            return
        off = base
        for j in range(k):
            off += reduce_grid(xs[j].size)
        total = block_sum_squares(x, b * THREADS + cuda.threadIdx.x, grid * THREADS, n)
        if cuda.threadIdx.x == 0:
            partial[off + b] = total
            if b == 0:
                offs[ids[k]] = off
                cnts[ids[k]] = grid

    # The finish, one block: tensor by tensor (in the node's input order) finish_l2's sum of its
    # partial sums, halved and rounded to the tensors' dtype (`halves`), added to the total as AddN
    # adds (left to right, each sum rounded to the dtype by its store into `out`).
    @cuda.jit
    def multi_finish_l2(partial: Any, offs: Any, cnts: Any, n: Any, halves: Any, out: Any) -> None:
        for k in range(n):
            total = block_sum(partial, offs[k], cnts[k])
            if cuda.threadIdx.x == 0:
                halves[k] = mul(total, HALF)
                if k == 0:
                    out[0] = halves[0]
                else:
                    out[0] = f32(out[0]) + f32(halves[k])
            cuda.syncthreads()  # block_sum's shared array is the next tensor's

    return SimpleNamespace(dropout=dropout, bump=bump, lstm_cell=lstm_cell, lstm_cell_grad=lstm_cell_grad,
                           lstm_cell_bf16=lstm_cell_bf16, lstm_cell_grad_bf16=lstm_cell_grad_bf16, sgd=sgd,
                           momentum=momentum, adam=adam, multi_sgd=multi_sgd,
                           multi_momentum=multi_momentum, multi_adam=multi_adam, assign_arr=assign_arr, assign_val=assign_val, set_flag=set_flag,
                           finite_flag=finite_flag, rank_sort=rank_sort, segment_rows=segment_rows,
                           sparse_sgd=sparse_sgd, sum_squares=sum_squares, finish_l2=finish_l2,
                           multi_sum_squares=multi_sum_squares, multi_finish_l2=multi_finish_l2)


# -------------------------------------------------------------------------------- helpers
# The arguments each kernel writes. In the simulator every other array goes in as `cuda.In`: the
# simulator copies each array argument to its fake device and, unless told, back again after the
# launch, which fails on a read-only input (a Const) and, where one array is passed twice, puts
# back a stale copy over the written one.
_WRITES = {"dropout": (1, 2), "bump": (0,), "lstm_cell": (7, 8, 9), "lstm_cell_grad": (6, 7), "sgd": (0,),
           "momentum": (0, 1), "adam": (0, 1, 2), "multi_sgd": (0,), "multi_momentum": (0, 1),
           "multi_adam": (0, 1, 2), "assign_arr": (0,), "assign_val": (0,), "set_flag": (0,),
           "finite_flag": (2,), "rank_sort": (3, 4), "segment_rows": (3,), "sparse_sgd": (0,),
           "sum_squares": (1,), "finish_l2": (2,), "multi_sum_squares": (4, 5, 6),
           "multi_finish_l2": (4, 5)}


def _go(xp: Any, k: Any, grid: Any, block: Any, *args: Any) -> None:
    if getattr(xp, "simulated", False):
        writes = _WRITES[k.__name__]
        into = numba_cuda().In
        # On the launch ledger, its plain view of the array's memory: a view of the array itself
        # would hold it from the captured step's tape, and a variable an L2 penalty reads would
        # then look shared to its update (which would not run in place)
        plain = getattr(xp, "plain", None)
        view = (lambda a: plain(a) if isinstance(a, xp.ndarray) else a.view(np.ndarray)) if plain is not None \
            else (lambda a: a.view(np.ndarray))
        args = tuple(into(view(a)) if isinstance(a, np.ndarray) and i not in writes else a
                     for i, a in enumerate(args))
    xp.launch(k, grid, block, *args)


def _launch(xp: Any, k: Any, n: int, *args: Any) -> None:
    """One launch of `k` with a thread per each of n items (nothing where n is 0)."""
    if n:
        # An element-wise kernel's result does not depend on its block size: in the simulator (a
        # Python thread per CUDA thread) a small launch gets a block no larger than it needs.
        threads = max(1, min(THREADS, n)) if getattr(xp, "simulated", False) else THREADS
        grid, block = blocks(n, threads)
        _go(xp, k, grid, block, *args)


def _flag(xp: Any, attrs: dict[str, Any]) -> Any:
    """The step guard's flag on this device (made now, at bind time), or a flag of our own that
    always reads 1 where the node has no guard."""
    guard = attrs.get("_guard")
    return guard.flag(xp) if isinstance(guard, StepGuard) else xp.ones(1, dtype="int32")


def _is_array(xp: Any, v: Any) -> bool:
    return isinstance(v, xp.ndarray)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float, np.generic)) and not isinstance(v, (bool, np.bool_))


def _dummy(xp: Any) -> Any:
    """A float32 array standing in for a scalar operand passed by value (made at bind time; never
    one of the kernel's other arrays: the simulator copies each argument back in turn)."""
    return xp.zeros(1, dtype="float32")


def _scalar_arg(xp: Any, v: Any, dtype: Any, dummy: Any) -> tuple[Any, Any, bool] | None:
    """(array, value, use_array) for a kernel's scalar operand: a device array of one value (read
    on the device: nothing crosses to the host) or a host number passed by value in `dtype`
    (`dummy` stands in for the array); None for anything else."""
    if _is_array(xp, v) and v.size == 1:
        return v.reshape(1), np.dtype(dtype).type(0), True
    if _is_scalar(v):
        return dummy, np.dtype(dtype).type(v), False
    return None


def _flat(xp: Any, x: Any) -> Any:
    return xp.ascontiguousarray(x).reshape(-1)


# -------------------------------------------------------------------------------- Dropout
@kernel("Dropout", ["gpu"])
def dropout_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    st = attrs["_resource"]
    rate = float(attrs["rate"])
    scale = 1.0 / (1.0 - rate)
    counter = st.device_counter(xp)  # made now, never inside a capture
    k0, k1 = (np.uint64(w) for w in philox.split64(st.seed))
    rate32 = np.float32(rate)  # numpy compares the float32 uniforms with rate as a float32
    k = _kernels()

    def run(x: Any) -> tuple[Any, Any]:
        dt = np.dtype(x.dtype)
        # the mask's value in x's dtype; float16 passes it (exactly) as a float32, and the product
        # of two float16 values is exact in float32, so y rounds once, as numpy's float16 does
        s = np.float32(np.float16(scale)) if dt == np.float16 else dt.type(scale)
        y = xp.empty(x.shape, dtype=x.dtype)
        mask = xp.empty(x.shape, dtype=x.dtype)
        n = int(x.size)
        _launch(xp, k.dropout, (n + 3) // 4, _flat(xp, x), y.reshape(-1), mask.reshape(-1), counter, n, k0, k1,
                rate32, s, type(s)(0))
        _go(xp, k.bump, 1, 1, counter)
        st.device_draws += 1  # the host's mirror (a captured step's replays add theirs)
        return y, mask

    return run


# -------------------------------------------------------------------------------- LSTM cell
_LSTM_DTYPES = ("float32", "float16")
for _op in ("LSTMBlockCell", "LSTMBlockCellGrad"):  # bfloat16 as uint16 bit patterns (cuda/bfloat16.py)
    bf16.native(_op, ["gpu"])


@kernel("LSTMBlockCell", ["gpu"])
def lstm_block_cell_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    forget_bias = float(attrs["forget_bias"])
    generic = lstm_block_cell(xp, attrs)
    k = _kernels()

    def run(xw: Any, hw: Any = None, c_prev: Any = None) -> tuple[Any, Any, Any]:
        low = bf16.is_bf16(xw)
        if low:
            xw, hw, c_prev = (None if v is None else v.view(np.uint16) for v in (xw, hw, c_prev))
        elif str(xw.dtype) not in _LSTM_DTYPES or (hw is not None and hw.dtype != xw.dtype) \
                or (c_prev is not None and c_prev.dtype != xw.dtype):
            return generic(xw, hw, c_prev)
        rows, units = int(xw.shape[0]), int(xw.shape[1]) // 4
        xw = xp.ascontiguousarray(xw)
        h = xp.empty((rows, units), dtype=xw.dtype)
        c = xp.empty((rows, units), dtype=xw.dtype)
        act = xp.empty(xw.shape, dtype=xw.dtype)
        hw_ = xp.ascontiguousarray(hw) if hw is not None else xw
        cp_ = xp.ascontiguousarray(c_prev) if c_prev is not None else c
        _launch(xp, k.lstm_cell_bf16 if low else k.lstm_cell, rows * units, xw, hw_, hw is not None, cp_,
                c_prev is not None, np.float32(forget_bias), bool(forget_bias), h, c, act, rows, units)
        return tuple(v.view(bf16.BF16) for v in (h, c, act)) if low else (h, c, act)

    return run


@kernel("LSTMBlockCellGrad", ["gpu"])
def lstm_block_cell_grad_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    generic = lstm_block_cell_grad(xp, attrs)
    k = _kernels()

    def run(dh: Any, dc: Any, act: Any, c: Any, c_prev: Any = None) -> Any:
        low = bf16.is_bf16(act)
        if low:
            dh, dc, act, c, c_prev = (None if v is None else v.view(np.uint16) for v in (dh, dc, act, c, c_prev))
        dt = act.dtype
        if not low and (str(dt) not in _LSTM_DTYPES or any(v is not None and v.dtype != dt for v in (dh, dc, c, c_prev))):
            return generic(dh, dc, act, c, c_prev)
        rows, units = int(act.shape[0]), int(act.shape[1]) // 4
        dh, dc, act, c = (xp.ascontiguousarray(v) for v in (dh, dc, act, c))
        dz = xp.empty(act.shape, dtype=dt)
        dc_prev = xp.empty((rows, units), dtype=dt) if c_prev is not None else None
        cp_ = xp.ascontiguousarray(c_prev) if c_prev is not None else c
        _launch(xp, k.lstm_cell_grad_bf16 if low else k.lstm_cell_grad, rows * units, dh, dc, act, c, cp_,
                c_prev is not None, dz, dc_prev if dc_prev is not None else xp.empty((1, 1), dtype=dt), rows, units)
        if low:
            dz, dc_prev = dz.view(bf16.BF16), None if dc_prev is None else dc_prev.view(bf16.BF16)
        return dz if c_prev is None else (dz, dc_prev)

    return run


# -------------------------------------------------------------------------------- L2Loss
@kernel("L2Loss", ["gpu"])
def l2_loss_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    """sum(t^2) / 2 accumulated in float32 in two launches: each block sums a fixed grid-stride
    share of the squares and reduces it as a tree, then one block adds the partial sums in order.
    The grid depends on the size alone, so the bits do too. float64 goes to the generic kernel."""
    generic = l2_loss(xp, attrs)
    k = _kernels()

    def run(t: Any) -> Any:
        if str(t.dtype) not in ("float32", "float16"):
            return generic(t)
        n = int(t.size)
        grid = max(1, min(_MAX_REDUCE_BLOCKS, (n + THREADS - 1) // THREADS))
        partial = xp.empty(grid, dtype="float32")
        out = xp.empty((), dtype=t.dtype)
        _go(xp, k.sum_squares, grid, THREADS, _flat(xp, t), partial, n)
        _go(xp, k.finish_l2, 1, THREADS, partial, grid, out.reshape(1))
        return out

    return run


# -------------------------------------------------------------------------------- MultiL2Loss
# An AddN over L2Loss nodes as one node (engine/multi_l2.py): clip_by_global_norm's global norm,
# an L2 penalty; Inception-v3's clipped step has ~190 L2Loss nodes, 2 launches each. Here: one
# first pass per K tensors (tuples of arrays, as the multi-tensor updates pass them, cuda/state.py)
# and one finish for all N, so 1 + ceil(N / K) launches. Each tensor's half squared norm is its
# L2Loss launch's bits (the same grid, shares and trees), and the total is AddN's left-to-right
# sum of them. float64 (the generic L2Loss) and mixed dtypes run the per-tensor kernels and AddN.
_L2_CHUNK = 32  # a 1-D array is 56 bytes of a launch's 4 KiB of parameters, its id 8


def _reduce_grid(n: int) -> int:
    """The grid of L2Loss's first launch for n elements (as the kernel's reduce_grid)."""
    return max(1, min(_MAX_REDUCE_BLOCKS, (n + THREADS - 1) // THREADS))


def multi_l2_parts(xp: Any, ts: tuple[Any, ...], pads: dict[Any, Any] | None = None) -> tuple[Any, Any]:
    """(halves, total): each tensor's L2Loss as an array of the tensors' dtype, and their sum as
    AddN sums it (a 0-d array), in 1 + ceil(N / K) launches. The tensors are float32 or float16,
    all of one dtype. `pads` keeps the empty array a chunk is padded with, per dtype, from call to
    call (made once: its making is a launch)."""
    k = _kernels()
    n = len(ts)
    dt = ts[0].dtype
    simulated = getattr(xp, "simulated", False)
    flats = [_flat(xp, t) for t in ts]
    grids = [_reduce_grid(int(f.size)) for f in flats]
    partial = xp.empty(sum(grids), dtype="float32")
    offs = xp.empty(n, dtype="int64")
    cnts = xp.empty(n, dtype="int64")
    halves = xp.empty(n, dtype=dt)
    out = xp.empty((), dtype=dt)
    order = sorted(range(n), key=lambda j: -grids[j])  # a chunk's blocks past a tensor's grid idle: few
    pads = {} if pads is None else pads
    base = 0
    for c in range(0, n, _L2_CHUNK):
        part = order[c:c + _L2_CHUNK]
        # padded to K on a GPU (one compilation); not in the simulator (a Python thread per thread)
        pad = 0 if simulated else _L2_CHUNK - len(part)
        if pad and dt not in pads:
            pads[dt] = xp.zeros(0, dtype=dt)
        xs = tuple(flats[j] for j in part) + (pads.get(dt),) * pad
        ids = tuple(part) + (0,) * pad
        _go(xp, k.multi_sum_squares, (grids[part[0]], len(part) + pad), THREADS, xs, ids, len(part), base,
            partial, offs, cnts)
        base += sum(grids[j] for j in part)
        del xs
    _go(xp, k.multi_finish_l2, 1, THREADS, partial, offs, cnts, n, halves, out.reshape(1))
    return halves, out


@kernel("MultiL2Loss", ["gpu"])
def multi_l2_loss_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    from flowctl.kernels.registry import KERNELS

    single = l2_loss_gpu(xp, attrs)
    total = KERNELS[("AddN", "gpu")](xp, attrs)
    pads: dict[Any, Any] = {}

    def run(*ts: Any) -> Any:
        if str(ts[0].dtype) not in ("float32", "float16") or any(t.dtype != ts[0].dtype for t in ts):
            return total(*[single(t) for t in ts])
        return multi_l2_parts(xp, ts, pads)[1]

    return run
