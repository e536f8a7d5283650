"""``_writes.checked_writes`` against a plain reference (Hypothesis).

``checked_writes`` runs once per outcome a handler returns with writes, so
it is written for speed (one pass over each write's values, the common write
kept as it is).  The reference below says the same rules the obvious way;
both must agree on every input: the same normalised writes, script layout
and keys, or a ``ValueError`` both.
"""

from __future__ import annotations

import math
from typing import Any

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


def reference(writes: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
    """The rules of ``checked_writes``, plainly."""
    if len(writes) > MAX_WRITES:
        raise ValueError("too many")
    out, parts, keys = [], [len(writes)], {}  # type: ignore[var-annotated]
    for w in writes:
        if isinstance(w, (str, bytes)) or not isinstance(w, (tuple, list)) or not w:
            raise ValueError("not a command")
        name = w[0].decode() if isinstance(w[0], bytes) else w[0]
        if not isinstance(name, str) or name.upper() not in WRITE_COMMANDS:
            raise ValueError("not allowed")
        name = name.upper()
        _, least, most, nkeys = WRITE_COMMANDS[name]
        if len(w) < least or (most is not None and len(w) > most):
            raise ValueError("arity")
        values = (name, *map(_text, w[1:]))
        if name == "HSET" and len(values) % 2 == 1:
            raise ValueError("pairs")
        out.append(values)
        parts += [len(values), *values]  # (the key's type: the script looks it up)
        keys.update(dict.fromkeys(values[1:] if nkeys is None else values[1:1 + nkeys]))
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
@example([("SADD", "k", *[b"x" * 1024] * 1000)] * 2)
def test_checked_writes_is_the_reference(writes: list[Any]) -> None:
    got, want = _either(checked_writes, writes), _either(reference, writes)
    assert got == want
    if got is not ValueError:  # (each value its exact type: str stays str, bytes bytes)
        assert [[type(v) for v in w] for w in got[0]] == [[type(v) for v in w] for w in want[0]]
