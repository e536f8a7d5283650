"""The package's shape: no import cycles, a sans-IO core, public names at home.

Every ``import`` statement counts -- at module level, inside a function, or
under ``if TYPE_CHECKING:`` -- because an import that only the type checker
sees still names a dependency the code relies on (a TYPE_CHECKING import of
``Consumer`` from a module that reaches ``consumer.scheduler`` at run time is
a hidden cycle).  The graph is read from the source with :mod:`ast`, so it
does not depend on what happens to be imported already.
"""

from __future__ import annotations

import ast
from pathlib import Path

import trio_redis_finalize

PACKAGE = "trio_redis_finalize"
ROOT = Path(trio_redis_finalize.__file__).resolve().parent

CORE = f"{PACKAGE}._core"
FORBIDDEN_IN_CORE = ("anyio", "trio", "sniffio", "socket", "ssl", "hiredis", f"{PACKAGE}._transport",
                     "redis.asyncio", "redis.client", "redis.connection")
"""What the sans-IO core may not reach, directly or through the modules it imports."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module ``name`` imports: the package's own ones (resolved to the
    deepest module that exists) and outside top-level modules, as written."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - node.level + 1]
                mod = ".".join([*prefix, *(node.module.split(".") if node.module else [])])
            else:
                mod = node.module or ""
            for alias in node.names:
                if f"{mod}.{alias.name}" in known:  # ``from . import _scripts``: a module
                    out.add(f"{mod}.{alias.name}")
                else:  # a name defined in ``mod``
                    out.add(mod)
    return {m for m in out if m and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _inner(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the package's modules only (a package's ``__init__``
    is a module like the others)."""
    return {m: {d for d in deps if d in graph} for m, deps in graph.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module that
    imports itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_the_package() -> None:
    graph = _graph()
    # the walk finds what it should: the consumer imports the mount, the
    # transport's package imports its connection module
    assert f"{PACKAGE}._mount" in graph[f"{PACKAGE}._consumer"]
    assert f"{PACKAGE}._transport._connection" in graph[f"{PACKAGE}._transport"]
    assert CORE in graph and any(m.startswith(f"{CORE}.") for m in graph)


def test_a_cycle_is_found() -> None:
    """The checker itself: a planted cycle (through a function-local import) is reported."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    cycles = _cycles(_inner(_graph()))
    assert not cycles, "import cycles (every import counts, TYPE_CHECKING too):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def _reach(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` reaches, each with the module that imports it."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        m = todo.pop()
        for d in graph.get(m, ()):
            if d not in seen:
                seen[d] = m
                if d in graph:
                    todo.append(d)
    return seen


def test_core_is_sans_io() -> None:
    graph = _graph()
    core = [m for m in graph if m == CORE or m.startswith(f"{CORE}.")]
    assert len(core) >= 3
    bad = []
    for m in core:
        for dep, via in _reach(graph, m).items():
            if any(dep == f or dep.startswith(f"{f}.") for f in FORBIDDEN_IN_CORE):
                bad.append(f"{m} reaches {dep} (imported by {via})")
    assert not bad, "\n".join(sorted(set(bad)))


def test_public_names_show_the_package_as_their_module() -> None:
    wrong = []
    for name in trio_redis_finalize.__all__:
        obj = getattr(trio_redis_finalize, name)
        mod = getattr(obj, "__module__", None)
        if (isinstance(obj, type) or callable(obj)) and mod != PACKAGE:
            wrong.append(f"{name}: {mod}")
    assert not wrong, wrong
