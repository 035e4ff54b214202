"""The layout rules, checked on the source: imports go gui -> engine -> kernels (nothing
under engine/ or kernels/ imports gui or Qt), and the project's packages have no import
cycle.

Imports are read with ``ast`` from every file, so an import inside a function (a lazy
import), under ``if TYPE_CHECKING:`` or in a ``try`` counts like one at the top, and so
does ``importlib.import_module("name")`` with a literal name.  An import of a
submodule is an edge to that submodule; ``from package import name`` is an edge to the
package (its ``__init__``) unless ``name`` is itself a submodule.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("folio", "gui", "engine", "kernels")
QT_FREE = ("engine", "kernels")  # below the GUI: testable and usable without a display
GUI_NAMES = ("gui", "PySide6", "shiboken6", "pyqtgraph", "PyQt5", "PyQt6")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. "engine.cache.kv_cache"
    target: str  # the absolute name imported: a module, or a name inside one
    path: Path
    line: int

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root).as_posix()}:{self.line}"


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the given top-level folders."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _literal_import_call(node: ast.Call) -> str | None:
    """The name in ``importlib.import_module("x")`` / ``__import__("x")``, if literal."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and not arg.value.startswith("."):
        return arg.value
    return None


def _statements(tree: ast.Module) -> Iterator[ast.AST]:
    """Every statement, at any depth (functions, classes, if, try, with, loops, match).
    Import statements live only there; skipping expressions keeps the walk fast."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        yield node
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            stack.extend(getattr(node, name, ()))


def read_imports(module: str, path: Path) -> Iterator[Import]:
    """Every import in one file, wherever it sits, with relative names made absolute."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(path))
    # The package a relative import starts from: the module's own for an __init__.
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    literal_calls = "import_module" in text or "__import__" in text
    for node in ast.walk(tree) if literal_calls else _statements(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, path, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 >= len(package):
                    continue  # beyond the top-level package: Python refuses it too
                base_parts = package[: len(package) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                target = base if alias.name == "*" else f"{base}.{alias.name}"
                yield Import(module, target, path, node.lineno)
        elif isinstance(node, ast.Call) and (name := _literal_import_call(node)):
            yield Import(module, name, path, node.lineno)


def owning_module(target: str, modules: dict[str, Path]) -> str | None:
    """The project module that ``target`` names or lives in, or None outside the project."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


@dataclass(frozen=True)
class ImportGraph:
    root: Path
    modules: dict[str, Path]
    imports: tuple[Import, ...]

    def edges(self) -> dict[str, dict[str, Import]]:
        """module -> {imported project module: the first import of it}."""
        out: dict[str, dict[str, Import]] = {m: {} for m in self.modules}
        for imp in self.imports:
            target = owning_module(imp.target, self.modules)
            if target is not None and target != imp.module:
                out[imp.module].setdefault(target, imp)
        return out


def build_graph(root: Path, packages: Iterable[str]) -> ImportGraph:
    modules = find_modules(root, packages)
    imports = tuple(imp for name, path in modules.items() for imp in read_imports(name, path))
    return ImportGraph(root, modules, imports)


@cache
def project_graph() -> ImportGraph:
    return build_graph(ROOT, PACKAGES)


def strongly_connected(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def shortest_cycle(graph: dict[str, Iterable[str]], start: str, within: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside ``within`` (a component)."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, ())):
            if w not in within:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise ValueError(f"{start} is on no cycle inside the component")


def describe_cycles(graph: ImportGraph) -> list[str]:
    """One paragraph per import cycle: its modules, then one shortest loop through them."""
    edges = graph.edges()
    out = []
    for component in strongly_connected(edges):
        loop = shortest_cycle(edges, component[0], set(component))
        steps = [f"{a} ({edges[a][b].where(graph.root)})" for a, b in zip(loop, loop[1:])]
        out.append(f"{len(component)} modules: {', '.join(component)}\n"
                   f"    e.g. {' -> '.join([*steps, loop[-1]])}")
    return out


def gui_imports_below_gui(graph: ImportGraph, lower: Iterable[str] = QT_FREE) -> list[str]:
    lower = tuple(lower)
    return [f"{imp.where(graph.root)}: {imp.module} imports {imp.target}"
            for imp in graph.imports
            if imp.module.split(".")[0] in lower and imp.target.split(".")[0] in GUI_NAMES]


# --- the rules, on this tree ---

def test_engine_and_kernels_do_not_import_gui_or_qt():
    bad = gui_imports_below_gui(project_graph())
    assert not bad, ("engine/ and kernels/ must not import the GUI or Qt "
                     "(gui -> engine -> kernels):\n  " + "\n  ".join(bad))


def test_no_import_cycles():
    cycles = describe_cycles(project_graph())
    assert not cycles, ("import cycles among the project's modules (lazy imports included):\n  "
                        + "\n  ".join(cycles))


def test_the_checks_see_the_whole_project():
    graph = project_graph()
    assert {m.split(".")[0] for m in graph.modules} == set(PACKAGES)
    assert {"engine", "kernels", "gui"} <= graph.modules.keys()
    assert len(graph.imports) > 100


# --- the checker itself, on small packages made for the purpose ---

def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_read_imports_resolves_relative_lazy_and_literal_imports(tmp_path):
    root = _write(tmp_path, {
        "alpha/__init__.py": "from .one import thing\nfrom . import two\n",
        "alpha/one.py": "thing = 1\n",
        "alpha/two.py": "",
        "alpha/sub/__init__.py": "",
        "alpha/sub/deep.py": (
            "import importlib\n"
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from ..one import thing\n"
            "def f():\n    from ...beyond import x\n    from .. import two\n"
            "class C:\n    def g(self):\n        import alpha.one\n"
            "try:\n    from os import path\nexcept ImportError:\n    pass\n"
            "importlib.import_module('alpha.two')\n"
        ),
    })
    graph = build_graph(root, ["alpha"])
    assert set(graph.modules) == {"alpha", "alpha.one", "alpha.two", "alpha.sub", "alpha.sub.deep"}
    seen = {(i.module, i.target) for i in graph.imports}
    assert {("alpha", "alpha.one.thing"), ("alpha", "alpha.two")} <= seen
    deep = {i.target for i in graph.imports if i.module == "alpha.sub.deep"}
    assert deep == {"importlib", "typing.TYPE_CHECKING", "alpha.one.thing", "alpha.two",
                    "alpha.one", "os.path"}  # `...beyond` climbs past alpha: dropped
    assert graph.edges()["alpha.sub.deep"].keys() == {"alpha.one", "alpha.two"}
    assert graph.edges()["alpha"].keys() == {"alpha.one", "alpha.two"}


def test_a_cycle_through_lazy_and_relative_imports_is_found(tmp_path):
    root = _write(tmp_path, {
        "alpha/__init__.py": "",
        "alpha/a.py": "from alpha.b import f\n",
        "alpha/b.py": "def f():\n    from .c import g  # lazy\n    return g\n",
        "alpha/c.py": "import alpha.a\ndef g():\n    pass\n",
        "alpha/d.py": "from alpha import a, b\n",
        "beta/__init__.py": "from beta.x import y\n",
        "beta/x.py": "from beta import z\ny = 1\n",
    })
    graph = build_graph(root, ["alpha", "beta"])
    assert strongly_connected(graph.edges()) == [["alpha.a", "alpha.b", "alpha.c"], ["beta", "beta.x"]]
    first, second = describe_cycles(graph)
    assert first.startswith("3 modules: alpha.a, alpha.b, alpha.c\n")
    assert ("alpha.a (alpha/a.py:1) -> alpha.b (alpha/b.py:2) -> alpha.c (alpha/c.py:1) -> alpha.a"
            in first)
    assert second.startswith("2 modules: beta, beta.x\n")


def test_an_acyclic_package_has_no_cycle(tmp_path):
    root = _write(tmp_path, {
        "alpha/__init__.py": "from alpha.a import f\n",
        "alpha/a.py": "from alpha.b import g\ndef f():\n    from . import c\n",
        "alpha/b.py": "import os\ndef g():\n    import alpha.c\n",
        "alpha/c.py": "from alpha import d\n",
        "alpha/d.py": "",
    })
    graph = build_graph(root, ["alpha"])
    assert graph.edges()["alpha.c"].keys() == {"alpha.d"}
    assert strongly_connected(graph.edges()) == []
    assert describe_cycles(graph) == []


def test_strongly_connected_components_of_a_plain_graph():
    graph = {"a": ["b"], "b": ["c", "d"], "c": ["a"], "d": ["e"], "e": ["d", "f"], "f": [],
             "g": ["g"]}  # a self-loop alone is no cycle between modules
    assert strongly_connected(graph) == [["a", "b", "c"], ["d", "e"]]
    assert shortest_cycle(graph, "a", {"a", "b", "c"}) == ["a", "b", "c", "a"]
    assert strongly_connected({f"m{i}": [f"m{i + 1}"] for i in range(500)}) == []


def test_the_qt_check_sees_lazy_and_relative_gui_imports(tmp_path):
    root = _write(tmp_path, {
        "gui/__init__.py": "",
        "gui/app.py": "from PySide6 import QtWidgets\nfrom engine import core\n",
        "engine/__init__.py": "",
        "engine/core.py": "import numpy\n",
        "engine/cli.py": "def main():\n    from gui.app import run  # lazy\n    run()\n",
        "kernels/__init__.py": "",
        "kernels/plot.py": "def show():\n    import pyqtgraph as pg\n",
        "kernels/fine.py": "from engine import core\n",
    })
    bad = gui_imports_below_gui(build_graph(root, ["gui", "engine", "kernels"]))
    assert bad == ["engine/cli.py:2: engine.cli imports gui.app.run",
                   "kernels/plot.py:2: kernels.plot imports pyqtgraph"]
