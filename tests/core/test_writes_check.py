"""``_writes.checked_writes`` against a plain reference (Hypothesis).

``checked_writes`` runs once per outcome a handler returns with writes, so
it is written for speed (one pass over each write's values, the common write
kept as it is).  The reference below says the same rules the obvious way;
both must agree on every input: the same normalised writes, script layout
and keys, or a ``ValueError`` both.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from trio_redis_finalize._writes import (
    MAX_WRITE_BYTES,
    MAX_WRITE_VALUES,
    MAX_WRITES,
    WRITE_COMMANDS,
    checked_writes,
)


def _text(v: object) -> str | bytes:
    if type(v) in (str, bytes):
        return v  # type: ignore[return-value]
    if isinstance(v, (str, bytes)):
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(v)
        return repr(v)
    return str(v)


def left(name: str, want: str, prev: str | None) -> str:
    """The type a write leaves its key with, the outcome's earlier writes
    having left it ``prev`` (None: untouched; '': as Redis has it; '?': a
    string or as Redis has it); ValueError for a type they make impossible."""
    if name in ("DEL", "UNLINK"):
        return "none"
    if want:
        if prev in (None, "", "none", want) or (prev == "?" and want == "string"):
            return want
        raise ValueError("another type")
    if name == "SET":
        return "string"
    if name == "SETNX":
        return {None: "?", "": "?", "none": "string"}.get(prev, prev)
    return "" if prev is None else prev


def reference(writes: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
    """The rules of ``checked_writes``, plainly."""
    if len(writes) > MAX_WRITES:
        raise ValueError("too many")
    out, parts, keys = [], [len(writes)], {}  # type: ignore[var-annotated]
    types: dict[Any, str] = {}
    for w in writes:
        if isinstance(w, (str, bytes)) or not isinstance(w, (tuple, list)) or not w:
            raise ValueError("not a command")
        name = w[0].decode() if isinstance(w[0], bytes) else w[0]
        if not isinstance(name, str) or name.upper() not in WRITE_COMMANDS:
            raise ValueError("not allowed")
        name = name.upper()
        want, least, most, nkeys = WRITE_COMMANDS[name]
        if len(w) < least or (most is not None and len(w) > most):
            raise ValueError("arity")
        values = (name, *map(_text, w[1:]))
        if name == "HSET" and len(values) % 2 == 1:
            raise ValueError("pairs")
        out.append(values)
        parts += [len(values), *values]  # (the key's type: the script looks it up)
        named = values[1:] if nkeys is None else values[1:1 + nkeys]
        keys.update(dict.fromkeys(named))
        for k in named:
            types[k] = left(name, want, types.get(k))
    if sum(map(len, out)) > MAX_WRITE_VALUES:
        raise ValueError("values")
    if sum(len(v) for w in out for v in w) > MAX_WRITE_BYTES:
        raise ValueError("bytes")
    return tuple(out), tuple(parts), tuple(keys)


_VALUE = st.one_of(
    st.text(max_size=4), st.binary(max_size=4), st.integers(-10**20, 10**20),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
)
_NAME = st.one_of(st.sampled_from(sorted(WRITE_COMMANDS)), st.sampled_from(["hset", b"SADD", "GET", b"x"]),
                  st.integers(0, 3))
_WRITE = st.one_of(
    st.builds(lambda n, vs: (n, *vs), _NAME, st.lists(_VALUE, max_size=6)),
    st.builds(lambda n, vs: [n, *vs], _NAME, st.lists(_VALUE, max_size=6)),
    st.sampled_from(["INCR x", b"SADD", (), [], None, 5]),
)


def _either(f: Any, writes: Any) -> Any:
    try:
        return f(writes)
    except ValueError:
        return ValueError


@given(st.lists(_WRITE, max_size=5))
@example([("HINCRBY", "t", "n", 1), ("SADD", "s", "1-0"), ("XADD", "e", "*", "id", "1-0"),
          ("HSET", "h", "id", "1-0"), ("EXPIRE", "s", 3600)])
@example([("SET", "k", b"v", 1.5), ("SET", "k", 1, True)])
@example([("HSET", "h", "f", 1, "g")])
@example([("INCR", "n"), ("HSET", "k", "f", 1), ("SET", "k", "x"), ("HINCRBY", "k", "f", 1)])
@example([("HSET", "k", "f", 1), ("SADD", "k", "m")])
@example([("HSET", "k", "f", 1), ("DEL", "k"), ("SADD", "k", "m")])
@example([("SETNX", "k", "v"), ("APPEND", "k", "w"), ("SETNX", "j", "v"), ("HSET", "j", "f", 1)])
@example([("SADD", "k", *[b"x" * 1024] * 1000)] * 2)
def test_checked_writes_is_the_reference(writes: list[Any]) -> None:
    got, want = _either(checked_writes, writes), _either(reference, writes)
    assert got == want
    if got is not ValueError:  # (each value its exact type: str stays str, bytes bytes)
        assert [[type(v) for v in w] for w in got[0]] == [[type(v) for v in w] for w in want[0]]


def test_a_write_on_a_key_an_earlier_write_makes_another_type_is_refused() -> None:
    """The scripts check each key's type as Redis has it, before anything is
    written: a write whose key the outcome's own earlier write makes another
    type would pass that check and fail when run, after the writes before it
    were applied (again at each redelivery).  Refused when the outcome is made."""
    with pytest.raises(ValueError, match=r"writes\[3\]: HINCRBY 'k' needs a hash, but .* is a string"):
        checked_writes([("INCR", "n"), ("HSET", "k", "f", 1), ("SET", "k", "x"),
                        ("HINCRBY", "k", "f", 1)])
    with pytest.raises(ValueError, match=r"writes\[1\]: SADD 'k' needs a set, but .* is a hash"):
        checked_writes([("HSET", "k", "f", 1), ("SADD", "k", "m")])
    with pytest.raises(ValueError, match=r"may be a string \(SETNX\)"):
        checked_writes([("SETNX", "k", "v"), ("HSET", "k", "f", 1)])
    # what leaves the type as it was, or empties the key first, is not
    for ok in ([("HSET", "k", "f", 1), ("HINCRBY", "k", "f", 1), ("EXPIRE", "k", 60)],
               [("HSET", "k", "f", 1), ("DEL", "k"), ("SADD", "k", "m")],
               [("SETNX", "k", "v"), ("APPEND", "k", "w")],
               [("DEL", "k"), ("SETNX", "k", "v"), ("INCR", "k")]):
        assert checked_writes(ok)[0]


class _Text(str):
    """A subclass of ``str``: kept as it is, sent as its text (``_writes._exact``)."""


_KEY = st.sampled_from(["k", "j", b"k", 5, "5", _Text("k")])
_COMMON_VALUE = st.one_of(
    st.text(max_size=3), st.binary(max_size=3), st.integers(-10**6, 10**6),
    st.sampled_from([True, 1.5, None, _Text("v"), "x" * (MAX_WRITE_BYTES // 3)]),
)
_ONE_KEY = sorted(n for n, spec in WRITE_COMMANDS.items() if spec[3] == 1)
_COMMON_NAME = st.sampled_from([*_ONE_KEY, "DEL", "hset"])
_COMMON_WRITE = st.builds(
    lambda name, key, values: (name, key, *values), _COMMON_NAME, _KEY,
    st.lists(_COMMON_VALUE, max_size=16).map(tuple) | st.lists(
        st.sampled_from(["a", b"b", 7]), min_size=13, max_size=17).map(tuple))


def _sound(name: str) -> st.SearchStrategy[tuple[Any, ...]]:
    """Writes ``name`` with a right count of values, on the keys ``k`` and ``j``."""
    _, least, most, _ = WRITE_COMMANDS[name]
    counts = [n for n in range(least, (most or least + 3) + 1) if name != "HSET" or n % 2 == 0]
    key, value = st.sampled_from(["k", "j"]), st.sampled_from(["k", "j", b"v", 2])
    return st.sampled_from(counts).flatmap(
        lambda n: st.tuples(st.just(name), key, *[value] * (n - 2)))


_SOUND_WRITE = (st.sampled_from([*_ONE_KEY, "DEL"])
                | st.sampled_from(["SET", "SETNX", "DEL"])).flatmap(_sound)
"""Writes each right by itself (those that leave a key any type often): one
after another on two keys, what is checked is the type each leaves its key."""
_COMMON_WRITES = st.lists(_COMMON_WRITE, max_size=6) | st.lists(_SOUND_WRITE, max_size=6)


@given(_COMMON_WRITES, _COMMON_WRITES)
@example([("SETNX", "k", "v"), ("INCR", "k"), ("EXPIRE", "j", 1), ("SETNX", "j", "v"), ("APPEND", "j", "w")],
         [("EXPIRE", "k", 1), ("SETNX", "k", "v"), ("HSET", "k", "f", 1)])
@example([("DEL", "k"), ("SADD", "k", "m"), ("SETNX", "k", "v"), ("SREM", "k", "m"), ("SET", "j", "v"),
          ("INCR", "j")],
         [("EXPIRE", "k", 1), ("HSET", "k", "f", 1), ("HINCRBY", "k", "f", 1), ("DEL", "j"),
          ("SETNX", "j", "v")])
@example([("DEL", "k"), ("SADD", "k", "m"), ("HSET", "k", "f", 1)],
         [("EXPIRE", "k", 1), ("SET", "k", "v"), ("HSET", "k", "f", 1)])
@example([("HSET", "k", "f", 1), ("HINCRBY", 5, "f", 1), ("SADD", "5", "m")], [])
@example([("LTRIM", "l", 0, 0), ("SETNX", "k", 1), ("INCR", "k"), ("SET", "k", "v")], [])
@example([("SADD", "k", *["m"] * 15)], [("XADD", "k", "*", *["f", 1] * 8)])
@example([("SET", "k", True)], [("EXPIRE", "k", 1.5)])
@example([("SET", "k", _Text("v"))], [("INCRBY", "k", None)])
@example([("SET", "k", "x" * (MAX_WRITE_BYTES // 3))] * 3, [("SET", "k", "v", "EX", 10)])
def test_common_writes_are_checked_as_in_full(first: list[Any], then: list[Any]) -> None:
    """The common writes (tuples of a one-key command, up to 16 values of
    ``str``, ``bytes`` and ``int``: what handlers return message after
    message) are checked by ``checked_writes`` itself, anything else by
    ``_checked``: both agree with the reference on every input, one after
    the other (nothing of the first call's is kept for the next), and a
    refusal is ``_checked``'s (the same message).  Both read the type a
    write leaves its key from ``_left``: the reference is what would see it
    wrong, hence sound writes on two keys and the examples of each case."""
    from trio_redis_finalize._writes import _checked

    for writes in (first, then, first + then):
        got, want = _either(checked_writes, writes), _either(reference, writes)
        assert got == want
        if got is ValueError:
            with pytest.raises(ValueError) as full:
                _checked(writes)
            with pytest.raises(ValueError, match=f"^{re.escape(str(full.value))}$"):
                checked_writes(writes)
        else:
            assert got == _checked(writes)
            assert [[type(v) for v in w] for w in got[0]] == [[type(v) for v in w] for w in want[0]]
            assert {*map(type, got[1])} <= {str, bytes, int}  # (the script's layout: exact classes)
