"""jaxscale's modules import each other without cycles.

The graph is read from the source with `ast`, so imports inside functions count: a cycle hidden in
a function body still breaks when the import order changes, and it ties modules that should stand
apart. An import of `a.b.c` is an edge to `a.b.c` only, not to the packages `a` and `a.b` that
Python initialises on the way.
"""

import ast
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE = "jaxscale"
# Known cycles, each as the exact set of modules in it (none today); a cycle that grows or changes fails.
ALLOWED_CYCLES: list[set[str]] = []


def module_files(root: Path = ROOT / PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} for every module of the package; a package is its __init__.py."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from X import ...` names; relative imports resolved against `module`."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    anchor = package[:len(package) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _known(name: str, modules) -> str | None:
    """`name` or its longest prefix that is one of `modules` (an import of a class names its module)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def imports_of(module: str, source: str, modules, is_package: bool = False) -> set[str]:
    """The members of `modules` that `module` imports anywhere in `source` (itself excluded).

    `from a.b import c` is an import of module a.b.c when that is a module, else of a.b.
    """
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(_known(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else _known(base, modules))
    return found - {None, module}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the package's modules it imports}."""
    return {name: imports_of(name, path.read_text(), modules, path.name == "__init__.py")
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[tuple[set[str], list[str]]]:
    """(modules, one cycle through them as [a, b, ..., a]) for each group of modules that import
    each other, directly or not (a strongly connected component with a cycle)."""
    return [(group, _cycle_within(graph, group)) for group in _strongly_connected(graph)
            if len(group) > 1 or next(iter(group)) in graph[next(iter(group))]]


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on deep import chains)."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while node not in group:
                        group.add(stack.pop())
                    on_stack -= group
                    groups.append(group)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def _cycle_within(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child == start:
                    return paths[node] + [start]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def _describe(group: set[str], cycle: list[str]) -> str:
    """'a -> b -> a', and the whole group where more modules than the cycle's are tied in."""
    more = set(group) - set(cycle)
    return " -> ".join(cycle) + (f" (tied in with {', '.join(sorted(more))})" if more else "")


def test_the_package_imports_no_cycle():
    modules = module_files()
    assert len(modules) > 40 and "jaxscale.tracking.tracker" in modules  # the walk found the package
    found = [_describe(group, cycle) for group, cycle in cycles(import_graph(modules)) if group not in ALLOWED_CYCLES]
    assert not found, "import cycles:\n" + "\n".join(found)


MODULES = {"p", "p.a", "p.b", "p.sub", "p.sub.c"}


@pytest.mark.parametrize("module, is_package, source, expected", [
    ("p.a", False, "from p import b", {"p.b"}),                      # a module named in `from ... import`
    ("p.a", False, "from p.sub import thing", {"p.sub"}),            # a name in a package: the package
    ("p.a", False, "import p.sub.c", {"p.sub.c"}),                   # no edge to the parents p, p.sub
    ("p.a", False, "def f():\n    from . import b", {"p.b"}),        # relative, inside a function
    ("p.sub.c", False, "from ..a import x", {"p.a"}),
    ("p.sub", True, "from . import c", {"p.sub.c"}),                 # a package's `.` is itself
    ("p.a", False, "import os\nfrom p.a import y", set()),           # outside the package; itself
])
def test_imports_are_resolved(module, is_package, source, expected):
    assert imports_of(module, source, MODULES, is_package) == expected


def test_a_cycle_is_named_in_order():
    graph = {"p.a": {"p.b"}, "p.b": {"p.sub.c"}, "p.sub.c": {"p.a"}, "p.sub": {"p.a"}, "p": set()}
    assert cycles(graph) == [({"p.a", "p.b", "p.sub.c"}, ["p.a", "p.b", "p.sub.c", "p.a"])]
    assert cycles({"p.a": {"p.b"}, "p.b": set()}) == []


def test_a_source_checkout_runs_without_being_installed():
    """A clone whose dependencies are installed but jaxscale is not: no package metadata for
    jaxscale. The session (what `python -m jaxscale.train` opens) takes the version from the
    source tree, which is also where the installed package's version comes from."""
    import importlib.metadata
    import subprocess
    import sys

    import jaxscale

    code = ("import importlib.metadata as m\nreal = m.version\n"
            "def version(name):\n    if name == 'jaxscale':\n        raise m.PackageNotFoundError(name)\n"
            "    return real(name)\nm.version = version\n"
            "from jaxscale.runtime import session\nprint(session.VERSIONS['jaxscale'])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == jaxscale.__version__ == importlib.metadata.version("jaxscale")
