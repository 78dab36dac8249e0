"""The package's shape: imports point one way (no cycles), modules stay readable
(at most 600 lines), and a ground floor of modules imports nothing above it.

tests/test_layers_import.py says which folder may not import which; this file
checks what such a list cannot: that no chain of imports, however long, comes
back to where it started. A cycle works by luck of import order (one side
imports the other inside a function, or after its own definitions) and breaks
when someone moves an import to the top; it also means neither module can be
read, tested or reused without the other.

Every ``import`` statement counts, wherever it stands: at the top, inside a
function (a lazy import is still a dependency) and under ``if TYPE_CHECKING:``
(the annotations still name the other module). An import names one module:

* ``import xmodlm.a.b`` and ``from xmodlm.a.b import f`` name ``xmodlm.a.b``;
* ``from xmodlm.a import b``, where ``b`` is a submodule, names ``xmodlm.a.b``;
  where ``b`` is anything else, it names the package ``xmodlm.a``, that is its
  ``__init__.py``;
* relative imports are resolved against the importing module's package.

Importing ``xmodlm.a.b`` also runs ``xmodlm/a/__init__.py`` first. That implicit
step is not counted: it comes with every import of a submodule, and a package's
``__init__`` importing its own submodules (to offer their names) is the normal
layout. An import that names the package itself is counted, so a submodule that
imports its own package's ``__init__`` while that ``__init__`` imports it back is
a cycle, as it is at run time. Imports built from strings at run time
(``importlib.import_module``) are out of reach of ``ast``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 600

# The ground floor: modules any layer may import, because they import nothing of
# ours but each other. A module that merely happens to import nothing (the routing
# mathematics, the bench's targets) belongs to its layer, not here.
GROUND = (
    "xmodlm.errors",  # the one user-error type
    "xmodlm.version",
    "xmodlm.typed",  # typed settings from YAML mappings
    "xmodlm.presets",  # where settings come from: presets, YAML files, base chains
    "xmodlm.depth",  # the (K, A, N0) layer-construction rule
    "xmodlm.record",  # the run record's columns and the family recipes
    "xmodlm.fileio",
    "xmodlm.progress",
    "xmodlm.pairing",  # the rule that pairs a routed run with its dense partner
    # the depth-router kinds: torch-free, read by FLOP accounting and the config;
    # the package imports each kind module by name at run time
    "xmodlm.depth_routers",
    "xmodlm.depth_routers.bce",
    "xmodlm.depth_routers.predictor",
)

# Known cycles being removed on another branch, each as the set of modules its
# strongly connected component holds. Delete an entry once its fix is merged:
# the test then fails if the cycle comes back (and fails now if it is gone).
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()
# Modules over MAX_LINES being split on other branches; delete an entry once merged.
KNOWN_LONG: frozenset[str] = frozenset()


def _module_files(src: Path = SRC) -> dict[str, Path]:
    """Every module of the package by dotted name; a package is its ``__init__.py``."""
    out = {}
    for path in sorted((src / "xmodlm").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _base(name: str, path: Path, node: ast.ImportFrom) -> str | None:
    """The absolute module a ``from ... import`` reads from (None: not dotted)."""
    if node.level == 0:
        return node.module
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if node.level > 1:
        package = package[: len(package) - node.level + 1]
    return ".".join([*package, *([node.module] if node.module else [])])


def _named(target: str, modules: dict[str, Path]) -> str | None:
    """The module of ours an import of ``target`` names: the longest known prefix."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that module ``name`` imports anywhere in its file."""
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(_named(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (base := _base(name, path, node)):
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else _named(base, modules))
    return {m for m in found if m is not None} - {name}


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Each module of xmodlm (under ``src``) and the modules of xmodlm it imports."""
    modules = _module_files(src)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The graph's strongly connected components of more than one module: each is
    a set of modules that all reach each other, so holds at least one cycle
    (Tarjan's algorithm, iterative so that a deep chain cannot hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(component)
    return out


def one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a path that ends
    where it starts (breadth first, inside the component only)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_imports_have_no_cycles() -> None:
    graph = import_graph()
    components = strongly_connected(graph)
    new = [c for c in components if frozenset(c) not in KNOWN_CYCLES]
    lines = [" -> ".join(one_cycle(graph, c)) + f"  ({len(c)} modules in the tangle)"
             for c in new]
    assert not lines, "import cycles:\n" + "\n".join(lines)
    gone = set(KNOWN_CYCLES) - {frozenset(c) for c in components}
    assert not gone, f"no longer cycles, remove from KNOWN_CYCLES: {[sorted(c) for c in gone]}"


def test_modules_stay_readable() -> None:
    sizes = {str(path.relative_to(SRC)): len(path.read_text(encoding="utf-8").splitlines())
             for path in _module_files().values()}
    long = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert set(long) <= KNOWN_LONG, (
        f"modules over {MAX_LINES} lines (split them by idea): "
        + ", ".join(f"{p} ({n})" for p, n in sorted(long.items()) if p not in KNOWN_LONG)
    )
    assert set(long) == KNOWN_LONG, (
        f"no longer over {MAX_LINES} lines, remove from KNOWN_LONG: {sorted(KNOWN_LONG - set(long))}"
    )


def test_ground_floor_imports_only_ground() -> None:
    graph = import_graph()
    missing = [m for m in GROUND if m not in graph]
    assert not missing, f"GROUND names modules that do not exist: {missing}"
    upward = [f"{m} imports {other}" for m in GROUND for other in sorted(graph[m])
              if other not in GROUND]
    assert not upward, "ground modules import above the ground floor:\n" + "\n".join(upward)


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The collector itself: a lazy import, a TYPE_CHECKING import, a relative import,
    a submodule imported by name from its package, and a package's ``__init__``."""
    root = tmp_path / "xmodlm"
    (root / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from xmodlm.b import g\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import c\n",
        "sub/__init__.py": "from xmodlm.sub.c import h\n",
        "sub/c.py": "from .. import a\nfrom xmodlm.sub import X\nimport xmodlm.errors\n",
        "errors.py": "",
    }
    for rel, text in files.items():
        (root / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert graph == {
        "xmodlm": set(),
        "xmodlm.a": {"xmodlm.b"},
        "xmodlm.b": {"xmodlm.sub.c"},
        "xmodlm.sub": {"xmodlm.sub.c"},
        "xmodlm.sub.c": {"xmodlm.a", "xmodlm.sub", "xmodlm.errors"},
        "xmodlm.errors": set(),
    }
    components = strongly_connected(graph)
    assert [sorted(c) for c in components] == [
        ["xmodlm.a", "xmodlm.b", "xmodlm.sub", "xmodlm.sub.c"]
    ]
    assert one_cycle(graph, components[0]) == ["xmodlm.a", "xmodlm.b", "xmodlm.sub.c", "xmodlm.a"]
