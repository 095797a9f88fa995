"""The house rules of docs/structure.md, checked on the code: which wing of the runtime may import which
(the table is read from the doc itself, so the doc and the test cannot drift apart), no import cycles
anywhere in plait (function-level imports count: a lazy import that closes a circle is still a circle),
no mixin classes, a runtime root of a dozen files or fewer, and tests/ and benchmarks/ in the rooms the doc lists."""

from __future__ import annotations

import ast
import os
import re
from collections import defaultdict

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = {"plait": "lang", "plait.runtime": "runtime", "plait.grammars": "grammars"}
GROUND = "ground floor"


def modules_of(root: str, package: str) -> dict[str, str]:
    """module name -> file, for every module under the folder `root` imported as `package`."""
    mods = {}
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = os.path.relpath(dirpath, root)
        parts = [] if rel == "." else rel.split(os.sep)
        for f in files:
            if f.endswith(".py"):
                name = ".".join([package, *parts] + ([] if f == "__init__.py" else [f[:-3]]))
                mods[name] = os.path.join(dirpath, f)
    return mods


def package_modules() -> dict[str, str]:
    """module name -> file, for every module of plait (the package map of setup.py)."""
    mods = {}
    for pkg, folder in PACKAGES.items():
        mods.update(modules_of(os.path.join(REPO, folder), pkg))
    return mods


def imports_of(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The plait modules `name` imports anywhere in its file (module level or inside functions)."""
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule when there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph(modules: dict[str, str] = None) -> dict[str, set[str]]:
    """module -> the modules (of `modules`, default: all of plait) it imports anywhere in its source."""
    modules = modules if modules is not None else package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def wing_of(module: str):
    """The runtime wing a module lives in (its first folder under runtime/), the ground floor for the
    root's own modules, None outside plait.runtime."""
    if not module.startswith("plait.runtime"):
        return None
    rest = module[len("plait.runtime") :].lstrip(".").split(".")
    if rest == [""]:
        return None  # the package itself: its public face (Engine, ServerArgs, SamplingParams), lazily
    if len(rest) == 1 and os.path.isfile(os.path.join(REPO, "runtime", rest[0] + ".py")):
        return GROUND
    return rest[0]


def rules_table(first_header: str) -> dict[str, set[str]]:
    """The table of docs/structure.md's "## Import rules" whose header is `| {first_header} | may import |`:
    each row's name -> the names it may import ("nothing": none)."""
    doc = open(os.path.join(REPO, "docs", "structure.md")).read()
    section = doc.split("## Import rules", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\|\s*{first_header}\s*\|\s*may import", line))
    rules = {}
    for line in lines[start + 2 :]:
        m = re.match(r"\|\s*`?([\w ]+?)/?`?\s*\|\s*([^|]*)\|", line)
        if not m:
            break
        allowed = {
            w.strip().strip("`").rstrip("/") for w in m.group(2).split(",") if w.strip() and w.strip() != "nothing"
        }
        rules[m.group(1).strip()] = allowed
    return rules


def import_rules() -> dict[str, set[str]]:
    """docs/structure.md's table "| wing | may import |"."""
    return rules_table("wing")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_reader_finds_a_lazy_cycle_and_resolves_relative_imports(tmp_path):
    # A made-up package: a cycle closed by an import inside a function and one under TYPE_CHECKING,
    # relative imports from a subpackage, `from . import sub` naming a submodule.
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .sub import b\nA = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("import os\n\ndef f():\n    from ..c import C\n    return C\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n")
    graph = import_graph(modules_of(str(pkg), "pkg"))
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.sub.b"},
        "pkg.c": {"pkg.a"},
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg.c"},
    }
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (pkg / "c.py").write_text("C = 2\n")
    assert cycles(import_graph(modules_of(str(pkg), "pkg"))) == []


def test_the_real_package_is_read_as_python_resolves_it():
    graph = import_graph()
    assert graph["plait.backend.native"] >= {"plait.backend.base", "plait.graph_builder"}
    assert "plait.graph_render" not in graph["plait.graph"]  # a graph is data; the renderer reads it
    assert "plait.runtime.engine.engine" in graph["plait.runtime.server.launch"]


def test_no_import_cycles_in_plait():
    found = cycles(import_graph())
    assert not found, "import cycles (a concept cut in two): " + "; ".join(" <-> ".join(c) for c in found)


def test_every_wing_imports_only_what_the_structure_doc_allows():
    rules = import_rules()
    graph = import_graph()
    wings = {wing_of(m) for m in graph if wing_of(m) is not None}
    assert wings <= set(rules), f"wings missing from docs/structure.md's import rules: {sorted(wings - set(rules))}"
    bad = defaultdict(list)
    for mod, deps in graph.items():
        src = wing_of(mod)
        if src is None:
            continue
        for dep in deps:
            dst = wing_of(dep)
            if dst is None or dst == src:
                continue
            if dst not in rules[src]:
                bad[f"{src} -> {dst}"].append(f"{mod} imports {dep}")
    assert not bad, "imports the structure doc does not allow:\n" + "\n".join(
        f"  {edge}: {', '.join(sorted(hits))}" for edge, hits in sorted(bad.items())
    )


@pytest.mark.parametrize("low", ["executor", "models", "attention", "kernels", "kvcache"])
def test_the_lower_wings_never_import_the_scheduler_or_the_engine(low):
    rules = import_rules()
    assert not rules[low] & {"scheduler", "engine", "server"}, f"docs/structure.md lets {low} import {rules[low]}"


def test_no_mixin_classes():
    mixins = []
    for name, path in package_modules().items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin"):
                mixins.append(f"{name}.{node.name}")
    assert not mixins, f"a class sliced over files shares its state through self: {mixins}"


def test_the_runtime_root_holds_a_dozen_files_or_fewer():
    root = os.path.join(REPO, "runtime")
    files = sorted(f for f in os.listdir(root) if f.endswith(".py"))
    assert len(files) <= 12, files


def rooms_listed(heading: str) -> set[str]:
    """The rooms (first-column folders, "`name/`") of docs/structure.md's section that starts with `heading`."""
    doc = open(os.path.join(REPO, "docs", "structure.md")).read()
    section = doc.split("\n" + heading, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(\w+)/` \|", section, flags=re.M))


def folders_in(root: str) -> set[str]:
    return {d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith((".", "_"))}


def test_tests_live_in_the_rooms_the_doc_lists_under_unique_names():
    tests = os.path.join(REPO, "tests")
    assert sorted(f for f in os.listdir(tests) if f.endswith(".py")) == ["conftest.py"], "a test outside a room"
    assert folders_in(tests) == rooms_listed("## tests/"), "tests/ rooms differ from docs/structure.md's"
    # pytest imports each test file under its own name (rootdir-relative, no packages): two alike would collide.
    names = defaultdict(list)
    for room in folders_in(tests):
        for f in os.listdir(os.path.join(tests, room)):
            if f.startswith("test_") and f.endswith(".py"):
                names[f].append(room)
    assert names and not {f: rooms for f, rooms in names.items() if len(rooms) > 1}


def test_a_test_reaches_another_rooms_code_only_through_helpers():
    tests = os.path.join(REPO, "tests")
    room_of = {}
    for room in folders_in(tests):
        for f in os.listdir(os.path.join(tests, room)):
            if f.endswith(".py"):
                room_of[f[:-3]] = room
    crossing = []
    for module, room in room_of.items():
        if room == "helpers":
            continue
        path = os.path.join(tests, room, module + ".py")
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                top = node.module.split(".")[0]
                if top in room_of and room_of[top] != room:
                    crossing.append(f"{room}/{module} imports {node.module}")
    assert not crossing, crossing


def test_benchmarks_live_in_the_rooms_the_doc_lists():
    benchmarks = os.path.join(REPO, "benchmarks")
    # The root keeps what every room shares (the scripts put benchmarks/ on sys.path for it) and the figures.
    root = sorted(f for f in os.listdir(benchmarks) if os.path.isfile(os.path.join(benchmarks, f)))
    assert root == ["RESULTS.md", "bench_common.py", "gpu_ceilings.py"], root
    rooms = folders_in(benchmarks) - {"out", "results"}  # where results are written when $OUT is not set
    assert rooms == rooms_listed("## benchmarks/"), "benchmarks/ rooms differ from docs/structure.md's"


SERVER = "plait.runtime.server"


def server_room_of(module: str):
    """The room of the server a module lives in (its folder under runtime/server/), "root" for the server's
    own modules, None outside the server."""
    if module != SERVER and not module.startswith(SERVER + "."):
        return None
    rest = module[len(SERVER) :].lstrip(".").split(".")
    return rest[0] if len(rest) > 1 else "root"


def test_the_servers_rooms_import_one_way_as_the_doc_says():
    rules = rules_table("server room")
    graph = import_graph()
    rooms = {server_room_of(m) for m in graph} - {None}
    assert rooms == set(rules), f"server rooms on disk {sorted(rooms)}, in docs/structure.md {sorted(rules)}"
    bad = []
    for mod, deps in graph.items():
        src = server_room_of(mod)
        for dep in deps:
            dst = server_room_of(dep)
            if src is not None and dst not in (None, src) and dst not in rules[src]:
                bad.append(f"{mod} imports {dep} ({src} -> {dst})")
    assert not bad, "imports between the server's rooms the structure doc does not allow:\n  " + "\n  ".join(bad)
