"""docs/architecture.md's layer table is true to the code: every module of the package is in
it, and each imports only modules of rows above it (inside ``core/``, only core modules listed
before it). Imports under ``if TYPE_CHECKING:`` count too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mambakv"
DOC = ROOT / "docs" / "architecture.md"


def _rows() -> list[tuple[int, list[str]]]:
    """(row number, the modules it names), in table order."""
    text = DOC.read_text()
    table = text[text.index("| layer | module |"):].split("\n\n", 1)[0].splitlines()[2:]
    rows = []
    for i, line in enumerate(table):
        cell = line.split("|")[2]
        names = []
        for entry in re.findall(r"`([^`]+)`", cell):
            if entry.endswith("/"):
                names += sorted(str(p.relative_to(PKG)) for p in (PKG / entry).rglob("*.py")
                                if p.name not in ("__init__.py", "__main__.py"))
            else:
                names += sorted(str(p.relative_to(PKG)) for p in PKG.glob(entry))
        rows.append((i, names))
    return rows


def _imports(path: Path) -> set[str]:
    """The mambakv modules `path` imports (anywhere in it), as paths relative to the package."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("mambakv"):
            continue
        base = node.module.split(".", 1)[1].replace(".", "/") if "." in node.module else ""
        submodules = {f"{base}/{a.name}.py" for a in node.names if (PKG / base / f"{a.name}.py").is_file()}
        if submodules:  # ``from mambakv.core import units``: the submodule, not the package
            out |= submodules
        elif (PKG / f"{base}.py").is_file():
            out.add(f"{base}.py")
        elif base and (PKG / base / "__init__.py").is_file():
            out.add(f"{base}/__init__.py")
    return out


def test_every_module_is_in_the_table_once() -> None:
    listed = [m for _, names in _rows() for m in names]
    assert len(listed) == len(set(listed)), "a module listed twice"
    modules = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    assert sorted(modules - set(listed)) == []
    assert sorted(set(listed) - modules) == []


def test_each_module_imports_only_rows_above_it() -> None:
    rows = _rows()
    row_of = {m: i for i, names in rows for m in names}
    order = {m: k for k, m in enumerate(m for _, names in rows for m in names)}
    packages = {}  # a package's __init__: the last row of its modules
    for m, i in row_of.items():
        if "/" in m:
            pkg = m.split("/")[0] + "/__init__.py"
            packages[pkg] = max(packages.get(pkg, -1), i)
    bad = []
    for m, i in row_of.items():
        for dep in _imports(PKG / m):
            if dep == m:
                continue
            if dep not in packages and dep not in row_of:
                bad.append(f"{m} imports {dep}, which the table does not list")
                continue
            j = packages[dep] if dep in packages else row_of[dep]
            if m.startswith("core/") and dep.startswith("core/") and dep in order:
                if order[dep] > order[m]:
                    bad.append(f"{m} imports {dep}, listed after it")
            elif j > i:
                bad.append(f"{m} (row {i}) imports {dep} (row {j})")
    assert bad == []


def test_no_row_below_device_imports_torch() -> None:
    rows = _rows()
    device = next(i for i, names in rows if any(m.startswith("device/") for m in names))
    torch_users = []
    for _, names in rows[:device]:
        for m in names:
            tree = ast.parse((PKG / m).read_text())
            for node in ast.walk(tree):
                if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names)) or (
                        isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch"):
                    torch_users.append(m)
    assert torch_users == []
