"""Dependencies point one way: no import cycle among engine's modules, and the core never
imports a plugin.

Every module of the ``engine`` distribution (core/, platforms/, attention_backends/, kernels/)
and of the in-tree plugins is parsed with ``ast``; each ``import`` statement becomes an edge,
at module level *and* inside functions (a lazy import inside a function is how a cycle hides:
it still ties the two modules together, it only defers the failure). Imports under
``if TYPE_CHECKING:`` are type annotations only and are left out. ``from pkg import name``
points at ``pkg.name`` when that is a module, else at ``pkg``. Importing ``a.b.c`` also runs
``a/__init__.py`` and ``a/b/__init__.py``, so it is an edge to those packages too, unless they
enclose the importing module (Python has started them before it, and a package's ``__init__``
importing its own submodules is the ordinary shape, not a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Import-package roots (pyproject.toml maps them; plugins are their own distributions).
ROOTS = {
    "engine": REPO / "core",
    "engine.platforms": REPO / "platforms",
    "engine.attention_backends": REPO / "attention_backends",
    "engine.kernels": REPO / "kernels",
    **{
        path.name: path
        for path in sorted((REPO / "plugins").glob("engine-*/engine_*"))
        if (path / "__init__.py").is_file()
    },
}
PLUGIN_PACKAGES = {name for name in ROOTS if not name.startswith("engine.") and name != "engine"}


def discover_modules() -> dict[str, Path]:
    modules = {}
    for package, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every runtime import in ``path`` of a known module."""
    found: list[tuple[str, int]] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else target, node.lineno))
        visit(node)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return [(m, line) for m, line in found if m in known and m != module]


def packages_run_by(module: str, target: str, known: set[str]) -> list[str]:
    """The packages whose ``__init__`` importing ``target`` from ``module`` runs, target last."""
    parts = target.split(".")
    enclosing = [".".join(parts[:i]) for i in range(1, len(parts))]
    return [
        p for p in enclosing if p in known and not (module == p or module.startswith(p + "."))
    ] + [target]


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int], dict[str, Path]]:
    modules = discover_modules()
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    where: dict[tuple[str, str], int] = {}
    for module, path in modules.items():
        for target, line in imports_of(module, path, known):
            for runs in packages_run_by(module, target, known):
                graph[module].add(runs)
                where.setdefault((module, runs), line)
    return graph, where, modules


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a closed path of modules) per strongly connected component (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, set(c)) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A closed path inside a strongly connected component, by breadth-first search."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {sorted(component)}")


def test_the_graph_sees_the_known_edges() -> None:
    """The walker itself: top-level, lazy and relative imports count, TYPE_CHECKING ones not."""
    graph, _, modules = import_graph()
    assert "engine.plugins" in modules and "engine_cpu.plugin" in modules
    assert "engine.hookspecs" in graph["engine.plugins"]  # `from engine import hookspecs`
    assert "engine.platforms.resolve" in graph["engine.plugins"]  # top level
    assert "engine.kernels.reference" in graph["engine.attention_backends.torch_ref"]
    assert "engine_cpu.platform" in graph["engine_cpu.plugin"]  # inside the hook function
    # platforms/interface.py imports engine.config only under TYPE_CHECKING.
    assert "engine.config" not in graph["engine.platforms.interface"]
    # Importing engine.platforms.resolve runs engine/platforms/__init__.py first.
    assert "engine.platforms" in graph["engine.plugins"]


def test_importing_a_submodule_runs_the_packages_around_it() -> None:
    known = {"a", "a.b", "a.b.c", "a.d", "x"}
    assert packages_run_by("x", "a.b.c", known) == ["a", "a.b", "a.b.c"]
    # a.d sits inside a: a/__init__.py has already started when a.d imports a sibling.
    assert packages_run_by("a.d", "a.b.c", known) == ["a.b", "a.b.c"]
    assert packages_run_by("a", "a.b", known) == ["a.b"]


def test_find_cycles_reports_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph, where, modules = import_graph()
    cycles = find_cycles(graph)
    lines = []
    for cycle in cycles:
        steps = [
            f"{a} ({modules[a].relative_to(REPO)}:{where[a, b]}) imports {b}"
            for a, b in zip(cycle, cycle[1:], strict=False)
        ]
        lines.append("cycle: " + " -> ".join(cycle) + "\n    " + "\n    ".join(steps))
    assert not cycles, "import cycles among engine's modules:\n" + "\n".join(lines)


def test_the_core_never_imports_a_plugin() -> None:
    graph, where, modules = import_graph()
    offending = [
        f"{m} ({modules[m].relative_to(REPO)}:{where[m, t]}) imports {t}"
        for m, targets in graph.items()
        if m.split(".")[0] == "engine"
        for t in sorted(targets)
        if t.split(".")[0] in PLUGIN_PACKAGES
    ]
    assert not offending, "the core imports plugins:\n" + "\n".join(offending)
