"""The spec's key reference, derived from its JSON schema (`flowctl validate --schema`).

`key_paths` lists every key a spec may hold, as dotted paths: `[]` marks a list item, `<name>` a
mapping key the user chooses, and `(tag)` the member of a tagged union (a layer type, a data
source), e.g. `model.layers[](conv2d).filters`. flowctl/spec/REFERENCE.md is `render()`'s output;
a test keeps the two in step.
"""
from __future__ import annotations

import json
from typing import Any

from flowctl.spec.schema import json_schema


def _tag(member: dict[str, Any]) -> str | None:
    props = member.get("properties", {})
    for key in ("type", "source"):
        p = props.get(key, {})
        if "const" in p:
            return str(p["const"])
    if "block" in props:
        return "block"
    return None


def _describe(node: dict[str, Any]) -> str:
    if "$ref" in node:
        return node["$ref"].rsplit("/", 1)[1]
    if "const" in node:
        return json.dumps(node["const"])
    if "enum" in node:
        return " | ".join(json.dumps(v) for v in node["enum"])
    for key in ("anyOf", "oneOf"):
        if key in node:
            return " | ".join(_describe(m) for m in node[key])
    t = node.get("type", "any")
    if t == "array":
        return f"list[{_describe(node.get('items', {}))}]"
    if t == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map[{_describe(node['additionalProperties'])}]"
    return str(t)


def key_paths(schema: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every key path with its type, default, whether it is required, and its description."""
    schema = schema or json_schema()
    defs = schema.get("$defs", {})
    out: list[dict[str, Any]] = []

    def deref(node: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[1]]
        return node

    def walk(node: dict[str, Any], path: str, stack: tuple[str, ...]) -> None:
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            if name in stack:
                return
            walk(defs[name], path, stack + (name,))
            return
        members = node.get("anyOf") or node.get("oneOf")
        if members:
            objects = [m for m in members if deref(m).get("type") == "object" and "properties" in deref(m)]
            for m in members:
                d = deref(m)
                if d.get("type") == "object" and "properties" in d:
                    tag = _tag(d) if len(objects) > 1 else None
                    walk(m, f"{path}({tag})" if tag else path, stack)
                else:
                    walk(m, path, stack)
            return
        t = node.get("type")
        if t == "object":
            required = set(node.get("required", []))
            for key, sub in node.get("properties", {}).items():
                p = f"{path}.{key}" if path else key
                out.append({"path": p, "type": _describe(sub), "required": key in required,
                            "default": sub.get("default"), "description": sub.get("description", "")})
                walk(sub, p, stack)
            extra = node.get("additionalProperties")
            if isinstance(extra, dict) and extra:
                walk(extra, f"{path}.<name>", stack)
        elif t == "array" and isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]", stack)

    walk(schema, "", ())
    return out


def render() -> str:
    lines = [
        "# Spec key reference",
        "",
        "Every key a flowctl spec may hold (generated from `flowctl validate --schema` by",
        "`flowctl.spec.reference.render()`; tests/test_spec_cli.py keeps it in step with the schema).",
        "`[]` marks a list item, `<name>` a key you choose, `(tag)` a layer type or data source.",
        "",
        "| key | type | required | default | description |",
        "|---|---|---|---|---|",
    ]
    for row in key_paths():
        default = "" if row["default"] is None else f"`{json.dumps(row['default'])}`"
        typ = row["type"].replace("|", "\\|")
        lines.append(f"| `{row['path']}` | {typ} | "
                     f"{'yes' if row['required'] else ''} | {default} | {row['description']} |")
    return "\n".join(lines) + "\n"


__all__ = ["key_paths", "render"]
