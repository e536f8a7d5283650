"""The stream's batched calls: its gated scripts of one batch that share their keys, in one call.

The finalizer's first round (``_batch.first_round``) puts the RETRY copies,
dead letters, durable delays and ACKs carrying writes of one subscription in
one batched script call each (``_scripts.STREAM_COPY_ACK_BATCH``,
``STREAM_ZADD_ACK_BATCH``, ``STREAM_WRITES_ACK_BATCH``), settled per delivery
as their own plans' (``_batch.batch_replies``).  Here is how each of those
scripts' calls becomes its part of a batched call and back (``_types.Batcher``):
the stream's row (``cells.StreamCells``) lists them.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

from .. import _scripts
from .._commands import Arg, Command
from .._types import Batcher, writes_at

__all__ = ["BATCHED", "BATCHERS", "gate_range"]

_STREAM_WRITES = _scripts.STREAM_WRITES


def _id_order(eid: Arg) -> tuple[int, str, int, str]:
    """A stream id's order (``ms-seq``, decimal digits without leading zeros:
    the longer number is the larger, equal lengths compare as text)."""
    text = eid if isinstance(eid, str) else eid.decode() if isinstance(eid, bytes) else str(eid)
    ms_, _, seq = text.partition("-")
    return len(ms_), ms_, len(seq), seq


_STR = {str}
_DASH = {"-"}


def gate_range(ids: Sequence[Arg]) -> tuple[Arg, Arg, int]:
    """``lo, hi, count`` of a batched call's gates (see ``_scripts``): the
    smallest and largest of ``ids``, and at most twice as many rows."""
    first = ids[0]
    # (checked with map(): no Python-level call per id)
    if first.__class__ is str and (k := first.find("-")) > 0 and set(map(type, ids)) == _STR:
        texts: Sequence[str] = ids  # type: ignore[assignment]
        if set(map(len, texts)) == {len(first)} and set(map(itemgetter(k), texts)) == _DASH:
            # ids of one shape (the common case): ms parts of one length, so
            # seq parts too; such ids compare as text
            return min(texts), max(texts), 2 * len(ids)
    keys = list(map(_id_order, ids))
    lo = min(keys)
    hi = max(keys)
    return ids[keys.index(lo)], ids[keys.index(hi)], 2 * len(ids)


_COPY_BATCH = _scripts.STREAM_COPY_ACK_BATCH
_ZADD_BATCH = _scripts.STREAM_ZADD_ACK_BATCH
_WRITES_BATCH = _scripts.STREAM_WRITES_ACK_BATCH


class _Copies(Batcher):
    """``STREAM_COPY_ACK`` (``EVALSHA sha 2 stream dest group id fields...``)
    or, ``ex``, ``STREAM_COPY_ACK_EX`` (``... group id delete cap
    fields...``): RETRY copies and dead letters, in ``STREAM_COPY_ACK_BATCH``
    calls keyed by stream, destination, group, delete and cap."""

    __slots__ = ("ex",)

    def __init__(self, ex: bool) -> None:
        self.ex = ex

    def part(self, cmd: Command) -> tuple[tuple[Arg, ...], tuple[Arg, ...]] | None:
        if cmd[2] != 2:
            return None
        if self.ex:
            fields = cmd[9:]
            key = (_COPY_BATCH.sha, cmd[3], cmd[4], cmd[5], str(cmd[7]), str(cmd[8]))
        else:
            fields = cmd[7:]
            key = (_COPY_BATCH.sha, cmd[3], cmd[4], cmd[5], "0", "0")
        return key, (cmd[6], len(fields), *fields)

    def call(self, singles: Sequence[Command], args: Sequence[Arg]) -> Command:
        c = singles[0]
        gates = gate_range([s[6] for s in singles])
        delete, cap_ = (c[7], c[8]) if self.ex else ("0", "0")
        return _COPY_BATCH.command((c[3], c[4]), (c[5], delete, cap_, *gates, *args))

    def singles(self, cmd: Command) -> list[Command]:
        stream, dest, group = cmd[3], cmd[4], cmd[5]
        delete, cap_ = cmd[6], cmd[7]  # ... group how cap lo hi count (id n values...)...
        plain = str(delete) == "0" and str(cap_) == "0"
        out: list[Command] = []
        i = 11
        while i < len(cmd):
            n = int(cmd[i + 1])
            eid, fields = cmd[i], cmd[i + 2:i + 2 + n]
            if plain:
                out.append(_scripts.STREAM_COPY_ACK.command((stream, dest), (group, eid, *fields)))
            else:
                out.append(_scripts.STREAM_COPY_ACK_EX.command(
                    (stream, dest), (group, eid, delete, cap_, *fields)))
            i += 2 + n
        return out


class _Delays(Batcher):
    """A durable delay's script (``EVALSHA sha 2 stream delays group id delay
    member``; how it removes: ``how``), in ``STREAM_ZADD_ACK_BATCH`` calls."""

    __slots__ = ("how",)

    def __init__(self, how: str) -> None:
        self.how = how

    def part(self, cmd: Command) -> tuple[tuple[Arg, ...], tuple[Arg, ...]] | None:
        if cmd[2] != 2:
            return None
        return (_ZADD_BATCH.sha, cmd[3], cmd[4], cmd[5], self.how), tuple(cmd[6:9])

    def call(self, singles: Sequence[Command], args: Sequence[Arg]) -> Command:
        c = singles[0]
        gates = gate_range([s[6] for s in singles])
        return _ZADD_BATCH.command((c[3], c[4]), (c[5], self.how, *gates, *args))

    def singles(self, cmd: Command) -> list[Command]:
        stream, dest, group = cmd[3], cmd[4], cmd[5]
        script = _ZADD_BY_HOW[str(cmd[6])]  # ... group how lo hi count (id delay member)...
        return [script.command((stream, dest), (group, *cmd[i:i + 3])) for i in range(10, len(cmd), 3)]


_ZADD_BY_HOW = {
    "0": _scripts.STREAM_ZADD_ACK, "1": _scripts.STREAM_ZADD_ACK_DEL, "x": _scripts.STREAM_ZADD_ACKDEL,
}


class _AckWrites(Batcher):
    """``STREAM_WRITES`` calls of op ``ack`` (an ACK or DROP with writes;
    ``EVALSHA sha nk stream stream keys... group id ack how 0 nw writes...``)
    in ``STREAM_WRITES_ACK_BATCH`` calls, keyed by stream, group and how; the
    rest (a copy, a durable delay) go alone."""

    __slots__ = ()

    def part(self, cmd: Command) -> tuple[tuple[Arg, ...], tuple[Arg, ...]] | None:
        nk = cmd[2]
        if nk.__class__ is not int or nk < 2 or len(cmd) < 9 + nk:
            return None
        at = 3 + nk  # the group
        if cmd[at + 2] != "ack" or cmd[3] != cmd[4] or cmd[at + 4] != 0:
            return None
        return (_WRITES_BATCH.sha, cmd[3], cmd[at], cmd[at + 3]), (cmd[at + 1], *cmd[at + 5:])

    def call(self, singles: Sequence[Command], args: Sequence[Arg]) -> Command:
        """Its keys: the stream's and every delivery's writes' keys, each once."""
        c = singles[0]
        nk = c[2]
        assert isinstance(nk, int)
        keys = list(dict.fromkeys(k for s in singles for k in s[5:3 + int(s[2])]))
        gates = gate_range([s[4 + int(s[2])] for s in singles])
        return _WRITES_BATCH.command((c[3], *keys), (c[3 + nk], c[6 + nk], *gates, *args))

    def singles(self, cmd: Command) -> list[Command]:
        """Each delivery's ``STREAM_WRITES`` call, its keys those its writes name."""
        nk = cmd[2]
        assert isinstance(nk, int)
        stream, at = cmd[3], 3 + nk
        group, how = cmd[at], cmd[at + 1]
        out: list[Command] = []
        i = at + 5  # past group, how, lo, hi, count
        while i < len(cmd):
            eid = cmd[i]
            keys, j = writes_at(cmd, i + 1)
            out.append(_STREAM_WRITES.command(
                (stream, stream, *keys), (group, eid, "ack", how, 0, *cmd[i + 1:j])))
            i = j
        return out


_COPIES = _Copies(ex=False)
_COPIES_EX = _Copies(ex=True)
_ACK_WRITES = _AckWrites()
BATCHERS: dict[object, Batcher] = {
    _scripts.STREAM_COPY_ACK.sha: _COPIES,
    _scripts.STREAM_COPY_ACK_EX.sha: _COPIES_EX,
    _scripts.STREAM_ZADD_ACK.sha: _Delays("0"),
    _scripts.STREAM_ZADD_ACK_DEL.sha: _Delays("1"),
    _scripts.STREAM_ZADD_ACKDEL.sha: _Delays("x"),
    _STREAM_WRITES.sha: _ACK_WRITES,
}
BATCHED: dict[object, Batcher] = {
    _COPY_BATCH.sha: _COPIES, _ZADD_BATCH.sha: _Delays("0"), _WRITES_BATCH.sha: _ACK_WRITES,
}
