"""The DSL's module graph is a DAG: no import cycles inside `lang/` (the `plait` package).

Imports are read from the source with `ast`, wherever they are written: a function-level (lazy)
import or one under `if TYPE_CHECKING:` is an edge like any other, so a cycle cannot hide behind
one. `package_imports` and `import_cycles` take any package folder, so the same check can cover
`runtime/` (`plait.runtime`).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module_name(package_dir: Path, package: str, path: Path) -> str:
    parts = list(path.relative_to(package_dir).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def package_imports(package_dir: Path, package: str) -> dict[str, set[str]]:
    """Every module under `package_dir` (imported as `package`) -> the modules of that same folder
    it imports anywhere in its source. Importing a module is not counted as importing its parent
    packages' `__init__`; modules outside the folder (another package, the standard library) are left out."""
    files = {_module_name(package_dir, package, p): p for p in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]  # the package relative imports start from
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in files)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.rsplit(".", node.level - 1)[0]  # level 1: `here` itself
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                for alias in node.names:
                    if f"{base}.{alias.name}" in files:  # `from . import graph`: the submodule
                        targets.add(f"{base}.{alias.name}")
                    elif base in files:
                        targets.add(base)
        targets.discard(name)
        graph[name] = targets
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules `start` imports, directly or through others (itself only through a cycle)."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:  # NOTE: a loop, not recursion: import chains can be long
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The knots of import cycles: each a sorted list of the modules that all reach one another
    (a strongly connected component of two or more), sorted. Empty for a DAG."""
    reach = {module: _reachable(graph, module) for module in graph}
    knots = {tuple(sorted({m} | {other for other in reach[m] if m in reach[other]})) for m in graph if m in reach[m]}
    return sorted(list(knot) for knot in knots)


def test_import_cycles_finds_a_lazy_cycle_and_resolves_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .sub import b\nA = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("import os\n\ndef f():\n    from ..c import C\n    return C\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n")
    graph = package_imports(pkg, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.c": {"pkg.a"}, "pkg.sub": set(),
                     "pkg.sub.b": {"pkg.c"}}
    assert import_cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (pkg / "c.py").write_text("C = 2\n")
    assert import_cycles(package_imports(pkg, "pkg")) == []


def test_the_dsl_has_no_import_cycles():
    graph = package_imports(REPO / "lang", "plait")
    # the real package, read as Python resolves it: subpackages, `from ..x`, imports inside functions
    assert graph["plait.backend.native"] >= {"plait.backend.base", "plait.graph_builder"}
    assert "plait.runtime" not in graph["plait"]  # plait.runtime is another folder's package
    assert "plait.graph_render" not in graph["plait.graph"]  # a graph is data; the renderer reads it
    assert import_cycles(graph) == []
