"""The package's import structure (docs/architecture.md, "Packages"): no import cycle between
modules, wherever the import stands (a function-level import that dodges a cycle at load time is
still a cycle in the design), and the engine never reaches up into the layers built on it.

Imports are counted as Python runs them: importing `a.b.c` (`import a.b.c`, `from a.b import c`,
`from a.b.c import x`) first runs the packages `a` and `a.b`, so their `__init__` counts as
imported too, except for the importing module's own packages (already running when it runs)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "flowctl"

ENGINE_MAY_NOT_IMPORT = ("flowctl.spec", "flowctl.cli", "flowctl.training", "flowctl.bench", "flowctl.data")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines under `if TYPE_CHECKING:`: imports that never run."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for child in node.body:
                out.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return out


def _with_packages(target: str, importer: str) -> list[str]:
    """`target` and the packages Python runs before it, less `importer`'s own packages (a module
    that names one of its own packages, `import flowctl`, still counts it)."""
    own = {importer.rsplit(".", i)[0] for i in range(1, importer.count(".") + 1)}
    parts = target.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts))) if m not in own] + [target]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the flowctl modules it imports (an imported name that is a submodule counts as
    that submodule; any other name as the package it comes from), each with the packages above it
    that the import runs."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_lines(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            else:
                continue
            edges[mod].update(m for t in targets for m in _with_packages(t, mod) if m in files and m != mod)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
    return out


def test_no_import_cycle_between_modules() -> None:
    found = [sorted(c) for c in cycles(import_graph())]
    assert not found, f"import cycles: {found}"


def test_the_engine_imports_nothing_above_it() -> None:
    bad = []
    for mod, targets in import_graph().items():
        if not mod.startswith("flowctl.engine"):
            continue
        for t in targets:
            if t == "flowctl" or t.startswith(ENGINE_MAY_NOT_IMPORT):
                bad.append(f"{mod} -> {t}")
    assert not bad, "engine modules importing the layers above them: " + "; ".join(sorted(bad))


def test_the_engine_reaches_kernels_through_the_registry_only() -> None:
    bad = [f"{m} -> {t}" for m, ts in import_graph().items() if m.startswith("flowctl.engine")
           for t in ts if t.startswith("flowctl.kernels")
           # (importing the registry runs its package, which fills it)
           and t not in ("flowctl.kernels.registry", "flowctl.kernels")]
    assert not bad, "; ".join(sorted(bad))


def test_kernels_import_no_op_module() -> None:
    bad = [f"{m} -> {t}" for m, ts in import_graph().items() if m.startswith("flowctl.kernels")
           for t in ts if t.startswith("flowctl.engine.ops") or t == "flowctl.engine.graph"]
    assert not bad, "; ".join(sorted(bad))


def test_the_checker_finds_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    """The checker itself can fail: a planted cycle and a planted upward import are both seen."""
    pkg = tmp_path / "flowctl"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "training").mkdir()
    for d in (pkg, pkg / "engine", pkg / "training"):
        (d / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("def f():\n    from flowctl.engine import b\n")
    (pkg / "engine" / "b.py").write_text("from flowctl.engine.a import f\nimport flowctl.training.t\n")
    (pkg / "engine" / "c.py").write_text("import flowctl as fc\n")
    (pkg / "training" / "t.py").write_text("")
    edges = import_graph(pkg)
    assert [sorted(c) for c in cycles(edges)] == [["flowctl.engine.a", "flowctl.engine.b"]]
    assert {"flowctl.training.t", "flowctl.training"} <= edges["flowctl.engine.b"]
    assert "flowctl" not in edges["flowctl.engine.b"]  # (its own package, running already)
    assert "flowctl" in edges["flowctl.engine.c"]  # (named: the package's API is above the engine)


def test_the_checker_finds_a_cycle_through_a_package_init(tmp_path: Path) -> None:
    """`from flowctl.engine.ops import api` runs `ops/__init__.py` first: when that imports a module
    that imports `g`, and `g` imports `api`, the three and the package are one cycle, though no
    module names another's module directly both ways. A module's import of its own package's
    other modules does not count its package (already running)."""
    ops = tmp_path / "flowctl" / "engine" / "ops"
    ops.mkdir(parents=True)
    for d in (ops.parents[1], ops.parent):
        (d / "__init__.py").write_text("")
    (ops / "__init__.py").write_text("from flowctl.engine.ops import math\n")
    (ops / "api.py").write_text("X = 1\n")
    (ops / "math.py").write_text("from flowctl.engine.g import Graph\nfrom flowctl.engine.ops.api import X\n")
    (ops.parent / "g.py").write_text("class Graph:\n    def f(self):\n        from flowctl.engine.ops import api\n")
    edges = import_graph(tmp_path / "flowctl")
    assert "flowctl.engine.ops" in edges["flowctl.engine.g"]
    assert "flowctl.engine.ops" not in edges["flowctl.engine.ops.math"]
    assert [sorted(c) for c in cycles(edges)] == [
        ["flowctl.engine.g", "flowctl.engine.ops", "flowctl.engine.ops.math"]]
    (ops.parent / "g.py").write_text("class Graph:\n    pass\n")
    assert cycles(import_graph(tmp_path / "flowctl")) == []


if __name__ == "__main__":  # pragma: no cover - a report for people
    for c in cycles(import_graph()):
        print(sorted(c))
    raise SystemExit(pytest.main([__file__, "-q"]))
