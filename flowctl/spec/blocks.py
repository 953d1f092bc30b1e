"""Blocks: parameterised groups of layers written once and instantiated many times.

This is the whitepaper's proposed "function mechanism" (§10, future work) at the spec level: a
block is expanded before anything else sees the model, so the layer library, shapes and the graph
only ever meet plain layers named `instance/layer` (e.g. `mixed_5b/branch1x1`). Every copied node
keeps its mark in the block definition and gains a `via` note naming the use site, so an error
inside an instantiated block points at both.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from flowctl.engine.errors import did_you_mean
from flowctl.spec.schema import BlockUse
from flowctl.spec.source import LocDict, LocList, Problems, copy_tree, locate
from flowctl.spec.validation import report_validation

_REF = re.compile(r"\$\{([^}]*)\}")
INPUT = "$input"
# An expanded model's layer count, checked before each block use expands (its repeat times its
# block's layers, nested repeats multiplied), so `repeat: 10000000` is refused at once instead of
# being built. Inception-v3 expands to a few hundred layers.
MAX_LAYERS = 100_000
MAX_NESTING = 32  # blocks inside blocks (each level is a few frames of the expansion's recursion)


@dataclass
class Instance:
    """One instantiated block: its name, the block, its layers (full names) and its output layer."""

    name: str
    block: str
    layers: list[str] = field(default_factory=list)
    output: str = ""
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Expansion:
    aliases: dict[str, str] = field(default_factory=dict)  # instance name -> its output layer
    instances: list[Instance] = field(default_factory=list)


def expand(root: LocDict, problems: Problems) -> Expansion:
    """Replace every block use in `root['model']['layers']` by the block's layers, in place."""
    out = Expansion()
    model = root.get("model")
    if not isinstance(model, LocDict) or not isinstance(model.get("layers"), LocList):
        return out  # the schema reports what is missing
    blocks: LocDict = model["blocks"] if isinstance(model.get("blocks"), LocDict) else LocDict()
    layers: LocList = model["layers"]
    expanded = LocList()
    expanded.mark = layers.mark
    prev: str | None = None
    for i, item in enumerate(layers):
        loc = ("model", "layers", i)
        if isinstance(item, LocDict) and "block" in item and "type" not in item:
            try:
                BlockUse.model_validate(dict(item))
            except ValidationError as e:
                report_validation(root, e, problems, prefix=loc, model=BlockUse)
                continue
            first = item.get("inputs")
            start = _alias(first[0], out.aliases) if first else prev
            prev = _use(root, item, loc, "", start, blocks, (), out, expanded, problems)
        else:
            if isinstance(item, LocDict) and "inputs" not in item and prev is not None \
                    and item.get("type") != "input":
                item["inputs"] = LocList([prev])
                item["inputs"].item_marks = [item.mark]
            if isinstance(item, LocDict) and isinstance(item.get("name"), str):
                prev = item["name"]
            expanded.append(item)
            expanded.item_marks.append(layers.item_marks[i])
    if len(expanded) > MAX_LAYERS:
        problems.at(root, ("model", "layers"), f"the model has {len(expanded):,} layers, more than the "
                    f"{MAX_LAYERS:,} a model may have")
        problems.raise_if_any()
    model["layers"] = expanded
    return out


def _size(items: Any, blocks: LocDict, stack: tuple[str, ...], memo: dict[str, int]) -> int:
    """The layers `items` expand to: a block use counts its repeat times its block's size. A use
    the expansion will refuse (unknown block, a cycle, too deep) counts one; a repeat given by a
    `${param}` counts one here and is counted when its use expands."""
    n = 0
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict) and "block" in item and "type" not in item:
            name = item.get("block")
            if isinstance(name, str) and name in blocks and name not in stack and len(stack) < MAX_NESTING:
                if name not in memo:
                    bdef = blocks[name]
                    memo[name] = _size(bdef.get("layers") if isinstance(bdef, dict) else None, blocks,
                                       stack + (name,), memo)
                n += _repeat(item) * memo[name]
            else:
                n += 1
        else:
            n += 1
    return n


def _repeat(use: dict) -> int:
    r = use.get("repeat", 1)
    return r if isinstance(r, int) and not isinstance(r, bool) and r >= 1 else 1


def _alias(name: Any, aliases: dict[str, str]) -> Any:
    return aliases.get(name, name) if isinstance(name, str) else name


def _use(root: LocDict, use: LocDict, loc: tuple, prefix: str, start: str | None, blocks: LocDict,
         stack: tuple[str, ...], out: Expansion, emitted: LocList, problems: Problems) -> str | None:
    """Instantiate `use` (repeat times, chained); append the layers to `emitted`; return the last
    instance's output layer."""
    checked = _check_use(root, use, loc, blocks, stack, problems)
    if checked is None:
        return None
    bname, bdef, declared = checked
    repeat = int(use.get("repeat", 1))
    size = repeat * _size(bdef["layers"], blocks, stack + (bname,), {})
    if len(emitted) + size > MAX_LAYERS:
        problems.at(root, loc + ("repeat",) if "repeat" in use and not stack else loc,
                    f"the model would have {len(emitted) + size:,} layers, more than the {MAX_LAYERS:,} "
                    f"a model may have: block '{bname}' × {repeat:,} expands to {size:,}")
        problems.raise_if_any()
    names, each = use.get("names"), use.get("each")
    current = start
    for k in range(repeat):
        local = names[k] if names else (use["name"] if repeat == 1 else f"{use['name']}_{k + 1}")
        inst = prefix + local
        params = {**declared, **use.get("params", {}), **(each[k] if each else {})}
        missing = [p for p, v in params.items() if v is None]
        if missing:
            problems.at(root, loc, f"block '{bname}' instance '{inst}' needs parameter(s) "
                        f"{', '.join(missing)}")
            return None
        record = Instance(inst, bname, params=dict(params))
        if not _instantiate(root, use, loc, record, bdef, current, blocks, stack, out, emitted, problems):
            return None
        out.aliases[inst] = record.output
        out.instances.append(record)
        current = record.output
    return current


def _check_use(root: LocDict, use: LocDict, loc: tuple, blocks: LocDict, stack: tuple[str, ...],
               problems: Problems) -> tuple[str, LocDict, dict[str, Any]] | None:
    """(block name, its definition, its declared parameters) for a use that can be instantiated;
    None, with the problems reported, for one that cannot."""
    if stack:  # a use inside a block: check its keys here, the top-level ones were checked by expand
        try:
            BlockUse.model_validate(dict(use))
        except ValidationError as e:
            before = len(problems.items)
            report_validation(use, e, problems, model=BlockUse)
            for p in problems.items[before:]:
                p.path = f"model.blocks.{stack[-1]}.layers[{use.get('name')}]" + ("." + p.path if p.path else "")
            return None
    bname = use["block"]
    if bname not in blocks:
        problems.at(root, loc + ("block",), f"unknown block '{bname}'" + did_you_mean(bname, blocks)
                    + (f" (blocks defined: {', '.join(blocks)})" if blocks else " (no blocks are defined)"))
        return None
    if bname in stack:
        problems.at(root, loc + ("block",), f"block '{bname}' uses itself: {' -> '.join(stack + (bname,))}")
        return None
    if len(stack) >= MAX_NESTING:
        problems.at(root, loc + ("block",), f"blocks nest more than {MAX_NESTING} deep: "
                    + " -> ".join(stack + (bname,)))
        return None
    bdef = blocks[bname]
    if not isinstance(bdef, LocDict) or not isinstance(bdef.get("layers"), LocList):
        return None  # the schema reports the malformed block
    declared: dict[str, Any] = bdef["params"] if isinstance(bdef.get("params"), dict) else {}
    repeat = int(use.get("repeat", 1))
    names, each = use.get("names"), use.get("each")
    if names is not None and len(names) != repeat:
        problems.at(root, loc + ("names",), f"{len(names)} names given for repeat {repeat}")
        return None
    if each is not None and len(each) != repeat:
        problems.at(root, loc + ("each",), f"{len(each)} parameter sets in `each` for repeat {repeat}")
        return None
    for key in use.get("params", {}):
        if key not in declared:
            problems.at(root, loc + ("params", key), f"block '{bname}' has no parameter '{key}'"
                        + did_you_mean(key, declared), key=True)
    for k, inst_params in enumerate(each or []):
        for key in inst_params:
            if key not in declared:
                problems.at(root, loc + ("each", k, key), f"block '{bname}' has no parameter '{key}'"
                            + did_you_mean(key, declared), key=True)
    return bname, bdef, declared


def _instantiate(root: LocDict, use: LocDict, loc: tuple, record: Instance, bdef: LocDict, current: str | None,
                 blocks: LocDict, stack: tuple[str, ...], out: Expansion, emitted: LocList,
                 problems: Problems) -> bool:
    """Emit one instance of a block: its layers renamed under the instance, `$input` wired to
    `current`, nested uses expanded; `record` gets the layers and the output. False on a problem
    that stops the expansion."""
    inst, bname = record.name, record.block
    via = f"block '{bname}' instance '{inst}', used at {use.mark}"
    body = copy_tree(bdef["layers"], (via,) + use.via)
    _substitute(body, record.params, bname, problems)
    local_names = [x.get("name") for x in body if isinstance(x, LocDict)]
    local_out: dict[Any, str] = {}
    prev_local: str | None = None
    for layer in body:
        if not isinstance(layer, LocDict):
            continue
        lname = layer.get("name")
        full = f"{inst}/{lname}"
        refs = layer.get("inputs")

        def resolve(ref: Any, mark_loc: tuple) -> Any:
            if ref == INPUT:
                if current is None:
                    problems.add(*_where(layer, mark_loc), f"block '{bname}' instance '{inst}' has no "
                                 f"input: give the use an `inputs:` or put a layer before it", layer.via)
                return current
            if ref in local_out:
                return local_out[ref]
            problems.add(*_where(layer, mark_loc), f"unknown layer '{ref}' inside block '{bname}'"
                         + did_you_mean(ref, [n for n in local_names if isinstance(n, str)] + [INPUT]), layer.via)
            return ref

        if refs is None:
            resolved = None if layer.get("type") == "input" else \
                LocList([current if prev_local is None else prev_local])
            if resolved is not None:
                resolved.item_marks = [layer.mark]
        elif isinstance(refs, LocList):
            resolved = LocList(resolve(r, ("inputs", n)) for n, r in enumerate(refs))
            resolved.mark, resolved.item_marks = refs.mark, list(refs.item_marks)
        else:
            resolved = refs  # the schema reports a malformed `inputs`
        if "block" in layer and "type" not in layer:
            sub_start = resolved[0] if isinstance(resolved, LocList) and resolved else current
            nested = copy_tree(layer)
            nested.pop("inputs", None)
            end = _use(root, nested, loc, inst + "/", sub_start, blocks, stack + (bname,), out, emitted, problems)
            local_out[lname] = end or full
        else:
            layer["name"] = full
            if resolved is not None:
                layer["inputs"] = resolved
            emitted.append(layer)
            emitted.item_marks.append(layer.mark)
            local_out[lname] = full
        prev_local = local_out[lname]
        record.layers.append(local_out[lname])
    want = bdef.get("output")
    if want is not None and want not in local_out:
        problems.add(bdef.value_marks.get("output"), f"model.blocks.{bname}.output",
                     f"block '{bname}' has no layer '{want}'" + did_you_mean(want, local_out))
        return False
    record.output = (local_out.get(want) if want else prev_local) or ""
    return True


def _where(layer: LocDict, loc: tuple) -> tuple[Any, str]:
    mark, _ = locate(layer, loc)
    return mark, f"model.layers[{layer.get('name')}]." + ".".join(str(x) for x in loc[:1])


def _substitute(node: Any, params: dict[str, Any], bname: str, problems: Problems) -> None:
    """Replace `${p}` in every string of a copied block body, in place. A string that is exactly
    `${p}` takes the parameter's value with its type (an int stays an int)."""
    items: list[tuple[Any, Any]]
    if isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return
    for key, value in items:
        if isinstance(value, str) and "${" in value:
            node[key] = _fill(value, params, bname, node, key, problems)
        else:
            _substitute(value, params, bname, problems)


def _fill(text: str, params: dict[str, Any], bname: str, parent: Any, key: Any, problems: Problems) -> Any:
    whole = _REF.fullmatch(text.strip())
    for ref in _REF.findall(text):
        if ref not in params:
            mark, via = locate(parent, (key,))
            if mark is not None:
                problems.suppress.add(mark)
            problems.add(mark, f"model.blocks.{bname}", f"unknown parameter '${{{ref}}}' in block '{bname}'"
                         + did_you_mean(ref, params), via or getattr(parent, "via", ()))
            return text
    if whole:
        return params[whole.group(1)]
    return _REF.sub(lambda m: str(params[m.group(1)]), text)


__all__ = ["Expansion", "Instance", "expand"]
