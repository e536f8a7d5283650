"""What the finalizer core tells the shell: a :class:`Step` after each round,
a :class:`Settlement` once the batch is done, and the log records of both.

``_finalize`` decides the rounds of a batch (:class:`~._finalize.FinalizeBatch`);
this module reads what Redis answered into what the shell applies: the
hot path's removals answered otherwise than planned (:func:`failed_removals`,
:func:`closed_removals`), the effects of the removals
(:func:`count_removals`) and of the plans (:func:`settle_plans`), each
delivery's settled effect, the runtime copies to hand the scheduler, and
the structured fields of every record about one delivery
(:func:`log_extra`).  Sans-IO, like the rest of ``_core``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from operator import attrgetter, itemgetter
from typing import Any

from .._delivery import Delivery
from .._outcome import Backoff, Outcome, OutcomeKind, WithWrites
from ._commands import Command
from ._plan import cells_of
from ._replies import FINAL, classify, describe_error
from ._types import FAILED, GATE_CLOSED, REMOVED, Effect, Plan, Target, settle
from ._writes import WRITES

__all__ = [
    "GO",
    "Record",
    "Settlement",
    "Step",
    "batched_elements",
    "closed_removals",
    "count_removals",
    "cut_warning",
    "failed_removals",
    "held_on_cancel",
    "held_warning",
    "log_extra",
    "settle_plans",
]

Record = tuple[int, str, tuple[object, ...], dict[str, Any]]
"""A log record to emit: ``(level, message, args, extra)``, for
``log.log(level, message, *args, extra=extra)``."""

_DEBUG = logging.DEBUG
_DELIVERY = itemgetter(0)
_ENTRY_ID = attrgetter("id")
_REMOVED_BY = REMOVED
_INFO = logging.INFO
_WARNING = logging.WARNING
_ERROR = logging.ERROR


class Step:
    """What the shell does after a round: count ``errors`` (finalize errors),
    log ``records``, and, when ``pause`` > 0, back off (``pause`` rounds in a
    row needed one: sleep ``backoff(pause - 1)``) before the next round."""

    __slots__ = ("errors", "pause", "records")

    def __init__(self, errors: int, pause: int, records: Sequence[Record]) -> None:
        self.errors = errors
        self.pause = pause
        self.records = records

    def __repr__(self) -> str:
        return f"Step(errors={self.errors}, pause={self.pause}, records={len(self.records)})"


GO = Step(0, 0, ())
"""The step after a round that went through: send the next round (if any) now."""


# -- a round's replies -----------------------------------------------------------------------------
def batched_elements(
    name: str, elements: list[Any], own: tuple[int, ...], plans: list[tuple[Delivery, Plan]],
    got: list[list[Any]], again: list[Command], again_owners: list[tuple[int, ...]],
    records: list[Record],
) -> tuple[int, str]:
    """A batched script call's reply read back as one element per delivery
    (``elements``, of the plans ``own``: ``_batch.batch_replies``), each
    settled as the reply to that plan's own script would be: appended to its
    replies in ``got``; one that did not run sends that delivery's own
    script again (into ``again``, alone), a final error is logged into
    ``records``.  ``(errors, deferred)``: the final errors, and the first
    deferral's description if it is the round's first (else ``""``)."""
    errors = 0
    deferred = ""
    for j, e in zip(own, elements, strict=True):
        if isinstance(e, Exception):
            single = plans[j][1].commands[0]
            if classify(e) is not FINAL:  # did not run: that delivery alone, again
                if not again:
                    deferred = describe_error(e, single)
                again.append(single)
                again_owners.append((j,))
                continue
            errors += 1
            records.append((_ERROR, "%s: finalization command failed: %s",
                            (name, describe_error(e, single)), {"subscription": name}))
        got[j].append(e)
    return errors, deferred


# -- the hot path's removals -----------------------------------------------------------------------
def failed_removals(broken: set[int], n: int, stream: bool, n_fast: int) -> list[int]:
    """The hot path's removals whose command got a final error reply, as
    indexes into the batch's ``n`` removals (``broken``: the indexes of the
    hot path's ``n_fast`` commands that got one): counted :data:`FAILED`
    (they stay pending).

    A stream's one ``XACK`` fails them all; its ``XDEL``
    (``DELETE_ON_FINALIZE``) failing alone fails none: they were
    acknowledged, and the periodic trim removes them from the stream (the
    error is logged and counted in ``finalize_errors`` all the same).  A
    reliable list's ``LREM`` fails its own element only."""
    if not broken:
        return []
    if stream:
        return list(range(n)) if 0 in broken else []
    if n_fast != n:  # pragma: no cover - one LREM per element, always
        return list(range(n))
    return sorted(broken)


def closed_removals(replies: Sequence[Any] | None, n: int, stream: bool) -> list[int]:
    """The hot path's removals Redis answered *nothing removed*, sent once
    in the first round with a known outcome, as indexes into the batch's
    ``n`` removals (``replies``: the hot path's own, in order): counted
    :data:`GATE_CLOSED`, not as acknowledged (or dropped).

    A reliable list's ``LREM`` answered 0 (or a counted gate's nil): the
    element was not (or no longer) in the processing list -- taken back
    by another consumer's takeover, say.  A stream's ``XACK`` of ``n``
    ids answered ``k < n``: ``n - k`` entries were no longer pending in
    the group (another consumer claimed and finalized them, or the
    group was recreated).  Which ones is not known (``XACK`` answers a
    count): the last ``n - k`` of the batch are reported so.  An
    ``XACKDEL`` (Redis 8.2, ``Retention.DELETE_ON_FINALIZE``) answers a
    code per id: exactly those answered ``-1`` are.  A resend's
    answer is no such evidence (the first send may have removed it):
    counted as planned."""
    if replies is None:
        return []
    if stream:
        k = replies[0] if replies else None
        if k.__class__ is list:  # XACKDEL: one code per id, -1 for one not pending
            codes: list[Any] = k
            return [i for i, c in enumerate(codes) if c == -1] if len(codes) == n else []
        if k.__class__ is not int or k >= n:
            return []
        return list(range(max(k, 0), n))
    if len(replies) != n or replies.count(1) == n:  # every LREM removed its element
        return []
    return [i for i, r in enumerate(replies) if r == 0 or r is None]


def count_removals(
    name: str, removals: dict[OutcomeKind, Effect], stream: bool, target: Target,
    removed: list[Delivery], kinds: list[OutcomeKind], tally: list[tuple[str, str, int]],
    broken: set[int], n_fast: int, replies: Sequence[Any] | None,
    items: Sequence[tuple[Delivery, Outcome | Plan | Backoff]] | None,
    effects: dict[str, int], records: list[Record],
) -> tuple[Sequence[int], Sequence[int]]:
    """The effects of a batch's hot-path removals (``removed``, of ``kinds``;
    ``tally``: ``(outcome, effect, n)`` per kind), counted into ``effects``,
    with their records (and, when ``items`` are given, a debug record per
    delivery); ``(closed, failed)``: the removals answered otherwise than
    planned (:func:`closed_removals`, :func:`failed_removals`)."""
    n = len(removed)
    # never the same removal in both: a removal answered 0 at once was not
    # sent again, and a stream's XACK that failed answered no count
    failed = failed_removals(broken, n, stream, n_fast) if broken else ()
    closed = closed_removals(replies, n, stream) if replies is not None else ()
    for _, e, k in tally:
        effects[e] = effects.get(e, 0) + k  # kinds may share an effect
    # the removals Redis answered otherwise than planned
    for instead, which in ((FAILED, failed), (GATE_CLOSED, closed)):
        if not which:
            continue
        for i in which:
            e = removals[kinds[i]]._value_
            if effects[e] > 1:
                effects[e] -= 1
            else:
                del effects[e]  # none of that effect after all
        effects[instead] = effects.get(instead, 0) + len(which)
    if closed and stream:
        records.append((
            _INFO, "%s: %s of %d entries acknowledged %d: %d were no longer "
            "pending (finalized already: claimed and finalized by another "
            "consumer, or the group was recreated); counted gate_closed",
            (name, "XACKDEL" if target.xackdel else "XACK", n, n - len(closed), len(closed)),
            {"subscription": name, "effect": GATE_CLOSED}))
    if items is not None:
        shut = {id(removed[i]) for i in closed}
        broke = {id(removed[i]) for i in failed}
        for d, outcome in items:
            effect = (removals.get(outcome.kind) if outcome.__class__ is Outcome
                      else None)
            if effect is not None:
                value = (GATE_CLOSED if id(d) in shut else FAILED if id(d) in broke
                         else effect.value)
                records.append((_DEBUG, "%s: %s (attempt %d) finalized: %s",
                                (name, d.id or d.origin_id, d.attempt, value),
                                log_extra(name, d, outcome, value)))
    return closed, failed


# -- the plans ---------------------------------------------------------------------------------
def settle_plans(
    name: str, plans: list[tuple[Delivery, Plan]], returned: list[Outcome | Plan | Backoff],
    got: list[list[Any]], unsure: bool, debug: bool,
    effects: dict[str, int], records: list[Record], later: list[tuple[float, tuple[Command, ...]]],
) -> list[str]:
    """Each plan's settled effect (:func:`~._plan.settle` of ``got``, its
    replies; ``returned``: what it came from), counted into ``effects`` with
    its records; the runtime delayed copies of those whose removal was
    confirmed go to ``later``."""
    settled_effects: list[str] = []
    for (d, p), outcome, rs in zip(plans, returned, got, strict=True):
        if not p.commands:
            settled = p.effect._value_
        elif (len(rs) == 1 and len(p.commands) == 1 and (r := rs[0]) is not None
              and r is not False and r.__class__ is not list and not isinstance(r, Exception)):
            settled = p.effect._value_  # settle()'s answer for one command that ran, inline
        else:
            settled = settle(p, rs, unsure=unsure)
        settled_effects.append(settled)
        effects[settled] = effects.get(settled, 0) + 1
        if (outcome.__class__ is WithWrites and settled != FAILED and settled != GATE_CLOSED
                and p.commands):
            # committed with the finalization (a closed gate or a failure: none; a
            # reliable list's runtime retry_after: by its delayed copy, counted then)
            effects[WRITES] = effects.get(WRITES, 0) + len(outcome.writes)
        if settled == FAILED:
            records.append((_ERROR, "%s: finalization of %s (attempt %d, origin %s) failed; it "
                            "stays where it was (pending) and is delivered again",
                            (name, d.id or d.origin_id, d.attempt, d.origin_id),
                            log_extra(name, d, outcome, settled)))
            continue
        if settled == GATE_CLOSED:
            records.append((_INFO, "%s: %s (attempt %d) was no longer pending: finalized "
                            "already, nothing written", (name, d.id or d.origin_id, d.attempt),
                            log_extra(name, d, outcome, settled)))
            continue
        if p.warning:
            records.append((_WARNING, "%s (attempt %d, origin %s)",
                            (p.warning, d.attempt, d.origin_id),
                            log_extra(name, d, outcome, settled)))
        elif debug:
            records.append((_DEBUG, "%s: %s (attempt %d) finalized: %s",
                            (name, d.id or d.origin_id, d.attempt, settled),
                            log_extra(name, d, outcome, settled)))
        if p.delay is not None and p.later:
            later.append((p.delay, p.later))
    return settled_effects


def held_on_cancel(plans: list[tuple[Delivery, Plan]]) -> list[tuple[float, tuple[Command, ...]]]:
    """A batch cancelled (shutdown deadline) with the outcome unknown: a
    runtime ``retry_after``'s removal may have been applied, so its copy must
    still go out -- every plan's ``(delay, removal + later)``.

    The removal goes first again, so the original cannot come back beside
    its copy (the removal may never have been sent): on a stream it is
    the gated script that answers from this finalization's own receipt
    (``STREAM_REMOVE_RECEIPT``), so the copy follows only when this
    finalization removed the original -- a racing finalization that got
    there first closes it (``_plan.chain_stops``); should the removal
    fail, the copy is not sent either and the original stays pending."""
    return [(p.delay, (*p.commands, *p.later))
            for _, p in plans if p.delay is not None and p.later]


# -- the end -----------------------------------------------------------------------------------
class Settlement:
    """What a finished batch did, as Redis answered.

    ``effects``: counts per effect (``acked``, ``copied``, ``failed``,
    ``gate_closed`` ...); ``records``: log records to emit; ``later``:
    ``(delay, commands)`` of runtime delayed copies to hand the scheduler
    (plans whose removal was confirmed).  :meth:`forget`: the stream ids no
    longer in hand; :meth:`deliveries`: each delivery with its settled
    effect (what instrumentation is told).
    """

    __slots__ = ("_closed", "_failed", "_ids", "_kinds", "_plans", "_removals", "_removed",
                 "_settled", "_wrote", "effects", "later", "records")

    def __init__(self, effects: dict[str, int], records: list[Record],
                 later: list[tuple[float, tuple[Command, ...]]], settled: Sequence[str],
                 closed: Sequence[int], failed: Sequence[int], ids: list[str],
                 removals: dict[OutcomeKind, Effect], removed: list[Delivery],
                 kinds: list[OutcomeKind], plans: list[tuple[Delivery, Plan]],
                 wrote: Sequence[tuple[Delivery, WithWrites]] = ()) -> None:
        self._closed = closed  # the hot path's removals that removed nothing (gate_closed)
        self._failed = failed  # those whose command got a final error reply
        self.effects = effects
        self.records = records
        self.later = later
        self._settled = settled
        self._ids = ids  # a stream's hot path's ids
        self._removals = removals
        self._removed = removed  # the hot path's removals, of _kinds
        self._kinds = kinds
        self._plans = plans
        self._wrote = wrote  # the hot path's ACKs and DROPs carrying writes (``_hot_writes``)

    def forget(self) -> list[str]:
        """The stream ids finalized (or failed: the own-PEL re-read delivers them again)."""
        # the hot path's ids listed once (streams; other forms hold no ids)
        ids = self._ids
        if self._wrote and self._wrote[0][0].id is not None:  # (a stream's: every one has an id)
            ids = [*ids, *map(_ENTRY_ID, map(_DELIVERY, self._wrote))]
        return ids + [d.id for d, _ in self._plans if d.id is not None]

    def deliveries(self) -> list[tuple[Delivery, str]]:
        """Every delivery the batch finalized with its settled effect (the hot
        path's first, then the plans'; ``backoffs`` and refused ones are not there)."""
        removals = self._removals
        out = [(d, removals[k]._value_) for d, k in zip(self._removed, self._kinds, strict=True)]
        for i in self._closed:
            out[i] = (out[i][0], GATE_CLOSED)
        for i in self._failed:
            out[i] = (out[i][0], FAILED)
        return (out + [(d, _REMOVED_BY[o.kind]._value_) for d, o in self._wrote]
                + [(d, e) for (d, _), e in zip(self._plans, self._settled, strict=True)])


def log_extra(
    subscription: str, d: Delivery, outcome: Outcome | Plan | Backoff | None,
    effect: str | None = None,
) -> dict[str, Any]:
    """The structured fields of a log record about one delivery (``logging`` ``extra=``).

    ``subscription``, ``entry_id`` (stream id or ``None``), ``origin_id``,
    ``attempt``, ``outcome`` (``ack``, ``retry``, ``drop``, ``retry_after``,
    ``backoff`` or ``None``) and, for finalization records, ``effect``.
    """
    extra: dict[str, Any] = {
        "subscription": subscription,
        "entry_id": d.id,
        "origin_id": d.origin_id,
        "attempt": d.attempt,
        "outcome": (outcome.kind.value if isinstance(outcome, Outcome)
                    else "backoff" if isinstance(outcome, Backoff) else None),
    }
    if effect is not None:
        extra["effect"] = effect
    return extra


def cut_warning(name: str, min_idle: float, d: Delivery, outcome: Outcome) -> Record:
    """The line logged once per claiming subscription at its first
    ``retry_after`` longer than ``min_idle``: the PEL is the delay, and
    ``XAUTOCLAIM`` takes the entry back once it has been idle ``min_idle``."""
    return (
        _WARNING,
        "%s: %r on a claiming subscription is cut to min_idle=%g s (entry %s, "
        "attempt %d); use delayed_retry=DelayedRetry.DURABLE_ZSET for longer delays "
        "(logged once per subscription)",
        (name, outcome, min_idle, d.id, d.attempt),
        log_extra(name, d, outcome),
    )


def held_warning(t: Target, d: Delivery, outcome: Outcome) -> tuple[str, tuple[object, ...],
                                                                   dict[str, Any]]:
    """The line logged once per subscription at its first runtime
    ``retry_after``: the copy waits in process memory; what a crash before
    the delay ends does to it (a stream's, Pub/Sub's or a simple list's is
    lost; a reliable list's original stays in its processing list, and its
    recovery waits out the delay written beside it), and what keeps the
    copy itself in Redis."""
    cells = cells_of(t)
    crash = ("a crash before the delay ends loses it" if cells.by_id or not cells.gated else
             "a crash before the delay ends leaves the original in the processing list "
             f"{t.processing!r}, delivered again by the restart or a reaper once its due time "
             "(written beside it) has passed, or at once where that write failed")
    if cells.gated:  # the forms that hold what they read have a durable delay set
        keep = ("delayed_retry=DelayedRetry.DURABLE_ZSET keeps it in Redis (the delay set "
                f"{t.delay_key!r})")
    else:
        keep = (f"a {cells.noun} has no durable delay (a StreamSubscription or "
                "ReliableListSubscription with delayed_retry=DelayedRetry.DURABLE_ZSET has)")
    return ("%s: %r keeps its copy in process memory (DelayedRetry.RUNTIME, the default): "
            "%s; %s (logged once per subscription)",
            (t.name, outcome, crash, keep), log_extra(t.name, d, outcome))
