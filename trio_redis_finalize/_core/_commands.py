"""Commands as plain values: their types, Lua scripts, the keys a command names.

Nothing here sends anything: the transport packs and sends these values;
the planner builds them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from itertools import chain, repeat
from operator import itemgetter
from typing import Any

__all__ = [
    "SCRIPTS", "Arg", "Command", "Script", "Spliced", "command_keys", "describe", "group_names",
    "script_of", "splice", "splice_batches", "splice_keyed", "split_field",
]

Arg = bytes | str | int | float
Command = Sequence[Arg]



class Spliced(tuple):  # type: ignore[type-arg]
    """A command made of segments of arguments, some of them the same object
    again (one outcome's encoded writes in the part of every delivery that
    returned it, in a batched call): a tuple of all its arguments, as any
    command, that the transport packs segment by segment, each distinct
    segment object once (:meth:`packed`; packing is most of what a write
    costs the client).  Made by :func:`splice` only: its arguments are its
    segments' in order."""

    segments: Sequence[Sequence[Arg]]

    def packed(self, pack: Callable[[tuple[Arg, ...]], bytes]) -> bytes:
        """The command's RESP bytes, ``pack`` (``hiredis.pack_command``)
        packing each distinct segment: the same bytes ``pack(self)`` gives."""
        keyed = self.__dict__.get("keyed")
        if keyed is not None:  # (see splice_keyed)
            head, ids, part = keyed
            h, p, e = pack(tuple(head)), pack(tuple(ids)), pack(tuple(part))
            lines = p.split(b"\r\n")  # "*n", then "$len", id for each id, ""
            body = b"\r\n".join(chain.from_iterable(
                zip(lines[1:-1:2], lines[2:-1:2], repeat(e[e.index(b"\n") + 1:-2]))))
            return b"".join((b"*%d\r\n" % len(self), h[h.index(b"\n") + 1:], body, b"\r\n"))
        done: dict[int, bytes] = {}
        out = [b"*%d\r\n" % len(self)]
        for seg in self.segments:
            if not seg:
                continue
            b = done.get(id(seg))
            if b is None:
                p = pack(tuple(seg))
                b = done[id(seg)] = p[p.index(b"\n") + 1:]  # without its "*<n>" line
            out.append(b)
        return b"".join(out)


def splice(segments: Sequence[Sequence[Arg]]) -> Spliced:
    """The command of ``segments`` (not empty), in order (see :class:`Spliced`)."""
    c = Spliced(chain.from_iterable(segments))
    c.segments = segments
    return c


def splice_keyed(head: Command, ids: Sequence[str], part: Sequence[Arg]) -> Spliced:
    """``head``, then for each of ``ids`` the id and ``part`` (the same
    values): a batch of deliveries known by id that all returned one outcome.
    Packed with every id at once (:meth:`Spliced.packed` cuts their packing
    at its line ends: the ids are a stream's, ``ms-seq``, never a CR or LF)."""
    c = splice([head, *chain.from_iterable(zip(zip(ids), repeat(part)))])
    if part:  # (no part: packed segment by segment)
        c.keyed = (head, ids, part)  # type: ignore[attr-defined]
    return c


def splice_batches(
    items: Sequence[tuple[object, object]], prefixes: Sequence[Sequence[Arg]],
    encode: Callable[[Any], tuple[Sequence[Arg], Sequence[Arg]]],
    head: Callable[[Sequence[Arg], int, int], Command], cap: int, room: int,
    ids: Sequence[str] | None = None, same: Arg | None = None,
) -> list[tuple[Command, int]]:
    """Batched script calls of ``items`` (deliveries and their outcomes), each
    delivery's part its ``prefixes[i]`` then its outcome's encoded writes
    (``encode(outcome)``: those and the keys they name, once per outcome
    object in a row): ``(call, how many deliveries it carries)``, in order.

    A call carries at most ``cap`` deliveries and about ``room`` values (one
    delivery at least), as ``_batch.first_round`` batches parts;
    ``head(keys, i, j)``: the call up to the parts, for ``items[i:j]`` and
    the keys their writes name (each once).  The calls are :class:`Spliced`:
    one outcome's writes, the same list object, packed once.  ``ids``: the
    prefixes are these stream ids alone (:func:`splice_keyed`, when every
    delivery returned one outcome object).  ``same``: in place of the writes
    of an outcome that is the object before it in the call (None: in full).
    """
    out: list[tuple[Command, int]] = []
    n = len(items)
    if n and len(set(map(id, map(_SECOND, items)))) == 1 and len(set(map(len, prefixes))) == 1:
        # one outcome object for all, prefixes of one width (the common batch):
        # its writes encoded once, the parts interleaved in C
        enc, names = encode(items[0][1])
        once = list(dict.fromkeys(names))
        per = max(1, min(cap, room // (len(prefixes[0]) + len(enc))))
        part = enc if same is None else (same,)  # (the deliveries' after the first)
        for i in range(0, n, per):
            j = min(n, i + per)
            first = (*head(once, i, j), *prefixes[i], *enc)  # (the first delivery's in full)
            out.append((splice_keyed(first, ids[i + 1:j], part) if ids and j - i > 1 else
                        splice([first, *chain.from_iterable(zip(prefixes[i + 1:j], repeat(part)))]),
                        j - i))
        return out
    i = 0
    last: object = None
    w: tuple[Sequence[Arg], Sequence[Arg]] = ((), ())
    while i < n:
        segments: list[Sequence[Arg]] = [()]
        keys: dict[Arg, None] = {}
        size = 0
        j = i
        end = min(n, i + cap)
        new = True
        while j < end:
            o = items[j][1]
            again = o is last
            if not again:
                w = encode(o)
                last = o
                new = True
            enc = w[0]
            width = len(prefixes[j]) + len(enc)
            if size + width > room and j > i:
                break
            if again and same is not None and j > i:  # (the first of a call: in full)
                segments.append([*prefixes[j], same])
            elif again:  # the writes packed once for the run of this outcome
                segments.append(prefixes[j])
                segments.append(enc)
            else:  # (one segment: one packing less for an outcome seen once)
                segments.append([*prefixes[j], *enc])
            if new:  # (the writes of one outcome object: their keys once)
                keys.update(dict.fromkeys(w[1]))
                new = False
            size += width
            j += 1
        segments[0] = head(list(keys), i, j)
        out.append((splice(segments), j - i))
        i = j
    return out


_SECOND = itemgetter(1)

SCRIPTS: dict[bytes, Script] = {}
"""Every script by its sha: its source (loaded on ``NOSCRIPT``) and its name
(error messages name the script run)."""


class Script:
    """A Lua script run by ``EVALSHA`` (loaded with ``SCRIPT LOAD`` on ``NOSCRIPT``).

    ``keys`` and ``argv`` are its layout, written once, as data: the names of
    its ``KEYS`` and ``ARGV`` in order, as the ``# KEYS: ... ARGV: ...`` header
    above its definition lists them (``tests/core/test_script_layouts.py``
    holds the two together).  A name may carry a mark:

    * ``n?``: optional, present when the call is long enough (only after
      every fixed field of its side, and with no ``...`` on that side);
    * ``record?why``: optional, present exactly when the optional key ``why`` is;
    * ``fields...``: any number of values (none included);
    * ``[id, delay, member]...``: a group repeated any number of times (the
      batched scripts); its width is fixed unless it holds a ``...`` itself.

    Fields before the first ``...`` of a side are found from its start, those
    after the last one from the end of the call (``LIST_WRITES``' ``n``), and
    a ``...`` itself by where it starts (the first one of its side).  Code
    that reads or rewrites a built call does it by these names
    (:meth:`at`, :meth:`field`, :meth:`replace`, :meth:`rest`,
    :meth:`groups`), never by position.  Built calls stay plain tuples
    (:meth:`command`); the positions are worked out here once, at import,
    into one small function per field (:meth:`locator`, for the hot path).
    """

    __slots__ = ("_at", "_places", "argv", "keys", "name", "sha", "source")

    def __init__(
        self, source: str, name: str = "script", *,
        keys: Sequence[str] | None = None, argv: Sequence[str] | None = None,
    ) -> None:
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest().encode()
        self.name = name
        self.keys: tuple[str, ...] | None = None if keys is None else tuple(keys)
        self.argv: tuple[str, ...] | None = None if argv is None else tuple(argv)
        self._places: dict[str, _Place] = (
            {} if self.keys is None or self.argv is None else _places(name, self.keys, self.argv)
        )
        self._at = {f: _locator(place, len(keys or ())) for f, place in self._places.items()}
        SCRIPTS[self.sha] = self

    def command(self, keys: Sequence[Arg], args: Sequence[Arg]) -> tuple[Arg, ...]:
        """The ``EVALSHA`` command for a pipeline."""
        return (b"EVALSHA", self.sha, len(keys), *keys, *args)

    def calls(self, cmd: Command) -> bool:
        """Whether ``cmd`` is a call of this script."""
        return len(cmd) > 2 and cmd[1] == self.sha and cmd[0] == b"EVALSHA"

    def key_at(self, name: str) -> int:
        """Where the key ``name`` sits in a built call (it is before any
        ``...`` of the keys; an optional one: where it sits when sent)."""
        place = self._place(name)
        if place[0] != _KEY_HEAD:
            raise ValueError(f"{self.name}: the key {name!r} has no fixed place")
        return place[1]

    def at(self, cmd: Command, name: str) -> int | None:
        """Where the field ``name`` (a key or an argument) sits in ``cmd``, a
        built call of this script; None when ``cmd`` does not carry it (an
        optional field not sent).  A ``...`` field: where it starts."""
        try:
            return self._at[name](cmd)
        except KeyError:
            self._place(name)  # names the field missing
            raise

    arg_index = at

    def locator(self, name: str) -> Callable[[Command], int | None]:
        """:meth:`at` for the one field ``name``, worked out at import: for
        code on the hot path, bound once (``N_AT = LIST_REMOVE.locator("n")``)
        and called per command (one call, a few operations, no lookup)."""
        self._place(name)
        return self._at[name]

    def field(self, cmd: Command, name: str, default: Arg | None = None) -> Arg | None:
        """The value of the field ``name`` in ``cmd`` (``default`` when not sent)."""
        i = self.at(cmd, name)
        return default if i is None else cmd[i]

    def replace(self, cmd: Command, name: str, value: Arg) -> tuple[Arg, ...]:
        """``cmd`` with the field ``name`` set to ``value``; an optional last
        field not sent is added."""
        i = self.at(cmd, name)
        if i is None:
            _, at, bound, opt, _ = self._place(name)
            nk = int(cmd[2])
            if opt != _TRAILING or 3 + nk + at - sum(k >= nk for k in bound) != len(cmd):
                raise ValueError(f"{self.name}: {name!r} cannot be added to this call")
            return (*cmd, value)
        return (*cmd[:i], value, *cmd[i + 1:])

    def rest(self, cmd: Command, name: str) -> tuple[Arg, ...]:
        """The values of the ``...`` field ``name`` in ``cmd`` (the first of its
        side): from where it starts to the fields after it."""
        kind, _, _, _, after = self._place(name)
        start = self.at(cmd, name)
        if kind not in (_KEY_REST, _ARG_REST) or start is None:
            raise ValueError(f"{self.name}: {name!r} is not a field of any number of values")
        stop = (3 + int(cmd[2]) if kind == _KEY_REST else len(cmd)) - after
        return tuple(cmd[start:stop])

    def groups(self, cmd: Command, name: str) -> list[tuple[Arg, ...]]:
        """The repeated groups of fixed width that start at ``name`` (the first
        name inside ``[...]...``), each a tuple of its values."""
        values = self.rest(cmd, name)
        width = _group_width(self, name)
        return [tuple(values[j:j + width]) for j in range(0, len(values), width)]

    def _place(self, name: str) -> _Place:
        try:
            return self._places[name]
        except KeyError:
            raise ValueError(f"{self.name} has no field {name!r} with a place "
                             f"(keys {self.keys}, argv {self.argv})") from None

    def __repr__(self) -> str:
        return f"Script({self.name})"


def script_of(cmd: Command) -> Script | None:
    """The library's script ``cmd`` calls, or None (not an ``EVALSHA`` of one)."""
    if len(cmd) < 3 or cmd[0] != b"EVALSHA":
        return None
    sha = cmd[1]
    return SCRIPTS.get(sha) if isinstance(sha, bytes) else None


# -- layouts: where each named field sits in a built call -----------------------------------
#
# A place is (kind, i, bound, opt, after), worked out once per script:
# _KEY_HEAD: the command's index ``i``; ``opt`` _TRAILING when optional
#   (present while ``i < 3 + numkeys``), else _REQUIRED.
# _KEY_TAIL / _ARG_TAIL: ``i`` < 0, from the end of the keys / of the call.
# _ARG_HEAD: ``i`` from ARGV[1], less one for each key of ``bound`` not sent
#   (the optional arguments up to it bound to optional keys); ``opt``: the
#   key it is bound to itself, _TRAILING (present when the call reaches
#   it) or _REQUIRED.
# _KEY_REST / _ARG_REST: a ``...`` field (or a group's first name): where it
#   starts as _KEY_HEAD / _ARG_HEAD, and ``after`` the number of fields after it.
_Place = tuple[int, int, tuple[int, ...], int, int]
_KEY_HEAD, _KEY_TAIL, _KEY_REST, _ARG_HEAD, _ARG_TAIL, _ARG_REST = range(6)
_TRAILING, _REQUIRED = -1, -2


def split_field(spec: str) -> tuple[str, str, str]:
    """``(name, mark, bound key)`` of a layout field: mark ``""``, ``"?"``,
    ``"..."`` or ``"[]..."`` (a repeated group, name its first name)."""
    if spec.startswith("["):
        if not spec.endswith("]..."):
            raise ValueError(f"a repeated group is written [a, b]...: {spec!r}")
        return group_names(spec)[0].rstrip("."), "[]...", ""
    if spec.endswith("..."):
        return spec[:-3], "...", ""
    name, q, bound = spec.partition("?")
    return name, q, bound


def group_names(spec: str) -> list[str]:
    """The names inside a repeated group ``[a, b, c...]...``."""
    return [n.strip() for n in spec[1:-4].split(",")]


def _group_width(script: Script, name: str) -> int:
    for spec in (*(script.keys or ()), *(script.argv or ())):
        if spec.startswith("[") and split_field(spec)[0] == name:
            names = group_names(spec)
            if any(n.endswith("...") for n in names):
                break
            return len(names)
    raise ValueError(f"{script.name}: {name!r} does not start a group of fixed width")


def _locator(place: _Place, nkeys: int) -> Callable[[Command], int | None]:
    """The function :meth:`Script.at` runs for a field at ``place``."""
    kind, i, bound, opt, _ = place
    if kind in (_KEY_HEAD, _KEY_REST):
        if opt == _REQUIRED:
            return lambda cmd: i
        return lambda cmd: i if i < 3 + int(cmd[2]) else None
    if kind == _KEY_TAIL:
        return lambda cmd: 3 + int(cmd[2]) + i
    if kind == _ARG_TAIL:
        return lambda cmd: len(cmd) + i
    k = 3 + i
    if bound:  # after (or bound to) an optional key: where, by the number of keys sent
        at = {nk: None if opt >= nk else k + nk - sum(key >= nk for key in bound)
              for nk in range(nkeys + 1)}

        def after_optional_keys(cmd: Command) -> int | None:
            j = at[int(cmd[2])]
            return None if j is None or (opt == _TRAILING and j >= len(cmd)) else j
        return after_optional_keys
    if opt == _TRAILING:
        def trailing(cmd: Command) -> int | None:
            j = k + int(cmd[2])
            return j if j < len(cmd) else None
        return trailing
    return lambda cmd: k + int(cmd[2])


def _places(script: str, keys: tuple[str, ...], argv: tuple[str, ...]) -> dict[str, _Place]:
    out: dict[str, _Place] = {}
    optional_keys: dict[str, int] = {}

    def side(fields: tuple[str, ...], is_keys: bool) -> None:
        marks = [split_field(f) for f in fields]
        rests = [j for j, (_, m, _) in enumerate(marks) if m.endswith("...")]
        first = rests[0] if rests else len(fields)
        last = rests[-1] if rests else len(fields)
        bound: list[int] = []
        for j, (name, mark, key) in enumerate(marks):
            if not name or name in out:
                raise ValueError(f"{script}: field {name!r} empty or named twice")
            if j > last:  # after the last ``...``: from the end
                if mark:
                    raise ValueError(f"{script}: {name!r} after a ... cannot be optional")
                out[name] = (_KEY_TAIL if is_keys else _ARG_TAIL, j - len(fields), (), _REQUIRED, 0)
                continue
            if j > first:
                continue  # between two ``...``: no place of its own
            if j == first:
                out[name] = ((_KEY_REST, 3 + j, (), _REQUIRED, len(fields) - 1 - j) if is_keys
                             else (_ARG_REST, j, tuple(bound), _REQUIRED, len(fields) - 1 - j))
                continue
            if mark == "?" and not key and any(m != "?" for _, m, _ in marks[j + 1:]):
                raise ValueError(f"{script}: the optional {name!r} must come last")
            if is_keys:
                if key:
                    raise ValueError(f"{script}: a key cannot be bound to another ({name!r})")
                if mark:
                    optional_keys[name] = j
                out[name] = (_KEY_HEAD, 3 + j, (), _TRAILING if mark else _REQUIRED, 0)
                continue
            if key:
                if key not in optional_keys:
                    raise ValueError(f"{script}: {name!r} is bound to {key!r}, no optional key")
                bound.append(optional_keys[key])
                out[name] = (_ARG_HEAD, j, tuple(bound), optional_keys[key], 0)
            else:
                out[name] = (_ARG_HEAD, j, tuple(bound), _TRAILING if mark else _REQUIRED, 0)

    side(keys, True)
    side(argv, False)
    return out


def _text(arg: Arg) -> str:
    if isinstance(arg, bytes):
        return arg.decode("utf-8", "backslashreplace")
    return str(arg)


_NO_KEYS = frozenset({
    "ACL", "ASKING", "AUTH", "BGREWRITEAOF", "BGSAVE", "CLIENT", "CLUSTER", "COMMAND", "CONFIG",
    "DBSIZE", "DEBUG", "DISCARD", "ECHO", "EXEC", "FLUSHALL", "FLUSHDB", "FUNCTION", "HELLO",
    "INFO", "KEYS", "LASTSAVE", "LATENCY", "LOLWUT", "MODULE", "MONITOR", "MULTI",
    "PING", "PSUBSCRIBE", "PUBLISH", "PUBSUB", "PUNSUBSCRIBE", "QUIT", "RANDOMKEY", "READONLY",
    "READWRITE", "RESET", "ROLE", "SAVE", "SCAN", "SCRIPT", "SELECT", "SHUTDOWN", "SLOWLOG",
    "SUBSCRIBE", "SWAPDB", "TIME", "UNSUBSCRIBE", "UNWATCH", "WAIT",
})
_ALL_KEYS = frozenset({
    "DEL", "EXISTS", "MGET", "PFCOUNT", "PFMERGE", "SDIFF", "SDIFFSTORE", "SINTER", "SINTERSTORE",
    "SUNION", "SUNIONSTORE", "TOUCH", "UNLINK", "WATCH",
})
_TWO_KEYS = frozenset({
    "BLMOVE", "BRPOPLPUSH", "COPY", "LMOVE", "RENAME", "RENAMENX", "RPOPLPUSH", "SMOVE",
})
_BLOCKING_POPS = frozenset({"BLPOP", "BRPOP", "BZPOPMAX", "BZPOPMIN"})
_SUBCOMMAND_KEY = frozenset({"MEMORY", "OBJECT", "XGROUP", "XINFO"})


def command_keys(command: Command) -> list[Arg]:
    """The keys ``command`` touches, as Redis Cluster routes them (``[]``: none).

    ``EVALSHA``/``EVAL``/``FCALL`` read ``numkeys``; ``XREAD``/``XREADGROUP``
    take the keys after ``STREAMS``; ``XGROUP``/``XINFO``/``OBJECT`` the
    argument after the subcommand; multi-key and two-key commands (``DEL``,
    ``MSET``, ``BLMOVE``, ``BLPOP`` ...) all of theirs; server commands
    (``PING``, ``SCRIPT``, ``CLUSTER``, ``PUBLISH`` ...) none (``XINFO HELP``
    and the like too: they name no key); any other
    command its first argument.
    """
    if not command:
        return []
    name = _text(command[0]).upper()
    if name in _NO_KEYS:
        return []
    if name in {"EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO", "FCALL", "FCALL_RO"}:
        if len(command) < 3:
            return []
        try:
            nkeys = int(command[2])
        except ValueError:
            return []
        return list(command[3 : 3 + max(nkeys, 0)])
    if name in {"XREADGROUP", "XREAD"}:
        upper = [_text(a).upper() for a in command]
        if "STREAMS" not in upper:
            return []
        rest = command[upper.index("STREAMS") + 1 :]
        return list(rest[: len(rest) // 2])
    if name in _SUBCOMMAND_KEY:
        return [command[2]] if len(command) > 2 else []
    if name in _ALL_KEYS:
        return list(command[1:])
    if name in {"MSET", "MSETNX"}:
        return list(command[1::2])
    if name in _TWO_KEYS:
        return list(command[1:3])
    if name in _BLOCKING_POPS:
        return list(command[1:-1])
    return [command[1]] if len(command) > 1 else []


def describe(command: Command) -> str:
    """``"XADD on key 'orders'"``: the command and its key(s), for error messages;
    a script of the library's by its name (``"EVALSHA stream_copy_ack on key
    'orders', 'orders'"``)."""
    name = _text(command[0]).upper() if command else "?"
    if name in {"PUBLISH", "SPUBLISH"} and len(command) > 1:
        return f"{name} on channel {_text(command[1])!r}"
    if name == "EVALSHA" and len(command) > 1:
        sha = command[1]
        sha = sha.encode() if isinstance(sha, str) else sha
        script = SCRIPTS.get(sha) if isinstance(sha, bytes) else None
        if script is not None:
            name = f"EVALSHA {script.name}"
    keys = command_keys(command)
    if not keys:
        return name
    shown = ", ".join(repr(_text(k)) for k in keys[:DESCRIBED_KEYS])
    if len(keys) > DESCRIBED_KEYS:  # a batched writes call declares every write's key
        shown += f" and {len(keys) - DESCRIBED_KEYS} more"
    return f"{name} on key {shown}"


DESCRIBED_KEYS = 8
"""How many of a command's keys :func:`describe` names (then how many more)."""
