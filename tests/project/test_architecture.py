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


# -- one home per form (issue: "one home and one row per form") -------------------------------------

FORM_HOMES = {
    "stream": (f"{PACKAGE}._forms.stream", f"{CORE}.stream"),
    "reliable_list": (f"{PACKAGE}._forms.reliable_list", f"{CORE}.reliable_list"),
    "simple_list": (f"{PACKAGE}._forms.simple_list",),
    "pubsub": (f"{PACKAGE}._forms.pubsub",),
}
"""Each form's home: its I/O (``_forms/<form>``) and its sans-IO rules and scripts (``_core/<form>``)."""
TABLES = {f"{PACKAGE}._subscription", f"{PACKAGE}._forms", f"{CORE}._plan"}
"""Where ``Form`` and ``Mode`` are defined, and the two registration tables: ``FORMS`` (the
shell's row per form) and ``CELLS`` (the core's half).  These name every form's members."""
FORMS_ENUM = {"Form": {"STREAM", "RELIABLE_LIST", "LIST", "CHANNEL", "PATTERN"},
              "Mode": {"PLAIN", "RECLAIM", "CLAIMING"}}


def _home(module: str) -> str | None:
    for form, prefixes in FORM_HOMES.items():
        if any(module == p or module.startswith(f"{p}.") for p in prefixes):
            return form
    return None


def _is_sha(node: ast.expr) -> bool:
    """A script's sha, as code that recognises a built command by it would name it."""
    if isinstance(node, ast.Attribute) and node.attr == "sha":
        return True
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.upper().endswith(("_SHA", "_SHAS"))


def form_knowledge(source: str) -> list[str]:
    """What in ``source`` knows a form by name: a ``Form``/``Mode`` member, a form's value
    (``form.value``, ``form == "stream"``), or a script's sha compared to recognise a command."""
    found = []
    tree = ast.parse(source)
    # a member passed as an argument builds a subscription as user code does (the demo's
    # ``mode=Mode.CLAIMING``): not a branch on it
    passed = {id(k.value) for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords}
    # so is a field's default value (``mode: Mode = Mode.PLAIN``)
    passed |= {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and n.value is not None}
    for node in ast.walk(tree):
        if id(node) in passed:
            continue
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.attr in FORMS_ENUM.get(node.value.id, ())):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
        elif (isinstance(node, ast.Attribute) and node.attr == "value"
              and isinstance(node.value, ast.Attribute) and node.value.attr == "form"):
            found.append(f"{node.lineno}: form.value")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = [s.attr if isinstance(s, ast.Attribute) else s.id if isinstance(s, ast.Name) else ""
                     for s in sides]
            texts = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
            if "form" in named and texts:
                found.append(f"{node.lineno}: form compared with a string")
            elif any(_is_sha(s) for s in sides):
                found.append(f"{node.lineno}: a script sha compared")
    return sorted(set(found), key=lambda f: (int(f.split(":")[0]), f))


def test_form_knowledge_is_found() -> None:
    """The checker itself, on planted code."""
    planted = ("if t.form is Form.STREAM: pass\n"
               "if t.mode is Mode.CLAIMING: pass\n"
               "x = t.form.value\n"
               "y = form == 'pattern'\n"
               "z = cmd[1] == LIST_WRITES.sha or cmd[1] in _COUNTED_SHAS\n"
               "ok = spec.leaves_pending and t.form is not None\n")
    assert [f.split(":")[0] for f in form_knowledge(planted)] == ["1", "2", "3", "4", "5"]
    assert form_knowledge("spec = FORMS[t.form]\nif spec.leaves_pending: pass\n") == []
    assert form_knowledge("sub = StreamSubscription('s', 'g', mode=Mode.CLAIMING)\n") == []


def test_forms_are_known_only_at_home() -> None:
    """No module outside a form's home and the registration tables branches on a form, a
    stream mode or a script's sha: adding a form or a read mode touches its home and one row."""
    bad = []
    for name, path in _modules().items():
        if _home(name) is not None or name in TABLES:
            continue
        if name.startswith(f"{CORE}._commands"):  # where a Script is defined
            continue
        bad += [f"{name}:{f}" for f in form_knowledge(path.read_text())]
    assert not bad, "\n".join(bad)


def test_a_form_never_imports_another() -> None:
    graph = _graph()
    bad = []
    for m, deps in graph.items():
        home = _home(m)
        if home is None:
            continue
        bad += [f"{m} imports {d}" for d in deps if _home(d) not in (None, home)]
    assert not bad, "\n".join(bad)


MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 350


def test_modules_and_classes_stay_small() -> None:
    """A module does one job and a class one concern: no module over 500 lines, no class over 350
    (the finalizer's core, the largest, is split along its rounds)."""
    bad = []
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.count("\n") + (not text.endswith("\n"))
        if lines > MAX_MODULE_LINES:
            bad.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    bad.append(f"{name}.{node.name}: {size} lines")
    assert not bad, "\n".join(bad)
