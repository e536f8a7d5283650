"""The sans-IO core: (form, mode, outcome, attempt policy, delivery) -> Plan.

Nothing here does I/O.  :func:`plan` turns a delivery and its handler's
outcome into a :class:`Plan`: the Redis commands to send, in order, on a pool
connection, the effect to count, and for a runtime ``retry_after`` the
commands to send once the delay is over.  The shell (``_consumer``) only
executes plans.

The table it implements (the README's forms and outcomes, with its gated two-step cells):

=================  ==========  =====================  ==========  ====================
form               ACK         RETRY                  DROP        retry_after(d)
=================  ==========  =====================  ==========  ====================
stream             XACK        XADD copy, XACK        XACK        runtime / zset
claiming stream    XACK        stays in PEL           XACK        PEL (or zset)
reliable list      LREM        LPUSH copy, LREM       LREM        runtime / zset
simple list        refused     refused                refused     runtime LPUSH copy
channel / pattern  refused     refused                refused     runtime PUBLISH copy
=================  ==========  =====================  ==========  ====================

REJECT (``reject(reason)``) is the dead letter now, at any attempt
(:func:`plan_reject`): a stream's or reliable list's gated copy-then-remove to
``dead_letter`` (claiming streams too); refused where there is no dead letter
(simple lists, Pub/Sub, ``dead_letter=None``).

Two-step cells run as one gated script (see ``stream.scripts``) unless the keys
live on different Redis Cluster slots, where they become two commands in
the listed order (duplicate, never loss).  A stream's runtime
``retry_after`` removes the original with a gated script that leaves a
*receipt* of that finalization (``stream_scripts.STREAM_REMOVE_RECEIPT``, key
:func:`receipt_key`); its copy is written later only while the receipt says
"removed by me", and a resend after an unknown outcome answers from it
(:data:`RECEIPTED`).  On a stream the finalizer sends
the gated scripts of one batch that share their keys as one batched call
(``_batch.first_round``), settled per delivery as these plans' own.  A RETRY or ``retry_after`` at the
last allowed attempt goes to the dead letter (or is dropped with a warning).

Stream retention (``Target.retention``): with ``DELETE_ON_FINALIZE`` every
removal of an original is followed by its ``XDEL`` -- inside the gated
scripts (``STREAM_COPY_ACK_EX``, ``STREAM_ZADD_ACK_DEL``) for the two-step
cells, right after the ``XACK`` otherwise (both idempotent).  Another group's
copy is only acknowledged, never deleted.  ``copy_maxlen`` /
``dead_letter_maxlen`` put ``MAXLEN ~ n`` on the XADDs of copies written to
the stream and of dead letters.  ``TRIM_ACKED`` changes no plan: a periodic
task of the reader trims (``_retention``).

On a server with Redis 8.2's stream commands (``Target.caps``, see
``_caps``): ``DELETE_ON_FINALIZE`` removes with one ``XACKDEL key group
ACKED IDS n id ...`` instead (:attr:`Target.xackdel`; inside the scripts too:
``STREAM_COPY_ACK_EX`` with ``x``, ``STREAM_ZADD_ACKDEL``, the batched
scripts), which deletes an entry only once no group references it (so
another group's copy is removed with it too, once that group is done).  Each two-step cell keeps its
order and its gate; only the commands inside change.  The caps stay
``MAXLEN ~ n`` (see ``_lua.HOW``: ``~ ... ACKED`` removes nothing on 8.2.3).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import itertools
import json
import operator
import uuid
from collections.abc import Mapping, Sequence
from itertools import chain

from .._delivery import Delivery
from .._envelope import GROUP_FIELD, ORIGIN_FIELD, RETRIES_FIELD, pack_parts, wrap
from .._errors import AckUnsupported
from .._keys import derived, same_slot
from .._outcome import Outcome, OutcomeKind
from .._subscription import DelayedRetry, Form, Mode, Retention
from .._value import builder, immutable
from . import _lua
from ._caps import NO_CAPABILITIES, Capabilities
from ._commands import Arg, Command
from .reliable_list import scripts as list_scripts
from .stream import scripts as stream_scripts

__all__ = [
    "DEAD_FIELDS",
    "DEAD_TIME",
    "FAILED",
    "GATE_CLOSED",
    "RECEIPTED",
    "RECEIPT_SUFFIX",
    "WHY_SUFFIX",
    "Effect",
    "Plan",
    "Target",
    "attempt_of",
    "chain_stops",
    "content_origin",
    "copy_how",
    "dead_record",
    "list_copies",
    "list_counted",
    "list_removal",
    "plain_removals",
    "plan",
    "plan_dead",
    "plan_foreign",
    "plan_lost",
    "plan_reject",
    "receipt_key",
    "reject_reason",
    "removal_commands",
    "settle",
    "stream_removals",
    "why_key",
    "xackdel_closed",
]

DEAD_REASON = b"trf-dead-reason"
DEAD_SOURCE = b"trf-dead-source"
DEAD_ID = b"trf-dead-id"
DEAD_GROUP = b"trf-dead-group"
DEAD_ATTEMPT = b"trf-dead-attempt"
DEAD_TIME = b"trf-dead-time"
"""When the entry was dead-lettered: epoch milliseconds of the server's clock,
written in the step that writes the dead letter (``_lua.SERVER_TIME``)."""
DEAD_FIELDS = (DEAD_REASON, DEAD_SOURCE, DEAD_ID, DEAD_GROUP, DEAD_ATTEMPT, DEAD_TIME)
DEAD_ERROR = b"trf-dead-error"  # the handler's exception, when it raised (not always there)
WHY_SUFFIX = ":why"
"""A reliable list's dead letter ``D`` records why each element is there in the
hash ``derived(D, WHY_SUFFIX)`` (:func:`why_key`)."""


class Effect(enum.Enum):
    """What a plan does in Redis, as counted in the stats."""

    ACKED = "acked"  # original removed after ACK
    DROPPED = "dropped"  # original removed after DROP
    COPIED = "copied"  # copy added, original removed (RETRY)
    DELAYED = "delayed"  # copy in the durable delay set, original removed
    HELD = "held"  # copy held in process memory until its delay is over
    LEFT_PENDING = "left_pending"  # claiming: the entry stays in the PEL
    DEAD_LETTERED = "dead_lettered"  # copy in the dead letter, original removed
    EXHAUSTED = "exhausted"  # max_attempts reached, no dead letter: removed
    NOTHING = "nothing"  # no-ack form, ACK/DROP: nothing to do
    LOST_BEFORE_HANDLING = "lost_before_handling"  # deleted while pending
    FOREIGN_COPY = "foreign_copy"  # another group's copy: acknowledged, not handled


@immutable
@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """A mounted subscription, resolved: every key named, every default chosen."""

    form: Form
    name: str
    source: str = ""
    mode: Mode = Mode.PLAIN
    group: str = ""
    processing: str = ""
    delayed_retry: DelayedRetry | None = None  # None on a claiming stream: the PEL
    delay_key: str = ""
    max_attempts: int | None = None
    dead_letter: str | None = None
    retry_channel: str | None = None
    min_idle: float = 60.0
    cluster: bool = False
    # streams: what else is removed (Retention), and the MAXLEN ~ caps of the
    # copies written to the stream and of the dead letters
    retention: Retention | None = None
    copy_maxlen: int | None = None
    dead_letter_maxlen: int | None = None
    # what the server can do beyond Redis 6.2, as the client reported it at
    # mount (``_caps``); none: every plan takes the fallback
    caps: Capabilities = NO_CAPABILITIES

    @property
    def deletes(self) -> bool:
        """Originals are deleted (XDEL) when finalized: ``Retention.DELETE_ON_FINALIZE``."""
        return self.retention is Retention.DELETE_ON_FINALIZE

    @property
    def xackdel(self) -> bool:
        """Originals are removed with ``XACKDEL ... ACKED`` (acknowledged, and
        deleted once no group references them): ``DELETE_ON_FINALIZE`` on a
        server that has it.  The one place the core consumes
        ``Capabilities.xackdel``."""
        return self.retention is Retention.DELETE_ON_FINALIZE and self.caps.xackdel

    @property
    def acked(self) -> bool:
        """The retention trim lets the server keep what some group still
        references (``XTRIM ... ACKED``: ``_retention.TRIM_ACKED_NATIVE``).
        The one place the core consumes ``Capabilities.acked_trim``.  (Not the
        ``*_maxlen`` caps: see ``_lua.HOW`` for why they stay ``MAXLEN ~ n``.)"""
        return self.caps.acked_trim


# Built per message: ``builder(init=True)`` below replaces the generated frozen
# ``__init__`` with one that fills the slots in on the builder twin (see
# ``_value.builder``): about 0.25 µs against 0.36 µs with the slot setters.
@immutable
@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """Commands to send now, in order; ``later`` after ``delay`` seconds.

    ``gated``: every command, now and ``later``, is safe to send again after
    an unknown outcome (idempotent, or a gated script).  ``warning``: a line
    to log.
    """

    effect: Effect
    commands: tuple[Command, ...] = ()
    delay: float | None = None
    later: tuple[Command, ...] = ()
    gated: bool = True
    warning: str | None = None


PlanBuilder = builder(Plan, init=True)
"""The builder twin of :class:`Plan` (``_value.builder``)."""


def attempt_of(retries: int, delivery_count: int = 1) -> int:
    """Attempt number of a delivery: ``max(header retries + 1, server count)``."""
    return max(retries + 1, delivery_count)


def content_origin(payload: bytes) -> str:
    """Origin id of a foreign list element or message: a digest of its bytes.

    The same bytes re-delivered after a crash keep the same origin id, so it
    still serves as an idempotency key.
    """
    return "sha1:" + hashlib.sha1(payload).hexdigest()[:24]


def _flat(fields: Mapping[bytes, bytes]) -> list[bytes]:
    return list(chain.from_iterable(fields.items()))


def _copy_retries(d: Delivery) -> int:
    """The retry counter a copy carries: one more than the delivery's.

    A delivery's attempt may exceed its header counter + 1 (a server delivery
    count after crashes, in reclaim and claiming modes); the copy then counts
    from the attempt so that attempts never go backwards.
    """
    return max(d.retries + 1, d.attempt)


def _entry_fields(d: Delivery) -> list[bytes]:
    """The entry's field list as read (order and repeated names kept), flat."""
    if d.flat is not None:
        return list(d.flat)
    return _flat(d.fields)


def _stream_copy_fields(d: Delivery, group: str = "") -> tuple[bytes, ...]:
    """A copy's fields: the entry's own, byte for byte, then the headers.

    ``group``: the group the copy is addressed to (:data:`GROUP_FIELD`,
    for copies written back to the stream); ``""``: no address.
    """
    flat = d.flat if d.flat is not None else _flat(d.fields)
    retries = d.retries + 1  # _copy_retries(d), inlined (every RETRY copy)
    if d.attempt > retries:
        retries = d.attempt
    if group:
        return (*flat, RETRIES_FIELD, str(retries).encode(), ORIGIN_FIELD, d.origin_id.encode(),
                GROUP_FIELD, group.encode())
    return (*flat, RETRIES_FIELD, str(retries).encode(), ORIGIN_FIELD, d.origin_id.encode())


def _body(d: Delivery) -> bytes:
    if d.data is not None:
        return d.data
    return d.raw or b""


def _list_copy(d: Delivery) -> bytes:
    return wrap(_body(d), _copy_retries(d), d.origin_id)


# Delays are capped (at ~31,700 years) so that the score stays an exact
# integer once the server adds its clock to it, and huge finite delays
# (``retry_after(1e308)``) cannot overflow.
_MAX_DELAY_MS = 10**15


def _ms(delay: float) -> int:
    if not delay > 0:
        return 0
    if delay >= _MAX_DELAY_MS / 1000:
        return _MAX_DELAY_MS
    return min(_MAX_DELAY_MS, round(delay * 1000))


def _member(*parts: bytes) -> bytes:
    return pack_parts([uuid.uuid4().bytes, *parts])


def _stream_remove(t: Target, d: Delivery, effect: Effect) -> Plan:
    assert d.id is not None
    if t.retention is Retention.DELETE_ON_FINALIZE:
        if t.xackdel:  # one command, idempotent; its reply says what it acknowledged
            return Plan(effect, (("XACKDEL", t.source, t.group, "ACKED", "IDS", 1, d.id),))
        # both idempotent: safe to send again after an unknown outcome
        return Plan(effect, (("XACK", t.source, t.group, d.id), ("XDEL", t.source, d.id)))
    return Plan(effect, (("XACK", t.source, t.group, d.id),))


def _cap(maxlen: int | None) -> tuple[str | int, ...]:
    """``MAXLEN ~ n`` for an XADD, or nothing."""
    return () if maxlen is None else ("MAXLEN", "~", maxlen)


def copy_how(t: Target) -> str:
    """How ``STREAM_COPY_ACK_EX`` removes the original (see ``_lua.HOW``):
    ``"0"`` XACK, ``"1"`` XACK then XDEL, ``"x"`` one XACKDEL ACKED."""
    return "x" if t.xackdel else "1" if t.deletes else "0"


def _list_remove(t: Target, d: Delivery, effect: Effect) -> Plan:
    assert d.raw is not None
    return Plan(effect, (("LREM", t.processing, -1, d.raw),))


# Identical elements (``LPUSH q X X``): a reliable list's removal of element
# ``e`` carries ``n``, the number of copies of ``e`` the consumer holds whose
# removal was not sent before this one (this one included), and removes only
# while the processing list holds at least ``n`` copies (``LPOS … RANK -n``).
# Removals are sent in the order their ``n`` was taken, so a removal sent
# again after an unknown outcome (applied: ``n - 1`` left) finds the gate
# closed instead of removing a copy another handler still holds.  ``n == 1``
# (unique elements, the common case) is the plain ``LREM`` / the scripts'
# plain ``LPOS`` gate.  The reader assigns ``n`` (``list_counted``) just
# before a finalization is first sent.
#
# Direction: the reader pushes what it reads onto the head of the processing
# list (``BLMOVE … RIGHT LEFT``), so the oldest elements -- those finalized
# first -- are at its tail, and every removal scans from there: ``LREM p -1
# e`` and the gates' ``LPOS … RANK -n`` (cost: the elements newer than the
# one removed read since are not walked over).  Identical elements are the
# same bytes: which of their copies goes changes no count (``LPOS RANK -n``
# exists exactly when ``LPOS RANK n`` does: the list holds >= n copies), so
# the gates and the reader's multiset counting do not depend on the direction.

_COPY_REMOVE_SHA = list_scripts.LIST_COPY_REMOVE.sha
_ZADD_REMOVE_SHA = list_scripts.LIST_ZADD_REMOVE.sha
_REMOVE_SHA = list_scripts.LIST_REMOVE.sha
# EVALSHA sha numkeys processing ...: index of the element, and the length
# of the command without its trailing n
_COUNTED_SHAS: dict[object, tuple[int, int]] = {
    _COPY_REMOVE_SHA: (5, 7), _ZADD_REMOVE_SHA: (5, 8), _REMOVE_SHA: (4, 5),
}
# LIST_COPY_REMOVE with its third key, the reason hash (a dead letter):
# EVALSHA sha 3 processing dead why element copy record [n]
_DEAD_AT = (6, 9)


_WRITES_SHA = list_scripts.LIST_WRITES.sha  # (with an outcome's writes: its n always last)


def _counted_at(cmd: Command) -> tuple[int, int] | None:
    sha = cmd[1]
    if sha == _COPY_REMOVE_SHA and cmd[2] == 3:
        return _DEAD_AT
    if sha == _WRITES_SHA:
        return 3 + int(cmd[2]), len(cmd) - 1
    return _COUNTED_SHAS.get(sha)


def list_removal(t: Target, cmd: Command) -> bytes | None:
    """The element that ``cmd``, a command of a reliable list's plan, removes
    from ``t.processing`` (one copy), or None when it removes none."""
    head = cmd[0]
    if head == "LREM":
        e = cmd[3]
        return e if cmd[1] == t.processing and isinstance(e, bytes) else None
    if head == b"EVALSHA":
        at = _counted_at(cmd)
        if at is not None and cmd[3] == t.processing:
            e = cmd[at[0]]
            return e if isinstance(e, bytes) else None
    return None


def list_copies(cmd: Command) -> int:
    """The ``n`` a removal :func:`list_removal` names is gated on (1: a plain gate)."""
    if cmd[0] == b"EVALSHA":
        at = _counted_at(cmd)
        if at is not None and len(cmd) > at[1]:
            return int(cmd[at[1]])
    return 1


def list_counted(cmd: Command, n: int) -> Command:
    """``cmd`` (a removal :func:`list_removal` names) gated on ``n`` copies."""
    if cmd[0] == "LREM":
        if n == 1:
            return cmd
        return list_scripts.LIST_REMOVE.command((cmd[1],), (cmd[3], n))
    at = _counted_at(cmd)
    assert at is not None
    return (*cmd[: at[1]], n)


# module-level names for the members the planners compare with (a global
# load, not an attribute load on the enum class)
_STREAM, _LIST, _CHANNEL, _PATTERN = Form.STREAM, Form.LIST, Form.CHANNEL, Form.PATTERN
_RETRY, _CLAIMING = OutcomeKind.RETRY, Mode.CLAIMING
_REJECT = OutcomeKind.REJECT
_COPIED, _LEFT_PENDING = Effect.COPIED, Effect.LEFT_PENDING
_COPY_ACK_SHA = stream_scripts.STREAM_COPY_ACK.sha


def _stream_copy(
    t: Target, d: Delivery, dest: str, fields: Sequence[bytes], effect: Effect,
    maxlen: int | None = None,
) -> Plan:
    assert d.id is not None
    deletes = t.retention is Retention.DELETE_ON_FINALIZE
    if t.cluster and not same_slot(t.source, dest):
        # copy, then remove (acknowledge; delete), each once the one before succeeded
        copy: Command = (
            stream_scripts.STREAM_XADD.command((dest,), (maxlen or 0, *fields))
            if fields and fields[-1] == _lua.SERVER_TIME  # a dead letter: the server's time
            else ("XADD", dest, *_cap(maxlen), "*", *fields))
        return Plan(effect, (copy, *_stream_remove(t, d, effect).commands), gated=False)
    if deletes or maxlen is not None:
        args: tuple[Arg, ...] = (t.group, d.id, copy_how(t), maxlen or 0, *fields)
        return Plan(effect, (stream_scripts.STREAM_COPY_ACK_EX.command((t.source, dest), args),))
    # STREAM_COPY_ACK.command((t.source, dest), (t.group, d.id, *fields)), in one tuple
    # (every RETRY copy)
    return Plan(effect, ((b"EVALSHA", _COPY_ACK_SHA, 2, t.source, dest, t.group, d.id, *fields),))


RECEIPT_SUFFIX = ":receipt:"
"""A runtime ``retry_after``'s receipt on a stream ``s`` is
``derived(s, RECEIPT_SUFFIX + <32 hex digits>)``, a name of its own per
finalization (:func:`receipt_key`)."""


def receipt_key(t: Target) -> str:
    """A fresh receipt key for one finalization of ``t``'s stream, in its hash slot."""
    return derived(t.source, RECEIPT_SUFFIX + uuid.uuid4().hex)


def _runtime_copy(t: Target, d: Delivery, receipt: str) -> Command:
    """The command that writes a runtime ``retry_after`` copy to the stream,
    once, and only while ``receipt`` says this finalization removed the
    original (``stream_scripts.STREAM_COPY_ONCE``)."""
    return stream_scripts.STREAM_COPY_ONCE.command(
        (t.source, receipt),
        (stream_scripts.COPY_MARK_TTL, t.copy_maxlen or 0, *_stream_copy_fields(d, t.group)))


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
        (list_scripts.LIST_COPY_REMOVE.command((t.processing, dest), (d.raw, element)),),
    )


def why_key(dead_letter: str) -> str:
    """The hash of a reliable list's dead letter that records why each element
    is there (see ``reliable_list.scripts``): ``{dead_letter}:why``, in its hash slot."""
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
            (list_scripts.LIST_DEAD_PUSH.command((dead, why), (d.raw, record)),
             ("LREM", t.processing, -1, d.raw)),
            gated=False,
        )
    return Plan(
        Effect.DEAD_LETTERED,
        (list_scripts.LIST_COPY_REMOVE.command((t.processing, dead, why), (d.raw, d.raw, record)),),
    )


def plan_dead(t: Target, d: Delivery, reason: str) -> Plan:
    """Send ``d`` to the dead letter (copy, then remove the original), or drop it.

    Used when ``max_attempts`` is exhausted, for a delivery that arrives past
    the limit, and for a corrupt envelope.
    """
    warning = f"{t.name}: {reason}; "
    if t.form is Form.STREAM:
        if t.dead_letter is None:
            return dataclasses.replace(
                _stream_remove(t, d, Effect.EXHAUSTED),
                warning=warning + f"entry {d.id} acknowledged without dead letter",
            )
        # the entry's own field list, byte for byte; no group address (the
        # dead letter is another stream, read by other groups)
        fields = [
            *_entry_fields(d),
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
        p = _stream_copy(t, d, t.dead_letter, fields, Effect.DEAD_LETTERED,
                         t.dead_letter_maxlen)
        return dataclasses.replace(p, warning=warning + f"entry {d.id} dead-lettered")
    if t.form is Form.RELIABLE_LIST:
        if t.dead_letter is None:
            return dataclasses.replace(
                _list_remove(t, d, Effect.EXHAUSTED),
                warning=warning + "element removed without dead letter",
            )
        p = _list_dead(t, d, reason)
        return dataclasses.replace(p, warning=warning + "element dead-lettered")
    # no-ack forms: nothing to remove, no dead letter
    return Plan(Effect.EXHAUSTED, (), warning=warning + "message dropped")


def reject_reason(outcome: Outcome) -> str:
    """The dead letter's reason for a REJECT: ``rejected: <reason>`` (``rejected``)."""
    return f"rejected: {outcome.reason}" if outcome.reason else "rejected"


def plan_reject(t: Target, d: Delivery, outcome: Outcome) -> Plan:
    """REJECT / ``reject(reason)``: the dead letter now, whatever the attempt
    (copy, then remove: :func:`plan_dead`'s gated step).

    Raises:
        AckUnsupported: no dead letter to send it to (simple lists, Pub/Sub,
            a stream or reliable list with ``dead_letter=None``).
    """
    if (t.form is not Form.STREAM and t.form is not Form.RELIABLE_LIST) or t.dead_letter is None:
        where = (f"a {t.form.value} has no dead letter"
                 if t.form is not Form.STREAM and t.form is not Form.RELIABLE_LIST
                 else "it has dead_letter=None (give it a dead_letter=, or leave the default)")
        raise AckUnsupported(f"{t.name}: {outcome!r} is refused: {where}; return DROP to give "
                             "the message up instead")
    return plan_dead(t, d, reject_reason(outcome))


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


_REMOVED = {OutcomeKind.ACK: Effect.ACKED, OutcomeKind.DROP: Effect.DROPPED}
"""The outcome kinds that remove the original from a stream or reliable list, and their effects."""


def plain_removals(t: Target) -> dict[OutcomeKind, Effect]:
    """The outcome kinds a handler returns whose finalization is the plain
    removal of the original.

    For each kind ``k`` returned with effect ``e``, and every delivery ``d``
    of ``t``, finalizing ``d`` with ``Outcome(k)`` is ``Plan(e,
    removal_commands(t, [d]))``: on a stream ``plan(t, d, Outcome(k))`` is
    one ``XACK`` of the entry, on a reliable list one ``LREM`` of the element
    from the processing list; on the forms with nothing to remove (simple
    lists, Pub/Sub) ``plan()`` refuses an ACK, which the finalizer counts as
    done (:attr:`Effect.NOTHING`, no command).  The finalizer uses it to
    remove such deliveries with :func:`removal_commands`, many at once,
    without building a plan (or, on the forms with nothing to remove,
    raising and catching a refusal) for each: the hot path.
    """
    if t.form is Form.STREAM or t.form is Form.RELIABLE_LIST:
        return dict(_REMOVED)
    return {OutcomeKind.ACK: Effect.NOTHING, OutcomeKind.DROP: Effect.NOTHING}


def removal_commands(t: Target, deliveries: Sequence[Delivery]) -> list[Command]:
    """The commands that remove ``deliveries`` of ``t`` (see :func:`plain_removals`).

    A stream's entries go in one ``XACK`` of all their ids (the plans'
    single-id ``XACK`` commands merge into one of their own), followed with
    ``Retention.DELETE_ON_FINALIZE`` by one ``XDEL`` of the same ids (both
    idempotent; a crash between the two leaves acknowledged entries in the
    stream, which the periodic trim removes) -- or, where the server has it
    (:attr:`Target.xackdel`), one ``XACKDEL ... ACKED IDS n`` of them all
    (its reply: one code per id); a reliable list's elements
    need one ``LREM`` each; simple lists and Pub/Sub have nothing to remove
    (no command).
    """
    if not deliveries:
        return []
    form = t.form
    if form is Form.STREAM:
        ids: list[str] = [d.id for d in deliveries]  # type: ignore[misc]  # a stream delivery has its id
        return stream_removals(t, ids)
    if form is Form.RELIABLE_LIST:
        # one ("LREM", processing, -1, raw) each, built in C (a reliable list's
        # deliveries always carry their element: None only in a hand-made one)
        raws = [*map(_RAW, deliveries)]
        if None in raws:
            raws = [e for e in raws if e is not None]
        return [*zip(_repeat("LREM"), _repeat(t.processing), _repeat(-1), raws, strict=False)]
    return []


_RAW = operator.attrgetter("raw")
_repeat = itertools.repeat


def stream_removals(t: Target, ids: Sequence[str]) -> list[Command]:
    """:func:`removal_commands` of the stream entries ``ids`` (not empty)."""
    if t.retention is Retention.DELETE_ON_FINALIZE:
        if t.xackdel:
            return [("XACKDEL", t.source, t.group, "ACKED", "IDS", len(ids), *ids)]
        return [("XACK", t.source, t.group, *ids), ("XDEL", t.source, *ids)]
    return [("XACK", t.source, t.group, *ids)]


def exhausted(t: Target, attempt: int) -> bool:
    """Whether ``attempt`` is the last one ``t.max_attempts`` allows (or past it): a retry
    then dead-letters (or drops, without ``dead_letter``).  The one place this rule is written."""
    return t.max_attempts is not None and attempt >= t.max_attempts


def plan(t: Target, d: Delivery, outcome: Outcome) -> Plan:
    """The plan that finalizes ``d`` with ``outcome`` on subscription ``t``.

    Raises:
        AckUnsupported: the form cannot carry out ``outcome`` (ACK, RETRY and
            DROP on simple lists and Pub/Sub; ``retry_after`` on a pattern
            subscription without ``retry_channel``).
    """
    kind = outcome.kind
    form = t.form
    if form is _STREAM and kind is _RETRY:  # the common case first (Enum class lookups are slow)
        if exhausted(t, d.attempt):
            return plan_dead(t, d, f"max_attempts={t.max_attempts} reached at attempt {d.attempt}")
        if t.mode is _CLAIMING:
            return Plan(_LEFT_PENDING)
        return _stream_copy(t, d, t.source, _stream_copy_fields(d, t.group), _COPIED,
                            t.copy_maxlen)
    if kind is _REJECT:
        return plan_reject(t, d, outcome)
    no_ack = form is _LIST or form is _CHANNEL or form is _PATTERN
    if no_ack and kind is not OutcomeKind.RETRY_AFTER:
        raise AckUnsupported(
            f"{t.name}: a {form.value} has nothing to acknowledge, so {outcome!r} is refused; "
            + (
                "use retry_after(delay) or a ReliableListSubscription to retry"
                if kind is OutcomeKind.RETRY
                else "ACK and DROP are no-ops there"
            )
        )
    if form is Form.PATTERN and t.retry_channel is None:
        # refused whatever the attempt: the configuration cannot carry it out
        raise AckUnsupported(
            f"{t.name}: a pattern subscription needs retry_channel= to publish "
            "retry_after copies (the pattern names no single channel)"
        )
    if (kind is OutcomeKind.RETRY or kind is OutcomeKind.RETRY_AFTER) and exhausted(t, d.attempt):
        return plan_dead(t, d, f"max_attempts={t.max_attempts} reached at attempt {d.attempt}")
    removed = _REMOVED.get(kind)
    if removed is not None:  # ACK, DROP: only a stream or a reliable list gets here
        return (_stream_remove if form is Form.STREAM else _list_remove)(t, d, removed)

    if form is Form.STREAM:
        if kind is OutcomeKind.RETRY:
            if t.mode is Mode.CLAIMING:
                return Plan(Effect.LEFT_PENDING)
            return _stream_copy(t, d, t.source, _stream_copy_fields(d, t.group), Effect.COPIED,
                                t.copy_maxlen)
        # retry_after
        way = t.delayed_retry
        if way is None:  # claiming: the PEL is the delay
            return Plan(Effect.LEFT_PENDING)
        if way is DelayedRetry.DURABLE_ZSET:
            assert d.id is not None
            member = _member(*_stream_copy_fields(d, t.group))
            script = (stream_scripts.STREAM_ZADD_ACK if t.retention is not Retention.DELETE_ON_FINALIZE
                      else stream_scripts.STREAM_ZADD_ACKDEL if t.xackdel
                      else stream_scripts.STREAM_ZADD_ACK_DEL)
            return Plan(
                Effect.DELAYED,
                (
                    script.command(
                        (t.source, t.delay_key), (t.group, d.id, _ms(outcome.delay), member)
                    ),
                ),
            )
        # runtime: remove now, leaving this finalization's receipt; XADD the
        # copy when the timer fires, only while the receipt says "removed by
        # me", once (see ``stream_scripts.STREAM_REMOVE_RECEIPT``)
        assert d.id is not None
        receipt = receipt_key(t)
        return Plan(
            Effect.HELD,
            (stream_scripts.STREAM_REMOVE_RECEIPT.command(
                (t.source, receipt), (t.group, d.id, copy_how(t), 0)),),
            delay=outcome.delay,
            later=(_runtime_copy(t, d, receipt),),
        )

    if form is Form.RELIABLE_LIST:
        if kind is OutcomeKind.RETRY:
            return _list_copy_remove(t, d, t.source, _list_copy(d), Effect.COPIED)
        if t.delayed_retry is DelayedRetry.DURABLE_ZSET:
            assert d.raw is not None
            member = _member(_list_copy(d))
            return Plan(
                Effect.DELAYED,
                (
                    list_scripts.LIST_ZADD_REMOVE.command(
                        (t.processing, t.delay_key), (d.raw, _ms(outcome.delay), member)
                    ),
                ),
            )
        # runtime: the original stays in the processing list meanwhile
        later = _list_copy_remove(t, d, t.source, _list_copy(d), Effect.COPIED)
        return Plan(Effect.HELD, (), delay=outcome.delay, later=later.commands,
                    gated=later.gated)

    # simple list, channel, pattern: only retry_after, as a runtime copy
    copy = _list_copy(d)
    if form is Form.LIST:
        return Plan(Effect.HELD, (), delay=outcome.delay, later=(("LPUSH", t.source, copy),),
                    gated=False)
    if form is Form.CHANNEL:
        return Plan(Effect.HELD, (), delay=outcome.delay, later=(("PUBLISH", d.source, copy),),
                    gated=False)
    assert t.retry_channel is not None
    return Plan(Effect.HELD, (), delay=outcome.delay,
                later=(("PUBLISH", t.retry_channel, copy),), gated=False)


def xackdel_closed(reply: object) -> bool:
    """Whether an ``XACKDEL`` reply says none of its ids was pending (every
    code ``-1``): nothing acknowledged, a closed gate."""
    return isinstance(reply, list) and bool(reply) and all(c == -1 for c in reply)


RECEIPTED = frozenset({stream_scripts.STREAM_REMOVE_RECEIPT.sha})
"""Shas of the gated scripts that read their finalization's own receipt when
the gate is closed: their answer is exact even after an unknown outcome."""


def chain_stops(cmd: Command, reply: object) -> bool:
    """Whether a held runtime copy's commands end at ``cmd`` answered ``reply``
    (the scheduler sends them in order, each once the one before succeeded):
    a gated script answered nil -- the removal of the original was not this
    finalization's (``STREAM_REMOVE_RECEIPT``: a shutdown sends it again with
    the copy), or the copy's receipt is gone -- so nothing after it is sent."""
    return reply is None and cmd[0] == b"EVALSHA"


GATE_CLOSED = "gate_closed"
"""The effect of a gated script whose gate was closed: the original was no
longer pending (finalized already, by this or a racing finalizer), nothing written."""
FAILED = "failed"
"""The effect of a plan whose step got a final error reply, or was not sent
because the step before it failed: the original stays where it was."""


def settle(p: Plan, replies: Sequence[object], *, unsure: bool = False) -> str:
    """The effect to count for ``p`` from what Redis answered (sans-IO).

    ``replies``: the replies to ``p.commands`` in order, as far as they were
    sent (error replies as exception values).  A step that got an error
    reply, or was never sent, makes the effect :data:`FAILED`; a gated
    script (``EVALSHA``) answered nil or false found its gate closed
    (:data:`GATE_CLOSED`: no copy written, nothing removed), and so did a
    plan's first command ``XACKDEL`` answered ``-1`` for every id (none
    was pending: nothing acknowledged, and a runtime ``retry_after``'s copy
    is then not written); otherwise the plan's own effect (``copied``,
    ``dead_lettered``, ``delayed`` ...).

    ``unsure``: an earlier send of these commands had an unknown outcome (a
    lost reply, a cut connection).  A closed gate then answers that this
    earlier send did the work: the plan's own effect is counted, once --
    except for a script that reads its own receipt (:data:`RECEIPTED`: a
    runtime ``retry_after``'s removal), whose closed gate means another
    finalization removed the original, whatever was sent before.
    """
    commands = p.commands
    if len(replies) < len(commands):
        return FAILED
    gate_closed = False
    for i, (cmd, r) in enumerate(zip(commands, replies[: len(commands)], strict=True)):
        if isinstance(r, Exception):
            return FAILED
        if (r is None or r is False) and p.gated and cmd[0] == b"EVALSHA":
            gate_closed = True
            if cmd[1] in RECEIPTED:  # its receipt answered for this very finalization
                return GATE_CLOSED
        # XACKDEL first (nothing written before it) acknowledged nothing
        gate_closed = gate_closed or (i == 0 and cmd[0] == "XACKDEL" and xackdel_closed(r))
    return GATE_CLOSED if gate_closed and not unsure else p.effect._value_
