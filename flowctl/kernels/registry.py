"""The kernel registry: one table keyed by (op name, device type) (whitepaper §2, §5.4).

A kernel is registered as a *factory* `factory(xp, attrs) -> fn`: it is called once when a plan is
compiled, with the device's array module and the node's resolved attributes (plus any resources the
engine binds, under keys starting with `_`), and returns the callable the step executes. Binding
attributes at plan time is what keeps a step free of per-node dictionary work.

Most kernels are written once against `xp` and registered for both `cpu` and `gpu`; a registration
for one device type alone overrides the generic one there (a stride-trick numpy path, say).
Every kernel module registers here when `flowctl.kernels` is imported (the package imports them
all), so the table is full before anyone can look in it.

Faster kernels register *beside* these as variants (`variant`): per (op, device type), a named
factory with a rule over the node's attributes and its inputs' dtypes and static shapes. `bind`
takes the first variant whose rule holds, else the registered kernel, which stays the reference
every variant is tested against. The choice is a rule, never a measurement, so a resumed run
binds the same kernels as the run it continues; `reference_kernels()` turns variants off (the
tests comparing against the reference, and `bench` measuring what a variant is worth). A node bound
to a variant forwards buffers (INTO) only through the variant's own in-place kernel, if it has one:
the reference's in-place kernel would compute what the variant replaced.

This module is the engine's one door into the kernels: besides the table it hands out each
device type's array module (`array_module`), the copy to host memory (`to_host`) and what the
driver says of the GPUs. It never imports the engine's graph classes.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from flowctl.kernels import bf16
from flowctl.kernels.backend import (DEAD, Ready, StepGuard, array_module, check_finite, cupy_or_none,
                                     gpu_count, gpu_properties, on_gpu, override_array_module, to_host,
                                     use_gpu)
from flowctl.kernels.cuda.blas import fp32_products, set_fp32_products
from flowctl.kernels.cuda.graphs import capture_backend

__all__ = ["DEAD", "DEVICE_TYPES", "INTO", "KERNELS", "KernelFactory", "Ready", "StepGuard", "array_module",
           "Variant", "applicable", "bind", "bind_into", "chosen", "capture_backend", "check_finite", "cupy_or_none", "device_types_for", "fp32_products", "gpu_count",
           "gpu_properties", "has_kernel", "into", "kernel", "on_gpu", "override_array_module", "reference_kernels", "set_fp32_products",
           "to_host", "use_gpu", "variant", "VARIANTS"]

KernelFactory = Callable[[Any, dict[str, Any]], Callable[..., Any]]

DEVICE_TYPES = ("cpu", "gpu")
KERNELS: dict[tuple[str, str], KernelFactory] = {}
_SPECIFIC: set[tuple[str, str]] = set()
# Buffer forwarding (TensorFlow's forward_input_or_allocate_output): for an op whose OpDef names
# `forward` inputs, a factory `factory(xp, attrs) -> fn(k, *inputs)` of a kernel that writes its
# output 0 into input k's buffer and returns it. The executor calls it only when it owns that
# buffer outright (no other reader, view or holder) and the op is its last reader; the result is
# bit for bit the allocating kernel's (exactly rounded element-wise operations in the same order).
INTO: dict[tuple[str, str], KernelFactory] = {}


@dataclass(frozen=True)
class Variant:
    """A faster kernel for one (op, device type): `applies(attrs, ins)` decides from the node's
    attributes and its inputs' specs (objects with .dtype, a name such as "float32", and .shape,
    a tuple whose unknown dimensions are None) whether `factory` may stand in for the reference."""

    name: str
    factory: KernelFactory
    applies: Callable[[dict[str, Any], Sequence[Any]], bool]
    into: KernelFactory | None = None  # its in-place kernel (see INTO), or None: no forwarding


VARIANTS: dict[tuple[str, str], list[Variant]] = {}
_reference_only = {"on": False}


def variant(op: str, device_type: str, name: str, applies: Callable[[dict[str, Any], Sequence[Any]], bool],
            into: KernelFactory | None = None) -> Callable[[KernelFactory], KernelFactory]:
    """Register `factory` as variant `name` of `op` on `device_type`, tried in registration order;
    `into`, its in-place kernel (a factory of `fn(k, *inputs)`, as INTO's)."""
    def deco(factory: KernelFactory) -> KernelFactory:
        found = VARIANTS.setdefault((op, device_type), [])
        if any(v.name == name for v in found):
            raise ValueError(f"variant {name!r} of {(op, device_type)} registered twice")
        found.append(Variant(name, factory, applies, into))
        return factory

    return deco


@contextmanager
def reference_kernels(on: bool = True) -> Iterator[None]:
    """Plans bound inside bind the reference kernels only (a process-wide switch: a session's device
    threads bind its plans too)."""
    saved = _reference_only["on"]
    _reference_only["on"] = on
    try:
        yield
    finally:
        _reference_only["on"] = saved


def chosen(op: str, device_type: str, attrs: dict[str, Any], ins: Sequence[Any] | None) -> Variant | None:
    """The variant `bind` takes for a node, or None for the reference kernel."""
    if ins is None or _reference_only["on"]:
        return None
    return applicable(op, device_type, attrs, ins)


def applicable(op: str, device_type: str, attrs: dict[str, Any], ins: Sequence[Any]) -> Variant | None:
    """The first variant whose rule holds for these inputs, whatever `reference_kernels` says: what
    a plan's pass asks when it decides a rewrite (a pass's choice must not depend on whether the
    plan it first served was bound to the reference kernels)."""
    for v in VARIANTS.get((op, device_type), ()):
        if v.applies(attrs, ins):
            return v
    return None


def kernel(op: str, device_types: Iterable[str] = DEVICE_TYPES) -> Callable[[KernelFactory], KernelFactory]:
    """Register `factory` for `op` on each device type. A registration naming one device type alone
    takes precedence over a generic one, whichever is imported first."""
    types = tuple(device_types)
    specific = len(types) == 1

    def deco(factory: KernelFactory) -> KernelFactory:
        for t in types:
            key = (op, t)
            if key in _SPECIFIC and not specific:
                continue
            if key in KERNELS and specific == (key in _SPECIFIC):
                raise ValueError(f"kernel for {key} registered twice")
            KERNELS[key] = factory
            if specific:
                _SPECIFIC.add(key)
        return factory

    return deco


def into(op: str, device_types: Iterable[str] = DEVICE_TYPES) -> Callable[[KernelFactory], KernelFactory]:
    """Register `factory` as `op`'s in-place variant (see INTO) on each device type."""
    def deco(factory: KernelFactory) -> KernelFactory:
        for t in device_types:
            if (op, t) in INTO:
                raise ValueError(f"in-place kernel for {(op, t)} registered twice")
            INTO[(op, t)] = factory
        return factory

    return deco


def bind_into(op: str, device_type: str, attrs: dict[str, Any],
              ins: Sequence[Any] | None = None, outs: Sequence[str] | None = None) -> Callable[..., Any] | None:
    """The step-time in-place variant of one node's kernel (INTO), or None where it has none. With
    the node's input specs: that of the variant `bind` takes, if it takes one (None if it has none).
    A node `bind` runs in float32 for bfloat16 (see `bind`) has none."""
    if outs is not None and bf16.touches(attrs, ins, outs):
        return None
    v = chosen(op, device_type, attrs, ins)
    factory = INTO.get((op, device_type)) if v is None else v.into
    return None if factory is None else factory(array_module(device_type), attrs)


def has_kernel(op: str, device_type: str) -> bool:
    return (op, device_type) in KERNELS


def device_types_for(op: str) -> tuple[str, ...]:
    return tuple(t for t in DEVICE_TYPES if (op, t) in KERNELS)


@dataclass(frozen=True)
class _Spec:
    dtype: str
    shape: Any


def bind(op: str, device_type: str, attrs: dict[str, Any], ins: Sequence[Any] | None = None,
         outs: Sequence[str] | None = None) -> Callable[..., Any]:
    """The step-time callable for one node: the factory applied to the device's array module. With
    the node's input specs, a variant whose rule holds stands in for the reference kernel.

    With its output dtypes (`outs`), a node that touches bfloat16 computes in float32 (kernels/
    bf16.py): the kernel (or the variant whose rule holds for float32) on widened inputs, its
    bfloat16 outputs rounded -- unless its kernel takes bfloat16 as it is (`bf16.native`). Without
    `outs` (state, resource and asynchronous ops) the kernel sees the arrays as they are."""
    factory = KERNELS.get((op, device_type))
    if factory is None:
        raise KeyError(f"no {device_type} kernel for op {op}")
    xp = array_module(device_type)
    if outs is not None and bf16.touches(attrs, ins, outs):
        if (op, device_type) in bf16.NATIVE and not _reference_only["on"]:
            return factory(xp, attrs)
        wide = None if ins is None else [_Spec("float32" if s.dtype == bf16.NAME else s.dtype, s.shape) for s in ins]
        v = chosen(op, device_type, bf16.widened_attrs(attrs), wide)
        return bf16.widened(factory if v is None else v.factory, xp, attrs, outs)
    v = chosen(op, device_type, attrs, ins)
    return (factory if v is None else v.factory)(xp, attrs)
