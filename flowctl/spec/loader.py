"""Loading a spec: YAML with marks -> blocks expanded -> layer defaults -> pydantic -> semantic
checks. Every problem found is collected and raised as one SpecError whose lines read
`file:line:col: key.path: message`."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from pydantic import ValidationError

from flowctl.engine.errors import SpecError, did_you_mean
from flowctl.spec.blocks import expand
from flowctl.spec.check import LoadedSpec, check
from flowctl.spec.layers import LAYERS
from flowctl.spec.overrides import apply as apply_overrides
from flowctl.spec.schema import Spec
from flowctl.spec.source import LocDict, LocList, Mark, Problems, load_yaml
from flowctl.spec.validation import report_validation


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> LoadedSpec:
    """Read, expand and validate a spec file, with `--set` overrides applied. Raises SpecError
    listing every problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecError(f"{p}: no such spec file") from None
    except OSError as e:
        raise SpecError(f"{p}: cannot read spec file: {e.strerror}") from None
    except UnicodeDecodeError as e:
        line = text_line(p.read_bytes(), e.start)
        raise SpecError(f"{p}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                        f"a spec is a UTF-8 YAML file") from None
    return load_text(text, str(p), base_dir=p.parent, overrides=overrides)


def load_text(text: str, filename: str = "<spec>", base_dir: Path | None = None,
              overrides: Sequence[str] = ()) -> LoadedSpec:
    root = load_yaml(text, filename)
    problems = Problems()
    if not isinstance(root, LocDict):
        # A plain value or an empty file has no mark of its own: it starts at the file's start.
        mark = getattr(root, "mark", None) or Mark(filename, 1, 1)
        empty = "the spec is empty: " if root is None else ""  # (no text, or comments only)
        problems.add(mark, "", empty + "a spec is a mapping with `version: 1` and a `model:`")
        problems.raise_if_any()
    # Overrides of a block's definition apply before blocks are expanded, the rest to the layers
    # as expanded (so `model.layers.<instance>/<layer>.units` reaches one instance's layer).
    in_blocks = [o for o in overrides if o.startswith("model.blocks.")]
    apply_overrides(root, in_blocks)
    expansion = expand(root, problems)
    apply_overrides(root, [o for o in overrides if o not in in_blocks])
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


def text_line(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


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


__all__ = ["load_spec", "load_text"]
