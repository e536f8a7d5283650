"""Redis writes an outcome carries (``ACK.with_writes(...)``): which commands,
how they are checked and normalised.  Pure: no I/O, no package imports.

A handler may return its own Redis writes with its outcome; the finalizer
runs them in the same gated script as the acknowledgement (see
``_core._writes``), so they are committed exactly once with it.  Only
deterministic write commands on declared keys are allowed: each command
names its keys at known places, so the script can declare them (Redis
Cluster routes a script by its keys) and check their types before it writes
anything.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "MAX_WRITES", "MAX_WRITE_BYTES", "MAX_WRITE_VALUES", "WRITE_COMMANDS", "Write",
    "check_writes", "checked_writes", "write_keys",
]

Write = tuple[str | bytes, ...]
"""One write as normalised: the command name (upper-case ``str``), then its
arguments as ``bytes`` or ``str`` (numbers are turned into their text)."""

# name -> (the type its key must have, or hold nothing: "" for any type (the
#          scripts' lookups of it are made from this table: ``_core._lua_writes``);
#          fewest values (the name included); most values, or None;
#          how many keys, from the first argument on: 1, or None for all of them)
WRITE_COMMANDS: dict[str, tuple[str, int, int | None, int | None]] = {
    # strings
    "SET": ("", 3, None, 1),
    "SETNX": ("", 3, 3, 1),
    "APPEND": ("string", 3, 3, 1),
    "INCR": ("string", 2, 2, 1),
    "INCRBY": ("string", 3, 3, 1),
    "INCRBYFLOAT": ("string", 3, 3, 1),
    "DECR": ("string", 2, 2, 1),
    "DECRBY": ("string", 3, 3, 1),
    "SETBIT": ("string", 4, 4, 1),
    "PFADD": ("string", 2, None, 1),
    # hashes
    "HSET": ("hash", 4, None, 1),
    "HSETNX": ("hash", 4, 4, 1),
    "HINCRBY": ("hash", 4, 4, 1),
    "HINCRBYFLOAT": ("hash", 4, 4, 1),
    "HDEL": ("hash", 3, None, 1),
    # sets and sorted sets
    "SADD": ("set", 3, None, 1),
    "SREM": ("set", 3, None, 1),
    "ZADD": ("zset", 4, None, 1),
    "ZINCRBY": ("zset", 4, 4, 1),
    "ZREM": ("zset", 3, None, 1),
    # lists and streams
    "LPUSH": ("list", 3, None, 1),
    "RPUSH": ("list", 3, None, 1),
    "LTRIM": ("list", 4, 4, 1),
    "XADD": ("stream", 5, None, 1),
    # any type
    "DEL": ("", 2, None, None),
    "UNLINK": ("", 2, None, None),
    "EXPIRE": ("", 3, 4, 1),
    "PEXPIRE": ("", 3, 4, 1),
    "EXPIREAT": ("", 3, 4, 1),
    "PEXPIREAT": ("", 3, 4, 1),
    "PERSIST": ("", 2, 2, 1),
}
"""The commands an outcome may carry.  Deterministic writes only (no
``SPOP``, no ``EVAL``), each on keys at known places, so the finalization
script declares every key and checks its type first."""

MAX_WRITES = 64
"""Writes one outcome carries at most."""
MAX_WRITE_VALUES = 4096
"""Values (names and arguments) of one outcome's writes together, at most."""
MAX_WRITE_BYTES = 1 << 20
"""Bytes of one outcome's writes together, at most (1 MiB)."""

_ANY_LEFT = {"SET": "string", "SETNX": "?"}
"""What a write of any type leaves a key it is the first to touch: SET a
string, SETNX a string or what Redis has (``"?"``); the others (EXPIRE ...)
what Redis has (``""``)."""
_MOST_COMMON = 16
"""The most values a write :func:`checked_writes` checks itself has (its
name included)."""


def _value(i: int, j: int, v: object) -> str | bytes:
    if isinstance(v, (bytes, str)):
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"writes[{i}][{j}] must be bytes, str, int or float, got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"writes[{i}][{j}] must be a finite number, got {v!r}")
    return repr(v) if isinstance(v, float) else str(v)


def _normal(i: int, w: object) -> tuple[tuple[Any, ...], tuple[str, int, int | None, int | None]]:
    """The write ``writes[i]`` as a tuple naming its command as listed, and
    the command's spec (what :func:`checked_writes` takes as it is: any other
    sequence, a name in another case or in bytes).

    Raises:
        ValueError: no command as a sequence, or one not allowed.
    """
    if (w.__class__ is not tuple and w.__class__ is not list
            and (isinstance(w, (str, bytes)) or not isinstance(w, Sequence))) or not w:
        raise ValueError(f"writes[{i}] must be a command as a tuple, e.g. "
                         f"('HINCRBY', 'totals', 'eur', 5), got {w!r}")
    seq: Sequence[Any] = w
    name = seq[0]
    name = name.decode() if isinstance(name, bytes) else name
    spec = WRITE_COMMANDS.get(name.upper()) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"writes[{i}]: {seq[0]!r} is not a write an outcome may carry "
                         f"(deterministic writes on declared keys: {', '.join(WRITE_COMMANDS)})")
    return (name.upper(), *seq[1:]), spec


def check_writes(writes: Sequence[object]) -> tuple[Write, ...]:
    """``writes`` normalised: each a tuple ``(NAME, arg, ...)`` of a command
    in :data:`WRITE_COMMANDS`, within the bounds.

    Raises:
        ValueError: not a sequence of commands, a command that is not allowed
            (named, with the list), a wrong number of arguments, a value that
            is not bytes/str/int/float, or past :data:`MAX_WRITES`,
            :data:`MAX_WRITE_VALUES` or :data:`MAX_WRITE_BYTES`.
    """
    return checked_writes(writes)[0]


_Checked = tuple[tuple[Write, ...], tuple[str | bytes | int, ...], tuple[str | bytes, ...]]


def checked_writes(writes: Sequence[Any]) -> _Checked:
    """:func:`check_writes`, and in the same pass what a finalization script
    reads of them: the count of writes, then per write its count of values
    and the command, each value ``str``, ``bytes`` or ``int`` exactly (the
    script's layout, ``_core._writes.encode_writes``;
    the type a key must have the script looks up by the command's name), and
    the keys they touch (in order, each once: :func:`write_keys`).

    The common writes are checked here (a handler returns them for every
    message: this is most of what a write costs the client): tuples naming a
    command of one key as listed, with a count of values :data:`_COMMON`
    knows as right for it (its bounds, HSET's pairs), each value ``str`` or
    ``bytes`` exactly, or an ``int`` (made text); a key an earlier write of
    them named checked as :func:`_checked` does.  Anything else -- or a write
    that is refused -- goes to :func:`_checked`, which checks (and refuses)
    every write in full, saying why.

    Raises:
        ValueError: as :func:`check_writes`.
    """
    try:
        if len(writes) > MAX_WRITES:
            raise TypeError
        out: list[Write] = []
        parts: list[str | bytes | int] = [len(writes)]
        keys: dict[str | bytes, str] = {}  # key -> the type the writes so far leave it (_left)
        size = 0
        for w in writes:
            if w.__class__ is not tuple:
                raise TypeError
            counts, first = _COMMON[w[0]]  # (KeyError: not a name as listed; IndexError: ())
            n = len(w)
            if n not in counts:  # (its bounds, HSET's pairs; a long write: _checked)
                raise TypeError
            for v in w:
                if v.__class__ is str or v.__class__ is bytes:
                    size += len(v)
                else:  # an int: the values from it on made text (anything else: _checked)
                    j = w.index(v)  # (its place: the values before it are text, none equal to it)
                    if j == n - 1 and v.__class__ is int:  # (the common one: a count, seconds)
                        text = str(v)
                        w = (*w[:j], text)
                        size += len(text)
                    else:
                        rest = _texts(w[j:])
                        w = w[:j] + rest
                        size += sum(map(len, rest))
                    break
            out.append(w)
            parts.append(n)
            parts += w
            k = w[1]
            if k not in keys:
                keys[k] = first
            elif first:  # (the others leave it as it was: EXPIRE ...)
                keys[k] = _LEFT[w[0], keys[k]]  # (KeyError: refused by _left; _checked says why)
        if size > MAX_WRITE_BYTES or len(parts) - len(out) > MAX_WRITE_VALUES + 1:
            raise TypeError
    except (TypeError, KeyError, IndexError):
        return _checked(writes)
    return tuple(out), tuple(parts), tuple(keys)


def _refused(j: int, v: object) -> str | bytes:
    raise TypeError


def _texts(values: tuple[Any, ...], other: Callable[[int, Any], str | bytes] = _refused,
           ) -> tuple[str | bytes, ...]:
    """``values``, each ``int`` made text, each ``str`` and ``bytes`` kept, any
    other value ``other(its index, it)`` (by default: TypeError)."""
    texts: list[str | bytes] = []
    for v in values:
        c = v.__class__
        if c is int:
            v = str(v)
        elif c is not str and c is not bytes:
            v = other(len(texts), v)
        texts.append(v)
    return tuple(texts)


_COMMON: dict[str, tuple[frozenset[int], str]] = {
    name: (frozenset(n for n in range(least, (most or _MOST_COMMON) + 1)
                     if name != "HSET" or n % 2 == 0),
           want or _ANY_LEFT.get(name, ""))
    for name, (want, least, most, nkeys) in WRITE_COMMANDS.items() if nkeys == 1
}
"""The commands of one key -> the counts of values (name included) right
for them up to :data:`_MOST_COMMON` (longer writes: :func:`_checked`), and
the type a write leaves a key it is the first to touch (its want, or
:data:`_ANY_LEFT`'s, or ``""``: as Redis has it)."""


def _checked(writes: Sequence[Any]) -> _Checked:
    """:func:`checked_writes` in full: any writes, each checked (the error
    naming the write and why)."""
    if len(writes) > MAX_WRITES:
        raise ValueError(f"writes: at most {MAX_WRITES} writes per outcome, got {len(writes)}")
    out: list[Write] = []
    parts: list[str | bytes | int] = [len(writes)]  # (each one a write, or refused)
    keys: dict[str | bytes, str] = {}  # key -> the type the writes so far leave it (_left)
    values = size = 0
    kept = False  # a value of a subclass of str or bytes, kept as it is
    spec_of = WRITE_COMMANDS.get
    for i, w in enumerate(writes):
        # the common write first: a tuple naming its command as listed; its
        # values all text (kept as it is) or text and integers (made text)
        spec = spec_of(w[0]) if w.__class__ is tuple and w else None
        if spec is None:
            w, spec = _normal(i, w)
        want, least, most, nkeys = spec
        n = len(w)
        if n < least or (most is not None and n > most):
            bound = f"{least}" if most == least else f"{least} to {most}" if most else f"at least {least}"
            raise ValueError(f"writes[{i}]: {w[0]} takes {bound} values (the name included), "
                             f"got {n}")
        # one pass over the values: their size while all are text (the
        # common write, kept as it is); at a value that is not, the write
        # again, each value made text
        before = size
        for v in w:
            if v.__class__ is str or v.__class__ is bytes:
                size += len(v)
            else:
                w = _texts(w, functools.partial(_value, i))
                size = before + sum(map(len, w))
                kept = kept or not {*map(type, w)} <= {str, bytes}
                break
        if n % 2 == 1 and w[0] == "HSET":
            raise ValueError(f"writes[{i}]: HSET takes a key and field value pairs, got {n - 1} "
                             "arguments")
        values += n
        out.append(w)
        parts.append(n)
        parts += w
        if nkeys == 1:
            k = w[1]
            prev = keys.get(k)
            if prev is None:
                keys[k] = _COMMON[w[0]][1]  # (the type a first write leaves its key)
            elif want or w[0] in _ANY_LEFT:  # (the others leave it as it was: EXPIRE ...)
                keys[k] = _left(i, w, want, prev)
        else:  # DEL, UNLINK: each key left with nothing
            keys.update(dict.fromkeys(w[1:] if nkeys is None else w[1:1 + nkeys], "none"))
    if values > MAX_WRITE_VALUES:
        raise ValueError(f"writes: at most {MAX_WRITE_VALUES} values per outcome, got {values}")
    if size > MAX_WRITE_BYTES:
        raise ValueError(f"writes: at most {MAX_WRITE_BYTES} bytes per outcome, got {size}")
    if kept:  # (the script's layout of exact classes: see _exact)
        parts = [*map(_exact, parts)]
    return tuple(out), tuple(parts), tuple(keys)


def _exact(v: str | bytes | int) -> str | bytes | int:
    """``v`` of its exact class: a value of a subclass of ``str`` or
    ``bytes`` as its text (the bytes sent), so equal values of the script's
    layout are the same bytes (the transport packs a batch's layouts as a
    template: ``_core._splice.splice_rows``)."""
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, bytes):
        return bytes.__bytes__(v)
    return v


def _left(i: int, w: Write, want: str, prev: str) -> str:
    """The type write ``i`` leaves its key with, the outcome's earlier writes
    having left it ``prev`` (a type, ``"none"``, ``""``: as Redis has it,
    ``"?"``: a string or as Redis has it).

    The scripts check each key's type as Redis has it before anything is
    written; a write whose key an earlier write of the same outcome makes
    another type (``SET k`` then ``HSET k``, ``HSET k`` then ``SADD k``)
    would pass that check and fail when run, after the writes before it
    were applied: refused here instead, when the outcome is made.

    Raises:
        ValueError: naming both writes' commands and the key.
    """
    name, key = str(w[0]), w[1]
    if want:
        if prev == want or prev in ("", "none") or (prev == "?" and want == "string"):
            return want
        what = "may be a string (SETNX)" if prev == "?" else f"is a {prev}"
        raise ValueError(f"writes[{i}]: {name} {key!r} needs a {want}, but after the outcome's "
                         f"earlier writes the key {what}: it would fail once those ran (DEL it "
                         "first, or use another key)")
    if name == "SET":
        return "string"
    if name == "SETNX":
        return "string" if prev == "none" else "?" if prev == "" else prev
    return prev


def _lefts() -> dict[tuple[str, str], str]:
    """:func:`_left` of each command of one key and each type the earlier
    writes can leave its key, that it does not refuse."""
    prevs = {want for want, *_ in WRITE_COMMANDS.values()} | {*_ANY_LEFT.values(), "none"}
    lefts: dict[tuple[str, str], str] = {}
    for name in _COMMON:
        for prev in prevs:
            with contextlib.suppress(ValueError):
                lefts[name, prev] = _left(0, (name, ""), WRITE_COMMANDS[name][0], prev)
    return lefts


_LEFT = _lefts()
"""(command, the type the earlier writes left its key) -> the type the
write leaves it: :func:`_left`'s rule as :func:`checked_writes` reads it (a
pair it refuses is not here)."""


def write_keys(writes: Sequence[Write]) -> list[str | bytes]:
    """The keys the (checked) ``writes`` touch, in order, each once."""
    keys: dict[str | bytes, None] = {}
    for w in writes:
        n = WRITE_COMMANDS[str(w[0])][3]
        keys.update(dict.fromkeys(w[1:] if n is None else w[1:1 + n]))
    return list(keys)
