"""Loading a spec: YAML with marks -> blocks expanded -> layer defaults -> pydantic -> semantic
checks. Every problem found is collected and raised as one SpecError whose lines read
`file:line:col: key.path: message`."""
from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from flowctl.engine.errors import SpecError
from flowctl.spec.blocks import expand
from flowctl.spec.layers import LAYERS
from flowctl.spec.schema import Spec
from flowctl.spec.source import LocDict, LocList, Problems, did_you_mean, dotted, load_yaml, locate

if TYPE_CHECKING:
    from flowctl.spec.check import LoadedSpec


def load_spec(path: str | Path) -> "LoadedSpec":
    """Read, expand and validate a spec file. Raises SpecError listing every problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecError(f"{p}: no such spec file") from None
    except OSError as e:
        raise SpecError(f"{p}: cannot read spec file: {e.strerror}") from None
    return load_text(text, str(p), base_dir=p.parent)


def load_text(text: str, filename: str = "<spec>", base_dir: Path | None = None) -> "LoadedSpec":
    from flowctl.spec.check import LoadedSpec, check

    root = load_yaml(text, filename)
    problems = Problems()
    if not isinstance(root, LocDict):
        problems.add(getattr(root, "mark", None), "", "a spec is a mapping with `version: 1` and a `model:`")
        problems.raise_if_any()
    expansion = expand(root, problems)
    _apply_defaults(root, problems)
    try:
        spec = Spec.model_validate(dict(root))
    except ValidationError as e:
        report_validation(root, e, problems)
        problems.raise_if_any()
        raise AssertionError("unreachable") from None
    problems.raise_if_any()
    loaded = check(spec, root, expansion, problems, base_dir or Path("."))
    problems.raise_if_any()
    return loaded


def _apply_defaults(root: LocDict, problems: Problems) -> None:
    """`model.defaults: {conv2d: {batch_norm: true}}` fills keys a layer does not set; the filled
    value keeps its mark in `defaults`, so an error in a default points there."""
    model = root.get("model")
    if not isinstance(model, LocDict) or not isinstance(model.get("defaults"), LocDict):
        return
    defaults: LocDict = model["defaults"]
    for t, values in defaults.items():
        if t not in LAYERS:
            problems.at(root, ("model", "defaults", t), f"unknown layer type '{t}'" + did_you_mean(t, LAYERS),
                        key=True)
            continue
        if not isinstance(values, LocDict) or not isinstance(model.get("layers"), LocList):
            continue
        for layer in model["layers"]:
            if isinstance(layer, LocDict) and layer.get("type") == t:
                for k, v in values.items():
                    if k not in layer:
                        layer[k] = v
                        layer.key_marks[k] = values.key_marks[k]
                        layer.value_marks[k] = values.value_marks[k]


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


__all__ = ["load_spec", "load_text", "report_validation", "locate"]
