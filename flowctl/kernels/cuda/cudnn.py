"""Convolutions and batch norm on a GPU through cuDNN, by the cuDNN frontend's Python graph API
(`nvidia-cudnn-frontend`, `import cudnn`, written against version 1.32.0) on cupy arrays.

What runs through cuDNN (gpu registrations; each replaces the generic kernel on `gpu`, so each
falls back to it -- the same factory of flowctl/kernels/conv.py or nn.py, same xp and attrs):
- Conv2D -> conv_fprop, Conv2DBackpropInput -> conv_dgrad, Conv2DBackpropFilter -> conv_wgrad.
- FusedBatchNorm -> batchnorm (training phase), FusedBatchNormGrad -> batchnorm_backward, each with
  the fused ReLU inside the cuDNN graph where an engine accepts it (relu / relu_backward pointwise
  nodes), else one cupy element-wise kernel beside it (forward: max(y, 0) in place; gradient: dy
  masked where y > 0, the generic kernel's rule). FusedBatchNormGrad with the statistics' own
  gradients (dmean, dvar: the batch statistics used downstream, rare) stays generic: cuDNN's
  backward has no term for them.
- ChannelAffine stays generic (one element-wise pass; cuDNN adds nothing).

Layouts. cuDNN dims are always N,C,H,W (filters K,C,R,S); strides carry the memory layout.
Images are NHWC: dims [N, C, H, W], strides [H*W*C, 1, W*C, C]. Filters are HWIO (R, S, C, K) in
flowctl; a graph first describes them as they lie, dims [K, C, R, S] with strides
[1, K, S*C*K, C*K] (`filter_hwio`), and if no engine takes that, builds again over a KRSC copy
(`filter_krsc`: one transposing copy of the filter per call for fprop/dgrad; wgrad writes KRSC
and one copy turns it back into HWIO). Which one a graph uses is recorded in `status()`.
Batch norm's x of any rank >= 2 is (..., C): rank 4 is described as NHWC, other ranks as
[M, C, 1, 1]. Per-channel tensors are [1, C, 1, 1] float32 (float16/bfloat16 inputs have their
per-channel vectors cast to float32 and the outputs cast back: C values each).

Padding is TensorFlow's (flowctl.kernels.conv.window): SAME pads max((out-1)*s + k - in, 0) with
the smaller half before, so it can be asymmetric; graphs get pre_padding / post_padding, and cuDNN's
own output size (in + pre + post - k) // s + 1 equals TensorFlow's for both paddings (tested).
flowctl has no dilations: always [1, 1].

Batch norm semantics (flowctl's FusedBatchNorm: y, batch mean, BIASED batch variance; epsilon;
ReLU): cuDNN's training batchnorm returns the mean and inv_variance = 1/sqrt(var + eps); the
variance output is 1/inv_variance**2 - eps (one element-wise kernel on C values; its absolute
error is about eps * 2**-23, negligible next to the float32 variance it feeds). The FE binding
requires running statistics, so each graph also gets zero previous running stats and scratch
next running stats (momentum 0.1) that nothing reads. The gradient takes flowctl's (mean, var)
and gives cuDNN inv_variance = 1/sqrt(var + eps) (one element-wise kernel on C values).
epsilon and momentum are pass-by-value scalars: first the graph-owned runtime scalar
(`tensor_scalar(value, scalar_type.RUNTIME_PARAM)`, as FE's C++ batchnorm sample does with
graph.tensor(1e-05f)), else a [1,1,1,1] pass-by-value tensor bound to a host float32 at execute
(the FE Python test's form).

Precision. float32 I/O computes in FLOAT. TF32 follows flowctl.kernels.registry.fp32_products():
"tf32" (default) leaves cuDNN's tensor-core engines in (for float32 they compute in TF32, as
PyTorch's cudnn.allow_tf32); "ieee" deselects engines with the numerical notes TENSOR_CORE and
DOWN_CONVERT_INPUTS (PyTorch's filter for allow_tf32=False, aten/src/ATen/native/cudnn/Conv_v8.cpp).
DOWN_CONVERT_INPUTS engines are deselected for float32 in both modes (they convert float32 inputs
to a narrower type). float16 / bfloat16 I/O compute in FLOAT with tensor cores. The precision mode is
part of every graph's cache key, so changing it builds new graphs. float64 stays generic.

Determinism. By default (FLOWCTL_CUDNN_DETERMINISTIC unset or 1) every graph deselects engines with
the numerical note NONDETERMINISTIC (wgrad and dgrad engines that accumulate with atomics carry
it); a shape with no deterministic engine falls back to the generic kernel, which is deterministic.
FLOWCTL_CUDNN_DETERMINISTIC=0 allows them. `status()` returns the mode, each graph's engine name
and layout, and every fallback with its reason, for a run to record.

Capture safety. A graph is built at its first call (the eager warm-up step): validate,
build_operation_graph, create_execution_plans([A, FALLBACK]), the note filters, check_support,
build_plans, then a workspace of its own (cupy, made once at build, never resized) and, for batch
norm, its scratch statistics. A first call inside a stream capture never builds: it runs the generic
kernel for that call. Execution passes raw device pointers (`arr.data.ptr`; cupy's __dlpack__ would
record events on the legacy stream) and the workspace's pointer, after
`cudnn.set_stream(handle=h, stream=cupy.cuda.get_current_stream().ptr)` on a handle made once per
(device, thread) (cuDNN handles must not be shared across threads). Outputs come from `xp.empty`
(cupy's pool; inside a capture its private pool gives them static addresses). A graph's cache key is
(op, shapes, dtype, strides, padding, dilation, precision, determinism, device), not the stream: two
streams running the same shape at once would share its workspace (flowctl runs a GPU step on one
stream). Inputs that are not C-contiguous or not 16-byte aligned are copied first.

Failures. `import cudnn` failing, a simulated or numpy-backed xp (the CPU launch ledger), an
unsupported dtype, a graph that fails to build for a shape, or an execute that raises on its first
(warm-up) call: the generic kernel runs, for that shape from then on; one warning per (op, reason)
goes to the "flowctl.cudnn" logger. FLOWCTL_CUDNN=0 turns cuDNN off. FLOWCTL_CUDNN_WORKSPACE_MB
(default 256) deselects plans wanting more workspace.

Verified against FE 1.32.0's source (its wheel's cudnn/_pygraph.py, cudnn/__init__.py, the compiled
module's signatures, the repository's samples and tests): the pygraph constructor's keywords;
tensor(name, dim, stride, data_type, is_pass_by_value); tensor_scalar(value, scalar_type);
conv_fprop(image, weight, ...) / conv_dgrad(loss, filter, ...) / conv_wgrad(image, loss, ...) with
pre_padding, post_padding, stride, dilation; batchnorm(input, scale, bias, in_running_mean,
in_running_var, epsilon, momentum) -> [Y, mean, inv_var, next_running_mean, next_running_var];
batchnorm_backward(grad, input, scale, mean, inv_variance) -> [DX, DScale, DBias];
relu(input) and relu_backward(loss, input); set_output / set_data_type / set_dim / set_stride
(chainable); validate, build_operation_graph, create_execution_plans, deselect_numeric_notes,
deselect_workspace_greater_than, check_support, build_plans, get_workspace_size;
execute(dict keyed by Tensor, workspace, handle=) accepting int pointers for operands and
workspace; create_handle() -> cudnn.Handle and set_stream(handle=, stream=); numerical_note
members. NOT verified until the GPU run: that any engine takes the strided HWIO filter, asymmetric
padding, float32 batch norm (FE's samples use half I/O), the fused ReLU nodes, the host-pointer
pass-by-value form; that cuDNN normalises with the biased variance (the GPU tests check var against
the generic kernel at M=50, where biased and unbiased differ by 2%); the numbers; capture of
execute inside a cupy stream capture.
"""
from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any, Callable

from flowctl.kernels import bf16
from flowctl.kernels import conv as _conv
from flowctl.kernels import nn as _nn
from flowctl.kernels.registry import fp32_products, kernel

Fn = Callable[..., Any]
_LOG = logging.getLogger("flowctl.cudnn")

DETERMINISTIC = os.environ.get("FLOWCTL_CUDNN_DETERMINISTIC", "1") != "0"
ENABLED = os.environ.get("FLOWCTL_CUDNN", "1") != "0"
WORKSPACE_LIMIT = int(float(os.environ.get("FLOWCTL_CUDNN_WORKSPACE_MB", "256")) * (1 << 20))
ALIGN = 16  # bytes; an operand less aligned than this is copied (cupy's pool gives 512)
IO_DTYPES = ("float32", "float16", "bfloat16")

_state: dict[str, Any] = {}
_lock = threading.RLock()
_warned: set[tuple[str, str]] = set()
_fallbacks: dict[tuple[str, str], int] = {}
_plans: dict[tuple, Any] = {}
_FAILED = object()  # a cache entry: this key runs the generic kernel
_handles: dict[tuple[int, int], Any] = {}


# ---------------------------------------------------------------------------- pure geometry
def conv_padding(size: int, k: int, s: int, padding: str) -> tuple[int, int, int]:
    """(output size, padding before, padding after) along one axis by TensorFlow's rule (the
    generic kernel's `window` and `_after`); cuDNN's (size + pre + post - k) // s + 1 gives the
    same output size."""
    out, pre = _conv.window(size, k, s, padding)
    return out, pre, _conv._after(size, k, s, pre, out)


def conv_geometry(x_shape: tuple, f_shape: tuple, strides: tuple, padding: str) -> dict[str, Any]:
    """Everything a convolution graph needs, from an NHWC input shape and an HWIO filter shape."""
    n, h, w, c = (int(d) for d in x_shape)
    kh, kw, c2, co = (int(d) for d in f_shape)
    if c != c2:
        raise ValueError(f"input channels {c} differ from the filter's {c2}")
    sh, sw = (int(s) for s in strides)
    ho, ph, qh = conv_padding(h, kh, sh, padding)
    wo, pw, qw = conv_padding(w, kw, sw, padding)
    return dict(n=n, h=h, w=w, c=c, kh=kh, kw=kw, co=co, ho=ho, wo=wo, stride=(sh, sw),
                pre=(ph, pw), post=(qh, qw), dilation=(1, 1))


def nhwc(n: int, c: int, h: int, w: int) -> tuple[list[int], list[int]]:
    """(dims, strides) of an NHWC array as cuDNN sees it: dims N,C,H,W, strides in elements."""
    return [n, c, h, w], [h * w * c, 1, w * c, c]


def filter_hwio(kh: int, kw: int, c: int, co: int) -> tuple[list[int], list[int]]:
    """(dims, strides) of an HWIO (R, S, C, K) filter described in place as K,C,R,S."""
    return [co, c, kh, kw], [1, co, kw * c * co, c * co]


def filter_krsc(kh: int, kw: int, c: int, co: int) -> tuple[list[int], list[int]]:
    """(dims, strides) of a KRSC filter (HWIO transposed (3, 0, 1, 2), contiguous)."""
    return [co, c, kh, kw], [kh * kw * c, 1, kw * c, c]


FILTER_LAYOUTS = {"hwio": filter_hwio, "krsc": filter_krsc}
# KRSC only, by default: the filter layout cuDNN documents for NHWC convolutions. (A GPU run of an
# unfinished tree that tried flowctl's HWIO described in place by strides first got wrong
# convolution values, cause not isolated; FLOWCTL_CUDNN_HWIO=1 tries HWIO first again.)
FILTER_ORDER = ("hwio", "krsc") if os.environ.get("FLOWCTL_CUDNN_HWIO") == "1" else ("krsc",)


def bn_dims(shape: tuple) -> tuple[list[int], list[int]]:
    """(dims, strides) of batch norm's (..., C) input: NHWC for rank 4, [M, C, 1, 1] otherwise."""
    shape = tuple(int(d) for d in shape)
    if len(shape) == 4:
        n, h, w, c = shape
        return nhwc(n, c, h, w)
    c = shape[-1]
    m = math.prod(shape[:-1])
    return [m, c, 1, 1], [c, 1, c, c]


def precision_mode(dtype: str) -> str:
    """How a graph of this I/O dtype computes: "tf32" or "ieee" (float32, by fp32_products()),
    else the dtype itself (float16 / bfloat16 always use tensor cores)."""
    return fp32_products() if dtype == "float32" else dtype


def deselected_notes(dtype: str, precision: str, deterministic: bool) -> list[str]:
    """Names of the cudnn.numerical_note members a graph deselects."""
    notes = ["NONDETERMINISTIC"] if deterministic else []
    if dtype == "float32":
        notes.append("DOWN_CONVERT_INPUTS")
        if precision == "ieee":
            notes.append("TENSOR_CORE")
    return notes


def cache_key(op: str, shapes: tuple, dtype: str, strides: tuple = (), padding: str = "",
              extra: tuple = (), device: int = 0) -> tuple:
    """The graph cache key: (op, shapes, dtype, strides, padding, dilation, precision, determinism,
    extra, device). Everything a built graph depends on, and nothing that changes per call."""
    return (op, tuple(tuple(int(d) for d in s) for s in shapes), dtype, tuple(int(s) for s in strides),
            padding, (1, 1), precision_mode(dtype), DETERMINISTIC, tuple(extra), int(device))


def conv_geometry_key(geom: dict[str, Any]) -> tuple:
    """Everything of a convolution's geometry a graph is built for (filter size, paddings, ...)."""
    return tuple((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in sorted(geom.items()))


def unavailable(xp: Any) -> str | None:
    """Why cuDNN cannot serve kernels bound to `xp` (None when it can): disabled, a simulated or
    numpy-backed module, or no importable cuDNN frontend."""
    if not ENABLED:
        return "disabled by FLOWCTL_CUDNN=0"
    if getattr(xp, "simulated", False):
        return "the array module is simulated"
    if getattr(xp, "cupy", None) is None:
        return "the array module is not the GPU device module"
    if _cudnn() is None:
        return f"the cuDNN frontend is not importable ({_state.get('import_error')})"
    return None


# ---------------------------------------------------------------------------- bookkeeping
def _expected(why: str) -> bool:
    """A reason that is the environment's, not a failure: a CPU or simulated module, or disabled."""
    return "import" not in why
def _cudnn() -> Any:
    if "cudnn" not in _state:
        try:
            import cudnn  # type: ignore[import-not-found]

            _state["cudnn"] = cudnn
        except Exception as e:  # noqa: BLE001 -- missing, or its libraries missing
            _state["cudnn"] = None
            _state["import_error"] = f"{type(e).__name__}: {e}"[:300]
    return _state["cudnn"]


def _fallback(op: str, reason: str, expected: bool = False) -> None:
    """Count a fallback; log it once per (op, reason): a warning, or at INFO for the expected ones
    (a CPU / simulated array module, float64)."""
    key = (op, reason)
    _fallbacks[key] = _fallbacks.get(key, 0) + 1
    if key not in _warned:
        _warned.add(key)
        _LOG.log(logging.INFO if expected else logging.WARNING,
                 "cuDNN not used for %s, the generic kernel runs: %s", op, reason)


def status() -> dict[str, Any]:
    """What cuDNN serves in this process, for a run to record."""
    return {
        "enabled": ENABLED,
        "deterministic": DETERMINISTIC,
        "fp32_products": fp32_products(),
        "frontend": getattr(_state.get("cudnn"), "__version__", None),
        "graphs": {repr(k): p.describe() for k, p in list(_plans.items()) if p is not _FAILED},
        "failed": [repr(k) for k, p in list(_plans.items()) if p is _FAILED],
        "fallbacks": {f"{op}: {why}": n for (op, why), n in list(_fallbacks.items())},
    }


def reset() -> None:
    """Forget every graph and fallback (tests)."""
    with _lock:
        _plans.clear()
        _fallbacks.clear()
        _warned.clear()


def _handle(cp: Any) -> Any:
    """This thread's cuDNN handle on the current device, made at first use."""
    key = (int(cp.cuda.runtime.getDevice()), threading.get_ident())
    h = _handles.get(key)
    if h is None:
        h = _handles[key] = _cudnn().create_handle()
    return h


def _device(cp: Any) -> int:
    return int(cp.cuda.runtime.getDevice())


def _ready(xp: Any, a: Any) -> Any:
    """`a` C-contiguous and ALIGN-aligned (a copy when it is not)."""
    if not a.flags.c_contiguous:
        return xp.ascontiguousarray(a)
    if a.data.ptr % ALIGN:
        return a.copy()
    return a


def _data_type(cudnn: Any, dtype: str) -> Any:
    return {"float32": cudnn.data_type.FLOAT, "float16": cudnn.data_type.HALF,
            "bfloat16": cudnn.data_type.BFLOAT16}[dtype]


class _Workspace:
    """One workspace per device, shared by every graph: a step runs its cuDNN calls one after
    another on one stream, so the largest need is enough. It grows while graphs are built (the
    warm-up step, before any capture); once a capture has used it, an outgrown buffer is kept,
    never freed, as a graph captured earlier may hold its address. It comes from cupy's default
    pool, not a captured step's private one."""

    def __init__(self) -> None:
        self.buffers: list[Any] = []
        self.sealed = False  # a captured graph may hold the current buffer's address

    def need(self, cp: Any, size: int) -> None:
        if not self.buffers or self.buffers[-1].nbytes < size:
            if not self.sealed:  # nothing captured holds an outgrown buffer yet: let it go
                self.buffers.clear()
            with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
                self.buffers.append(cp.empty(max(size, 1 << 20), dtype=cp.uint8))
        if not self.sealed and cp.cuda.get_current_stream().is_capturing():
            self.sealed = True

    def ptr(self) -> int:
        return int(self.buffers[-1].data.ptr)

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers)


_workspaces: dict[int, _Workspace] = {}


def _workspace(cp: Any) -> _Workspace:
    return _workspaces.setdefault(int(cp.cuda.runtime.getDevice()), _Workspace())


class _Plan:
    """One built graph: its operands (Tensor objects, in a fixed order), the workspace it needs
    (from the device's shared one) and whatever scratch buffers it binds itself."""

    def __init__(self, graph: Any, slots: dict[str, Any], workspace: Any, info: dict[str, Any],
                 bound: dict[Any, int] | None = None, keep: tuple = ()) -> None:
        self.graph, self.slots, self.info = graph, slots, info
        self.workspace_bytes = int(workspace)
        self.bound = bound or {}  # operands the plan binds itself (scratch, host scalars)
        self.keep = keep  # buffers those pointers point into
        self.verified = False

    def describe(self) -> dict[str, Any]:
        return dict(self.info, workspace_bytes=self.workspace_bytes)

    def run(self, cp: Any, ptrs: dict[str, int]) -> None:
        cudnn = _cudnn()
        h = _handle(cp)
        ws = _workspace(cp)
        ws.need(cp, self.workspace_bytes)
        cudnn.set_stream(handle=h, stream=cp.cuda.get_current_stream().ptr)
        pack = {self.slots[name]: p for name, p in ptrs.items()}
        pack.update(self.bound)
        self.graph.execute(pack, ws.ptr(), handle=h)


def _finish(cudnn: Any, cp: Any, g: Any, dtype: str, precision: str) -> tuple[Any, dict[str, Any]]:
    """Plan, filter, check and build `g`; its workspace and a description of what was chosen."""
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    names = deselected_notes(dtype, precision, DETERMINISTIC)
    notes = [getattr(cudnn.numerical_note, n) for n in names]
    if notes:
        g.deselect_numeric_notes(notes)
    g.deselect_workspace_greater_than(WORKSPACE_LIMIT)
    g.check_support()
    g.build_plans()
    workspace = int(g.get_workspace_size())  # bytes: the device's shared workspace grows to it
    _workspace(cp).need(cp, workspace)
    info: dict[str, Any] = {"deselected_notes": names, "precision": precision}
    try:
        info["engine"] = g.get_plan_name_at_index(getattr(g, "_plan_index", 0))
    except Exception:  # noqa: BLE001 -- a name is nice to have
        pass
    return workspace, info


def _lookup(op: str, key: tuple, xp: Any, build: Callable[[], _Plan]) -> _Plan | None:
    """The plan for `key`, built now if new; None: run the generic kernel (failures are cached,
    a first call inside a capture is not)."""
    plan = _plans.get(key)
    if plan is _FAILED:
        _fallback(op, "cuDNN could not build a graph for this shape")
        return None
    if plan is not None:
        return plan
    if xp.is_capturing():
        _fallback(op, "first call for a shape came inside a stream capture (warm up eagerly first)")
        return None
    with _lock:
        plan = _plans.get(key)
        if plan is None:
            try:
                plan = build()
            except Exception as e:  # noqa: BLE001 -- any build failure means: generic kernel
                _LOG.warning("cuDNN graph for %s %s failed to build: %s: %s", op, key[1], type(e).__name__,
                             str(e)[:500])
                plan = _FAILED
            _plans[key] = plan
    if plan is _FAILED:
        _fallback(op, "cuDNN could not build a graph for this shape")
        return None
    return plan


def _execute(op: str, key: tuple, plan: _Plan, cp: Any, ptrs: dict[str, int]) -> bool:
    """Run the plan; False when its first (warm-up) execution raised, which retires the plan."""
    if plan.verified:
        plan.run(cp, ptrs)
        return True
    try:
        plan.run(cp, ptrs)
    except Exception as e:  # noqa: BLE001
        _LOG.warning("cuDNN graph for %s %s failed on its first execution: %s: %s", op, key[1],
                     type(e).__name__, str(e)[:500])
        _plans[key] = _FAILED
        _fallback(op, "cuDNN execution failed")
        return False
    plan.verified = True
    return True


# ---------------------------------------------------------------------------- convolution
def _build_conv(kind: str, cp: Any, geom: dict[str, Any], dtype: str, precision: str) -> _Plan:
    """A conv_fprop / conv_dgrad / conv_wgrad graph: the filter described in place (HWIO strides)
    first, over a KRSC copy if no engine takes that."""
    cudnn = _cudnn()
    io = _data_type(cudnn, dtype)
    g_ = geom
    xd, xs = nhwc(g_["n"], g_["c"], g_["h"], g_["w"])
    yd, ys = nhwc(g_["n"], g_["co"], g_["ho"], g_["wo"])
    errors = []
    for layout in FILTER_ORDER:
        wd, wst = FILTER_LAYOUTS[layout](g_["kh"], g_["kw"], g_["c"], g_["co"])
        try:
            g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=_handle(cp))
            args = dict(pre_padding=list(g_["pre"]), post_padding=list(g_["post"]), stride=list(g_["stride"]),
                        dilation=list(g_["dilation"]))
            if kind == "fprop":
                a = g.tensor(name="x", dim=xd, stride=xs, data_type=io)
                b = g.tensor(name="w", dim=wd, stride=wst, data_type=io)
                out = g.conv_fprop(image=a, weight=b, **args)
                out.set_output(True).set_data_type(io).set_dim(yd).set_stride(ys)
            elif kind == "dgrad":
                a = g.tensor(name="dy", dim=yd, stride=ys, data_type=io)
                b = g.tensor(name="w", dim=wd, stride=wst, data_type=io)
                out = g.conv_dgrad(loss=a, filter=b, **args)
                out.set_output(True).set_data_type(io).set_dim(xd).set_stride(xs)
            else:
                a = g.tensor(name="x", dim=xd, stride=xs, data_type=io)
                b = g.tensor(name="dy", dim=yd, stride=ys, data_type=io)
                out = g.conv_wgrad(image=a, loss=b, **args)
                out.set_output(True).set_data_type(io).set_dim(wd).set_stride(wst)
            workspace, info = _finish(cudnn, cp, g, dtype, precision)
        except Exception as e:  # noqa: BLE001 -- try the next layout
            errors.append(f"{layout}: {type(e).__name__}: {str(e)[:300]}")
            continue
        info.update(op=kind, filter_layout=layout)
        return _Plan(g, {"a": a, "b": b, "out": out}, workspace, info)
    raise RuntimeError("; ".join(errors))


def _conv_run(op: str, kind: str, xp: Any, a: Any, b: Any, geom: dict[str, Any], padding: str,
              generic: Callable[[], Any]) -> Any:
    """One convolution pass through cuDNN, or `generic()`. a, b: (x, f) for fprop, (dy, f) for
    dgrad, (x, dy) for wgrad, flowctl's layouts."""
    dtype = str(a.dtype)
    if dtype not in IO_DTYPES or str(b.dtype) != dtype:
        _fallback(op, f"dtype {dtype} is not float32/float16/bfloat16", dtype == "float64")
        return generic()
    if min(geom["n"], geom["c"], geom["co"], geom["ho"], geom["wo"]) <= 0:
        return generic()
    cp = xp.cupy
    precision = precision_mode(dtype)
    # The whole geometry in the key: a filter gradient's operands (x, dy) are the same for a 1x7, a
    # 7x1 and a 3x3 filter over one image size (a first GPU run reused one graph for all three).
    key = cache_key(op, (a.shape, b.shape), dtype, geom["stride"], padding, device=_device(cp),
                    extra=conv_geometry_key(geom))
    plan = _lookup(op, key, xp, lambda: _build_conv(kind, cp, geom, dtype, precision))
    if plan is None:
        return generic()
    krsc = plan.info["filter_layout"] == "krsc"
    g_ = geom
    a = _ready(xp, a)
    if kind == "fprop":
        w = xp.ascontiguousarray(b.transpose(3, 0, 1, 2)) if krsc else _ready(xp, b)
        out = xp.empty((g_["n"], g_["ho"], g_["wo"], g_["co"]), dtype=a.dtype)
        ptrs = {"a": a.data.ptr, "b": w.data.ptr, "out": out.data.ptr}
    elif kind == "dgrad":
        w = xp.ascontiguousarray(b.transpose(3, 0, 1, 2)) if krsc else _ready(xp, b)
        out = xp.empty((g_["n"], g_["h"], g_["w"], g_["c"]), dtype=a.dtype)
        ptrs = {"a": a.data.ptr, "b": w.data.ptr, "out": out.data.ptr}
    else:
        b = _ready(xp, b)
        shape = (g_["co"], g_["kh"], g_["kw"], g_["c"]) if krsc else (g_["kh"], g_["kw"], g_["c"], g_["co"])
        out = xp.empty(shape, dtype=a.dtype)
        ptrs = {"a": a.data.ptr, "b": b.data.ptr, "out": out.data.ptr}
    if not _execute(op, key, plan, cp, ptrs):
        return generic()
    if kind == "wgrad" and krsc:
        return xp.ascontiguousarray(out.transpose(1, 2, 3, 0))
    return out


def _conv_factory(op: str, xp: Any, generic: Fn, body: Callable[[], Fn]) -> Fn:
    """`body()`'s kernel where cuDNN can serve `xp`, else the generic one (said once)."""
    why = unavailable(xp)
    if why is not None:
        _fallback(op, why, _expected(why))
        return generic
    return body()


# cuDNN takes bfloat16 tensors as they are (tensor cores, float32 accumulation, one rounding); the
# generic kernel it falls back on computes a bfloat16 call in float32 (kernels/bf16.py).
# Batch norm likewise reads and writes bfloat16 x, y, dy and dx with float32 parameters and
# statistics (the precision's rule: ops/nn.py).
for _op in ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "FusedBatchNorm", "FusedBatchNormGrad"):
    bf16.native(_op, ["gpu"])


@kernel("Conv2D", ["gpu"])
def conv2d_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    generic = bf16.computed_in_float32(_conv.conv2d_kernel(xp, attrs))
    strides, padding = tuple(attrs["strides"]), attrs["padding"]

    def run(x: Any, f: Any) -> Any:
        geom = conv_geometry(x.shape, f.shape, strides, padding)
        return _conv_run("Conv2D", "fprop", xp, x, f, geom, padding, lambda: generic(x, f))

    return _conv_factory("Conv2D", xp, generic, lambda: run)


@kernel("Conv2DBackpropInput", ["gpu"])
def conv2d_backprop_input_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    generic = bf16.computed_in_float32(_conv.conv2d_backprop_input_kernel(xp, attrs))
    strides, padding = tuple(attrs["strides"]), attrs["padding"]

    def run(dy: Any, f: Any, like_x: Any) -> Any:
        x_shape = (dy.shape[0],) + tuple(like_x.shape[1:])
        geom = conv_geometry(x_shape, f.shape, strides, padding)
        if (geom["ho"], geom["wo"], geom["co"]) != tuple(dy.shape[1:]):
            return generic(dy, f, like_x)  # let the generic kernel report the mismatch
        return _conv_run("Conv2DBackpropInput", "dgrad", xp, dy, f, geom, padding,
                         lambda: generic(dy, f, like_x))

    return _conv_factory("Conv2DBackpropInput", xp, generic, lambda: run)


@kernel("Conv2DBackpropFilter", ["gpu"])
def conv2d_backprop_filter_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    generic = bf16.computed_in_float32(_conv.conv2d_backprop_filter_kernel(xp, attrs))
    strides, padding = tuple(attrs["strides"]), attrs["padding"]

    def run(x: Any, dy: Any, like_f: Any) -> Any:
        geom = conv_geometry(x.shape, like_f.shape, strides, padding)
        if (geom["n"], geom["ho"], geom["wo"], geom["co"]) != tuple(dy.shape):
            return generic(x, dy, like_f)
        return _conv_run("Conv2DBackpropFilter", "wgrad", xp, x, dy, geom, padding,
                         lambda: generic(x, dy, like_f))

    return _conv_factory("Conv2DBackpropFilter", xp, generic, lambda: run)


# ---------------------------------------------------------------------------- batch norm
def _scalars(cudnn: Any, g: Any, form: str, values: dict[str, float]) -> tuple[dict[str, Any], dict, tuple]:
    """Pass-by-value float scalars: graph-owned runtime scalars ("graph") or [1,1,1,1] tensors bound
    to host float32 values at execute ("host"). (tensors, bindings, host buffers to keep alive)."""
    import numpy as np

    tensors, bound, keep = {}, {}, []
    for name, v in values.items():
        if form == "graph":
            tensors[name] = g.tensor_scalar(float(v), cudnn.scalar_type.RUNTIME_PARAM, name=name)
        else:
            t = g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT,
                         is_pass_by_value=True)
            host = np.full((1,), v, dtype=np.float32)
            tensors[name], bound[t] = t, int(host.ctypes.data)
            keep.append(host)
    return tensors, bound, tuple(keep)


def _variants(relu: bool) -> list[tuple[bool, str]]:
    """(ReLU inside the graph, scalar form) in the order tried."""
    if relu:
        return [(True, "graph"), (False, "graph"), (True, "host"), (False, "host")]
    return [(False, "graph"), (False, "host")]


def _build_bn(cp: Any, shape: tuple, dtype: str, eps: float, relu: bool, precision: str) -> _Plan:
    cudnn = _cudnn()
    io, f32 = _data_type(cudnn, dtype), cudnn.data_type.FLOAT
    xd, xs = bn_dims(shape)
    c = xd[1]
    vd, vs = [1, c, 1, 1], [c, 1, c, c]
    errors = []
    for fused, form in _variants(relu):
        try:
            g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=_handle(cp))
            x = g.tensor(name="x", dim=xd, stride=xs, data_type=io)
            scale = g.tensor(name="scale", dim=vd, stride=vs, data_type=f32)
            bias = g.tensor(name="bias", dim=vd, stride=vs, data_type=f32)
            run_mean = g.tensor(name="run_mean", dim=vd, stride=vs, data_type=f32)
            run_var = g.tensor(name="run_var", dim=vd, stride=vs, data_type=f32)
            sc, bound, keep = _scalars(cudnn, g, form, {"epsilon": eps, "momentum": 0.1})
            y, mean, inv_var, next_mean, next_var = g.batchnorm(
                name="bn", input=x, scale=scale, bias=bias, in_running_mean=run_mean, in_running_var=run_var,
                epsilon=sc["epsilon"], momentum=sc["momentum"])
            if fused:
                y = g.relu(name="relu", input=y)
            y.set_output(True).set_data_type(io).set_dim(xd).set_stride(xs)
            for t in (mean, inv_var, next_mean, next_var):
                t.set_output(True).set_data_type(f32).set_dim(vd).set_stride(vs)
            workspace, info = _finish(cudnn, cp, g, dtype, precision)
        except Exception as e:  # noqa: BLE001 -- try the next variant
            errors.append(f"relu_in_graph={fused} scalars={form}: {type(e).__name__}: {str(e)[:300]}")
            continue
        # Previous running stats (read), next ones (written), never read by anyone: one array each.
        zeros = tuple(cp.zeros((c,), dtype=cp.float32) for _ in range(4))
        bound.update({t: z.data.ptr for t, z in zip((run_mean, run_var, next_mean, next_var), zeros)})
        info.update(op="batchnorm", relu_in_graph=fused, scalars=form)
        return _Plan(g, {"x": x, "scale": scale, "bias": bias, "y": y, "mean": mean, "inv_var": inv_var},
                     workspace, info, bound, keep + zeros)
    raise RuntimeError("; ".join(errors))


def _build_bn_grad(cp: Any, shape: tuple, dtype: str, relu: bool, precision: str) -> _Plan:
    cudnn = _cudnn()
    io, f32 = _data_type(cudnn, dtype), cudnn.data_type.FLOAT
    xd, xs = bn_dims(shape)
    c = xd[1]
    vd, vs = [1, c, 1, 1], [c, 1, c, c]
    errors = []
    for fused in ([True, False] if relu else [False]):
        try:
            g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=_handle(cp))
            dy = g.tensor(name="dy", dim=xd, stride=xs, data_type=io)
            x = g.tensor(name="x", dim=xd, stride=xs, data_type=io)
            scale = g.tensor(name="scale", dim=vd, stride=vs, data_type=f32)
            mean = g.tensor(name="mean", dim=vd, stride=vs, data_type=f32)
            inv_var = g.tensor(name="inv_var", dim=vd, stride=vs, data_type=f32)
            slots = {"dy": dy, "x": x, "scale": scale, "mean": mean, "inv_var": inv_var}
            grad = dy
            if fused:
                y = g.tensor(name="y", dim=xd, stride=xs, data_type=io)
                grad = g.relu_backward(name="drelu", loss=dy, input=y)
                slots["y"] = y
            dx, dscale, dbias = g.batchnorm_backward(name="dbn", grad=grad, input=x, scale=scale, mean=mean,
                                                     inv_variance=inv_var)
            dx.set_output(True).set_data_type(io).set_dim(xd).set_stride(xs)
            for t in (dscale, dbias):
                t.set_output(True).set_data_type(f32).set_dim(vd).set_stride(vs)
            workspace, info = _finish(cudnn, cp, g, dtype, precision)
        except Exception as e:  # noqa: BLE001
            errors.append(f"relu_in_graph={fused}: {type(e).__name__}: {str(e)[:300]}")
            continue
        slots.update(dx=dx, dscale=dscale, dbias=dbias)
        info.update(op="batchnorm_backward", relu_in_graph=fused)
        return _Plan(g, slots, workspace, info)
    raise RuntimeError("; ".join(errors))


_kernels: dict[int, Any] = {}


def _elementwise(cp: Any) -> Any:
    """The small cupy kernels beside the graphs (float32 per-channel vectors, the ReLU mask), made
    once per cupy module and compiled at their first (eager) call."""
    k = _kernels.get(id(cp))
    if k is None:
        from types import SimpleNamespace

        k = _kernels[id(cp)] = SimpleNamespace(
            var=cp.ElementwiseKernel("float32 iv, float32 eps", "float32 var",
                                     "var = 1.0f / (iv * iv) - eps", "flowctl_bn_var"),
            inv_std=cp.ElementwiseKernel("float32 var, float32 eps", "float32 iv",
                                         "iv = rsqrtf(var + eps)", "flowctl_bn_inv_std"),
            relu_mask=cp.ElementwiseKernel("T dy, T y", "T g", "g = ((float)y > 0.0f) ? dy : (T)0",
                                           "flowctl_relu_mask"),
        )
    return k


def _relu_mask(xp: Any, k: Any, dy: Any, y: Any) -> Any:
    """dy where y > 0, else 0 (one kernel; bfloat16, which cupy kernels may not spell, by xp ops)."""
    if str(dy.dtype) in ("float32", "float16"):
        return k.relu_mask(dy, y)
    return dy * (y > 0).astype(dy.dtype)


def _f32(xp: Any, v: Any) -> Any:
    """A per-channel vector as contiguous, aligned float32 (C values: a copy costs nothing)."""
    if str(v.dtype) != "float32":
        v = v.astype("float32")
    return _ready(xp, v.reshape(-1))


@kernel("FusedBatchNorm", ["gpu"])
def fused_batch_norm_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    generic = bf16.computed_in_float32(_nn.fused_batch_norm(xp, attrs), (True, False, False))
    why = unavailable(xp)
    if why is not None:
        _fallback("FusedBatchNorm", why, _expected(why))
        return generic
    eps, relu = float(attrs["epsilon"]), attrs["activation"] == "relu"

    def run(x: Any, scale: Any, offset: Any) -> Any:
        dtype = str(x.dtype)
        if dtype not in IO_DTYPES:
            _fallback("FusedBatchNorm", f"dtype {dtype} is not float32/float16/bfloat16", dtype == "float64")
            return generic(x, scale, offset)
        if x.ndim < 2 or x.size == 0:
            return generic(x, scale, offset)
        cp = xp.cupy
        precision = precision_mode(dtype)
        key = cache_key("FusedBatchNorm", (x.shape,), dtype, extra=(eps, relu), device=_device(cp))
        plan = _lookup("FusedBatchNorm", key, xp, lambda: _build_bn(cp, tuple(x.shape), dtype, eps, relu, precision))
        if plan is None:
            return generic(x, scale, offset)
        c = x.shape[-1]
        x = _ready(xp, x)
        s32, b32 = _f32(xp, scale), _f32(xp, offset)
        y = xp.empty(x.shape, dtype=x.dtype)
        mean = xp.empty((c,), dtype="float32")
        inv_var = xp.empty((c,), dtype="float32")
        ptrs = {"x": x.data.ptr, "scale": s32.data.ptr, "bias": b32.data.ptr, "y": y.data.ptr,
                "mean": mean.data.ptr, "inv_var": inv_var.data.ptr}
        if not _execute("FusedBatchNorm", key, plan, cp, ptrs):
            return generic(x, scale, offset)
        k = _elementwise(cp)
        if relu and not plan.info["relu_in_graph"]:
            xp.maximum(y, 0, out=y)
        var = k.var(inv_var, xp.float32(eps))
        if str(scale.dtype) != "float32":  # the statistics in the parameters' dtype (float16 ones)
            mean, var = mean.astype(scale.dtype), var.astype(scale.dtype)
        return y, mean, var

    return run


@kernel("FusedBatchNormGrad", ["gpu"])
def fused_batch_norm_grad_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    generic = bf16.computed_in_float32(_nn.fused_batch_norm_grad(xp, attrs), (True, False, False))
    why = unavailable(xp)
    if why is not None:
        _fallback("FusedBatchNormGrad", why, _expected(why))
        return generic
    eps, relu = float(attrs["epsilon"]), attrs["activation"] == "relu"

    def run(dy: Any, x: Any, scale: Any, mean: Any, var: Any, *rest: Any) -> Any:
        y, stat_grads = _nn._bn_grad_args(relu, rest)
        if stat_grads:
            _fallback("FusedBatchNormGrad", "the batch statistics' own gradients (dmean, dvar) are not cuDNN's", True)
            return generic(dy, x, scale, mean, var, *rest)
        dtype = str(x.dtype)
        if dtype not in IO_DTYPES or str(dy.dtype) != dtype:
            _fallback("FusedBatchNormGrad", f"dtype {dtype} is not float32/float16/bfloat16", dtype == "float64")
            return generic(dy, x, scale, mean, var, *rest)
        if x.ndim < 2 or x.size == 0:
            return generic(dy, x, scale, mean, var, *rest)
        cp = xp.cupy
        precision = precision_mode(dtype)
        key = cache_key("FusedBatchNormGrad", (x.shape,), dtype, extra=(relu,), device=_device(cp))
        plan = _lookup("FusedBatchNormGrad", key, xp, lambda: _build_bn_grad(cp, tuple(x.shape), dtype, relu, precision))
        if plan is None:
            return generic(dy, x, scale, mean, var, *rest)
        c = x.shape[-1]
        k = _elementwise(cp)
        x_r = _ready(xp, x)
        g = _ready(xp, dy)
        ptrs: dict[str, int] = {}
        if relu:
            y_r = _ready(xp, y)
            if plan.info["relu_in_graph"]:
                ptrs["y"] = y_r.data.ptr
            else:
                g = _relu_mask(xp, k, g, y_r)
        inv_var = k.inv_std(_f32(xp, var), xp.float32(eps))
        s32, m32 = _f32(xp, scale), _f32(xp, mean)
        dx = xp.empty(x.shape, dtype=x.dtype)
        dscale = xp.empty((c,), dtype="float32")
        dbias = xp.empty((c,), dtype="float32")
        ptrs.update(dy=g.data.ptr, x=x_r.data.ptr, scale=s32.data.ptr, mean=m32.data.ptr, inv_var=inv_var.data.ptr,
                    dx=dx.data.ptr, dscale=dscale.data.ptr, dbias=dbias.data.ptr)
        if not _execute("FusedBatchNormGrad", key, plan, cp, ptrs):
            return generic(dy, x, scale, mean, var, *rest)
        if str(scale.dtype) != "float32":
            dscale, dbias = dscale.astype(scale.dtype), dbias.astype(scale.dtype)
        return dx, dscale, dbias

    return run
