"""A finalizer batch's first round: commands, their owners, the steps left.

Sans-IO: the finalizer (``_finalizer``) sends what this decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from .._writes import write_keys
from . import _lua
from ._commands import Arg, Command
from ._plan import Effect, Plan
from .reliable_list import scripts as list_scripts
from .stream import scripts as stream_scripts

__all__ = [
    "BATCHED", "COPIED", "batch_part", "batch_replies", "batch_singles",
    "counted_removals", "fast_index", "fast_owner",
    "first_round", "gate_range", "is_batched", "merge_commands", "with_counts",
]


def fast_owner(i: int) -> int:
    """The owner of the hot path's command ``i`` (no plan): ``-(i + 1)``,
    negative where a plan's index is not."""
    return -(i + 1)


def fast_index(owner: int) -> int:
    """The hot path's command that ``owner`` (< 0, :func:`fast_owner`) stands for."""
    return -owner - 1

_COPY = stream_scripts.STREAM_COPY_ACK.sha
_COPY_EX = stream_scripts.STREAM_COPY_ACK_EX.sha
_ZADD = stream_scripts.STREAM_ZADD_ACK.sha
_ZADD_DEL = stream_scripts.STREAM_ZADD_ACK_DEL.sha
_ZADD_ACKDEL = stream_scripts.STREAM_ZADD_ACKDEL.sha
_COPY_BATCH = stream_scripts.STREAM_COPY_ACK_BATCH.sha
_ZADD_BATCH = stream_scripts.STREAM_ZADD_ACK_BATCH.sha
_WRITES = stream_scripts.STREAM_WRITES.sha
_WRITES_BATCH = stream_scripts.STREAM_WRITES_ACK_BATCH.sha
_LIST_WRITES = list_scripts.LIST_WRITES.sha
_LIST_WRITES_BATCH = list_scripts.LIST_WRITES_REMOVE_BATCH.sha
_SINGLE = frozenset({_COPY, _COPY_EX, _ZADD, _ZADD_DEL, _ZADD_ACKDEL})
# a durable delay's single script -> the batched call's ``how`` (see ``_lua.HOW``), and back
_ZADD_HOW = {_ZADD: "0", _ZADD_DEL: "1", _ZADD_ACKDEL: "x"}
_ZADD_BY_HOW = {
    "0": stream_scripts.STREAM_ZADD_ACK, "1": stream_scripts.STREAM_ZADD_ACK_DEL,
    "x": stream_scripts.STREAM_ZADD_ACKDEL,
}

BATCHED = frozenset({_COPY_BATCH, _ZADD_BATCH, _WRITES_BATCH, _LIST_WRITES_BATCH})
"""The shas of the batched scripts: :func:`batch_replies` reads their reply
as one element per owner."""


COPIED = 1
"""The element :func:`batch_replies` gives a delivery of a batched call that
its reply did not list: copied (or added to the delay set), its original
removed (the single script answers the new id or the due time; no
settlement reads it)."""


def batch_replies(reply: object, n: int) -> list[Any] | None:
    """The elements of a batched call's ``reply``, one per delivery in order
    (what each delivery's single script would have answered), or None when
    ``reply`` is not a reply of ``n`` deliveries.

    The batched scripts answer ``[n, at, element, ...]``: only the
    deliveries not finalized, by place (1-based), a closed gate's nil or an
    error; the others get :data:`COPIED`.
    """
    if reply.__class__ is not list:
        return None
    if not reply or reply[0] != n or len(reply) % 2 != 1:
        return None
    out: list[Any] = [COPIED] * n
    for k in range(1, len(reply), 2):
        at = reply[k]
        if at.__class__ is not int or not 0 < at <= n:
            return None
        out[at - 1] = reply[k + 1]
    return out


def is_batched(cmd: Command) -> bool:
    """True for a batched script call (its reply: see :func:`batch_replies`)."""
    return cmd[0] == b"EVALSHA" and cmd[1] in BATCHED


def batch_singles(cmd: Command) -> list[Command]:
    """The single-script commands a batched call ``cmd`` carries, in the order
    of its reply's elements (what each delivery's plan would send alone)."""
    if cmd[1] == _WRITES_BATCH:
        return _writes_singles(cmd)
    if cmd[1] == _LIST_WRITES_BATCH:
        return _list_writes_singles(cmd)
    sha, stream, dest, group = cmd[1], cmd[3], cmd[4], cmd[5]
    out: list[Command] = []
    if sha == _ZADD_BATCH:  # ... group how lo hi count (id delay member)...
        script = _ZADD_BY_HOW[str(cmd[6])]
        for i in range(10, len(cmd), 3):
            out.append(script.command((stream, dest), (group, *cmd[i:i + 3])))
        return out
    if sha != _COPY_BATCH:
        raise ValueError(f"not a batched script call: {cmd[:2]!r}")
    delete, cap = cmd[6], cmd[7]  # ... group how cap lo hi count (id n values...)...
    plain = str(delete) == "0" and str(cap) == "0"
    i = 11
    while i < len(cmd):
        n = int(cmd[i + 1])
        eid, fields = cmd[i], cmd[i + 2:i + 2 + n]
        if plain:
            out.append(stream_scripts.STREAM_COPY_ACK.command((stream, dest), (group, eid, *fields)))
        else:
            out.append(stream_scripts.STREAM_COPY_ACK_EX.command(
                (stream, dest), (group, eid, delete, cap, *fields)))
        i += 2 + n
    return out


def _writes_part(cmd: Command) -> tuple[tuple[Arg, ...], tuple[Arg, ...]] | None:
    """:func:`batch_part` of a ``STREAM_WRITES`` call: those of op ``ack``
    (an ACK or DROP with writes; ``EVALSHA sha nk stream stream keys... group
    id ack how 0 nw writes...``) go in ``STREAM_WRITES_ACK_BATCH`` calls, keyed
    by stream, group and how; the rest (a copy, a durable delay) go alone."""
    nk = cmd[2]
    if nk.__class__ is not int or nk < 2 or len(cmd) < 9 + nk:
        return None
    at = 3 + nk  # the group
    if cmd[at + 2] != "ack" or cmd[3] != cmd[4] or cmd[at + 4] != 0:
        return None
    return (_WRITES_BATCH, cmd[3], cmd[at], cmd[at + 3]), (cmd[at + 1], *cmd[at + 5:])


def _writes_batch(singles: Sequence[Command], args: Sequence[Arg]) -> Command:
    """The ``STREAM_WRITES_ACK_BATCH`` call of ``singles`` (their parts: ``args``):
    keys, the stream's and every delivery's writes' keys, each once."""
    c = singles[0]
    nk = c[2]
    assert isinstance(nk, int)
    keys = list(dict.fromkeys(k for s in singles for k in s[5:3 + int(s[2])]))
    gates = gate_range([s[4 + int(s[2])] for s in singles])
    return (b"EVALSHA", _WRITES_BATCH, 1 + len(keys), c[3], *keys, c[3 + nk], c[6 + nk],
            *gates, *args)


def _writes_singles(cmd: Command) -> list[Command]:
    """:func:`batch_singles` of a ``STREAM_WRITES_ACK_BATCH`` call: each
    delivery's ``STREAM_WRITES`` call, its keys those its writes name."""
    nk = cmd[2]
    assert isinstance(nk, int)
    stream, at = cmd[3], 3 + nk
    group, how = cmd[at], cmd[at + 1]
    out: list[Command] = []
    i = at + 5  # past group, how, lo, hi, count
    while i < len(cmd):
        eid = cmd[i]
        keys, j = _writes_at(cmd, i + 1)
        out.append(stream_scripts.STREAM_WRITES.command(
            (stream, stream, *keys), (group, eid, "ack", how, 0, *cmd[i + 1:j])))
        i = j
    return out


def _writes_at(cmd: Command, i: int) -> tuple[list[str | bytes], int]:
    """The keys of the encoded writes at ``cmd[i]`` (``nw``, then each write's
    count of values, key type and command), and the index after them."""
    writes: list[tuple[Arg, ...]] = []
    j = i + 1
    for _ in range(int(cmd[i])):
        argc = int(cmd[j])
        writes.append(tuple(cmd[j + 2:j + 2 + argc]))
        j += 2 + argc
    return write_keys(writes), j  # type: ignore[arg-type]


def _list_writes_part(cmd: Command) -> tuple[tuple[Arg, ...], tuple[Arg, ...]] | None:
    """:func:`batch_part` of a ``LIST_WRITES`` call: those of op ``remove``
    (an ACK or DROP with writes; ``EVALSHA sha nk list list list keys...
    element remove nw writes... n``) go in ``LIST_WRITES_REMOVE_BATCH`` calls,
    keyed by the processing list; the rest (a copy, a dead letter, a durable
    delay) go alone."""
    nk = cmd[2]
    if nk.__class__ is not int or nk < 3 or len(cmd) < 7 + nk:
        return None
    at = 3 + nk  # the element
    if cmd[at + 1] != "remove" or not cmd[3] == cmd[4] == cmd[5]:
        return None
    return (_LIST_WRITES_BATCH, cmd[3]), (cmd[at], cmd[-1], *cmd[at + 2:-1])


def _list_writes_batch(singles: Sequence[Command], args: Sequence[Arg]) -> Command:
    """The ``LIST_WRITES_REMOVE_BATCH`` call of ``singles`` (their parts:
    ``args``): keys, the processing list and every element's writes' keys, each once."""
    keys = list(dict.fromkeys(k for s in singles for k in s[6:3 + int(s[2])]))
    return (b"EVALSHA", _LIST_WRITES_BATCH, 1 + len(keys), singles[0][3], *keys, *args)


def _list_writes_singles(cmd: Command) -> list[Command]:
    """:func:`batch_singles` of a ``LIST_WRITES_REMOVE_BATCH`` call: each
    element's ``LIST_WRITES`` call (with its ``n``), its keys those its writes name."""
    nk = cmd[2]
    assert isinstance(nk, int)
    processing = cmd[3]
    out: list[Command] = []
    i = 3 + nk
    while i < len(cmd):
        e, n = cmd[i], cmd[i + 1]
        keys, j = _writes_at(cmd, i + 2)
        out.append(list_scripts.LIST_WRITES.command(
            (processing, processing, processing, *keys), (e, "remove", *cmd[i + 2:j], n)))
        i = j
    return out


def counted_removals(cmd: Command) -> list[tuple[int, Any, Any]]:
    """``(at, element, n)`` of each element of a ``LIST_WRITES_REMOVE_BATCH``
    call, in order: ``cmd[at]`` is its ``n`` (its counted gate), which
    :func:`with_counts` rewrites (the reliable list's counted gates, before
    each send); cheaper than :func:`batch_singles` (no command built)."""
    nk = cmd[2]
    assert isinstance(nk, int)
    out: list[tuple[int, Any, Any]] = []
    i = 3 + nk
    end = len(cmd)
    while i < end:
        out.append((i + 1, cmd[i], cmd[i + 1]))
        j = i + 3
        for _ in range(int(cmd[i + 2])):
            j += 2 + int(cmd[j])
        i = j
    return out


def with_counts(cmd: Command, counts: Sequence[tuple[int, int]]) -> Command:
    """``cmd`` (a ``LIST_WRITES_REMOVE_BATCH`` call) with ``cmd[at] = n`` for
    each ``(at, n)`` of ``counts`` (see :func:`counted_removals`)."""
    out = list(cmd)
    for at, n in counts:
        out[at] = n
    return tuple(out)


def _id_order(eid: Arg) -> tuple[int, str, int, str]:
    """A stream id's order (``ms-seq``, decimal digits without leading zeros:
    the longer number is the larger, equal lengths compare as text)."""
    text = eid if isinstance(eid, str) else eid.decode() if isinstance(eid, bytes) else str(eid)
    ms, _, seq = text.partition("-")
    return len(ms), ms, len(seq), seq


_UNSET = object()
_STR = {str}
_DASH = {"-"}


def gate_range(ids: Sequence[Arg]) -> tuple[Arg, Arg, int]:
    """``lo, hi, count`` of a batched call's gates (see ``_lua``): the
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


def batch_part(cmd: Command) -> tuple[tuple[Arg, ...], tuple[Arg, ...]] | None:
    """``(key, part)`` of a gated stream script that a batched call can carry,
    else None.

    ``key``: what the deliveries of one batched call share -- the batched
    script, its keys (stream; destination stream or delay set) and its fixed
    arguments (group, delete, cap); ``part``: this delivery's arguments in
    the batched call (see ``stream_scripts.STREAM_COPY_ACK_BATCH`` /
    ``STREAM_ZADD_ACK_BATCH``).
    """
    if cmd[0] != b"EVALSHA":
        return None
    sha = cmd[1]
    if sha == _WRITES:
        return _writes_part(cmd)
    if sha == _LIST_WRITES:
        return _list_writes_part(cmd)
    if sha not in _SINGLE or cmd[2] != 2:
        return None
    if sha == _COPY:  # EVALSHA sha 2 stream dest group id fields...
        fields = cmd[7:]
        return (_COPY_BATCH, cmd[3], cmd[4], cmd[5], "0", "0"), (cmd[6], len(fields), *fields)
    if sha == _COPY_EX:  # EVALSHA sha 2 stream dest group id delete cap fields...
        fields = cmd[9:]
        return ((_COPY_BATCH, cmd[3], cmd[4], cmd[5], str(cmd[7]), str(cmd[8])),
                (cmd[6], len(fields), *fields))
    # EVALSHA sha 2 stream delays group id delay member
    return (_ZADD_BATCH, cmd[3], cmd[4], cmd[5], _ZADD_HOW[sha]), tuple(cmd[6:9])


def first_round(
    fast: Sequence[Command], plans: Sequence[Plan]
) -> tuple[list[Command], list[tuple[int, ...]], list[list[Command]]]:
    """The first pipeline of a batch: commands, their owners, the steps left.

    ``owners[i]``: the indexes of the plans that command ``i`` serves
    (negative: the hot path's removal command ``fast[k]``, see
    :func:`fast_owner`), each sent as it is.  Plans' single-``XACK``
    commands merge per stream and group, as :func:`merge_commands` does,
    never into a hot-path removal: its own reply settles it (a short
    ``XACK`` count is ``gate_closed``).  Plans of one gated
    stream script that share its keys and fixed arguments (RETRY copies,
    dead letters, durable delays of one subscription; ACKs and DROPs carrying
    writes, a stream's or a reliable list's, whose calls declare every
    delivery's write keys) go in batched script
    calls (:func:`batch_part`), at most ``STREAM_BATCH_MAX`` deliveries and
    about ``STREAM_BATCH_VALUES`` values each, at the place of their first
    plan; the owners of a batched call are its deliveries' plans, in the
    order of its reply's elements; a call that would carry one delivery is
    that plan's own command.  A plan that is not
    gated and has several steps (a cross-slot copy, then the removal of the
    original) sends only its first step; ``rest[j]`` holds the others, each
    sent once the one before it succeeded: a removal never follows a copy
    that failed or whose outcome is unknown.
    """
    out: list[Any] = []
    owners: list[list[int]] = []
    rest: list[list[Command]] = [[] for _ in plans]
    xacks: dict[tuple[Any, Any], int] = {}

    def add(cmds: Sequence[Command], j: int) -> None:
        if len(cmds) == 1 and cmds[0][0] == "XACK":
            c = cmds[0]
            key = (c[1], c[2])
            at = xacks.get(key)
            if at is None:
                xacks[key] = len(out)
                out.append(["XACK", c[1], c[2], *c[3:]])
                owners.append([j])
            else:
                out[at].extend(c[3:])
                if j not in owners[at]:
                    owners[at].append(j)
            return
        for c in cmds:
            out.append(c)
            owners.append([j])

    for i, c in enumerate(fast):
        # the hot path's removals go as they are, never merged with a plan's
        # XACK: their own reply is what settles them (a short XACK is gate_closed)
        out.append(c)
        owners.append([fast_owner(i)])
    # batched calls being filled: key -> [place in out, plans, their single
    # commands, arguments, values]
    batches: dict[tuple[Arg, ...], list[Any]] = {}
    placed: list[list[Any]] = []
    cap = _lua.STREAM_BATCH_MAX
    room = _lua.STREAM_BATCH_VALUES
    # the script and keys of the last batched plan, its key, where its values
    # start, and its call
    lsha: object = _UNSET
    l3: object = _UNSET
    l4: object = _UNSET
    l5: object = _UNSET
    lkey: tuple[Arg, ...] = ()
    lat = 0
    lb: list[Any] | None = None
    for j, p in enumerate(plans):
        cmds = p.commands
        if len(cmds) == 1 and cmds[0][0] != "XACK":  # one script (the common case), inline
            c = cmds[0]
            sha = c[1]
            if c[0] == b"EVALSHA" and sha in _SINGLE and p.gated and c[2] == 2:
                # a gated stream script: into the batched call of its keys (the
                # key looked up only when it is not the one of the plan before)
                if sha == lsha and c[3] is l3 and c[4] is l4 and c[5] is l5:
                    key, at, b = lkey, lat, lb
                else:
                    if sha == _COPY:
                        key, at = (_COPY_BATCH, c[3], c[4], c[5], "0", "0"), 7
                    elif sha == _COPY_EX:
                        key, at = (_COPY_BATCH, c[3], c[4], c[5], str(c[7]), str(c[8])), 9
                    else:
                        key, at = (_ZADD_BATCH, c[3], c[4], c[5], _ZADD_HOW[sha]), 0
                    b = batches.get(key)
                    # an EX copy's key has its own arguments too: never reused
                    lsha = sha if sha != _COPY_EX else _UNSET
                    l3, l4, l5, lkey, lat = c[3], c[4], c[5], key, at
                size = len(c) - at + 2 if at else 3
                if b is None or len(b[1]) >= cap or b[4] + size > room:
                    b = batches[key] = [len(out), [], [], [], 0]
                    placed.append(b)
                    out.append(None)
                    owners.append([])
                lb = b
                b[1].append(j)
                b[2].append(c)
                args = b[3]
                if at:  # id, n, the copy's n values
                    args += (c[6], size - 2)
                    args += c[at:]
                else:  # id, delay, member
                    args += c[6:9]
                b[4] += size
                continue
            if sha in (_WRITES, _LIST_WRITES) and c[0] == b"EVALSHA" and p.gated:
                bp = _writes_part(c) if sha == _WRITES else _list_writes_part(c)
                if bp is not None:  # an ACK or DROP with writes: into its batched call
                    key, part = bp
                    b = batches.get(key)
                    size = len(part)
                    if b is None or len(b[1]) >= cap or b[4] + size > room:
                        b = batches[key] = [len(out), [], [], [], 0]
                        placed.append(b)
                        out.append(None)
                        owners.append([])
                    b[1].append(j)
                    b[2].append(c)
                    b[3] += part
                    b[4] += size
                    continue
            out.append(c)
            owners.append([j])
            continue
        if not p.gated and len(cmds) > 1:
            rest[j] = list(cmds[1:])
            cmds = cmds[:1]
        add(cmds, j)
    for at, members, singles, args, _ in placed:
        owners[at] = members
        if len(members) == 1:
            out[at] = singles[0]
        elif singles[0][1] == _WRITES:
            out[at] = _writes_batch(singles, args)
        elif singles[0][1] == _LIST_WRITES:
            out[at] = _list_writes_batch(singles, args)
        else:
            c = singles[0]
            sha = c[1]
            gates = gate_range([s[6] for s in singles])
            head: tuple[Arg, ...]
            if sha == _COPY:
                head = (c[5], "0", "0", *gates)
            elif sha == _COPY_EX:
                head = (c[5], c[7], c[8], *gates)
            else:
                head = (c[5], _ZADD_HOW[sha], *gates)
            batch = _ZADD_BATCH if sha in _ZADD_HOW else _COPY_BATCH
            out[at] = (b"EVALSHA", batch, 2, c[3], c[4], *head, *args)
    commands: list[Command] = [tuple(c) if isinstance(c, list) else c for c in out]
    return commands, [tuple(o) for o in owners], rest




def merge_commands(groups: Sequence[Sequence[Command]]) -> list[Command]:
    """Concatenate plans' commands, merging single-XACK plans per stream and group.

    What :func:`first_round` sends for gated plans of these commands (a plan
    of one ``XACK`` needs no order with other plans, so all of them become
    one ``XACK key group id id ...`` at the place of the first; multi-command
    plans keep their own order).
    """
    commands, _, _ = first_round((), [Plan(Effect.NOTHING, tuple(g)) for g in groups])
    return commands
