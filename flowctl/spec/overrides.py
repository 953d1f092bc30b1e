"""`--set KEY=VALUE`: one change to a spec from the command line, so an experiment needs no copied
YAML file. KEY is a dotted path (`training.batch_size`, `model.layers.lstm_1.units`: a list of
named mappings is indexed by name, any list by position); VALUE is YAML (`512`, `[cpu:0, cpu:1]`,
`{type: adam}`). Keys are checked against the schema with a "did you mean", before validation, so
a typo never passes as a new key. The spec is then validated as a whole, as if the file said it.
"""
from __future__ import annotations

import re
import typing
from typing import Any, Sequence, Union, cast, get_args, get_origin

from pydantic import BaseModel

from flowctl.engine.errors import SpecError, did_you_mean
from flowctl.spec.layers import LAYERS
from flowctl.spec.schema import BlockUse, Spec
from flowctl.spec.source import LocDict, LocList, load_yaml


def parse(override: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], the value read as YAML)."""
    key, eq, text = override.partition("=")
    key = key.strip()
    if not eq or not key or any(not part for part in key.split(".")):
        raise SpecError(f"--set {override}: write KEY=VALUE with a dotted key, e.g. training.batch_size=64")
    value = load_yaml(text, filename=f"--set {key}") if text.strip() else None
    return key.split("."), value


_DEVICE_NAME = re.compile(r"^(?:/job:[\w-]+/task:\d+/device:|(?:[\w-]+/)?)(?:cpu|gpu):\d+$")


def device_names(text: str) -> list[str] | None:
    """`cpu:0,cpu:1` (the spec's own device names) as a list; None for anything else, such as a
    what-if cluster of profiles (`4xgpu:k40`, `gpu:p100+cpu`)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return parts if parts and all(_DEVICE_NAME.match(p) for p in parts) else None


def apply(root: LocDict, overrides: Sequence[str]) -> None:
    """Apply each override to the spec tree `root` in place, in order."""
    for override in overrides:
        path, value = parse(override)
        _set(root, path, value, override)


def _set(root: LocDict, path: list[str], value: Any, override: str) -> None:
    node: Any = root
    model: Any = Spec
    for depth, part in enumerate(path):
        last = depth == len(path) - 1
        where = ".".join(path[:depth]) or "the spec"
        if isinstance(node, LocList):
            index = _list_index(node, part, override, where)
            if last:
                node[index] = value
                return
            node, model = node[index], _item_model(model, node[index])
            continue
        if not isinstance(node, dict):
            raise SpecError(f"--set {override}: {where} is a value ({node!r}), not a mapping with keys")
        fields = _fields(model, node)
        if fields is not None and part not in fields:
            raise SpecError(f"--set {override}: unknown key '{part}' in {where}" + did_you_mean(part, fields)
                            + (f" (keys: {', '.join(fields)})" if not did_you_mean(part, fields) else ""))
        if last:
            node[part] = value
            return
        if part not in node or node[part] is None:
            node[part] = LocDict()
        node, model = node[part], _field_model(model, part)


def _list_index(node: LocList, part: str, override: str, where: str) -> int:
    if part.lstrip("-").isdigit():
        i = int(part)
        if not -len(node) <= i < len(node):
            raise SpecError(f"--set {override}: {where} has {len(node)} item(s); there is no item {i}")
        return i % len(node)
    names = [item.get("name") for item in node if isinstance(item, dict)]
    if part in names:
        return names.index(part)
    known = [n for n in names if isinstance(n, str)]
    raise SpecError(f"--set {override}: no item named '{part}' in {where}" + did_you_mean(part, known)
                    + (f" (items: {', '.join(known[:12])})" if known and not did_you_mean(part, known) else ""))


def _unwrap(t: Any) -> list[Any]:
    """The members of an annotation: Optional/Union/Annotated peeled to classes and containers."""
    origin = get_origin(t)
    if origin is typing.Annotated:
        return _unwrap(get_args(t)[0])
    if origin is Union or str(origin) == "<class 'types.UnionType'>":
        return [m for a in get_args(t) for m in _unwrap(a)]
    return [t]


def _fields(model: Any, node: dict) -> list[str] | None:
    """The keys a mapping may hold here, or None where the schema leaves them open (a dict of
    user-chosen names, a block's parameters)."""
    members = [m for m in _unwrap(model) if m is _Layer or (isinstance(m, type) and issubclass(m, BaseModel))]
    if not members:
        return None
    if members[0] is _Layer:
        cls = BlockUse if "block" in node and "type" not in node else LAYERS.get(node.get("type", ""))
        return list(cls.model_fields) if cls is not None else None
    models = [cast(type[BaseModel], m) for m in members]  # members[0] is not _Layer, so none is
    if len(models) > 1 and "source" in node:  # `data:`: the member its `source` names
        models = [c for c in models if "source" in c.model_fields
                  and node["source"] in get_args(c.model_fields["source"].annotation)] or models
    out: list[str] = []
    for c in models:
        out += [f for f in c.model_fields if f not in out]
    return out


class _Layer:
    """Stands for a layer entry: its keys are its type's."""


_LAYER = _Layer


def _field_model(model: Any, name: str) -> Any:
    for m in _unwrap(model):
        if isinstance(m, type) and issubclass(m, BaseModel) and name in m.model_fields:
            ann = m.model_fields[name].annotation
            if m.__name__ == "ModelSpec" and name == "layers":
                return list[_LAYER]  # type: ignore[valid-type]
            return ann
    return None


def _item_model(model: Any, item: Any) -> Any:
    for m in _unwrap(model):
        if get_origin(m) in (list, tuple) and get_args(m):
            return get_args(m)[0]
    return None


__all__ = ["apply", "device_names", "parse"]
