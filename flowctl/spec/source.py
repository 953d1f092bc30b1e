"""YAML loading that remembers where every node came from, so each error can say `file:line:col`.

The loader is a `yaml.SafeLoader` subclass (no arbitrary object construction) that builds
`LocDict`/`LocList` containers: plain dicts and lists that also carry the marks of their keys and
values, and the block use sites they were instantiated through (`via`). Pydantic accepts them as
ordinary mappings and sequences, and an error's `loc` path is walked back through them to a mark.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, SequenceNode
from yaml.reader import ReaderError

from flowctl.engine.errors import SpecError


@dataclass(frozen=True)
class Mark:
    """A position in a spec file, 1-based as editors show it."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


def _mark(file: str, node: Node) -> Mark:
    return Mark(file, node.start_mark.line + 1, node.start_mark.column + 1)


class LocDict(dict):
    """A dict that knows the mark of itself, of each key and of each value."""

    mark: Mark | None
    key_marks: dict[Any, Mark]
    value_marks: dict[Any, Mark]
    via: tuple[str, ...]  # "block 'x' used at file:line:col", innermost first

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.mark = None
        self.key_marks = {}
        self.value_marks = {}
        self.via = ()


class LocList(list):
    mark: Mark | None
    item_marks: list[Mark | None]
    via: tuple[str, ...]

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.mark = None
        self.item_marks = [None] * len(self)
        self.via = ()


@dataclass
class Problem:
    """One error found in a spec: where, which key, what."""

    mark: Mark | None
    path: str
    message: str
    via: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = f"{self.mark}: " if self.mark else ""
        key = f"{self.path}: " if self.path else ""
        tail = "".join(f"\n    (in {v})" for v in self.via)
        return f"{where}{key}{self.message}{tail}"


@dataclass
class Problems:
    """Collects every problem in a spec so one SpecError can list them all."""

    items: list[Problem] = field(default_factory=list)
    # Marks whose value is already reported as broken (an unknown `${param}`): later errors about
    # the same value (its type) would only repeat the first one.
    suppress: set[Mark] = field(default_factory=set)

    def add(self, mark: Mark | None, path: str, message: str, via: tuple[str, ...] = ()) -> None:
        self.items.append(Problem(mark, path, message, via))

    def at(self, root: Any, loc: Sequence[Any], message: str, key: bool = False) -> None:
        mark, via = locate(root, loc, key=key)
        self.add(mark, dotted(root, loc), message, via)

    def raise_if_any(self) -> None:
        if self.items:
            raise spec_error(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


def spec_error(items: Iterable[Problem]) -> SpecError:
    merged: dict[tuple[Any, str, str], Problem] = {}
    for p in items:  # one copy per (place, message); a block's several uses become several `via`s
        key = (p.mark, p.path if not p.via else "", p.message)
        if key in merged:
            merged[key].via = merged[key].via + tuple(v for v in p.via if v not in merged[key].via)
        else:
            merged[key] = Problem(p.mark, p.path, p.message, p.via)
    items = sorted(merged.values(), key=lambda p: (p.mark.file, p.mark.line, p.mark.col) if p.mark else ("", 0, 0))
    lines = [str(p) for p in items]
    head = "invalid spec" if len(lines) == 1 else f"invalid spec ({len(lines)} errors)"
    err = SpecError(head + ":\n  " + "\n  ".join(line.replace("\n", "\n  ") for line in lines))
    err.problems = items  # type: ignore[attr-defined]
    return err


# How deep mappings and lists may nest. A spec nests a handful of levels; the bound keeps the
# recursive passes over the tree (composing, constructing, copying blocks) far from Python's
# recursion limit, which a file nested a few thousand levels would otherwise reach.
MAX_DEPTH = 100


class _Loader(yaml.SafeLoader):
    """SafeLoader that builds LocDict/LocList, rejects duplicate keys and nesting beyond MAX_DEPTH."""

    filename = "<spec>"
    depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:  # type: ignore[override]
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _TooDeep(self.peek_event().start_mark)  # type: ignore[no-untyped-call]
            return super().compose_node(parent, index)  # type: ignore[no-untyped-call]
        finally:
            self.depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> LocDict:  # type: ignore[override]
        self.flatten_mapping(node)
        out = LocDict()
        out.mark = _mark(self.filename, node)
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            try:
                hash(key)
            except TypeError:
                raise ConstructorError(None, None, "a mapping key must be a plain value",
                                       key_node.start_mark) from None
            if key in out:
                first = out.key_marks[key]
                raise _Duplicate(_mark(self.filename, key_node), key, first)
            out[key] = self.construct_object(value_node, deep=True)  # type: ignore[no-untyped-call]
            out.key_marks[key] = _mark(self.filename, key_node)
            out.value_marks[key] = _mark(self.filename, value_node)
        return out

    def construct_sequence(self, node: SequenceNode, deep: bool = False) -> LocList:  # type: ignore[override]
        out = LocList(self.construct_object(child, deep=True) for child in node.value)  # type: ignore[no-untyped-call]
        out.mark = _mark(self.filename, node)
        out.item_marks = [_mark(self.filename, child) for child in node.value]
        return out


def _construct_map(loader: _Loader, node: MappingNode) -> LocDict:
    return loader.construct_mapping(node)


def _construct_seq(loader: _Loader, node: SequenceNode) -> LocList:
    return loader.construct_sequence(node)


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)  # type: ignore[arg-type]
_Loader.add_constructor("tag:yaml.org,2002:seq", _construct_seq)  # type: ignore[arg-type]


class _TooDeep(Exception):
    def __init__(self, mark: Any) -> None:
        super().__init__("too deep")
        self.mark = mark


class _Duplicate(Exception):
    def __init__(self, mark: Mark, key: Any, first: Mark) -> None:
        super().__init__(key)
        self.mark, self.key, self.first = mark, key, first


def load_yaml(text: str, filename: str = "<spec>") -> Any:
    """Parse YAML text into LocDict/LocList trees. Syntax errors, characters YAML forbids,
    duplicate keys and nesting beyond MAX_DEPTH raise SpecError with the position."""
    loader_cls = type("SpecLoader", (_Loader,), {"filename": filename})
    try:
        loader = loader_cls(text)  # (the reader checks every character here)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except ReaderError as e:
        raise spec_error([Problem(_offset_mark(filename, text, e.position), "",
                                  _unprintable(e.character))]) from None
    except _TooDeep as e:
        raise spec_error([Problem(Mark(filename, e.mark.line + 1, e.mark.column + 1), "",
                                  f"mappings and lists nested more than {MAX_DEPTH} levels deep (a spec needs a handful)")]) from None
    except _Duplicate as e:
        raise spec_error([Problem(e.mark, "", f"duplicate key '{e.key}' (first given at {e.first})")]) from None
    except yaml.MarkedYAMLError as e:
        m = e.problem_mark or e.context_mark
        mark = Mark(filename, m.line + 1, m.column + 1) if m else None
        what = " ".join(x for x in (e.context, e.problem) if x) or "cannot parse"
        raise spec_error([Problem(mark, "", f"YAML syntax error: {what}")]) from None
    except yaml.YAMLError as e:
        raise spec_error([Problem(Mark(filename, 1, 1), "", f"YAML error: {e}")]) from None


def _offset_mark(filename: str, text: str, offset: int) -> Mark:
    line_start = text.rfind("\n", 0, offset) + 1
    return Mark(filename, text.count("\n", 0, offset) + 1, offset - line_start + 1)


def _unprintable(character: Any) -> str:
    code = ord(character) if isinstance(character, str) else character
    name = "NUL" if code == 0 else f"U+{code:04X}"
    return f"character {name} is not allowed in YAML (a control character; a spec is plain text)"


def locate(root: Any, loc: Sequence[Any], key: bool = False) -> tuple[Mark | None, tuple[str, ...]]:
    """The mark for a pydantic-style `loc` path through a LocDict/LocList tree: the value's mark,
    or the key's mark when `key` (for unknown keys). Stops at the deepest node that has one."""
    node = root
    mark: Mark | None = getattr(root, "mark", None)
    via: tuple[str, ...] = getattr(root, "via", ())
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, LocDict) and part in node:
            mark = (node.key_marks if key and last else node.value_marks).get(part, mark)
            node = node[part]
        elif isinstance(node, LocList) and isinstance(part, int) and 0 <= part < len(node):
            mark = node.item_marks[part] or mark
            node = node[part]
        elif isinstance(node, (LocDict, LocList)):
            continue  # a pydantic tag (union member name) that is not in the data: skip it
        else:
            break
        via = getattr(node, "via", via) or via
    return mark, via


def dotted(root: Any, loc: Sequence[Any]) -> str:
    """`model.layers[mixed_5b/branch1x1].filters`: list items that have a name are shown by name."""
    out = ""
    node = root
    for part in loc:
        if isinstance(node, LocList) and isinstance(part, int):
            item = node[part] if 0 <= part < len(node) else None
            label = item.get("name") if isinstance(item, dict) else None
            out += f"[{label}]" if isinstance(label, str) else f"[{part}]"
            node = item
        elif isinstance(node, dict) and part in node:
            out += ("." if out else "") + str(part)
            node = node[part]
        elif isinstance(node, (dict, list)):
            continue  # union tag
        else:
            out += ("." if out else "") + str(part)
            node = None
    return out


def copy_tree(node: Any, via: tuple[str, ...] = ()) -> Any:
    """A deep copy that keeps marks, adding `via` (block use sites) to every container."""
    if isinstance(node, LocDict):
        out = LocDict((k, copy_tree(v, via)) for k, v in node.items())
        out.mark, out.key_marks, out.value_marks = node.mark, dict(node.key_marks), dict(node.value_marks)
        out.via = node.via + via
        return out
    if isinstance(node, LocList):
        lst = LocList(copy_tree(v, via) for v in node)
        lst.mark, lst.item_marks, lst.via = node.mark, list(node.item_marks), node.via + via
        return lst
    if isinstance(node, dict):
        return {k: copy_tree(v, via) for k, v in node.items()}
    if isinstance(node, list):
        return [copy_tree(v, via) for v in node]
    return node
