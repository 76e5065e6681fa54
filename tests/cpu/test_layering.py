"""kopt's modules import one way: graph utilities (``kopt/graph/``), then patterns and passes,
then cost and profile, then the API (``kopt.api``, ``kopt.ablate``, ``kopt.backend``,
``kopt.cli``, ``kopt.integrations``). A definition two layers need lives in the lower one
(``kopt.graph.regions.CachedRegion``, ``kopt.graph.is_view``, ``kopt.graph.op_category``):
an import deferred into a function to dodge a circle is still a circle, and is caught here.

Imports are read from the source with ``ast``, in functions too; those under
``if TYPE_CHECKING:`` are left out (they never run)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]

API = ("kopt.api", "kopt.ablate", "kopt.backend", "kopt.cli", "kopt.integrations")
# what graph utilities, patterns and passes may not import when they are imported
ABOVE_PASSES = ("kopt.cost", "kopt.profile", "kopt.cudagraphs", *API)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the kopt module it imports (a package's __init__ where a name is not a module)
    line: int
    module_level: bool  # runs when the module is imported (False: inside a function)

    def __str__(self) -> str:
        where = "" if self.module_level else " (in a function)"
        return f"{self.source}:{self.line} imports {self.target}{where}"


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _in(module: str, packages: tuple[str, ...] | str) -> bool:
    packages = (packages,) if isinstance(packages, str) else packages
    return any(module == p or module.startswith(p + ".") for p in packages)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collect(ast.NodeVisitor):
    def __init__(self, name: str, package: str, modules: set[str]) -> None:
        self.name, self.package, self.modules = name, package, modules
        self.found: list[Import] = []
        self.depth = 0  # functions entered

    def _resolve(self, dotted: str) -> str | None:
        while dotted and dotted not in self.modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def _add(self, dotted: str, line: int) -> None:
        target = self._resolve(dotted)
        if target is not None and target != self.name:
            self.found.append(Import(self.name, target, line, self.depth == 0))

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _type_checking(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: from the importing module's package up
            package = self.package
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        for alias in node.names:  # a submodule by name, or a name from the module
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in self.modules else base, node.lineno)


def kopt_imports(root: Path, package: str = "kopt") -> list[Import]:
    """Every import of one of ``package``'s modules by another, under ``root``."""
    files = {_module_name(root, p): p for p in (root / package).rglob("*.py")}
    modules = set(files)
    found = []
    for name, path in sorted(files.items()):
        own = name if path.name == "__init__.py" else name.rpartition(".")[0]
        collect = _Collect(name, own, modules)
        collect.visit(ast.parse(path.read_text(), str(path)))
        found += collect.found
    return found


def layering_errors(imports: list[Import]) -> list[str]:
    """What breaks the one-way order, one line each."""
    errors = [f"graph utilities import above them: {i}" for i in imports
              if _in(i.source, "kopt.graph") and not _in(i.target, ("kopt.graph", "kopt.errors"))]
    errors += [f"patterns/passes import cost, profile or the API: {i}" for i in imports
               if _in(i.source, ("kopt.graph", "kopt.patterns", "kopt.passes")) and i.module_level
               and _in(i.target, ABOVE_PASSES)]
    errors += [f"cost/profile import the API: {i}" for i in imports
               if _in(i.source, ("kopt.cost", "kopt.profile")) and (i.target == "kopt"
                                                                    or _in(i.target, API))]
    graph = nx.DiGraph((i.source, i.target) for i in imports)
    cycles = [c[c.index(min(c)):] + c[:c.index(min(c))] for c in nx.simple_cycles(graph)]
    errors += ["import circle: " + " -> ".join([*c, c[0]]) for c in sorted(cycles)]
    return errors


def test_kopt_imports_run_one_way() -> None:
    imports = kopt_imports(ROOT)
    # the parse saw the package: every layer imports the graph utilities
    assert {i.source.split(".")[1] for i in imports if _in(i.target, "kopt.graph")} >= {
        "patterns", "passes", "cost", "profile", "api"}
    assert len(imports) > 200
    errors = layering_errors(imports)
    assert not errors, "\n".join(errors)


def test_layering_catches_a_deferred_circle_and_an_upward_import(tmp_path: Path) -> None:
    files = {
        "kopt/__init__.py": "",
        "kopt/graph/__init__.py": "from kopt.graph.regions import Region\n",
        # deferred into a function to dodge the circle: still one
        "kopt/graph/regions.py": "class Region:\n    def f(self):\n"
                                 "        from kopt.passes.hoist import plan\n",
        "kopt/passes/__init__.py": "",
        "kopt/passes/hoist.py": "from typing import TYPE_CHECKING\n"
                                "from kopt.graph import Region\n"
                                "from . import base\n"
                                "if TYPE_CHECKING:\n    from kopt.api import optimize\n"
                                "from kopt.cost import model\n",
        "kopt/passes/base.py": "",
        "kopt/cost/__init__.py": "from kopt import api\n",
        "kopt/api.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    imports = kopt_imports(tmp_path)
    assert [str(i) for i in imports if i.source == "kopt.passes.hoist"] == [
        "kopt.passes.hoist:2 imports kopt.graph", "kopt.passes.hoist:3 imports kopt.passes.base",
        "kopt.passes.hoist:6 imports kopt.cost"]  # not the TYPE_CHECKING one
    assert layering_errors(imports) == [
        "graph utilities import above them: kopt.graph.regions:3 imports kopt.passes.hoist "
        "(in a function)",
        "patterns/passes import cost, profile or the API: kopt.passes.hoist:6 imports kopt.cost",
        "cost/profile import the API: kopt.cost:1 imports kopt.api",
        "import circle: kopt.graph -> kopt.graph.regions -> kopt.passes.hoist -> kopt.graph",
    ]
