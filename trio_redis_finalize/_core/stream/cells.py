"""The stream's row of the outcome table: what each outcome sends (sans-IO).

=================  ==========  =====================  ==========  ====================
stream             ACK         RETRY                  DROP        retry_after(d)
=================  ==========  =====================  ==========  ====================
plain / reclaim    XACK        XADD copy, XACK        XACK        runtime / zset
claiming           XACK        stays in PEL           XACK        PEL (or zset)
=================  ==========  =====================  ==========  ====================

:data:`STREAM` is the row ``_plan.CELLS`` holds for ``Form.STREAM``: its
:meth:`~StreamCells.plan` builds the commands of every cell, its
:meth:`~StreamCells.dead` the dead letter (an entry's own fields, byte for
byte, then the ``trf-dead-*`` fields), :meth:`~StreamCells.with_writes`
turns a plan's gated removal into ``STREAM_WRITES`` (an outcome's writes,
``_writes``), and its batchers (``batches``) say how the gated scripts of
one batch go in one batched call (``_batch.first_round``) and back.  The
lost and foreign entries a read finds (:func:`plan_lost`, :func:`plan_foreign`) and the hot
path's removals (:func:`stream_removals`) are here too.

Two-step cells run as one gated script (see ``scripts``) unless the keys
live on different Redis Cluster slots, where they become two commands in the
listed order (duplicate, never loss).  A runtime ``retry_after`` removes the
original with a gated script that leaves a *receipt* of that finalization
(``scripts.STREAM_REMOVE_RECEIPT``, key :func:`receipt_key`); its copy is
written later only while the receipt says "removed by me", and a resend
after an unknown outcome answers from it (``_types.RECEIPTED``).

Retention (``Target.retention``): with ``DELETE_ON_FINALIZE`` every removal
of an original is followed by its ``XDEL`` -- inside the gated scripts
(``STREAM_COPY_ACK_EX``, ``STREAM_ZADD_ACK_DEL``) for the two-step cells,
right after the ``XACK`` otherwise (both idempotent).  Another group's copy
is only acknowledged, never deleted.  ``copy_maxlen`` / ``dead_letter_maxlen``
put ``MAXLEN ~ n`` on the XADDs of copies written to the stream and of dead
letters.  ``TRIM_ACKED`` changes no plan: a periodic task of the reader trims
(``_retention``).  On a server with Redis 8.2's stream commands
(``Target.xackdel``) ``DELETE_ON_FINALIZE`` removes with one ``XACKDEL key
group ACKED IDS n id ...`` instead (inside the scripts too: how ``x``), which
deletes an entry only once no group references it.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ..._delivery import Delivery
from ..._envelope import GROUP_FIELD, ORIGIN_FIELD, RETRIES_FIELD
from ..._keys import derived, same_slot
from ..._outcome import Outcome, OutcomeKind
from ..._subscription import DelayedRetry, Mode, Retention
from .. import _lua
from .._carrying import Carry, GatedCells
from .._commands import Arg, Command, Script
from .._types import (
    DEAD_ATTEMPT,
    DEAD_ERROR,
    DEAD_GROUP,
    DEAD_ID,
    DEAD_REASON,
    DEAD_SOURCE,
    DEAD_TIME,
    RECEIPTED,
    REMOVED,
    Effect,
    Plan,
    Target,
    cap,
    entry_fields,
    exhausted,
    fields_of,
    flat,
    member,
    ms,
)
from . import scripts
from .batches import BATCHED, BATCHERS, ack_writes_calls

__all__ = [
    "RECEIPT_SUFFIX",
    "STREAM",
    "StreamCells",
    "copy_how",
    "plan_foreign",
    "plan_lost",
    "receipt_key",
    "stream_copy_fields",
    "stream_removals",
]

RECEIPT_SUFFIX = ":receipt:"
"""A runtime ``retry_after``'s receipt on a stream ``s`` is
``derived(s, RECEIPT_SUFFIX + <32 hex digits>)``, a name of its own per
finalization (:func:`receipt_key`)."""

RECEIPTED.add(scripts.STREAM_REMOVE_RECEIPT.sha)  # its closed gate is exact (``_types.settle``)


def receipt_key(t: Target) -> str:
    """A fresh receipt key for one finalization of ``t``'s stream, in its hash slot."""
    return derived(t.source, RECEIPT_SUFFIX + uuid.uuid4().hex)


def stream_copy_fields(d: Delivery, group: str = "") -> tuple[bytes, ...]:
    """A copy's fields: the entry's own, byte for byte, then the headers.

    ``group``: the group the copy is addressed to (:data:`GROUP_FIELD`,
    for copies written back to the stream); ``""``: no address.
    """
    fields = d.flat if d.flat is not None else flat(d.fields)
    retries = d.retries + 1  # _types.copy_retries(d), inlined (every RETRY copy)
    if d.attempt > retries:
        retries = d.attempt
    if group:
        return (*fields, RETRIES_FIELD, str(retries).encode(), ORIGIN_FIELD, d.origin_id.encode(),
                GROUP_FIELD, group.encode())
    return (*fields, RETRIES_FIELD, str(retries).encode(), ORIGIN_FIELD, d.origin_id.encode())


def copy_how(t: Target) -> str:
    """How ``STREAM_COPY_ACK_EX`` removes the original (see ``scripts``):
    ``"0"`` XACK, ``"1"`` XACK then XDEL, ``"x"`` one XACKDEL ACKED."""
    return "x" if t.xackdel else "1" if t.deletes else "0"


def _stream_remove(t: Target, d: Delivery, effect: Effect) -> Plan:
    assert d.id is not None
    if t.retention is Retention.DELETE_ON_FINALIZE:
        if t.xackdel:  # one command, idempotent; its reply says what it acknowledged
            return Plan(effect, (("XACKDEL", t.source, t.group, "ACKED", "IDS", 1, d.id),))
        # both idempotent: safe to send again after an unknown outcome
        return Plan(effect, (("XACK", t.source, t.group, d.id), ("XDEL", t.source, d.id)))
    return Plan(effect, (("XACK", t.source, t.group, d.id),))


_COPY_ACK_SHA = scripts.STREAM_COPY_ACK.sha


def _stream_copy(
    t: Target, d: Delivery, dest: str, fields: Sequence[bytes], effect: Effect,
    maxlen: int | None = None,
) -> Plan:
    assert d.id is not None
    deletes = t.retention is Retention.DELETE_ON_FINALIZE
    if t.cluster and not same_slot(t.source, dest):
        # copy, then remove (acknowledge; delete), each once the one before succeeded
        copy: Command = (
            scripts.STREAM_XADD.command((dest,), (maxlen or 0, *fields))
            if fields and fields[-1] == _lua.SERVER_TIME  # a dead letter: the server's time
            else ("XADD", dest, *cap(maxlen), "*", *fields))
        return Plan(effect, (copy, *_stream_remove(t, d, effect).commands), gated=False)
    if deletes or maxlen is not None:
        args: tuple[Arg, ...] = (t.group, d.id, copy_how(t), maxlen or 0, *fields)
        return Plan(effect, (scripts.STREAM_COPY_ACK_EX.command((t.source, dest), args),))
    # STREAM_COPY_ACK.command((t.source, dest), (t.group, d.id, *fields)), in one tuple
    # (every RETRY copy)
    return Plan(effect, ((b"EVALSHA", _COPY_ACK_SHA, 2, t.source, dest, t.group, d.id, *fields),))


def _runtime_copy(t: Target, d: Delivery, receipt: str) -> Command:
    """The command that writes a runtime ``retry_after`` copy to the stream,
    once, and only while ``receipt`` says this finalization removed the
    original (``scripts.STREAM_COPY_ONCE``)."""
    return scripts.STREAM_COPY_ONCE.command(
        (t.source, receipt),
        (scripts.COPY_MARK_TTL, t.copy_maxlen or 0, *stream_copy_fields(d, t.group)))


def plan_lost(t: Target, d: Delivery) -> Plan:
    """An entry deleted from the stream while pending: acknowledge, count it."""
    return _stream_remove(t, d, Effect.LOST_BEFORE_HANDLING)


def plan_foreign(t: Target, d: Delivery) -> Plan:
    """A copy another group wrote to the stream: acknowledge it unhandled, count it.

    Never deleted, whatever the retention: it is the other group's -- but
    with ``XACKDEL ... ACKED`` (:attr:`Target.xackdel`), which deletes it only
    once no group references it any more (the group it is addressed to
    finalized it already).
    """
    assert d.id is not None
    if t.xackdel:
        return Plan(Effect.FOREIGN_COPY, (("XACKDEL", t.source, t.group, "ACKED", "IDS", 1, d.id),))
    return Plan(Effect.FOREIGN_COPY, (("XACK", t.source, t.group, d.id),))


def stream_removals(t: Target, ids: Sequence[str]) -> list[Command]:
    """``_plan.removal_commands`` of the stream entries ``ids`` (not empty):
    one ``XACK`` of them all (a plan's single-id ``XACK`` merges into one of
    its own), followed with ``Retention.DELETE_ON_FINALIZE`` by one ``XDEL``
    of the same ids (both idempotent; a crash between the two leaves
    acknowledged entries in the stream, which the periodic trim removes) --
    or, where the server has it (:attr:`Target.xackdel`), one ``XACKDEL ...
    ACKED IDS n`` of them all (its reply: one code per id)."""
    if t.retention is Retention.DELETE_ON_FINALIZE:
        if t.xackdel:
            return [("XACKDEL", t.source, t.group, "ACKED", "IDS", len(ids), *ids)]
        return [("XACK", t.source, t.group, *ids), ("XDEL", t.source, *ids)]
    return [("XACK", t.source, t.group, *ids)]


# module-level names for the members the planner compares with (a global
# load, not an attribute load on the enum class)
_RETRY, _REJECT, _RETRY_AFTER = OutcomeKind.RETRY, OutcomeKind.REJECT, OutcomeKind.RETRY_AFTER
_CLAIMING = Mode.CLAIMING
_COPIED, _LEFT_PENDING = Effect.COPIED, Effect.LEFT_PENDING


class StreamCells(GatedCells):
    """The stream's row (see the module docstring)."""

    __slots__ = ()

    noun: ClassVar[str] = "stream"
    by_id: ClassVar[bool] = True
    batchers = BATCHERS
    batched = BATCHED

    def plan(self, t: Target, d: Delivery, outcome: Outcome) -> Plan:
        kind = outcome.kind
        if kind is _RETRY:  # the common case first (Enum class lookups are slow)
            if exhausted(t, d.attempt):
                return self.dead(t, d, f"max_attempts={t.max_attempts} reached at attempt {d.attempt}")
            if t.mode is _CLAIMING:
                return Plan(_LEFT_PENDING)
            return _stream_copy(t, d, t.source, stream_copy_fields(d, t.group), _COPIED,
                                t.copy_maxlen)
        if kind is _REJECT:
            return self.reject(t, d, outcome)
        if kind is _RETRY_AFTER and exhausted(t, d.attempt):
            return self.dead(t, d, f"max_attempts={t.max_attempts} reached at attempt {d.attempt}")
        removed = REMOVED.get(kind)
        if removed is not None:  # ACK, DROP
            return _stream_remove(t, d, removed)
        # retry_after
        way = t.delayed_retry
        if way is None:  # claiming: the PEL is the delay
            return Plan(Effect.LEFT_PENDING)
        assert d.id is not None
        if way is DelayedRetry.DURABLE_ZSET:
            script = (scripts.STREAM_ZADD_ACK if t.retention is not Retention.DELETE_ON_FINALIZE
                      else scripts.STREAM_ZADD_ACKDEL if t.xackdel
                      else scripts.STREAM_ZADD_ACK_DEL)
            return Plan(Effect.DELAYED, (script.command(
                (t.source, t.delay_key),
                (t.group, d.id, ms(outcome.delay), member(*stream_copy_fields(d, t.group)))),))
        # runtime: remove now, leaving this finalization's receipt; XADD the
        # copy when the timer fires, only while the receipt says "removed by
        # me", once (see ``scripts.STREAM_REMOVE_RECEIPT``)
        receipt = receipt_key(t)
        return Plan(
            Effect.HELD,
            (scripts.STREAM_REMOVE_RECEIPT.command(
                (t.source, receipt), (t.group, d.id, copy_how(t), 0)),),
            delay=outcome.delay,
            later=(_runtime_copy(t, d, receipt),),
        )

    def dead(self, t: Target, d: Delivery, reason: str) -> Plan:
        warning = f"{t.name}: {reason}; "
        if t.dead_letter is None:
            return dataclasses.replace(
                _stream_remove(t, d, Effect.EXHAUSTED),
                warning=warning + f"entry {d.id} acknowledged without dead letter",
            )
        # the entry's own field list, byte for byte; no group address (the
        # dead letter is another stream, read by other groups)
        fields = [
            *entry_fields(d),
            RETRIES_FIELD, str(d.retries).encode(),
            ORIGIN_FIELD, d.origin_id.encode(),
            DEAD_REASON, reason.encode(),
            DEAD_SOURCE, t.source.encode(),
            DEAD_ID, (d.id or "").encode(),
            DEAD_GROUP, t.group.encode(),
            DEAD_ATTEMPT, str(d.attempt).encode(),
        ]
        if error := getattr(d, "error", None):  # set by the runtime when the handler raised
            fields += [DEAD_ERROR, error.encode()]
        fields += [DEAD_TIME, _lua.SERVER_TIME]  # last: the script writes the server's clock
        p = _stream_copy(t, d, t.dead_letter, fields, Effect.DEAD_LETTERED, t.dead_letter_maxlen)
        return dataclasses.replace(p, warning=warning + f"entry {d.id} dead-lettered")

    def removal_commands(self, t: Target, deliveries: Sequence[Delivery]) -> list[Command]:
        ids: list[str] = [d.id for d in deliveries]  # type: ignore[misc]  # a stream delivery has its id
        return stream_removals(t, ids)

    def leaves_pending(self, t: Target, d: Delivery, outcome: Outcome) -> bool:
        # a claiming subscription's RETRY, and retry_after through the PEL,
        # before the last attempt
        return (t.mode is _CLAIMING and outcome.is_retry
                and (outcome.kind is _RETRY or t.delayed_retry is None)
                and not exhausted(t, d.attempt))

    def removal_with_writes(self, t: Target, d: Delivery, effect: Effect, writes: Sequence[Arg],
                            keys: Sequence[str | bytes]) -> Plan | None:
        # XACK; XACK + XDEL; XACKDEL: the script's 'ack'
        assert d.id is not None
        src = t.source
        return Plan(effect, (_STREAM_WRITES.command(
            (src, src, *keys), (t.group, d.id, "ack", copy_how(t), 0, *writes)),))

    def ack_writes_calls(self, t: Target, items: Sequence[tuple[Delivery, Outcome]],
                         encode: Callable[[Any], tuple[Sequence[Arg], Sequence[Arg]]]
                         ) -> list[tuple[Command, int]] | None:
        return ack_writes_calls(t, copy_how(t), items, encode)

    def own_with_writes(self, commands: Sequence[Command], i: int, writes: Sequence[Arg],
                        keys: Sequence[Any]) -> tuple[Command, int] | None:
        # a plain removal as STREAM_WRITES 'ack': XACK (with the XDEL after it,
        # if any: both in the one step) or XACKDEL
        cmd = commands[i]
        head = cmd[0]
        if head == "XACK":
            src, group, eid = cmd[1], cmd[2], cmd[3]
            delete = i + 1 < len(commands) and commands[i + 1][0] == "XDEL"
            how, used = ("1", 2) if delete else ("0", 1)
            return _STREAM_WRITES.command((src, src, *keys), (group, eid, "ack", how, 0, *writes)), used
        if head == "XACKDEL":  # Redis 8.2: XACKDEL key group ACKED IDS 1 id
            src, group, eid = cmd[1], cmd[2], cmd[6]
            return _STREAM_WRITES.command((src, src, *keys), (group, eid, "ack", "x", 0, *writes)), 1
        return None


STREAM = StreamCells()
"""The stream's row of ``_plan.CELLS``."""

_STREAM_WRITES = scripts.STREAM_WRITES


# -- an outcome's writes in a gated step: each gated script, as STREAM_WRITES ----------------------

def _receipt_with_writes(cmd: Command, writes: Sequence[Arg], keys: Sequence[Any]) -> Command:
    """A runtime retry_after's removal (``STREAM_REMOVE_RECEIPT``): the writes
    in it, before its receipt."""
    r = scripts.STREAM_REMOVE_RECEIPT
    src, receipt, group, eid, how = fields_of(r, cmd, "stream", "receipt", "group", "id", "how")
    return r.command((src, receipt, *keys), (group, eid, how, *writes))


def _copy_with_writes(cmd: Command, writes: Sequence[Arg], keys: Sequence[Any]) -> Command:
    """``STREAM_COPY_ACK`` as ``STREAM_WRITES`` 'copy' (how ``"0"``, no cap)."""
    c = scripts.STREAM_COPY_ACK
    src, dest, group, eid = fields_of(c, cmd, "stream", "dest", "group", "id")
    return _STREAM_WRITES.command(
        (src, dest, *keys), (group, eid, "copy", "0", 0, *writes, *c.rest(cmd, "fields")))


def _copy_ex_with_writes(cmd: Command, writes: Sequence[Arg], keys: Sequence[Any]) -> Command:
    """``STREAM_COPY_ACK_EX`` as ``STREAM_WRITES`` 'copy'."""
    c = scripts.STREAM_COPY_ACK_EX
    src, dest, group, eid, how, cap_ = fields_of(c, cmd, "stream", "dest", "group", "id", "how", "cap")
    return _STREAM_WRITES.command(
        (src, dest, *keys), (group, eid, "copy", how, cap_, *writes, *c.rest(cmd, "fields")))


def _zadd_with_writes(script: Script, how: str) -> Callable[[Command, Sequence[Arg], Sequence[Any]],
                                                           Command]:
    def carry(cmd: Command, writes: Sequence[Arg], keys: Sequence[Any]) -> Command:
        """A durable delay as ``STREAM_WRITES`` 'zadd' (how it removes: ``how``)."""
        src, dest, group, eid, delay, mem = fields_of(
            script, cmd, "stream", "delays", "group", "id", "delay_ms", "member")
        return _STREAM_WRITES.command(
            (src, dest, *keys), (group, eid, "zadd", how, 0, *writes, delay, mem))
    return carry


_CARRY: dict[object, Carry] = {
    scripts.STREAM_REMOVE_RECEIPT.sha: _receipt_with_writes,
    scripts.STREAM_COPY_ACK.sha: _copy_with_writes,
    scripts.STREAM_COPY_ACK_EX.sha: _copy_ex_with_writes,
    scripts.STREAM_ZADD_ACK.sha: _zadd_with_writes(scripts.STREAM_ZADD_ACK, "0"),
    scripts.STREAM_ZADD_ACK_DEL.sha: _zadd_with_writes(scripts.STREAM_ZADD_ACK_DEL, "1"),
    scripts.STREAM_ZADD_ACKDEL.sha: _zadd_with_writes(scripts.STREAM_ZADD_ACKDEL, "x"),
}
"""The gated scripts of the stream's plans that remove the original, by sha:
how each becomes a step that carries an outcome's writes."""
StreamCells.carry = _CARRY

