"""pydantic's validation errors as located problems: file:line:col, the dotted key, a "did you
mean" for unknown keys, layer types and values outside a fixed set, one message for a value that fails every member of a union."""
from __future__ import annotations

import re
import types
import typing
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from flowctl.engine.errors import did_you_mean
from flowctl.spec.layers import LAYERS
from flowctl.spec.schema import Spec
from flowctl.spec.source import Problems, dotted, locate


def report_validation(root: Any, err: ValidationError, problems: Problems, prefix: tuple = (),
                      model: type[BaseModel] = Spec) -> None:
    """Turn pydantic's errors into located problems, with 'did you mean' for unknown keys and
    layer types."""
    seen: set[tuple] = set()
    # A value that fails every member of a union (`kernel: int | [h, w]`) gets one message that
    # joins the members' complaints, not one line per member.
    grouped: dict[tuple, list[str]] = {}
    order: list[tuple] = []
    for e in err.errors(include_url=False):
        loc = prefix + tuple(e["loc"])
        typ = e["type"]
        msg = e["msg"]
        key = False
        if typ == "extra_forbidden":
            name = loc[-1]
            allowed = _fields_at(model, tuple(e["loc"])[:-1])
            msg = f"unknown key '{name}'" + did_you_mean(str(name), allowed)
            if allowed and not did_you_mean(str(name), allowed):
                msg += f" (allowed: {', '.join(allowed)})"
            key = True
        elif typ == "union_tag_invalid":
            tag = e["ctx"]["tag"]
            if len(loc) >= 2 and loc[-2] == "layers":
                msg = f"unknown layer type '{tag}'" + did_you_mean(tag, LAYERS)
                if not did_you_mean(tag, LAYERS):
                    msg += f" (known: {', '.join(LAYERS)})"
                loc = loc + ("type",)
            else:
                disc = str(e["ctx"].get("discriminator", "")).strip("'")
                tags = str(e["ctx"].get("expected_tags", ""))
                choices = [t.strip(" '") for t in tags.split(",")]
                msg = f"unknown {disc} '{tag}'" + did_you_mean(tag, choices) + f" (expected {tags})"
                loc = loc + (disc,) if disc else loc
        elif typ == "union_tag_not_found":
            if len(loc) >= 2 and loc[-2] == "layers":
                msg = "a layer needs a `type:` (or a `block:` to instantiate a block)"
            else:
                msg = f"missing key {e['ctx'].get('discriminator', '')}"
        elif typ == "missing":
            msg = f"missing required key '{loc[-1]}'"
            loc = loc[:-1]
        elif typ == "literal_error" and loc[-1:] == ("version",):
            msg = f"unsupported spec version {e.get('input')!r}: this flowctl reads version 1"
        elif typ == "literal_error":
            choices = [c.strip(" '\"") for c in re.split(r",| or ", str(e.get("ctx", {}).get("expected", "")))]
            msg += did_you_mean(str(e.get("input")), [c for c in choices if c])
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        mark, _ = locate(root, loc, key=key)
        if mark in problems.suppress:
            continue
        path = dotted(root, loc)
        if (path, msg) in seen:
            continue
        seen.add((path, msg))
        if (path, key) in grouped:
            grouped[(path, key)].append(msg)
            continue
        grouped[(path, key)] = [msg]
        order.append((loc, path, key))
    for loc, path, key in order:
        msgs = grouped[(path, key)]
        msg = msgs[0] if len(msgs) == 1 else "; or ".join(msgs)
        problems.at(root, loc, msg, key=key)


def _unwrap(t: Any) -> Any:
    while get_origin(t) is typing.Annotated:
        t = get_args(t)[0]
    return t


def _members(t: Any) -> list[tuple[Any, str | None]]:
    """Union members with their tag (a pydantic Tag, or the Literal of a `source`/`type` field)."""
    out = []
    for m in get_args(t):
        tag = None
        if get_origin(m) is typing.Annotated:
            tag = next((getattr(x, "tag", None) for x in get_args(m)[1:] if hasattr(x, "tag")), None)
            m = _unwrap(m)
        out.append((m, tag))
    return out


def _step(t: Any, part: Any) -> Any:
    t = _unwrap(t)
    origin = get_origin(t)
    if origin in (Union, types.UnionType):
        members = _members(t)
        for m, tag in members:
            if part == tag or (isinstance(m, type) and m.__name__ == part):
                return m
            if isinstance(m, type) and issubclass(m, BaseModel):
                for key in ("source", "type"):
                    fld = m.model_fields.get(key)
                    if fld is not None and part in get_args(fld.annotation):
                        return m
        for m, _ in members:
            if m is type(None):
                continue
            got = _step(m, part)
            if got is not None:
                return got
        return None
    if isinstance(t, type) and issubclass(t, BaseModel):
        info = t.model_fields.get(part) if isinstance(part, str) else None
        return info.annotation if info is not None else None
    if origin in (list, tuple) and isinstance(part, int):
        return get_args(t)[0]
    if origin is dict and isinstance(part, str):
        return get_args(t)[1]
    return None


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    t: Any = model
    for part in loc:
        nxt = _step(t, part)
        if nxt is None:
            # A union tag that is not a key of the data, or a dead end: keep the current type.
            continue
        t = nxt
    t = _unwrap(t)
    if get_origin(t) in (Union, types.UnionType):
        t = next((m for m, _ in _members(t) if isinstance(m, type) and issubclass(m, BaseModel)), None)
    if isinstance(t, type) and issubclass(t, BaseModel):
        return list(t.model_fields)
    return []


__all__ = ["report_validation"]
