"""The finalizer's decisions, sans-IO: a batch of outcomes -> rounds of commands -> effects.

Nothing here does I/O, sleeps or logs.  The shell (the mount's finalizer
task) drives one :class:`FinalizeBatch` per batch of outcomes, h11-style::

    batch = FinalizeBatch(core, items, debug=log.isEnabledFor(logging.DEBUG))
    count(batch.outcomes, batch.refused); emit(batch.records); wait_out(batch.backoffs)
    try:
        while cmds := batch.commands():          # the next round (empty: done)
            try:
                replies = await client.pipeline(cmds, raise_on_error=False, timeout=...)
            except (RedisError, OSError) as e:
                step = batch.failed(e)
            else:
                step = batch.receive(replies)
            if step is not GO:                   # errors to count, records to log, a pause
                ...; await sleep(backoff(step.pause - 1))
    except Cancelled:
        hold(batch.cancelled()); raise           # runtime copies whose removal may have run
    done = batch.result()                        # effects, records, copies to hold, ids to forget

What the core decides:

* **The hot path.**  Outcomes whose plan is the plain removal of the
  original (ACK and DROP on a stream or a reliable list,
  :func:`~._plan.plain_removals`) get no plan each: one
  :func:`~._plan.removal_commands` removes them all (one ``XACK`` of every
  id on a stream).  Everything else gets its :func:`~._plan.plan`.
* **The first round** (:func:`~._batch.first_round`): single-``XACK`` plans merge
  per stream and group, apart from the hot path's ``XACK`` (whose own count
  settles its removals: a short one is ``gate_closed``); a plan of two ungated
  steps (a copy to another Redis Cluster slot, then the removal of the
  original) sends only its copy; its removal goes in a later round, once
  the copy's reply was a success.  A removal never follows a copy that
  failed, did not run, or whose outcome is unknown.
* **Batched scripts**: the two-step deliveries of a batch that share their
  keys (RETRY copies, dead letters, durable delays on one stream) go in one
  batched script call (:func:`~._batch.first_round`); its reply has one
  element per delivery, settled as that delivery's own script's reply
  would be: an element that did not run sends that delivery's own script
  again (alone, after a pause), a final one fails that delivery only.  An
  error reply to the whole call, or a round trip that failed, is handled
  as for any command (the call sent again whole: every delivery is gated).
* **Error replies** (:func:`~._replies.classify`): one that did not run
  (OOM, BUSY, READONLY ...) is sent again, alone, after a pause; a final
  one is logged with its command and key, counted, and makes its
  deliveries' effect ``failed``.  A round trip that failed (connection
  lost, timeout; or a whole pipeline that did not run) sends the same
  round again after a pause, and the batch becomes *unsure*: a closed gate
  then answers that the earlier send did the work (:func:`~._plan.settle`).
* **Counted gates** (reliable lists, identical elements): a :class:`Gates`
  object -- the reader's -- numbers the removals once before the first send
  (``prepare``), again before every resend (``resend``: the copies held
  *now*), and learns what Redis answered (``settle``).
* **Effects** are counted from the replies (:func:`~._plan.settle`), with
  the runtime ``retry_after`` copies to hand the scheduler (only for plans
  whose removal was confirmed; on cancellation every one, duplicate never
  loss), the log records to emit and the stream ids to forget.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from typing import Any, Protocol

from redis import exceptions as rexc

from .._delivery import Delivery
from .._errors import AckUnsupported
from .._outcome import ACK, DROP, Backoff, Outcome, OutcomeKind, WithWrites
from .._subscription import Form
from ._batch import BATCHED, batch_replies, fast_index, fast_owner, first_round
from ._commands import Command
from ._plan import (
    FAILED,
    GATE_CLOSED,
    Effect,
    Plan,
    Target,
    plain_removals,
    plan,
    plan_dead,
    removal_commands,
    settle,
    stream_removals,
)
from ._replies import FINAL, classify, describe_error
from ._writes import WRITES, plan_writes

__all__ = [
    "GO",
    "FinalizeBatch",
    "FinalizerCore",
    "Gates",
    "Item",
    "Record",
    "Settlement",
    "Step",
    "log_extra",
]

Item = tuple[Delivery, "Outcome | Plan | Backoff"]
Record = tuple[int, str, tuple[object, ...], dict[str, Any]]
"""A log record to emit: ``(level, message, args, extra)``, for
``log.log(level, message, *args, extra=extra)``."""

_RETRY = OutcomeKind.RETRY
_DELIVERY = operator.itemgetter(0)
_OUTCOME = operator.itemgetter(1)
_RETRY_KEY = _RETRY._value_  # what _plan_for counts
_RETRY_AFTER = OutcomeKind.RETRY_AFTER
_LEFT_PENDING = Effect.LEFT_PENDING
_HELD = Effect.HELD
_COUNTED_IDS = frozenset((id(ACK), id(DROP)))
"""The constants ``ACK`` and ``DROP`` by identity (module constants: alive
as long as the process): a batch of only those is told apart in C."""

_DEBUG = logging.DEBUG
_INFO = logging.INFO
_WARNING = logging.WARNING
_ERROR = logging.ERROR


class Gates(Protocol):
    """Counted gates for removals of identical elements (the reliable list reader).

    A reliable list may hold several copies of one element; a removal of
    element ``e`` is gated on the number of copies the consumer holds (see
    ``_plan.list_counted``).  The core calls, for every batch:
    """

    def prepare(self, commands: list[Command], fast: int = 0) -> list[Command]:
        """Once, before the first send, with every command of the batch (the
        first round's, then the later steps'): the same commands, removals
        numbered.  ``fast``: the first ``fast`` commands are the hot path's
        plain ``LREM`` s (``removal_commands``)."""
        ...

    def resend(self, commands: Sequence[Command], answered: Sequence[Command],
               answers: Sequence[object]) -> list[Command]:
        """Before ``commands`` are sent again (not run, or outcome unknown):
        removals renumbered on what is held now; ``answered``/``answers``:
        the batch's commands answered so far and their replies."""
        ...

    def settle(self, items: Sequence[Item], commands: Sequence[Command],
               replies: Sequence[object], hot: bool = False) -> None:
        """Once the batch is done: every command answered, and its reply.
        ``hot``: the batch was the hot path's removals only (no plan, nothing
        refused), each answered once: ``commands`` are those removals, as
        prepared (or renumbered for a resend)."""
        ...


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


class FinalizerCore:
    """The finalizer's fixed decisions for one mounted subscription.

    ``gates``: the reader's counted gates (reliable lists), or None.
    """

    __slots__ = ("_counted", "_cut_warned", "_held_warned", "_kinds", "_lists", "_names", "_stream", "gates",
                 "name", "removals", "target")

    def __init__(self, target: Target, *, gates: Gates | None = None) -> None:
        self.target = target
        self.name = target.name
        self.gates = gates
        self.removals = plain_removals(target)
        self._kinds = tuple(self.removals)  # a tuple: `in` by identity, no Enum.__hash__ call
        self._names = tuple((k, k._value_, e._value_) for k, e in self.removals.items())
        self._cut_warned = False  # claiming: a retry_after longer than min_idle was logged
        self._held_warned = False  # a runtime retry_after's copy in memory was logged
        self._stream = target.form is Form.STREAM
        self._lists = target.form is Form.RELIABLE_LIST  # the hot path: one LREM per element
        # nothing to remove (Pub/Sub, simple lists): ACK and DROP are counted only
        self._counted = not self._stream and not self._lists

    def batch(self, items: Sequence[Item], *, debug: bool = False) -> FinalizeBatch:
        """The batch that finalizes ``items``; ``debug``: add a record per delivery finalized."""
        return FinalizeBatch(self, items, debug)

    def _plan_for(self, d: Delivery, outcome: Outcome | Backoff, b: FinalizeBatch) -> Plan | None:
        """The plan for one outcome; None when refused or when it waits out a
        :class:`Backoff` (then in ``b.backoffs``)."""
        t = self.target
        outcomes = b.outcomes
        if isinstance(outcome, Backoff):
            outcomes["backoff"] = outcomes.get("backoff", 0) + 1
            if t.max_attempts is not None and d.attempt >= t.max_attempts:
                # as a RETRY at the last attempt: dead letter (copy, then remove) or drop
                return plan_dead(t, d, f"max_attempts={t.max_attempts} reached at attempt {d.attempt}")
            b.backoffs.append((d, outcome))
            return None
        kind = outcome.kind
        key = kind._value_  # not .value: a Python-level property
        outcomes[key] = outcomes.get(key, 0) + 1
        try:
            p = plan_writes(t, d, outcome) if outcome.__class__ is WithWrites else plan(t, d, outcome)
        except (AckUnsupported, ValueError) as e:
            if (kind is OutcomeKind.ACK or kind is OutcomeKind.DROP) and isinstance(e, AckUnsupported):
                return Plan(Effect.NOTHING)
            b.refused += 1
            b.records.append((_ERROR, "%s (message %s, attempt %d)", (e, d.origin_id, d.attempt),
                              log_extra(self.name, d, outcome)))
            return None
        if p.effect is _HELD and not self._held_warned:
            self._held_warned = True
            b.records.append((_WARNING, *held_warning(t, d, outcome)))
        if (p.effect is _LEFT_PENDING and kind is _RETRY_AFTER
                and outcome.delay > t.min_idle and not self._cut_warned):
            # claiming: the PEL is the delay, and XAUTOCLAIM takes the entry
            # back once it has been idle min_idle, whatever the delay asked
            self._cut_warned = True
            b.records.append((
                _WARNING,
                "%s: %r on a claiming subscription is cut to min_idle=%g s (entry %s, "
                "attempt %d); use delayed_retry=DelayedRetry.DURABLE_ZSET for longer delays "
                "(logged once per subscription)",
                (self.name, outcome, t.min_idle, d.id, d.attempt),
                log_extra(self.name, d, outcome),
            ))
        return p


def held_warning(t: Target, d: Delivery, outcome: Outcome) -> tuple[str, tuple[object, ...],
                                                                   dict[str, Any]]:
    """The line logged once per subscription at its first runtime
    ``retry_after``: the copy waits in process memory, a crash before the
    delay ends loses it, and what keeps it in Redis."""
    if t.form is Form.STREAM or t.form is Form.RELIABLE_LIST:
        keep = ("delayed_retry=DelayedRetry.DURABLE_ZSET keeps it in Redis (the delay set "
                f"{t.delay_key!r})")
    else:
        keep = (f"a {t.form.value} has no durable delay (a StreamSubscription or "
                "ReliableListSubscription with delayed_retry=DelayedRetry.DURABLE_ZSET has)")
    return ("%s: %r keeps its copy in process memory (DelayedRetry.RUNTIME, the default): a "
            "crash before the delay ends loses it; %s (logged once per subscription)",
            (t.name, outcome, keep), log_extra(t.name, d, outcome))


class FinalizeBatch:
    """One batch of outcomes being finalized (see the module docstring).

    Set at construction (sans-IO, before anything is sent):

    * ``outcomes``: what the handlers returned, per kind (``ack``, ...,
      ``backoff``), to count now;
    * ``refused``: outcomes the form cannot carry out (logged in ``records``);
    * ``backoffs``: ``(delivery, Backoff)`` pairs to wait out (the shell's
      waiting set: nothing is sent for them);
    * ``records``: log records to emit now.
    """

    __slots__ = (
        "_answered", "_answers", "_attempt", "_commands", "_core", "_debug", "_fast_failed",
        "_fast_replies", "_first", "_got", "_ids", "_items", "_kinds", "_n_fast", "_owners", "_plans",
        "_recount", "_removed", "_rest",
        "_returned", "_tally", "_unsure", "backoffs", "outcomes", "records", "refused",
    )

    def __init__(self, core: FinalizerCore, items: Sequence[Item], debug: bool) -> None:
        self._core = core
        self._items = items
        self._debug = debug
        self.outcomes: dict[str, int] = {}
        self.refused = 0
        self.records: list[Record] = []
        self.backoffs: list[tuple[Delivery, Backoff]] = []
        plans: list[tuple[Delivery, Plan]] = []
        returned: list[Outcome | Plan | Backoff] = []  # what each plan came from (for records)
        removed: list[Delivery] = []
        kinds: list[OutcomeKind] = []
        removable = core._kinds
        retries = core._stream  # a stream: a RETRY's plan, without _plan_for's checks
        target = core.target
        outcomes = self.outcomes
        # the common batch: one hot-path outcome object for every delivery (a
        # handler returning ACK): its lists built in C, no loop in Python
        first = items[0][1] if items else None
        todo = items
        if (first.__class__ is Outcome and first.kind in removable
                and [*map(_OUTCOME, items)].count(first) == len(items)):
            removed = [*map(_DELIVERY, items)]
            kinds = [first.kind] * len(removed)
            todo = ()
        elif core._counted and items:
            # Pub/Sub, simple lists: an ACK or a DROP sends nothing, it is only
            # counted.  A batch of only those (the constants) is sorted out
            # without a loop in Python: the same deliveries and kinds as below.
            ds, outs = zip(*items, strict=False)  # pairs, every one
            if set(map(id, outs)) <= _COUNTED_IDS:
                removed = list(ds)
                kinds = [o.kind for o in outs]
                todo = ()  # nothing left for the loop
        for d, outcome in todo:
            if outcome.__class__ is Outcome:
                kind = outcome.kind
                if kind is _RETRY and retries:
                    # _plan_for(), inline: plan() refuses nothing on a stream
                    outcomes[_RETRY_KEY] = outcomes.get(_RETRY_KEY, 0) + 1
                    plans.append((d, plan(target, d, outcome)))
                    returned.append(outcome)
                    continue
                if kind in removable:
                    removed.append(d)
                    kinds.append(kind)
                    continue
                p = core._plan_for(d, outcome, self)
            elif isinstance(outcome, Plan):
                p = outcome
            else:
                p = core._plan_for(d, outcome, self)
            if p is not None:
                plans.append((d, p))
                returned.append(outcome)
        self._plans = plans
        self._returned = returned
        self._removed = removed
        self._kinds = kinds
        fast: list[Command] = []
        self._ids: list[str] = []  # a stream's: the hot path's ids
        if removed:
            # the hot path's count per kind: (outcome, effect, n)
            tally = self._tally = [(o, e, n) for k, o, e in core._names if (n := kinds.count(k))]
            outcomes = self.outcomes
            if outcomes:
                for o, _, n in tally:
                    outcomes[o] = outcomes.get(o, 0) + n
            else:
                self.outcomes = {o: n for o, _, n in tally}
            if core._stream:  # the ids once: the XACK's, then those forgotten
                ids = self._ids = [d.id for d in removed]  # type: ignore[misc]
                fast = stream_removals(core.target, ids)
            else:
                fast = removal_commands(core.target, removed)
        rest: list[list[Command]]
        owners: list[tuple[int, ...]] | None
        if plans:
            commands, owners, rest = first_round(fast, [p for _, p in plans])
            self._got: list[list[Any]] = [[] for _ in plans]  # per plan: its replies so far
        else:
            commands, owners, rest = fast, None, []
            self._got = rest
        gates = core.gates
        if gates is not None:
            # the reader's say on the commands (counted gates for identical
            # elements), once, before the first send: a resend sends the same
            later = [c for r in rest for c in r]
            prepared = gates.prepare([*commands, *later], len(fast))
            n = len(commands)
            commands = prepared[:n]
            it = iter(prepared[n:])
            rest = [[next(it) for _ in r] for r in rest]
        self._commands: list[Command] = commands
        self._owners = owners  # None: the hot path only, all or nothing
        self._rest = rest
        self._answered: list[Command] = []  # commands with a final reply (kept for the gates)
        self._answers: list[Any] = []
        self._attempt = 0  # rounds in a row that needed a pause
        self._recount = False  # a resend: the gates renumber on what is held now
        self._unsure = False  # a send had an unknown outcome (then resent)
        self._fast_failed: set[int] = set()  # the hot path's commands answered a final error
        # the hot path's removals answered in the first round, sent once (see _closed())
        self._fast_replies: Sequence[Any] | None = None
        self._n_fast = len(fast)
        self._first = True

    # -- the rounds --------------------------------------------------------------
    def commands(self) -> list[Command]:
        """The round to send now; empty once the batch is done."""
        if self._recount:
            self._recount = False
            gates = self._core.gates
            if gates is not None:
                self._commands = gates.resend(self._commands, self._answered, self._answers)
        return self._commands

    def failed(self, err: BaseException) -> Step:
        """The round trip of :meth:`commands` raised ``err`` (connection lost,
        timeout, or a whole pipeline refused)."""
        core = self._core
        commands = self._commands
        if not commands:
            raise RuntimeError("failed(): no round is outstanding")
        if classify(err) is FINAL:
            return self.receive([err] * len(commands))
        # Did not run, or outcome unknown: every command is idempotent or
        # gated (a two-step ungated plan's removal is only sent once its copy
        # succeeded): send the same round again.
        self._unsure = self._recount = True
        self._attempt += 1
        return Step(1, self._attempt, [(
            _WARNING, "%s: finalization of %d deliveries failed (%s); sending again",
            (core.name, len(self._plans) + len(self._removed), err), {"subscription": core.name},
        )])

    def receive(self, replies: Sequence[Any]) -> Step:
        """The replies to :meth:`commands`, in order (error replies as exception values)."""
        commands = self._commands
        if len(replies) != len(commands) or not commands:
            raise RuntimeError(f"receive(): {len(replies)} replies to {len(commands)} commands")
        track = self._core.gates is not None
        owners = self._owners
        # a first round sent once with a known outcome: its replies settle the
        # hot path's removals (see _closed()); a resend's do not
        known = self._first and not self._unsure
        self._first = False
        if owners is None:
            # the hot path: only removals; done unless an error reply came (a
            # reliable list's LREMs all answered 1: none came, counted in C)
            clean = self._core._lists and replies.count(1) == len(replies)
            if not clean:
                for r in replies:
                    if isinstance(r, Exception):
                        break
                else:
                    clean = True
            if clean:
                if track:
                    self._answered += commands
                    self._answers += replies
                if known:
                    self._fast_replies = replies  # the removals' own replies, in order
                self._commands = []
                return GO
            owners = [(fast_owner(i),) for i in range(len(commands))]
            if known:
                self._fast_replies = replies  # error replies among them settle nothing here
        elif known and self._n_fast:
            # the first round of a batch with plans: the hot path's removals
            # are the commands only it owns, first and in order (never merged
            # with a plan's XACK: first_round keeps them apart)
            mine = [r for r, own in zip(replies, owners, strict=True) if len(own) == 1 and own[0] < 0]
            if len(mine) == self._n_fast:
                self._fast_replies = mine
        core = self._core
        got = self._got
        rest = self._rest
        again: list[Command] = []  # did not run: send again after a pause
        again_owners: list[tuple[int, ...]] = []
        step: list[Command] = []  # next steps of two-step plans whose copy succeeded
        step_owners: list[tuple[int, ...]] = []
        errors = 0
        records: list[Record] = []
        deferred = ""
        for cmd, r, own in zip(commands, replies, owners, strict=True):
            if len(own) > 1 and cmd[0] == b"EVALSHA" and cmd[1] in BATCHED:
                # a batched script call: its short reply read back as one element
                # per delivery (plan, ``batch_replies``), each settled as the
                # reply to that plan's own script would be
                elements = batch_replies(r, len(own))
                if elements is None:
                    if not isinstance(r, Exception):
                        r = rexc.ResponseError(
                            f"a batched script answered {r!r:.200} to {len(own)} deliveries")
                else:
                    if track:
                        self._answered.append(cmd)
                        self._answers.append(r)
                    plans = self._plans
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
                                            (core.name, describe_error(e, single)),
                                            {"subscription": core.name}))
                        got[j].append(e)
                    continue
            if isinstance(r, Exception):
                if classify(r) is not FINAL:
                    if not again:
                        deferred = describe_error(r, cmd)
                    again.append(cmd)
                    again_owners.append(own)
                    continue
                errors += 1
                records.append((_ERROR, "%s: finalization command failed: %s",
                                (core.name, describe_error(r, cmd)), {"subscription": core.name}))
            if track:
                self._answered.append(cmd)
                self._answers.append(r)
            for j in own:
                if j < 0:
                    if isinstance(r, Exception):
                        self._fast_failed.add(fast_index(j))
                    continue
                got[j].append(r)
                more = rest[j]
                if more and not isinstance(r, Exception):
                    step.append(more.pop(0))
                    step_owners.append((j,))
        pause = 0
        if again:
            errors += 1
            records.append((_WARNING, "%s: finalization deferred by the server (%s); sending again",
                            (core.name, deferred), {"subscription": core.name}))
            self._attempt += 1
            pause = self._attempt
        else:
            self._attempt = 0
        self._commands = again + step
        self._owners = again_owners + step_owners
        self._recount = bool(again)
        if not errors:
            return GO
        return Step(errors, pause, records)

    # -- the end -----------------------------------------------------------------
    def cancelled(self) -> list[tuple[float, tuple[Command, ...]]]:
        """Cancelled (shutdown deadline) with the outcome unknown: a runtime
        ``retry_after``'s removal may have been applied, so its copy must
        still go out -- every plan's ``(delay, removal + later)``.

        The removal goes first again, so the original cannot come back beside
        its copy (the removal may never have been sent): on a stream it is
        the gated script that answers from this finalization's own receipt
        (``STREAM_REMOVE_RECEIPT``), so the copy follows only when this
        finalization removed the original -- a racing finalization that got
        there first closes it (``_plan.chain_stops``); should the removal
        fail, the copy is not sent either and the original stays pending."""
        return [(p.delay, (*p.commands, *p.later))
                for _, p in self._plans if p.delay is not None and p.later]

    def _failed(self) -> list[int]:
        """The hot path's removals whose command got a final error reply, as
        indexes into ``_removed``: counted :data:`FAILED` (they stay pending).

        A stream's one ``XACK`` fails them all; its ``XDEL``
        (``DELETE_ON_FINALIZE``) failing alone fails none: they were
        acknowledged, and the periodic trim removes them from the stream (the
        error is logged and counted in ``finalize_errors`` all the same).  A
        reliable list's ``LREM`` fails its own element only."""
        broken = self._fast_failed
        if not broken:
            return []
        n = len(self._removed)
        if self._core._stream:
            return list(range(n)) if 0 in broken else []
        if self._n_fast != n:  # pragma: no cover - one LREM per element, always
            return list(range(n))
        return sorted(broken)

    def _closed(self) -> list[int]:
        """The hot path's removals Redis answered *nothing removed*, sent once
        in the first round with a known outcome, as indexes into ``_removed``:
        counted :data:`GATE_CLOSED`, not as acknowledged (or dropped).

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
        replies = self._fast_replies
        if replies is None:
            return []
        n = len(self._removed)
        if self._core._stream:
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

    def result(self) -> Settlement:
        """The batch's settlement, once :meth:`commands` is empty."""
        if self._commands:
            raise RuntimeError("result(): the batch is not done")
        core = self._core
        gates = core.gates
        if gates is not None:
            gates.settle(self._items, self._answered, self._answers,
                         self._owners is None and not self.refused)
        name = core.name
        debug = self._debug
        effects: dict[str, int] = {}
        records: list[Record] = []
        later: list[tuple[float, tuple[Command, ...]]] = []
        removed = self._removed
        removals = core.removals
        # never the same removal in both: a removal answered 0 at once was not
        # sent again, and a stream's XACK that failed answered no count
        failed = self._failed()
        closed = self._closed()
        if removed:
            for _, e, n in self._tally:
                effects[e] = effects.get(e, 0) + n  # kinds may share an effect
            # the removals Redis answered otherwise than planned
            for instead, which in ((FAILED, failed), (GATE_CLOSED, closed)):
                if not which:
                    continue
                for i in which:
                    e = removals[self._kinds[i]]._value_
                    if effects[e] > 1:
                        effects[e] -= 1
                    else:
                        del effects[e]  # none of that effect after all
                effects[instead] = effects.get(instead, 0) + len(which)
            if closed and core._stream:
                records.append((
                    _INFO, "%s: %s of %d entries acknowledged %d: %d were no longer "
                    "pending (finalized already: claimed and finalized by another "
                    "consumer, or the group was recreated); counted gate_closed",
                    (name, "XACKDEL" if core.target.xackdel else "XACK", len(removed),
                     len(removed) - len(closed), len(closed)),
                    {"subscription": name, "effect": GATE_CLOSED}))
            if debug:
                shut = {id(removed[i]) for i in closed}
                broke = {id(removed[i]) for i in failed}
                for d, outcome in self._items:
                    effect = (removals.get(outcome.kind) if outcome.__class__ is Outcome
                              else None)
                    if effect is not None:
                        value = (GATE_CLOSED if id(d) in shut else FAILED if id(d) in broke
                                 else effect.value)
                        records.append((_DEBUG, "%s: %s (attempt %d) finalized: %s",
                                        (name, d.id or d.origin_id, d.attempt, value),
                                        log_extra(name, d, outcome, value)))
        plans = self._plans
        settled_effects: list[str] = []
        unsure = self._unsure
        for (d, p), outcome, rs in zip(plans, self._returned, self._got, strict=True) if plans else ():
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
        return Settlement(self, effects, records, later, settled_effects, closed, failed)


class Settlement:
    """What a finished batch did, as Redis answered.

    ``effects``: counts per effect (``acked``, ``copied``, ``failed``,
    ``gate_closed`` ...); ``records``: log records to emit; ``later``:
    ``(delay, commands)`` of runtime delayed copies to hand the scheduler
    (plans whose removal was confirmed).  :meth:`forget`: the stream ids no
    longer in hand; :meth:`deliveries`: each delivery with its settled
    effect (what instrumentation is told).
    """

    __slots__ = ("_batch", "_closed", "_failed", "_settled", "effects", "later", "records")

    def __init__(self, batch: FinalizeBatch, effects: dict[str, int], records: list[Record],
                 later: list[tuple[float, tuple[Command, ...]]], settled: list[str],
                 closed: list[int], failed: list[int]) -> None:
        self._batch = batch
        self._closed = closed  # the hot path's removals that removed nothing (gate_closed)
        self._failed = failed  # those whose command got a final error reply
        self.effects = effects
        self.records = records
        self.later = later
        self._settled = settled

    def forget(self) -> list[str]:
        """The stream ids finalized (or failed: the own-PEL re-read delivers them again)."""
        b = self._batch
        # the hot path's ids listed once (streams; other forms hold no ids)
        return b._ids + [d.id for d, _ in b._plans if d.id is not None]

    def deliveries(self) -> list[tuple[Delivery, str]]:
        """Every delivery the batch finalized with its settled effect (the hot
        path's first, then the plans'; ``backoffs`` and refused ones are not there)."""
        b = self._batch
        removals = b._core.removals
        out = [(d, removals[k]._value_) for d, k in zip(b._removed, b._kinds, strict=True)]
        for i in self._closed:
            out[i] = (out[i][0], GATE_CLOSED)
        for i in self._failed:
            out[i] = (out[i][0], FAILED)
        return out + [(d, e) for (d, _), e in zip(b._plans, self._settled, strict=True)]


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
