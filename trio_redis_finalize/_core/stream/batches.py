"""The stream's batched calls: its gated scripts of one batch that share their keys, in one call.

The finalizer's first round (``_batch.first_round``) puts the RETRY copies,
dead letters, durable delays and ACKs carrying writes of one subscription in
one batched script call each (``scripts.STREAM_COPY_ACK_BATCH``,
``STREAM_ZADD_ACK_BATCH``, ``STREAM_WRITES_ACK_BATCH``), settled per delivery
as their own plans' (``_batch.batch_replies``).  Here is how each of those
scripts' calls becomes its part of a batched call and back (``_types.Batcher``):
the stream's row (``cells.StreamCells``) lists them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from itertools import compress
from operator import attrgetter, itemgetter
from typing import Any, cast

from ..._delivery import Delivery
from ..._outcome import Outcome
from .._carrying import argv_at
from .._commands import Arg, Command, splice_batches
from .._lua import STREAM_BATCH_MAX, STREAM_BATCH_VALUES
from .._lua_writes import SAME_WRITES
from .._types import Batcher, Target, args_at, fields_of, fixed_at, writes_at
from . import scripts

__all__ = ["BATCHED", "BATCHERS", "ack_writes_calls", "gate_range"]

_STREAM_WRITES = scripts.STREAM_WRITES
_DELIVERY = itemgetter(0)
_ENTRY_ID = attrgetter("id")


def _id_order(eid: Arg) -> tuple[int, str, int, str]:
    """A stream id's order (``ms-seq``, decimal digits without leading zeros:
    the longer number is the larger, equal lengths compare as text)."""
    text = eid if isinstance(eid, str) else eid.decode() if isinstance(eid, bytes) else str(eid)
    ms_, _, seq = text.partition("-")
    return len(ms_), ms_, len(seq), seq


def gate_range(ids: Sequence[Arg]) -> tuple[Arg, Arg, int]:
    """``lo, hi, count`` of a batched call's gates (see ``scripts``): the
    smallest and largest of ``ids``, and at most twice as many rows.

    Ids as text (``ms-seq``, decimal, no leading zeros) of one length whose
    ms parts are of one length too (the dash at one place) compare as text,
    digit against digit (``2-1000`` and ``1000-0`` are of one length, but
    not their ms parts).  Of several lengths but one ms (a burst), the
    smallest is the smallest of the shortest, the largest the largest of
    the longest.  Found in C: a few passes over the ids, no call per id;
    anything else by each id's order.
    """
    if ids[0].__class__ is str:
        texts = cast("Sequence[str]", ids)
        try:
            lens = [*map(len, texts)]
            lo_t, hi_t = min(texts), max(texts)  # (TypeError: not all text)
        except TypeError:
            pass
        else:
            short, long = min(lens), max(lens)
            k = lo_t.find("-")
            # one length, the dash of each at one place: every long-th character
            # from the first id's dash on (a join and a slice, in C)
            if short == long and "".join(texts)[k::long] == "-" * len(texts):
                return lo_t, hi_t, 2 * len(ids)
            if k > 0 and hi_t.startswith(lo_t[:k + 1]):
                # (every id between the two by text shares their "ms-")
                return (min(compress(texts, map(short.__eq__, lens))),
                        max(compress(texts, map(long.__eq__, lens))), 2 * len(ids))
    keys = list(map(_id_order, ids))
    lo = min(keys)
    hi = max(keys)
    return ids[keys.index(lo)], ids[keys.index(hi)], 2 * len(ids)


_COPY = scripts.STREAM_COPY_ACK
_COPY_EX = scripts.STREAM_COPY_ACK_EX
_COPY_BATCH = scripts.STREAM_COPY_ACK_BATCH
_ZADD_BATCH = scripts.STREAM_ZADD_ACK_BATCH
_WRITES_BATCH = scripts.STREAM_WRITES_ACK_BATCH
_ZADD_BY_HOW = {
    "0": scripts.STREAM_ZADD_ACK, "1": scripts.STREAM_ZADD_ACK_DEL, "x": scripts.STREAM_ZADD_ACKDEL,
}

# the places every single stream script shares (its two keys, then group and
# id), read by name once: the scripts below are batched per delivery
_STREAM, _DEST, _GROUP, _ID = (fixed_at(_COPY, n) for n in ("stream", "dest", "group", "id"))
for _s in (_COPY_EX, *_ZADD_BY_HOW.values()):
    assert (fixed_at(_s, "stream"), fixed_at(_s, "group"), fixed_at(_s, "id")) == (_STREAM, _GROUP, _ID)
    assert _s.key_at(_s.keys[1] if _s.keys else "") == _DEST
_FIELDS = fixed_at(_COPY, "fields...")
_HOW, _CAP, _FIELDS_EX = (fixed_at(_COPY_EX, n) for n in ("how", "cap", "fields..."))
_DELAY_ARGS = slice(_ID, fixed_at(_ZADD_BY_HOW["0"], "member") + 1)  # id, delay_ms, member


@dataclasses.dataclass(frozen=True, slots=True)
class _Copies(Batcher):
    """``STREAM_COPY_ACK`` or, ``ex``, ``STREAM_COPY_ACK_EX`` calls (RETRY
    copies, dead letters) in ``STREAM_COPY_ACK_BATCH`` calls keyed by stream,
    destination, group, how (delete) and cap; the part of each: id, n, its
    n fields."""

    ex: bool

    def part(self, cmd: Command) -> tuple[tuple[Arg, ...], tuple[Arg, ...]] | None:
        if cmd[2] != 2:
            return None
        if self.ex:
            fields = cmd[_FIELDS_EX:]
            key = (_COPY_BATCH.sha, cmd[_STREAM], cmd[_DEST], cmd[_GROUP], str(cmd[_HOW]),
                   str(cmd[_CAP]))
        else:
            fields = cmd[_FIELDS:]
            key = (_COPY_BATCH.sha, cmd[_STREAM], cmd[_DEST], cmd[_GROUP], "0", "0")
        return key, (cmd[_ID], len(fields), *fields)

    def call(self, singles: Sequence[Command], args: Sequence[Arg]) -> Command:
        c = singles[0]
        gates = gate_range([s[_ID] for s in singles])
        how, cap_ = (c[_HOW], c[_CAP]) if self.ex else ("0", "0")
        return _COPY_BATCH.command((c[_STREAM], c[_DEST]), (c[_GROUP], how, cap_, *gates, *args))

    def singles(self, cmd: Command) -> list[Command]:
        b = _COPY_BATCH
        stream, dest, group, how, cap_ = fields_of(b, cmd, "stream", "dest", "group", "how", "cap")
        plain = str(how) == "0" and str(cap_) == "0"
        values = b.rest(cmd, "id")  # (id n fields...)...
        out: list[Command] = []
        i = 0
        while i < len(values):
            n = int(values[i + 1])
            eid, fields = values[i], values[i + 2:i + 2 + n]
            if plain:
                out.append(_COPY.command((stream, dest), (group, eid, *fields)))
            else:
                out.append(_COPY_EX.command((stream, dest), (group, eid, how, cap_, *fields)))
            i += 2 + n
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class _Delays(Batcher):
    """A durable delay's script (how it removes: ``how``), in
    ``STREAM_ZADD_ACK_BATCH`` calls keyed by stream, delay set, group and
    how; the part of each: id, delay_ms, member."""

    how: str

    def part(self, cmd: Command) -> tuple[tuple[Arg, ...], tuple[Arg, ...]] | None:
        if cmd[2] != 2:
            return None
        return (_ZADD_BATCH.sha, cmd[_STREAM], cmd[_DEST], cmd[_GROUP], self.how), tuple(cmd[_DELAY_ARGS])

    def call(self, singles: Sequence[Command], args: Sequence[Arg]) -> Command:
        c = singles[0]
        gates = gate_range([s[_ID] for s in singles])
        return _ZADD_BATCH.command((c[_STREAM], c[_DEST]), (c[_GROUP], self.how, *gates, *args))

    def singles(self, cmd: Command) -> list[Command]:
        b = _ZADD_BATCH
        stream, delays, group, how = fields_of(b, cmd, "stream", "delays", "group", "how")
        script = _ZADD_BY_HOW[str(how)]
        return [script.command((stream, delays), (group, *g)) for g in b.groups(cmd, "id")]


_W = _STREAM_WRITES
# STREAM_WRITES' arguments, from ARGV[1] (its keys: stream, dest, write_keys...)
_W_GROUP, _W_ID, _W_OP, _W_HOW, _W_CAP, _W_WRITES = (
    args_at(_W, n) for n in ("group", "id", "op", "how", "cap", "writes..."))
_W_STREAM, _W_DEST, _W_KEYS = (fixed_at(_W, n) for n in ("stream", "dest", "write_keys..."))
_WB = _WRITES_BATCH
_SAME = SAME_WRITES


class _AckWrites(Batcher):
    """``STREAM_WRITES`` calls of op ``ack`` (an ACK or DROP with writes:
    ``dest`` the stream, ``cap`` 0) in ``STREAM_WRITES_ACK_BATCH`` calls,
    keyed by stream, group and how; the part of each: id, its encoded writes;
    the rest (a copy, a durable delay) go alone."""

    __slots__ = ()

    def part(self, cmd: Command) -> tuple[tuple[Arg, ...], tuple[Arg, ...]] | None:
        at = argv_at(cmd, 2, 6)
        if at is None:
            return None
        if cmd[at + _W_OP] != "ack" or cmd[_W_STREAM] != cmd[_W_DEST] or cmd[at + _W_CAP] != 0:
            return None
        return ((_WB.sha, cmd[_W_STREAM], cmd[at + _W_GROUP], cmd[at + _W_HOW]),
                (cmd[at + _W_ID], *cmd[at + _W_WRITES:]))

    def call(self, singles: Sequence[Command], args: Sequence[Arg]) -> Command:
        """Its keys: the stream's and every delivery's writes' keys, each once."""
        c = singles[0]
        keys = list(dict.fromkeys(k for s in singles for k in s[_W_KEYS:3 + int(s[2])]))
        gates = gate_range([s[3 + int(s[2]) + _W_ID] for s in singles])
        group, how = fields_of(_W, c, "group", "how")
        # a delivery's writes equal to those before it: SAME_WRITES (the hot
        # path, ack_writes_calls, sends it for one outcome object only)
        parts: list[Arg] = []
        before: Sequence[Arg] = ()
        i = 0
        while i < len(args):
            _, j = writes_at(args, i + 1)
            writes = args[i + 1:j]
            parts += (args[i], _SAME) if writes == before and parts else args[i:j]
            before, i = writes, j
        return _WB.command((c[_W_STREAM], *keys), (group, how, *gates, *parts))

    def singles(self, cmd: Command) -> list[Command]:
        """Each delivery's ``STREAM_WRITES`` call, its keys those its writes name."""
        stream, group, how = fields_of(_WB, cmd, "stream", "group", "how")
        values = _WB.rest(cmd, "id")  # (id, writes...)...
        out: list[Command] = []
        keys: list[str | bytes] = []
        writes: Sequence[Arg] = ()
        i = 0
        while i < len(values):
            if values[i + 1] == _SAME:  # the writes of the delivery before
                j = i + 2
            else:
                keys, j = writes_at(values, i + 1)
                writes = values[i + 1:j]
            out.append(_W.command((stream, stream, *keys),
                                  (group, values[i], "ack", how, 0, *writes)))
            i = j
        return out


_COPIES = _Copies(ex=False)
_COPIES_EX = _Copies(ex=True)
_ACK_WRITES = _AckWrites()
BATCHERS: dict[object, Batcher] = {
    _COPY.sha: _COPIES,
    _COPY_EX.sha: _COPIES_EX,
    **{s.sha: _Delays(how) for how, s in _ZADD_BY_HOW.items()},
    _W.sha: _ACK_WRITES,
}
"""The stream's gated scripts whose calls are batched, by sha (``Cells.batchers``)."""
BATCHED: dict[object, Batcher] = {
    _COPY_BATCH.sha: _COPIES, _ZADD_BATCH.sha: _Delays("0"), _WB.sha: _ACK_WRITES,
}
"""The batched scripts they go in, by sha (``Cells.batched``)."""


def ack_writes_calls(t: Target, how: str, items: Sequence[tuple[Delivery, Outcome]],
                     encode: Callable[[Any], tuple[Sequence[Arg], Sequence[Arg]]]
                     ) -> list[tuple[Command, int]]:
    """The ``STREAM_WRITES_ACK_BATCH`` calls of ACKs and DROPs carrying writes
    (``items``: each delivery and its outcome; the finalizer's hot path for
    them, ``_core._hot_writes``), built directly: ``(call, how many
    deliveries it carries)``, in order.  ``encode(outcome)``: its writes as
    the script reads them (``_writes.encode_writes``) and the keys they
    name, once per outcome object in a row.

    The calls are the ones :func:`~.._batch.first_round` makes of those
    deliveries' own ``STREAM_WRITES`` plans (``_AckWrites``: at most
    ``STREAM_BATCH_MAX`` deliveries and about ``STREAM_BATCH_VALUES`` values
    each, every key once), without a plan per delivery; one delivery too
    goes as a batched call (its reply read the same way).
    """
    src, group = t.source, t.group
    ids: list[Arg] = [*map(_ENTRY_ID, map(_DELIVERY, items))]

    def head(keys: Sequence[Arg], i: int, j: int) -> Command:
        return _WB.command((src, *keys), (group, how, *gate_range(ids[i:j])))

    return splice_batches(items, [*zip(ids)], encode, head, STREAM_BATCH_MAX, STREAM_BATCH_VALUES,
                          ids, _SAME)  # type: ignore[arg-type]
