"""LSTM cell kernels, written once against the array module `xp`: the gates and cell update of one
time step, and their gradient, each a handful of in-place passes over one [batch, 4 * units]
buffer (the gate activations, which the gradient reads back instead of recomputing)."""
from __future__ import annotations

from typing import Any, Callable

from flowctl.kernels import bf16
from flowctl.kernels.registry import kernel

Fn = Callable[..., Any]


def _sigmoid_(xp: Any, x: Any) -> None:
    # 0.5 (1 + tanh(x/2)) in place: the Sigmoid kernel's formula (no overflow), to the same bits.
    x *= 0.5
    xp.tanh(x, out=x)
    x *= 0.5
    x += 0.5


# h @ w through the GPU module's cuBLAS GEMM, which takes bfloat16 as it is (as MatMul, matrix.py)
bf16.native("RecurrentMatMul", ["gpu"])


@kernel("RecurrentMatMul")
def recurrent_matmul(xp: Any, attrs: dict[str, Any]) -> Fn:
    mm = xp.matmul
    return lambda h, w, w_t=None: mm(h, w)


@kernel("TransposeCopy")
def transpose_copy(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda w: xp.ascontiguousarray(w.T)


@kernel("PackPanels")
def pack_panels(xp: Any, attrs: dict[str, Any]) -> Fn:
    lanes, transpose = attrs["lanes"], attrs["transpose"]

    def run(w: Any) -> Any:
        if transpose:
            w = w.T
        k, n = w.shape
        p = -(-n // lanes)
        wp = xp.zeros((p, k, lanes), w.dtype)
        full = n // lanes
        wp[:full] = w[:, :full * lanes].reshape(k, full, lanes).transpose(1, 0, 2)
        if n % lanes:
            wp[full, :, :n % lanes] = w[:, full * lanes:]
        return wp

    return run


def unpack(wp: Any, n: int) -> Any:
    """w (K, n) back from its packed panels wp (P, K, lanes): a copy."""
    p, k, lanes = wp.shape
    return wp.transpose(1, 0, 2).reshape(k, p * lanes)[:, :n]


@kernel("PanelMatMul")
def panel_matmul(xp: Any, attrs: dict[str, Any]) -> Fn:
    """The reference: w unpacked, then a @ w (the product RecurrentMatMul's reference runs)."""
    n, transpose_out = attrs["n"], attrs["transpose_out"]
    mm = xp.matmul

    def run(a: Any, wp: Any) -> Any:
        out = mm(a, unpack(wp, n))
        return out.T if transpose_out else out

    return run


@kernel("LSTMBlockCell")
def lstm_block_cell(xp: Any, attrs: dict[str, Any]) -> Fn:
    forget_bias = attrs["forget_bias"]

    def run(xw: Any, hw: Any = None, c_prev: Any = None) -> tuple[Any, Any, Any]:
        act = xp.add(xw, hw) if hw is not None else xp.array(xw, copy=True)
        u = act.shape[1] // 4
        i, f, g, o = act[:, :u], act[:, u:2 * u], act[:, 2 * u:3 * u], act[:, 3 * u:]
        if forget_bias:
            f += forget_bias
        _sigmoid_(xp, act[:, :2 * u])  # i and f are adjacent: one pass for both
        xp.tanh(g, out=g)
        _sigmoid_(xp, o)
        c = i * g
        if c_prev is not None:
            kept = f * c_prev
            c += kept
        h = xp.tanh(c)
        h *= o
        return h, c, act

    return run


@kernel("LSTMBlockCellGrad")
def lstm_block_cell_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(dh: Any, dc: Any, act: Any, c: Any, c_prev: Any = None) -> Any:
        u = act.shape[1] // 4
        i, f, g, o = act[:, :u], act[:, u:2 * u], act[:, 2 * u:3 * u], act[:, 3 * u:]
        dz = xp.empty_like(act)
        di, df, dg, do = dz[:, :u], dz[:, u:2 * u], dz[:, 2 * u:3 * u], dz[:, 3 * u:]
        tc = xp.tanh(c)
        # dc_total = dc + dh o (1 - tanh(c)^2): the state's gradient from both of its uses.
        xp.multiply(dh, tc, out=do)  # d o (before its sigmoid) = dh tanh(c) o (1 - o)
        dct = tc
        dct *= tc
        xp.subtract(1.0, dct, out=dct)
        dct *= o
        dct *= dh
        dct += dc
        xp.subtract(1.0, o, out=dg)  # dg as scratch for o (1 - o)
        dg *= o
        do *= dg
        xp.subtract(1.0, i, out=di)
        di *= i
        di *= g
        di *= dct  # di = dct g i (1 - i)
        xp.multiply(g, g, out=dg)
        xp.subtract(1.0, dg, out=dg)
        dg *= i
        dg *= dct  # dg = dct i (1 - g^2)
        if c_prev is None:
            df[...] = 0.0  # the first step's forget gate multiplies a zero state
            return dz
        xp.subtract(1.0, f, out=df)
        df *= f
        df *= c_prev
        df *= dct  # df = dct c_prev f (1 - f)
        dct *= f  # dc_prev = dct f
        return dz, dct

    return run
