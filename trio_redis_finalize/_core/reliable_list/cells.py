"""The reliable list's row of the outcome table: what each outcome sends (sans-IO).

=================  ==========  =====================  ==========  ====================
form               ACK         RETRY                  DROP        retry_after(d)
=================  ==========  =====================  ==========  ====================
reliable list      LREM        LPUSH copy, LREM       LREM        runtime / zset
=================  ==========  =====================  ==========  ====================

:data:`RELIABLE_LIST` is the row ``_plan.CELLS`` holds for
``Form.RELIABLE_LIST``.  Every removal takes the element out of the
consumer's processing list (``LREM p -1 e``, or a gated script's ``LPOS``
gate then ``LREM``); a copy goes back onto the queue, a dead letter (with its
reason record in :func:`why_key`'s hash) or the delay set first, in one gated
script unless the keys live on different Redis Cluster slots.

Identical elements (``LPUSH q X X``): a reliable list's removal of element
``e`` carries ``n``, the number of copies of ``e`` the consumer holds whose
removal was not sent before this one (this one included), and removes only
while the processing list holds at least ``n`` copies (``LPOS … RANK -n``).
Removals are sent in the order their ``n`` was taken, so a removal sent
again after an unknown outcome (applied: ``n - 1`` left) finds the gate
closed instead of removing a copy another handler still holds.  ``n == 1``
(unique elements, the common case) is the plain ``LREM`` / the scripts'
plain ``LPOS`` gate.  The counted gates (``gates.ListGates``) assign ``n``
(:func:`list_counted`) just before a finalization is first sent, and read
it back (:func:`list_removal`, :func:`list_copies`, :func:`counted_removals`).

Direction: the reader pushes what it reads onto the head of the processing
list (``BLMOVE … RIGHT LEFT``), so the oldest elements -- those finalized
first -- are at its tail, and every removal scans from there: ``LREM p -1
e`` and the gates' ``LPOS … RANK -n`` (cost: the elements newer than the
one removed read since are not walked over).  Identical elements are the
same bytes: which of their copies goes changes no count (``LPOS RANK -n``
exists exactly when ``LPOS RANK n`` does: the list holds >= n copies), so
the gates and the reader's multiset counting do not depend on the direction.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import operator
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ..._delivery import Delivery
from ..._keys import derived, same_slot
from ..._outcome import Outcome, OutcomeKind
from ..._subscription import DelayedRetry
from .. import _lua
from .._carrying import Carry, GatedCells, argv_at
from .._commands import Arg, Command, Script, splice_batches
from .._types import (
    REMOVED,
    Batcher,
    Effect,
    Plan,
    Target,
    args_at,
    exhausted,
    fields_of,
    fixed_at,
    list_copy,
    member,
    ms,
    writes_at,
)
from . import scripts
from .liveness import DELAYED_COPY, GIVE_BACK, delayed_parts

__all__ = [
    "RELIABLE_LIST",
    "WHY_SUFFIX",
    "ReliableListCells",
    "counted_removals",
    "dead_record",
    "delayed_of",
    "delayed_token",
    "give_back_counted",
    "given_back",
    "list_copies",
    "list_counted",
    "list_removal",
    "runtime_copy",
    "why_key",
    "with_counts",
]

WHY_SUFFIX = ":why"
"""A reliable list's dead letter ``D`` records why each element is there in the
hash ``derived(D, WHY_SUFFIX)`` (:func:`why_key`)."""


def why_key(dead_letter: str) -> str:
    """The hash of a reliable list's dead letter that records why each element
    is there (see ``scripts``): ``{dead_letter}:why``, in its hash slot."""
    return derived(dead_letter, WHY_SUFFIX)


def dead_record(t: Target, d: Delivery, reason: str) -> bytes:
    """The reason record of a list dead letter, JSON (ASCII), without its time
    (the script puts the server's in front): reason, the handler's exception
    (``error``, bounded, when it raised), attempt, queue, processing list,
    origin id."""
    record: dict[str, object] = {"reason": reason}
    if error := getattr(d, "error", None):  # set by the runtime when the handler raised
        record["error"] = error
    record.update(attempt=d.attempt, source=t.source, processing=t.processing,
                  origin=d.origin_id)
    return json.dumps(record, separators=(",", ":")).encode()


def _list_remove(t: Target, d: Delivery, effect: Effect) -> Plan:
    assert d.raw is not None
    return Plan(effect, (("LREM", t.processing, -1, d.raw),))


def _list_copy_remove(t: Target, d: Delivery, dest: str, element: bytes, effect: Effect) -> Plan:
    assert d.raw is not None
    if t.cluster and not same_slot(t.processing, dest):
        return Plan(
            effect,
            (("LPUSH", dest, element), ("LREM", t.processing, -1, d.raw)),
            gated=False,
        )
    return Plan(
        effect,
        (scripts.LIST_COPY_REMOVE.command((t.processing, dest), (d.raw, element)),),
    )


def _list_dead(t: Target, d: Delivery, reason: str) -> Plan:
    """Copy the element as read to the dead letter with its reason record, then
    remove it from the processing list: one gated script, or (the dead letter
    in another Redis Cluster slot) the copy and its record, then the LREM."""
    assert d.raw is not None and t.dead_letter is not None
    dead = t.dead_letter
    record = dead_record(t, d, reason)
    why = why_key(dead)
    if t.cluster and not same_slot(t.processing, dead):
        return Plan(
            Effect.DEAD_LETTERED,
            (scripts.LIST_DEAD_PUSH.command((dead, why), (d.raw, record)),
             ("LREM", t.processing, -1, d.raw)),
            gated=False,
        )
    return Plan(
        Effect.DEAD_LETTERED,
        (scripts.LIST_COPY_REMOVE.command((t.processing, dead, why), (d.raw, d.raw, record)),),
    )


_RETRY, _REJECT, _RETRY_AFTER = OutcomeKind.RETRY, OutcomeKind.REJECT, OutcomeKind.RETRY_AFTER
_RAW = operator.attrgetter("raw")
_DELIVERY = operator.itemgetter(0)
_repeat = itertools.repeat


class ReliableListCells(GatedCells):
    """The reliable list's row (see the module docstring)."""

    __slots__ = ()

    noun: ClassVar[str] = "reliable list"
    counted: ClassVar[bool] = True

    def plan(self, t: Target, d: Delivery, outcome: Outcome) -> Plan:
        kind = outcome.kind
        if kind is _REJECT:
            return self.reject(t, d, outcome)
        if (kind is _RETRY or kind is _RETRY_AFTER) and exhausted(t, d.attempt):
            return self.dead(t, d, f"max_attempts={t.max_attempts} reached at attempt {d.attempt}")
        removed = REMOVED.get(kind)
        if removed is not None:  # ACK, DROP
            return _list_remove(t, d, removed)
        if kind is _RETRY:
            return _list_copy_remove(t, d, t.source, list_copy(d), Effect.COPIED)
        if t.delayed_retry is DelayedRetry.DURABLE_ZSET:
            assert d.raw is not None
            return Plan(Effect.DELAYED, (scripts.LIST_ZADD_REMOVE.command(
                (t.processing, t.delay_key), (d.raw, ms(outcome.delay), member(list_copy(d)))),))
        # runtime: the original stays in the processing list meanwhile
        later = _list_copy_remove(t, d, t.source, list_copy(d), Effect.COPIED)
        return Plan(Effect.HELD, (), delay=outcome.delay, later=later.commands,
                    gated=later.gated)

    def dead(self, t: Target, d: Delivery, reason: str) -> Plan:
        warning = f"{t.name}: {reason}; "
        if t.dead_letter is None:
            return dataclasses.replace(
                _list_remove(t, d, Effect.EXHAUSTED),
                warning=warning + "element removed without dead letter",
            )
        return dataclasses.replace(_list_dead(t, d, reason), warning=warning + "element dead-lettered")

    def removal_commands(self, t: Target, deliveries: Sequence[Delivery]) -> list[Command]:
        # one ("LREM", processing, -1, raw) each, built in C (a reliable list's
        # deliveries always carry their element: None only in a hand-made one)
        raws = [*map(_RAW, deliveries)]
        if None in raws:
            raws = [e for e in raws if e is not None]
        return [*zip(_repeat("LREM"), _repeat(t.processing), _repeat(-1), raws, strict=False)]

    def gate_key(self, t: Target) -> str:
        return t.processing

    def removal_with_writes(self, t: Target, d: Delivery, effect: Effect, writes: Sequence[Arg],
                            keys: Sequence[str | bytes]) -> Plan | None:
        if d.raw is None:
            return None
        p = t.processing  # LREM: the script's 'remove'
        return Plan(effect, (_LIST_WRITES.command((p, p, p, *keys), (d.raw, "remove", *writes, 1)),))

    def ack_writes_calls(self, t: Target, items: Sequence[tuple[Delivery, Outcome]],
                         encode: Callable[[Any], tuple[Sequence[Arg], Sequence[Arg]]]
                         ) -> list[tuple[Command, int]] | None:
        # LIST_WRITES_REMOVE_BATCH calls, each element's n 1 (the counted
        # gates number identical elements before the first send: ListGates.prepare)
        p = t.processing
        raws = [*map(_RAW, map(_DELIVERY, items))]
        if None in raws:
            return None

        def head(keys: Sequence[Arg], i: int, j: int) -> Command:
            return _REMOVE_BATCH.command((p, *keys), ())

        return splice_batches(items, [*zip(raws, itertools.repeat(1))], encode, head,
                              _lua.STREAM_BATCH_MAX, _lua.STREAM_BATCH_VALUES)

    def own_with_writes(self, commands: Sequence[Command], i: int, writes: Sequence[Arg],
                        keys: Sequence[Any]) -> tuple[Command, int] | None:
        # the plain removal LREM p -1 e as LIST_WRITES 'remove'
        cmd = commands[i]
        if cmd[0] != "LREM":
            return None
        p, raw = cmd[1], cmd[3]
        return _LIST_WRITES.command((p, p, p, *keys), (raw, "remove", *writes, 1)), 1


RELIABLE_LIST = ReliableListCells()
"""The reliable list's row of ``_plan.CELLS``."""

_LIST_WRITES = scripts.LIST_WRITES


def _copy_remove_with_writes(cmd: Command, writes: Sequence[Arg], keys: Sequence[Any]) -> Command:
    """``LIST_COPY_REMOVE`` as ``LIST_WRITES``: a dead letter (with its reason
    hash ``why`` and ``record``) 'dead'; a copy back onto the queue 'copy'."""
    c = scripts.LIST_COPY_REMOVE
    p, dest, element, copy = fields_of(c, cmd, "processing", "dest", "element", "copy")
    why = c.field(cmd, "why")
    if why is not None:
        return _LIST_WRITES.command((p, dest, why, *keys),
                                    (element, "dead", *writes, copy, *fields_of(c, cmd, "record"), 1))
    return _LIST_WRITES.command((p, dest, p, *keys), (element, "copy", *writes, copy, 1))


def _zadd_remove_with_writes(cmd: Command, writes: Sequence[Arg], keys: Sequence[Any]) -> Command:
    """``LIST_ZADD_REMOVE`` (a durable delay) as ``LIST_WRITES`` 'zadd'."""
    p, delays, element, delay, mem = fields_of(
        scripts.LIST_ZADD_REMOVE, cmd, "processing", "delays", "element", "delay_ms", "member")
    return _LIST_WRITES.command((p, delays, p, *keys), (element, "zadd", *writes, delay, mem, 1))


_CARRY: dict[object, Carry] = {
    scripts.LIST_COPY_REMOVE.sha: _copy_remove_with_writes,
    scripts.LIST_ZADD_REMOVE.sha: _zadd_remove_with_writes,
}
"""The gated scripts of the list's plans that remove the original, by sha:
how each becomes a step that carries an outcome's writes."""
ReliableListCells.carry = _CARRY


# -- counted removals (identical elements; see the module docstring) -------------------------------

_COUNTED: dict[object, Script] = {
    s.sha: s for s in (scripts.LIST_COPY_REMOVE, scripts.LIST_ZADD_REMOVE, scripts.LIST_REMOVE,
                       _LIST_WRITES)
}
"""The scripts of the list's plans that remove an element gated on ``n``
copies (their field ``n``; optional where a plain gate is the default), by sha."""
_PROCESSING = _LIST_WRITES.key_at("processing")
assert all(s.key_at("processing") == _PROCESSING for s in _COUNTED.values())
# (an outcome's writes, the common counted removal: read by name, once)
_LW_ELEMENT = args_at(_LIST_WRITES, "element")
assert _LIST_WRITES.argv is not None and _LIST_WRITES.argv[-1] == "n"  # its n always last


def list_removal(t: Target, cmd: Command) -> bytes | None:
    """The element that ``cmd``, a command of a reliable list's plan, removes
    from ``t.processing`` (one copy), or None when it removes none."""
    head = cmd[0]
    if head == "LREM":
        e = cmd[3]
        return e if cmd[1] == t.processing and isinstance(e, bytes) else None
    if head == b"EVALSHA":
        script = _COUNTED.get(cmd[1])
        if script is not None and cmd[_PROCESSING] == t.processing:
            x = (cmd[3 + int(cmd[2]) + _LW_ELEMENT] if script is _LIST_WRITES
                 else script.field(cmd, "element"))
            return x if isinstance(x, bytes) else None
    return None


def list_copies(cmd: Command) -> int:
    """The ``n`` a removal :func:`list_removal` names is gated on (1: a plain gate)."""
    if cmd[0] == b"EVALSHA":
        script = _COUNTED.get(cmd[1])
        if script is _LIST_WRITES:
            return int(cmd[-1])
        if script is not None:
            return int(script.field(cmd, "n", 1))  # type: ignore[arg-type]
    return 1


def list_counted(cmd: Command, n: int) -> Command:
    """``cmd`` (a removal :func:`list_removal` names) gated on ``n`` copies."""
    if cmd[0] == "LREM":
        if n == 1:
            return cmd
        return scripts.LIST_REMOVE.command((cmd[1],), (cmd[3], n))
    return _COUNTED[cmd[1]].replace(cmd, "n", n)


# -- batched calls: removals carrying writes, in one call per processing list ---------------------

_REMOVE_BATCH = scripts.LIST_WRITES_REMOVE_BATCH
# LIST_WRITES' places, by name (its keys: processing, dest, why, write_keys...;
# the arguments from ARGV[1])
_LW_DEST, _LW_WHY, _LW_KEYS = (fixed_at(_LIST_WRITES, n) for n in ("dest", "why", "write_keys..."))
_LW_OP, _LW_WRITES = args_at(_LIST_WRITES, "op"), args_at(_LIST_WRITES, "writes...")


class _RemoveWrites(Batcher):
    """``LIST_WRITES`` calls of op ``remove`` (an ACK or DROP with writes;
    ``EVALSHA sha nk list list list keys... element remove nw writes... n``)
    in ``LIST_WRITES_REMOVE_BATCH`` calls, keyed by the processing list; the
    rest (a copy, a dead letter, a durable delay) go alone."""

    __slots__ = ()

    def part(self, cmd: Command) -> tuple[tuple[Arg, ...], tuple[Arg, ...]] | None:
        at = argv_at(cmd, 3, 4)
        if at is None:
            return None
        p = cmd[_PROCESSING]
        if cmd[at + _LW_OP] != "remove" or not p == cmd[_LW_DEST] == cmd[_LW_WHY]:
            return None
        return (_REMOVE_BATCH.sha, p), (cmd[at + _LW_ELEMENT], cmd[-1], *cmd[at + _LW_WRITES:-1])

    def call(self, singles: Sequence[Command], args: Sequence[Arg]) -> Command:
        """Its keys: the processing list and every element's writes' keys, each once."""
        keys = list(dict.fromkeys(k for s in singles for k in s[_LW_KEYS:3 + int(s[2])]))
        return _REMOVE_BATCH.command((singles[0][_PROCESSING], *keys), args)

    def singles(self, cmd: Command) -> list[Command]:
        """Each element's ``LIST_WRITES`` call (with its ``n``), its keys those its writes name."""
        (p,) = fields_of(_REMOVE_BATCH, cmd, "processing")
        values = _REMOVE_BATCH.rest(cmd, "element")  # (element, n, writes...)...
        out: list[Command] = []
        i = 0
        while i < len(values):
            e, n = values[i], values[i + 1]
            keys, j = writes_at(values, i + 2)
            out.append(_LIST_WRITES.command((p, p, p, *keys), (e, "remove", *values[i + 2:j], n)))
            i = j
        return out


_REMOVE_WRITES = _RemoveWrites()
ReliableListCells.batchers = {_LIST_WRITES.sha: _REMOVE_WRITES}
ReliableListCells.batched = {_REMOVE_BATCH.sha: _REMOVE_WRITES}


def counted_removals(cmd: Command) -> list[tuple[int, Any, Any]]:
    """``(at, element, n)`` of each element of a ``LIST_WRITES_REMOVE_BATCH``
    call, in order: ``cmd[at]`` is its ``n`` (its counted gate), which
    :func:`with_counts` rewrites (the counted gates, before each send);
    cheaper than ``Batcher.singles`` (no command built)."""
    at = _REMOVE_BATCH.at(cmd, "element")  # (element, n, writes...)...
    assert at is not None
    out: list[tuple[int, Any, Any]] = []
    i = at
    end = len(cmd)
    while i < end:
        out.append((i + 1, cmd[i], cmd[i + 1]))
        j = i + 3
        for _ in range(int(cmd[i + 2])):
            j += 1 + int(cmd[j])
        i = j
    return out


def with_counts(cmd: Command, counts: Sequence[tuple[int, int]]) -> Command:
    """``cmd`` (a ``LIST_WRITES_REMOVE_BATCH`` call) with ``cmd[at] = n`` for
    each ``(at, n)`` of ``counts`` (see :func:`counted_removals`)."""
    out = list(cmd)
    for at, n in counts:
        out[at] = n
    return tuple(out)


# -- what the counted gates read in the commands they number ---------------------------------------

def given_back(t: Target, cmd: Command) -> Sequence[Arg] | None:
    """The ``[element, n]...`` values of ``cmd`` when it is a ``liveness.GIVE_BACK``
    of ``t``'s processing list (:func:`give_back_counted` renumbers them), else None."""
    if GIVE_BACK.calls(cmd) and GIVE_BACK.field(cmd, "processing") == t.processing:
        return GIVE_BACK.rest(cmd, "element")
    return None


def give_back_counted(cmd: Command, n: Callable[[bytes], int]) -> Command:
    """A :func:`given_back` call with each element's ``n`` replaced by ``n(element)``."""
    at = GIVE_BACK.at(cmd, "element")
    assert at is not None
    args = list(cmd)
    for j in range(at, len(args), 2):
        g = args[j]
        if isinstance(g, bytes):
            args[j + 1] = n(g)
    return tuple(args)


def runtime_copy(t: Target, cmd: Command) -> tuple[bytes, Arg, bytes, Sequence[Arg],
                                                     Sequence[Arg]] | None:
    """``(element, queue, copy, writes, write keys)`` of ``cmd`` when it is a
    runtime ``retry_after``'s delayed copy of ``t``'s processing list as its
    plan built it (``LIST_COPY_REMOVE`` back onto the queue, or
    ``LIST_WRITES`` 'copy': ``writes`` encoded, ``(0,)`` for none), else None."""
    writes: Sequence[Arg]
    wkeys: Sequence[Arg]
    c, w = scripts.LIST_COPY_REMOVE, _LIST_WRITES
    if c.calls(cmd) and c.field(cmd, "why") is None:  # back onto the queue
        p, queue, element, copy = fields_of(c, cmd, "processing", "dest", "element", "copy")
        writes, wkeys = (0,), ()
    elif w.calls(cmd) and w.field(cmd, "op") in (b"copy", "copy"):
        # processing, queue, processing, keys; element, 'copy', nw, writes, copy, n
        p, queue, element = fields_of(w, cmd, "processing", "dest", "element")
        copy = cmd[-2]  # the one own value of a copy, before its n
        wkeys = w.rest(cmd, "write_keys")
        at = w.at(cmd, "writes")
        assert at is not None
        writes = cmd[at:-2]
    else:
        return None
    if p != t.processing or not isinstance(element, bytes) or not isinstance(copy, bytes):
        return None
    return element, queue, copy, writes, wkeys


def delayed_of(t: Target, cmd: Command) -> tuple[bytes, int, int] | None:
    """``(element, n, writes)`` of ``cmd`` when it is a ``liveness.DELAYED_COPY``
    of ``t``'s processing list (``liveness.delayed_parts``), else None."""
    parts = delayed_parts(cmd)
    return None if parts is None or DELAYED_COPY.field(cmd, "processing") != t.processing else parts


def delayed_token(cmd: Command) -> bytes:
    """The receipt token of a ``liveness.DELAYED_COPY`` call."""
    token = DELAYED_COPY.field(cmd, "token")
    assert isinstance(token, bytes)
    return token
