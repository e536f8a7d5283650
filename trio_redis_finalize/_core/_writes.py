"""Exactly-once effects, sans-IO: an outcome's writes in its finalization script.

A handler may return Redis writes with its outcome
(``ACK.with_writes(("HINCRBY", "totals", "eur", 5))``, see ``_writes``).
:func:`plan_outcome` plans such an outcome as :func:`~._plan.plan` plans the
outcome alone, then turns the plan's gated step -- the one that removes the
original -- into one of the two scripts below, which

1. check the gate (the entry still pending in the group's PEL; the element
   still in the processing list, ``n`` copies of it for identical elements),
2. check the type of every key a write names (before anything is written:
   a write to a key of another type fails the whole finalization, nothing
   written),
3. run the writes, in order,
4. then the cell's own steps in the contract's order (copy, then remove).

One script is one atomic step on the server, so

* a crash before it: nothing applied, the delivery comes back and its next
  attempt's writes apply once;
* it ran and its reply was lost: the finalizer sends it again, the gate is
  closed, nothing is applied twice (counted once, as any resend);
* racing finalizers (a reclaimed entry, a claiming subscription): only the
  first passes the gate.

A script error after a write ran (a value the command refuses: an
overflow, ``HINCRBYFLOAT`` on text) leaves the writes before it applied:
Redis scripts do not roll back.  The checks before writing cover what can be
known there: every key's type, and the values Redis would certainly refuse
(``INCR`` family and ``HINCRBY`` on a value or by an increment that is no
integer, ``PFADD`` on a string that is no HyperLogLog; see
``_lua.WRITES_LUA``); the user guide (docs/guide.rst) says the rest.

A runtime ``retry_after`` on a stream carries its writes in the removal that
leaves its receipt (``stream_scripts.STREAM_REMOVE_RECEIPT``): a resend after an
unknown outcome applies and counts them only when its own first send did.

Where a plan is two ungated commands (a dead letter in another Redis Cluster
slot: the copy, then the removal), the writes go with the removal, which
stays gated: the copy may be duplicated (as without writes), the writes are
not.  In Redis Cluster every key a write names must share the source's hash
slot (:func:`check_outcome`).
"""

from __future__ import annotations

from .._delivery import Delivery
from .._errors import AckUnsupported
from .._keys import same_slot
from .._outcome import ACK, DROP, RETRY, Outcome, OutcomeKind, WithWrites
from .._subscription import Form, Mode
from .._writes import WRITE_COMMANDS, Write, write_keys
from ._commands import Arg, Command
from ._plan import _REMOVED, Plan, Target, copy_how, plan
from .reliable_list import scripts as list_scripts
from .stream import scripts as stream_scripts

__all__ = ["WRITES", "check_outcome", "encode_writes", "plan_outcome", "plan_writes"]

WRITES = "writes"
"""The effect counted per write committed with its finalization (in ``stats()``)."""

STREAM_WRITES = stream_scripts.STREAM_WRITES
LIST_WRITES = list_scripts.LIST_WRITES

def encode_writes(writes: tuple[Write, ...]) -> list[Arg]:
    """The writes as the scripts read them: ``nw``, then per write its count of
    values, its key's type ('' for any) and the command."""
    out: list[Arg] = [len(writes)]
    for w in writes:
        out += [len(w), WRITE_COMMANDS[str(w[0])][0], *w]
    return out


def check_outcome(t: Target, d: Delivery, outcome: Outcome) -> None:
    """Whether ``t`` can commit ``outcome``'s writes with the finalization of ``d``.

    Raises:
        ValueError: a form without a gate to commit them with (simple lists,
            Pub/Sub), a retry that leaves the entry pending on a claiming
            subscription (RETRY, ``retry_after`` through the PEL: nothing is
            finalized) before its last attempt, or, in Redis Cluster, a key in
            another hash slot than the source (named).
    """
    if not outcome.writes:
        return
    if t.form is not Form.STREAM and t.form is not Form.RELIABLE_LIST:
        raise ValueError(f"{t.name}: {outcome!r}: a {t.form.value} has nothing to finalize, so "
                         "it cannot commit writes (streams and reliable lists can)")
    if (t.mode is Mode.CLAIMING and t.form is Form.STREAM and outcome.is_retry
            and (outcome.kind is OutcomeKind.RETRY or t.delayed_retry is None)
            and not (t.max_attempts is not None and d.attempt >= t.max_attempts)):
        raise ValueError(f"{t.name}: {outcome!r}: on a claiming subscription a retry leaves the "
                         "entry pending, nothing is finalized to commit the writes with; return "
                         "them with the outcome that finalizes it")
    if t.cluster:
        source = t.processing if t.form is Form.RELIABLE_LIST else t.source
        for key in write_keys(outcome.writes):
            if not same_slot(source, key):
                raise ValueError(
                    f"{t.name}: {outcome!r}: key {key!r} is in another Redis Cluster hash slot "
                    f"than {source!r}; the writes run in one script with the finalization, so "
                    f"their keys must share its slot (a hash tag: '{{{t.source}}}...')")


def plan_outcome(t: Target, d: Delivery, outcome: Outcome) -> Plan:
    """:func:`~._plan.plan`, and for an outcome with writes :func:`plan_writes`."""
    if outcome.__class__ is WithWrites and outcome.writes:
        return plan_writes(t, d, outcome)
    return plan(t, d, outcome)


def plan_writes(t: Target, d: Delivery, outcome: Outcome) -> Plan:
    """The plan of ``outcome`` with its writes in its gated removal step.

    Raises:
        ValueError: see :func:`check_outcome`.
        AckUnsupported: as :func:`~._plan.plan`.
    """
    check_outcome(t, d, outcome)
    kind = outcome.kind
    encoded = encode_writes(outcome.writes)
    keys = write_keys(outcome.writes)
    removed = _REMOVED_BY_VALUE.get(kind._value_)  # (by value: an Enum's hash is Python code)
    if removed is not None:
        # an ACK or DROP, inline: plan()'s removal as _with_writes() turns it
        # into the writes script's own removal
        form = t.form
        if form is Form.STREAM:  # XACK; XACK + XDEL; XACKDEL: the script's 'ack'
            assert d.id is not None
            src = t.source
            return Plan(removed, (STREAM_WRITES.command(
                (src, src, *keys), (t.group, d.id, "ack", copy_how(t), 0, *encoded)),))
        if form is Form.RELIABLE_LIST and d.raw is not None:  # LREM: the script's 'remove'
            p = t.processing
            return Plan(removed, (LIST_WRITES.command((p, p, p, *keys),
                                                      (d.raw, "remove", *encoded, 1)),))
    base = plan(t, d, _PLAIN[kind] if kind in _PLAIN else Outcome(kind, outcome.delay, outcome.reason))
    if base.commands:
        commands = _with_writes(t, base.commands, encoded, keys)
        return Plan(base.effect, commands, base.delay, base.later, base.gated, base.warning)
    # a reliable list's runtime retry_after: the gated copy-then-remove comes later
    later = _with_writes(t, base.later, encoded, keys)
    return Plan(base.effect, base.commands, base.delay, later, base.gated, base.warning)


_PLAIN = {o.kind: o for o in (ACK, DROP, RETRY)}
_REMOVED_BY_VALUE = {k._value_: e for k, e in _REMOVED.items()}


_COPY = stream_scripts.STREAM_COPY_ACK.sha
_COPY_EX = stream_scripts.STREAM_COPY_ACK_EX.sha
_STREAM_CELLS = {  # the stream's gated cell scripts (for a durable delay: how it removes)
    _COPY: "", _COPY_EX: "",
    stream_scripts.STREAM_ZADD_ACK.sha: "0", stream_scripts.STREAM_ZADD_ACK_DEL.sha: "1",
    stream_scripts.STREAM_ZADD_ACKDEL.sha: "x",
}
_REMOVE_RECEIPT = stream_scripts.STREAM_REMOVE_RECEIPT.sha
_CARRIERS = (STREAM_WRITES.sha, LIST_WRITES.sha, _REMOVE_RECEIPT)
"""The scripts that carry an outcome's writes."""
_LIST_COPY = list_scripts.LIST_COPY_REMOVE.sha
_LIST_ZADD = list_scripts.LIST_ZADD_REMOVE.sha


def _with_writes(t: Target, commands: tuple[Command, ...], writes: list[Arg],
                 keys: list[str | bytes]) -> tuple[Command, ...]:
    """``commands`` with the step that removes the original replaced by the
    writes script doing the same after the writes."""
    out: list[Command] = []
    stream = t.form is Form.STREAM
    i = 0
    while i < len(commands):
        cmd = commands[i]
        head = cmd[0]
        if stream and head == "XACK":
            src, group, eid = cmd[1], cmd[2], cmd[3]
            delete = i + 1 < len(commands) and commands[i + 1][0] == "XDEL"
            out.append(STREAM_WRITES.command(
                (src, src, *keys), (group, eid, "ack", "1" if delete else "0", 0, *writes)))
            i += 2 if delete else 1
            continue
        if stream and head == "XACKDEL":  # Redis 8.2: XACKDEL key group ACKED IDS 1 id
            src, group, eid = cmd[1], cmd[2], cmd[6]
            out.append(STREAM_WRITES.command((src, src, *keys), (group, eid, "ack", "x", 0, *writes)))
        elif stream and head == b"EVALSHA" and cmd[1] == _REMOVE_RECEIPT:
            # a runtime retry_after: the writes in its removal, before its receipt
            src, receipt, group, eid, how = cmd[3], cmd[4], cmd[5], cmd[6], cmd[7]
            out.append(stream_scripts.STREAM_REMOVE_RECEIPT.command(
                (src, receipt, *keys), (group, eid, how, *writes)))
        elif stream and head == b"EVALSHA" and cmd[1] in _STREAM_CELLS:
            sha, src, dest, group, eid = cmd[1], cmd[3], cmd[4], cmd[5], cmd[6]
            if sha == _COPY:
                args = (group, eid, "copy", "0", 0, *writes, *cmd[7:])
            elif sha == _COPY_EX:  # ... how cap fields
                args = (group, eid, "copy", cmd[7], cmd[8], *writes, *cmd[9:])
            else:
                args = (group, eid, "zadd", _STREAM_CELLS[sha], 0, *writes, *cmd[7:9])
            out.append(STREAM_WRITES.command((src, dest, *keys), args))
        elif not stream and head == "LREM":
            p, raw = cmd[1], cmd[3]
            out.append(LIST_WRITES.command((p, p, p, *keys), (raw, "remove", *writes, 1)))
        elif not stream and head == b"EVALSHA" and cmd[1] == _LIST_COPY:
            if cmd[2] == 3:  # the dead letter and its reason hash: element, copy, record
                p, dead, why = cmd[3], cmd[4], cmd[5]
                out.append(LIST_WRITES.command(
                    (p, dead, why, *keys), (cmd[6], "dead", *writes, cmd[7], cmd[8], 1)))
            else:  # a copy back onto the queue: element, copy
                p, dest = cmd[3], cmd[4]
                out.append(LIST_WRITES.command((p, dest, p, *keys), (cmd[5], "copy", *writes, cmd[6], 1)))
        elif not stream and head == b"EVALSHA" and cmd[1] == _LIST_ZADD:
            p, delays = cmd[3], cmd[4]
            out.append(LIST_WRITES.command(
                (p, delays, p, *keys), (cmd[5], "zadd", *writes, cmd[6], cmd[7], 1)))
        else:  # a step before the removal (a copy to another Cluster slot): as it is
            out.append(cmd)
        i += 1
    if not any(c[0] == b"EVALSHA" and c[1] in _CARRIERS for c in out):
        raise AckUnsupported(f"{t.name}: no step of this finalization can carry writes: {commands!r}")
    return tuple(out)
