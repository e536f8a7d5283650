"""The core's values of a finalization: what every cell returns, and how replies settle it.

Nothing here does I/O or knows a form.  :class:`Target` is a mounted
subscription resolved; :class:`Plan` is what a form's cells (``_plan.CELLS``:
``stream/cells.py``, ``reliable_list/cells.py``, the no-ack forms' in
``_plan``) make of a delivery and its outcome: the commands to send, the
:class:`Effect` to count, a runtime ``retry_after``'s commands to send later.
:func:`settle` turns the replies into the effect counted.  :class:`Cells` is
the row a form fills in (the core's half of the form table); the helpers
below are what more than one form's cells share (copies' retry counters,
delays, the dead letter's fields, the ``max_attempts`` rule:
:func:`exhausted`).

This module imports no other module of the core but ``_caps`` and
``_commands``, so every form's cells can import it without a circle.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any, ClassVar

from .._delivery import Delivery
from .._envelope import pack_parts, wrap
from .._errors import AckUnsupported
from .._outcome import Outcome, OutcomeKind
from .._subscription import DelayedRetry, Form, Mode, Retention
from .._value import builder, immutable
from .._writes import write_keys
from ._caps import NO_CAPABILITIES, Capabilities
from ._commands import Arg, Command, Script

__all__ = [
    "DEAD_ATTEMPT",
    "DEAD_ERROR",
    "DEAD_FIELDS",
    "DEAD_GROUP",
    "DEAD_ID",
    "DEAD_REASON",
    "DEAD_SOURCE",
    "DEAD_TIME",
    "FAILED",
    "GATE_CLOSED",
    "NOTHING_REMOVED",
    "RECEIPTED",
    "REMOVED",
    "Batcher",
    "Cells",
    "Effect",
    "Plan",
    "PlanBuilder",
    "Target",
    "args_at",
    "attempt_of",
    "chain_stops",
    "content_origin",
    "exhausted",
    "fields_of",
    "fixed_at",
    "reject_reason",
    "settle",
    "writes_at",
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
    """Attempt number of a delivery: ``header retries + server count``."""
    return retries + max(delivery_count, 1)


def content_origin(payload: bytes) -> str:
    """Origin id of a foreign list element or message: a digest of its bytes.

    The same bytes re-delivered after a crash keep the same origin id, so it
    still serves as an idempotency key.
    """
    return "sha1:" + hashlib.sha1(payload).hexdigest()[:24]


def flat(fields: Mapping[bytes, bytes]) -> list[bytes]:
    """``fields`` as one flat list: name, value, name, value ..."""
    return list(chain.from_iterable(fields.items()))


def copy_retries(d: Delivery) -> int:
    """The retry counter a copy carries: one more than the delivery's.

    A delivery's attempt may exceed its header counter + 1 (a server delivery
    count after crashes, in reclaim and claiming modes); the copy then counts
    from the attempt so that attempts never go backwards.
    """
    return max(d.retries + 1, d.attempt)


def entry_fields(d: Delivery) -> list[bytes]:
    """The entry's field list as read (order and repeated names kept), flat."""
    if d.flat is not None:
        return list(d.flat)
    return flat(d.fields)


def body(d: Delivery) -> bytes:
    """What a copy of ``d`` carries: its payload, or its element as read."""
    if d.data is not None:
        return d.data
    return d.raw or b""


def list_copy(d: Delivery) -> bytes:
    """A list element's or message's copy: its body in an envelope one retry on."""
    return wrap(body(d), copy_retries(d), d.origin_id)


# Delays are capped (at ~31,700 years) so that the score stays an exact
# integer once the server adds its clock to it, and huge finite delays
# (``retry_after(1e308)``) cannot overflow.
MAX_DELAY_MS = 10**15


def ms(delay: float) -> int:
    """``delay`` seconds as whole milliseconds, at least 0, at most :data:`MAX_DELAY_MS`."""
    if not delay > 0:
        return 0
    if delay >= MAX_DELAY_MS / 1000:
        return MAX_DELAY_MS
    return min(MAX_DELAY_MS, round(delay * 1000))


def member(*parts: bytes) -> bytes:
    """A durable delay's member: a fresh uuid, then ``parts`` (one per finalization)."""
    return pack_parts([uuid.uuid4().bytes, *parts])


def cap(maxlen: int | None) -> tuple[str | int, ...]:
    """``MAXLEN ~ n`` for an XADD, or nothing."""
    return () if maxlen is None else ("MAXLEN", "~", maxlen)


def reject_reason(outcome: Outcome) -> str:
    """The dead letter's reason for a REJECT: ``rejected: <reason>`` (``rejected``)."""
    return f"rejected: {outcome.reason}" if outcome.reason else "rejected"


REMOVED = {OutcomeKind.ACK: Effect.ACKED, OutcomeKind.DROP: Effect.DROPPED}
"""The outcome kinds that remove the original where there is one (a gated form), and their effects."""


def exhausted(t: Target, attempt: int) -> bool:
    """Whether ``attempt`` is the last one ``t.max_attempts`` allows (or past it): a retry
    then dead-letters (or drops, without ``dead_letter``).  The one place this rule is written."""
    return t.max_attempts is not None and attempt >= t.max_attempts


class Batcher:
    """A gated script whose calls in one finalizer batch can go in one
    batched call (``_batch.first_round``), and back.

    A form's cells list theirs in ``Cells.batchers`` (by the single
    script's sha) and ``Cells.batched`` (by the batched script's sha).
    """

    __slots__ = ()

    def part(self, cmd: Command) -> tuple[tuple[Arg, ...], tuple[Arg, ...]] | None:
        """``(key, part)`` of ``cmd``, a call of this script, else None (it goes
        alone): ``key``, what the calls of one batched call share (the
        batched script, its keys and fixed arguments); ``part``, this call's
        arguments in the batched call."""
        raise NotImplementedError

    def call(self, singles: Sequence[Command], args: Sequence[Arg]) -> Command:
        """The batched call of ``singles`` (calls of one key; ``args``: their parts)."""
        raise NotImplementedError

    def singles(self, cmd: Command) -> list[Command]:
        """The single calls a batched call ``cmd`` carries, in the order of its
        reply's elements (what each delivery's plan would send alone)."""
        raise NotImplementedError


def fixed_at(script: Script, name: str) -> int:
    """Where the field ``name`` (as ``script``'s layout writes it: ``"id"``,
    ``"fields..."``) sits (starts) in every built call of ``script``: a key
    after no optional or ``...`` key, or an argument of a script whose keys are fixed
    in number, before any optional or ``...`` argument.  Worked out once, by
    name, for the code that reads built calls on the hot path (elsewhere:
    ``Script.field``, ``Script.at``)."""
    keys, argv = script.keys or (), script.argv or ()
    if name in keys:
        k = keys.index(name)
        if any(key[-1] in "?." for key in keys[:k]):
            raise ValueError(f"{script.name}: {name!r} has no fixed place")
        return 3 + k
    i = argv.index(name)
    if any(k[-1] in "?." for k in keys) or any(a[-1] in "?." or a[0] == "[" for a in argv[:i]):
        raise ValueError(f"{script.name}: {name!r} has no fixed place")
    return 3 + len(keys) + i


def args_at(script: Script, name: str) -> int:
    """Where the argument ``name`` sits from ``ARGV[1]`` (``cmd[3 + numkeys]``)
    in every built call of ``script`` (no optional or ``...`` argument before
    it): worked out once, by name, for the hot path."""
    argv = script.argv or ()
    i = argv.index(name)
    if any(a[-1] in "?." or a[0] == "[" for a in argv[:i]):
        raise ValueError(f"{script.name}: {name!r} has no fixed place")
    return i


def fields_of(script: Script, cmd: Command, *names: str) -> tuple[Arg, ...]:
    """The values of the fields ``names`` in ``cmd``, a call of ``script``
    that sends every one of them (``Script.field`` each)."""
    out = [script.field(cmd, n) for n in names]
    if None in out:
        raise ValueError(f"{script.name}: a call without one of {names}: {cmd[:2]!r}")
    return tuple(out)  # type: ignore[arg-type]


def writes_at(cmd: Command, i: int) -> tuple[list[str | bytes], int]:
    """The keys of the encoded writes at ``cmd[i]`` (``nw``, then each write's
    count of values and command: ``_writes.encode_writes``), and the index
    after them."""
    writes: list[tuple[Arg, ...]] = []
    j = i + 1
    for _ in range(int(cmd[i])):
        argc = int(cmd[j])
        writes.append(tuple(cmd[j + 1:j + 1 + argc]))
        j += 1 + argc
    return write_keys(writes), j  # type: ignore[arg-type]


NOTHING_REMOVED = {OutcomeKind.ACK: Effect.NOTHING, OutcomeKind.DROP: Effect.NOTHING}
"""A form with nothing to remove: ACK and DROP are counted, nothing sent."""


class Cells:
    """One form's row of the outcome table: the core's half of the form table.

    ``_plan.CELLS`` maps every ``Form`` to one instance; the core asks it
    (``cells.gated``, ``cells.by_id``, ``cells.plan(...)`` ...) instead of
    testing which form a subscription is.  This base is the row of a form
    with nothing to acknowledge (simple lists, Pub/Sub): ACK and DROP remove
    nothing, there is no gate and no dead letter.  The stream's row is
    ``stream/cells.py``, the reliable list's ``reliable_list/cells.py``.
    """

    __slots__ = ()

    noun: ClassVar[str] = ""
    """The form as a refusal names it (``"a stream"`` ...: ``a {noun}``)."""
    gated: ClassVar[bool] = False
    """An original to remove behind a gate: REJECT, dead letters and writes are possible."""
    by_id: ClassVar[bool] = False
    """Deliveries are known by an entry id (a stream), else by their bytes."""
    counted: ClassVar[bool] = False
    """Removals of identical elements are counted (a reliable list: ``ListGates``)."""
    writes_calls: ClassVar[bool] = False
    """ACKs and DROPs carrying writes are built as batched calls, no plan each (:meth:`ack_writes_calls`)."""
    removals: ClassVar[Mapping[OutcomeKind, Effect]] = NOTHING_REMOVED
    """The outcome kinds finalized by the plain removal of the original
    (``_plan.plain_removals``), with their effects."""
    batchers: ClassVar[Mapping[object, Batcher]] = {}
    """The gated scripts of this form's plans whose calls are batched, by sha."""
    batched: ClassVar[Mapping[object, Batcher]] = {}
    """The batched scripts those calls go in, by sha (their replies: ``_batch.batch_replies``)."""

    def plan(self, t: Target, d: Delivery, outcome: Outcome) -> Plan:
        """The plan that finalizes ``d`` with ``outcome`` (``_plan.plan``)."""
        raise NotImplementedError

    def dead(self, t: Target, d: Delivery, reason: str) -> Plan:
        """``d`` to the dead letter, or dropped (``_plan.plan_dead``); here:
        nothing to remove, no dead letter."""
        return Plan(Effect.EXHAUSTED, (), warning=f"{t.name}: {reason}; message dropped")

    def reject(self, t: Target, d: Delivery, outcome: Outcome) -> Plan:
        """REJECT: the dead letter now (``_plan.plan_reject``).

        Raises:
            AckUnsupported: no dead letter to send it to.
        """
        if not self.gated or t.dead_letter is None:
            where = (f"a {self.noun} has no dead letter" if not self.gated
                     else "it has dead_letter=None (give it a dead_letter=, or leave the default)")
            raise AckUnsupported(f"{t.name}: {outcome!r} is refused: {where}; return DROP to give "
                                 "the message up instead")
        return self.dead(t, d, reject_reason(outcome))

    def removal_commands(self, t: Target, deliveries: Sequence[Delivery]) -> list[Command]:
        """The commands removing ``deliveries`` (not empty) at once (``_plan.removal_commands``)."""
        return []

    def gate_key(self, t: Target) -> str:
        """The key a finalization's gate reads: the writes' keys share its hash slot."""
        return t.source

    def leaves_pending(self, t: Target, d: Delivery, outcome: Outcome) -> bool:
        """Whether ``outcome`` leaves ``d`` pending, finalizing nothing (a claiming retry)."""
        return False

    def with_writes(self, t: Target, commands: Sequence[Command], writes: Sequence[Arg],
                    keys: Sequence[str | bytes]) -> tuple[Command, ...] | None:
        """``commands`` with the step that removes the original carrying
        ``writes`` (encoded; their ``keys``); None when no step can."""
        return None

    def removal_with_writes(self, t: Target, d: Delivery, effect: Effect, writes: Sequence[Arg],
                            keys: Sequence[str | bytes]) -> Plan | None:
        """The plain removal of ``d`` (an ACK or DROP, ``effect``) carrying
        ``writes``, in one script; None: plan it as any other outcome."""
        return None

    def ack_writes_calls(self, t: Target, items: Sequence[tuple[Delivery, Outcome]],
                         encode: Callable[[Any], tuple[Sequence[Arg], Sequence[Arg]]]
                         ) -> list[tuple[Command, int]] | None:
        """The batched calls of ACKs and DROPs carrying writes (``items``;
        ``encode(outcome)``: its encoded writes and their keys), built
        without a plan each: ``(call, deliveries it carries)`` (the
        finalizer's hot path, ``_hot_writes``); None: this form has none
        (every one planned)."""
        return None


def xackdel_closed(reply: object) -> bool:
    """Whether an ``XACKDEL`` reply says none of its ids was pending (every
    code ``-1``): nothing acknowledged, a closed gate."""
    return isinstance(reply, list) and bool(reply) and all(c == -1 for c in reply)


RECEIPTED: set[object] = set()
"""Shas of the gated scripts that read their finalization's own receipt when
the gate is closed: their answer is exact even after an unknown outcome.  The
form whose cells send such a script registers it here (``stream/cells.py``:
``STREAM_REMOVE_RECEIPT``)."""


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
