"""Each Lua script's layout is written once, as data, and its header says the same.

Every ``Script(...)`` of the package declares ``keys=`` and ``argv=`` (the
names of its KEYS and ARGV, see :class:`~trio_redis_finalize._core._commands.Script`),
and the comment above its definition opens with the same names, BullMQ's
``Input:`` block in our words::

    # KEYS: processing (the processing list), dest (the destination list),
    #   why? (the reason hash)
    # ARGV: element, copy, record?why (sent with the reason hash), n? (see _list_gate)
    # With the reason hash ... (prose)

A ``KEYS:`` or ``ARGV:`` clause is one comment line, continued by lines
indented two more spaces; its names are separated by commas, each may be
followed by a note in parentheses (dropped before comparing).  Sans-IO: the
modules are imported and read, nothing is sent.

Checked here: the header's names are the layout's; every ``KEYS[i]`` /
``ARGV[i]`` the Lua reads has a place in the layout; every required field
before the first ``...`` is read by the Lua; and no ``Script(...)`` call of the
package leaves its layout out.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest

import trio_redis_finalize
from trio_redis_finalize._core._commands import Script, split_field
from trio_redis_finalize._core.reliable_list import scripts as list_scripts
from trio_redis_finalize._core.stream import scripts as stream_scripts

PACKAGE = Path(trio_redis_finalize.__file__).parent


def _modules() -> list[ModuleType]:
    """The package's modules that make scripts (``Script(`` in their source)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "Script(" in path.read_text() and path.name != "_commands.py":
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out.append(importlib.import_module(name))
    return out


MODULES = _modules()


def _split(text: str) -> list[str]:
    """``text`` split at its commas outside parentheses and brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return out


def _strip_notes(field: str) -> str:
    """A header's field without its notes in parentheses (``[...]`` kept)."""
    out, depth = "", 0
    for ch in field:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif depth == 0:
            out += ch
    return " ".join(out.split())


def parse_header(comment: list[str]) -> dict[str, tuple[str, ...]]:
    """The names of a header's ``KEYS:`` and ``ARGV:`` clauses (see above)."""
    clauses: dict[str, str] = {}
    current = None
    for line in comment:
        text = line.lstrip()[1:]  # past the '#'
        m = re.match(r" (KEYS|ARGV): ?(.*)$", text)
        if m:
            current = m.group(1)
            clauses[current] = m.group(2)
        elif current and text.startswith("   "):
            clauses[current] += " " + text.strip()
        else:
            current = None
    return {
        side: tuple(f for f in (_strip_notes(x).strip() for x in _split(body)) if f)
        for side, body in clauses.items()
    }


def _definitions() -> list[tuple[str, str, Script, list[str]]]:
    """``(module, name, script, comment above)`` of each module-level
    ``NAME = <call>`` that defines a script (each script once)."""
    out = []
    seen: set[int] = set()
    for module in MODULES:
        path = getattr(module, "__file__", None)
        if not path:
            continue
        lines = Path(path).read_text().splitlines()
        for node in ast.parse("\n".join(lines)).body:
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            for target in node.targets:
                value = getattr(module, target.id, None) if isinstance(target, ast.Name) else None
                if isinstance(value, Script) and id(value) not in seen:
                    seen.add(id(value))
                    i = node.lineno - 2
                    comment: list[str] = []
                    while i >= 0 and lines[i].lstrip().startswith("#"):
                        comment.insert(0, lines[i])
                        i -= 1
                    out.append((module.__name__, target.id, value, comment))
    return out


DEFINITIONS = _definitions()


def layout_problems(script: Script, comment: list[str]) -> list[str]:
    """What is wrong between ``script``'s layout, its header ``comment`` and its Lua."""
    problems = []
    if script.keys is None or script.argv is None:
        return [f"{script.name}: no keys=/argv= layout"]
    header = parse_header(comment)
    for side, declared in (("KEYS", script.keys), ("ARGV", script.argv)):
        written = header.get(side)
        if written is None:
            problems.append(f"{script.name}: no '# {side}:' line in its header")
        elif written != tuple(" ".join(d.split()) for d in declared):
            problems.append(f"{script.name}: header {side} {written} != layout {declared}")
    source = script.source.decode()
    for side, declared, pattern in (
        ("KEYS", script.keys, r"\bKEYS\[(\d+)\]"),
        ("ARGV", script.argv, r"\b(?:ARGV|argv)\[(\d+)\]"),
    ):
        marks = [split_field(f)[1] for f in declared]
        fixed = next((j for j, m in enumerate(marks) if m.endswith("...")), len(declared))
        read = {int(i) for i in re.findall(pattern, source)}
        for i in sorted(read):
            if i > fixed and fixed == len(declared):
                problems.append(f"{script.name}: the Lua reads {side}[{i}], the layout "
                                f"has {len(declared)}: {declared}")
        for j in range(fixed):
            if marks[j] == "" and j + 1 not in read:
                problems.append(f"{script.name}: {side}[{j + 1}] ({declared[j]}) is "
                                f"declared and never read by the Lua")
    return problems


def test_every_script_has_a_layout_and_a_header() -> None:
    assert len(DEFINITIONS) >= 30
    problems = [p for _, _, script, comment in DEFINITIONS for p in layout_problems(script, comment)]
    assert not problems, "\n".join(problems)


def test_every_script_call_declares_its_layout() -> None:
    """Scripts made in functions too (``move_due_to_stream(cap)``, the
    three ``_stream_zadd_ack``): every ``Script(...)`` of the package."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "Script"):
                given = {k.arg for k in node.keywords}
                if not {"keys", "argv"} <= given:
                    missing.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not missing, f"Script(...) without keys=/argv=: {missing}"


def test_made_scripts_share_their_layout() -> None:
    capped = stream_scripts.move_due_to_stream(1000)
    assert (capped.keys, capped.argv) == (stream_scripts.MOVE_DUE_TO_STREAM.keys,
                                          stream_scripts.MOVE_DUE_TO_STREAM.argv)
    assert layout_problems(capped, _header_of("MOVE_DUE_TO_STREAM")) == []


def _header_of(name: str) -> list[str]:
    return next(c for _, n, _, c in DEFINITIONS if n == name)


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("dest (the destination list)", "destination", "header KEYS"),
    ("n? (see list_gate)", "n (see list_gate)", "header ARGV"),
    ("record?why (sent with the reason hash), ", "", "header ARGV"),
    ("# ARGV:", "# Input:", "no '# ARGV:' line"),
])
def test_a_wrong_header_is_found(old: str, new: str, expected: str) -> None:
    """The check can fail: a header that drifted from the layout is named."""
    comment = _header_of("LIST_COPY_REMOVE")
    assert layout_problems(list_scripts.LIST_COPY_REMOVE, comment) == []
    planted = [line.replace(old, new) for line in comment]
    assert planted != comment
    problems = layout_problems(list_scripts.LIST_COPY_REMOVE, planted)
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_lua_read_outside_the_layout_is_found() -> None:
    script = Script("return {KEYS[1], ARGV[1], ARGV[3]}", name="planted",
                    keys=("stream",), argv=("group", "id"))
    comment = ["# KEYS: stream", "# ARGV: group, id"]
    problems = layout_problems(script, comment)
    assert any("reads ARGV[3]" in p for p in problems), problems
    assert any("ARGV[2] (id) is declared and never read" in p for p in problems), problems


def test_fields_by_name() -> None:
    """The built calls read and rewritten by name (the places the planner
    and the batcher use), optional and trailing fields included."""

    s = list_scripts.LIST_COPY_REMOVE
    plain = s.command(("p", "q"), (b"e", b"c"))
    dead = s.command(("p", "d", "w"), (b"e", b"c", b"{}"))
    assert s.field(plain, "element") == b"e" and s.field(plain, "n") is None
    assert s.field(plain, "why") is None and s.field(plain, "record") is None
    assert s.replace(plain, "n", 3) == (*plain, 3)
    assert s.field(s.replace(plain, "n", 3), "n") == 3
    assert s.field(dead, "record") == b"{}" and s.at(dead, "n") is None
    assert s.replace(s.replace(dead, "n", 2), "n", 5) == (*dead, 5)
    assert s.key_at("processing") == 3 and s.calls(dead) and not s.calls(("LREM", "p", -1, b"e"))

    w = list_scripts.LIST_WRITES
    cmd = w.command(("p", "p", "p", "k"), (b"e", "remove", 1, 3, "SET", "k", "v", 4))
    assert w.field(cmd, "op") == "remove" and w.field(cmd, "n") == 4
    assert w.rest(cmd, "write_keys") == ("k",)
    assert w.replace(cmd, "n", 1)[-1] == 1

    z = stream_scripts.STREAM_ZADD_ACK_BATCH
    cmd = z.command(("s", "z"), ("g", "0", "1-0", "2-0", 4, "1-0", 5, b"m", "2-0", 6, b"n"))
    assert z.groups(cmd, "id") == [("1-0", 5, b"m"), ("2-0", 6, b"n")]
    with pytest.raises(ValueError, match="fixed width"):
        stream_scripts.STREAM_COPY_ACK_BATCH.groups(cmd, "id")
    with pytest.raises(ValueError, match="no field"):
        z.field(cmd, "element")


def test_optional_keys_and_their_arguments() -> None:
    """Every field of a layout with two optional keys, one argument bound to
    the first and an optional last one, for each number of keys sent."""
    s = Script("return 0", name="optional_keys", keys=("a", "b?", "c?"), argv=("x", "y?b", "z", "w?"))
    for nk in (1, 2, 3):
        for last in ((), ("W",)):
            cmd = s.command(["A", "B", "C"][:nk], ["X", *(["Y"] if nk > 1 else []), "Z", *last])
            got = {n: s.field(cmd, n) for n in ("a", "b", "c", "x", "y", "z", "w")}
            assert got == {"a": "A", "b": "B" if nk > 1 else None, "c": "C" if nk > 2 else None,
                           "x": "X", "y": "Y" if nk > 1 else None, "z": "Z",
                           "w": "W" if last else None}
            assert s.locator("z")(cmd) == s.at(cmd, "z") == cmd.index("Z")
    with pytest.raises(ValueError, match="cannot be added"):
        s.replace(s.command(["A"], ["X", "Z"]), "y", "Y")


@pytest.mark.parametrize(("keys", "argv", "why"), [
    (("a?", "b"), (), "must come last"),
    (("a",), ("x?b",), "no optional key"),
    (("a",), ("x?", "y..."), "must come last"),
    (("a",), ("y...", "x?"), "after a ... cannot be optional"),
    (("a",), ("a",), "named twice"),
    (("a",), ("[x, y]",), "repeated group"),
])
def test_a_layout_that_cannot_be_read_is_refused(keys: tuple[str, ...], argv: tuple[str, ...],
                                                 why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Script(f"return '{keys}{argv}'", name="bad", keys=keys, argv=argv)
