"""The package's import graph has no circle, counting every import: at module level, inside
functions and under ``if TYPE_CHECKING:`` (an annotation-only import is still a dependency a
reader follows). ``from mambakv.x import y`` names the submodule ``x/y.py`` when there is one,
else the module or package ``x``. No class is a ``Mixin``: a class lives in one file."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mambakv"


def _module_file(dotted: str) -> Path | None:
    rel = dotted.split(".")[1:]
    path = PKG.joinpath(*rel)
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def imports_of(path: Path) -> set[Path]:
    """Every mambakv module `path` imports, wherever the import statement sits."""
    out: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "mambakv"]
            out |= {f for f in map(_module_file, names) if f is not None}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "mambakv":
            module = node.module or ""
            subs = [_module_file(f"{module}.{a.name}") for a in node.names]
            found = [f for f in subs if f is not None]
            if found:
                out |= set(found)
            else:
                f = _module_file(module)
                if f is not None:
                    out.add(f)
    out.discard(path)
    return out


def graph() -> dict[Path, set[Path]]:
    return {p: imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def circles(g: dict[Path, set[Path]]) -> list[list[Path]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on: set[Path] = set()
    out: list[list[Path]] = []

    def visit(v: Path) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    found = circles(graph())
    assert not found, "import circles: " + "; ".join(
        " <-> ".join(str(p.relative_to(PKG)) for p in c) for c in found)


def test_the_circle_finder_has_teeth() -> None:
    a, b, c = Path("a.py"), Path("b.py"), Path("c.py")
    assert circles({a: {b}, b: {c}, c: set()}) == []
    assert circles({a: {b}, b: {c}, c: {a}}) == [[a, b, c]]


def test_a_type_checking_import_counts(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mambakv.coordinator import X\n")
    assert imports_of(mod) == {PKG / "coordinator.py"}


def test_no_mixin_classes() -> None:
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert not node.name.endswith("Mixin"), f"{path.relative_to(PKG)}: class {node.name}"
