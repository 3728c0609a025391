"""No import circle in parts/: the module import graph, read with ``ast``, has no cycle.

Every ``import`` counts: module level, inside functions (a lazy import that exists only to
break a circle is still the circle) and under ``TYPE_CHECKING``. ``from pkg import name``
points at the module that defines ``name`` when ``pkg/__init__.py`` re-exports it, so a
package's ``__init__`` does not make every sibling look circular. Run as a script
(``python tests/test_import_cycles.py``) it prints each circle with the import lines.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ROOT / "parts"
Import = tuple[str, str | None, int]  # (module, imported name or None, line)


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module under parts/."""
    found = {}
    for path in PARTS.rglob("*.py"):
        names = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(names[:-1] if names[-1] == "__init__" else names)] = path
    return found


MODULES = module_files()


def _package(module: str, level: int) -> str:
    """The package a relative import of ``level`` dots in ``module`` starts from."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return package


@functools.cache
def imports(module: str) -> list[Import]:
    """Every import statement of ``module``, anywhere in its body, relative ones resolved."""
    found: list[Import] = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                package = _package(module, node.level)
                source = f"{package}.{source}" if source else package
            found += [(source, alias.name, node.lineno) for alias in node.names]
    return found


def resolve(source: str, name: str | None, seen: frozenset[str] = frozenset()) -> str | None:
    """The parts module an import of ``name`` from ``source`` really loads (None if external)."""
    if source not in MODULES:
        return None
    if name and f"{source}.{name}" in MODULES:
        return f"{source}.{name}"
    if name and MODULES[source].name == "__init__.py" and source not in seen:
        for inner, inner_name, _ in imports(source):
            if inner_name == name:
                return resolve(inner, inner_name, seen | {source}) or source
    return source


def graph() -> dict[str, dict[str, int]]:
    """module -> {imported parts module: first line importing it}."""
    edges: dict[str, dict[str, int]] = {}
    for module in MODULES:
        edges[module] = {}
        for source, name, line in imports(module):
            target = resolve(source, name)
            if target is not None and target != module:
                edges[module].setdefault(target, line)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(edges[child])))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while not component or component[-1] != node:
                    component.append(stack.pop())
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe(component: list[str], edges: dict[str, dict[str, int]]) -> str:
    """One circle as its import lines: ``a (line n) -> b``."""
    return "; ".join(f"{a} (line {line}) -> {b}" for a in component
                     for b, line in edges[a].items() if b in component)


def test_parts_has_no_import_circle() -> None:
    """No module of parts/ reaches itself through imports."""
    edges = graph()
    found = cycles(edges)
    assert not found, "\n".join(describe(c, edges) for c in found)


def test_the_cycle_finder_finds_a_circle() -> None:
    """The finder reports a two-module and a three-module circle, and nothing in a chain."""
    edges = {"a": {"b": 1}, "b": {"a": 2}, "c": {"d": 3}, "d": {"e": 4}, "e": {"c": 5},
             "f": {"a": 6}, "g": {}}
    assert sorted(cycles(edges)) == [["a", "b"], ["c", "d", "e"]]
    assert describe(["a", "b"], edges) == "a (line 1) -> b; b (line 2) -> a"


def test_lazy_and_type_checking_imports_count() -> None:
    """An import inside a function or under TYPE_CHECKING is an edge of the graph."""
    lazy = [(m, line) for m in MODULES for s, n, line in imports(m)
            if m == "parts.optim.bf16_optimizer" and resolve(s, n) == "parts.optim.dcp_state"]
    assert lazy, "bf16_optimizer imports dcp_state on first use: that import must be seen"


def test_parts_imports_no_recipe_or_benchmark() -> None:
    """recipes/ and benchmarks/ sit on top: no module of parts/ imports one of their files."""
    above = {p.stem for d in ("recipes", "benchmarks") for p in (ROOT / d).glob("*.py")}
    above |= {"recipes", "benchmarks"}
    bad = [(m, line, s) for m in MODULES for s, _, line in imports(m) if s.split(".")[0] in above]
    assert not bad, bad


def test_base_uses_no_part() -> None:
    """parts.base imports nothing of parts but itself and the torch shims (not even parts.comm)."""
    bad = [(m, line, s) for m in MODULES if m.startswith("parts.base")
           for s, _, line in imports(m)
           if s.startswith("parts.") and not s.startswith(("parts.base", "parts._compat"))]
    assert not bad, bad


PUBLIC_MODULES = {"parts.io", "parts.integrations.transformers", "parts.integrations.accelerate",
                  "parts.integrations.accelerate_snapshots"}


def test_only_public_surfaces_carry___all__() -> None:
    """``__all__`` names a public surface: a package's ``__init__`` or a module users import by
    name (``parts.io``, the integrations); a private module has none."""
    bad = [m for m, path in MODULES.items() if path.name != "__init__.py" and m not in PUBLIC_MODULES
           and any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
                   for node in ast.parse(path.read_text()).body)]
    assert not bad, bad


def test_nothing_in_parts_imports_integrations() -> None:
    """Integrations sit above the parts: only parts.integrations itself imports it (an
    import-linter contract cannot name the package before it exists, so it is checked here)."""
    bad = [(m, line) for m in MODULES if not m.startswith("parts.integrations")
           for s, n, line in imports(m)
           if s.startswith("parts.integrations") or (s == "parts" and n == "integrations")]
    assert not bad, bad


if __name__ == "__main__":
    found = cycles(graph())
    for component in found:
        print(describe(component, graph()))
    sys.exit(1 if found else 0)
