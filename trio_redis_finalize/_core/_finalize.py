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
  id on a stream); ACKs and DROPs carrying writes on a stream get none
  either: their batched calls are built at once (``_hot_writes``).
  Everything else gets its :func:`~._plan.plan`.
* **The first round** (:func:`~._batch.first_round`): single-``XACK`` plans merge
  per stream and group, apart from the hot path's ``XACK`` (whose own count
  settles its removals: a short one is ``gate_closed``); a plan of two ungated
  steps (a copy to another Redis Cluster slot, then the removal) sends only
  its copy, the removal once the copy's reply was a success (never after a
  copy that failed, did not run, or whose outcome is unknown).
* **Batched scripts**: the two-step deliveries of a batch that share their
  keys (RETRY copies, dead letters, durable delays on one stream) go in one
  batched script call; its reply has one element per delivery, settled as
  that delivery's own script's reply would be (one that did not run sends
  that delivery's own script again, alone, after a pause; a final one fails
  that delivery only).  An error reply to the whole call, or a round trip
  that failed, is handled as for any command.
* **Error replies** (:func:`~._replies.classify`): one that did not run
  (OOM, BUSY, READONLY ...) is sent again, alone, after a pause; a final
  one is logged with its command and key, counted, and makes its
  deliveries' effect ``failed``.  A round trip that failed (connection
  lost, timeout; or a whole pipeline that did not run) sends the same
  round again after a pause, and the batch becomes *unsure*: a closed gate
  then answers that the earlier send did the work (:func:`~._plan.settle`).
* **Counted gates** (reliable lists, identical elements): a :class:`~._gates.Gates`
  object -- the reader's -- numbers the removals once before the first send
  (``prepare``), again before every resend (``resend``: the copies held
  *now*), and learns what Redis answered (``settle``).
* **Effects** are counted from the replies (``_settlement``), with the
  runtime ``retry_after`` copies to hand the scheduler (only for plans whose
  removal was confirmed; on cancellation every one, duplicate never loss),
  the records to log and the stream ids to forget (a
  :class:`~._settlement.Step` after each round, a
  :class:`~._settlement.Settlement` at the end).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from typing import Any

from redis import exceptions as rexc

from .._delivery import Delivery
from .._errors import AckUnsupported
from .._outcome import ACK, DROP, Backoff, Outcome, OutcomeKind, WithWrites
from ._batch import BATCHED, batch_replies, fast_index, fast_owner, first_round
from ._commands import Command
from ._gates import Gates, Item
from ._hot_writes import HotWrites
from ._plan import cells_of, plain_removals, plan, plan_dead, removal_commands, stream_removals
from ._replies import FINAL, classify, describe_error
from ._settlement import (
    GO,
    Record,
    Settlement,
    Step,
    batched_elements,
    count_removals,
    cut_warning,
    held_on_cancel,
    held_warning,
    log_extra,
    settle_plans,
)
from ._types import Effect, Plan, Target, exhausted
from ._writes import plan_writes

__all__ = ["GO", "FinalizeBatch", "FinalizerCore", "Gates", "Item", "Record", "Settlement", "Step",
           "log_extra"]

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

_WARNING = logging.WARNING
_ERROR = logging.ERROR


class FinalizerCore:
    """The finalizer's fixed decisions for one mounted subscription.

    ``gates``: the reader's counted gates (reliable lists), or None.
    """

    __slots__ = ("_cells", "_counted", "_cut_warned", "_held_warned", "_hot", "_kinds", "_lists",
                 "_names", "_stream", "gates", "name", "removals", "target")

    def __init__(self, target: Target, *, gates: Gates | None = None) -> None:
        self.target = target
        self.name = target.name
        self.gates = gates
        self.removals = plain_removals(target)
        self._kinds = tuple(self.removals)  # a tuple: `in` by identity, no Enum.__hash__ call
        self._names = tuple((k, k._value_, e._value_) for k, e in self.removals.items())
        self._cut_warned = False  # claiming: a retry_after longer than min_idle was logged
        self._held_warned = False  # a runtime retry_after's copy in memory was logged
        cells = self._cells = cells_of(target)
        self._hot = HotWrites.applies(cells, target)  # ACKs and DROPs with writes
        self._stream = cells.by_id
        self._lists = cells.counted  # the hot path: one LREM per element
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
            if exhausted(t, d.attempt):
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
            b.records.append(cut_warning(self.name, t.min_idle, d, outcome))
        return p


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
        "_fast_replies", "_first", "_got", "_hot", "_hot_calls", "_ids", "_items", "_kinds",
        "_n_fast", "_owners", "_plans", "_recount", "_removed", "_rest", "_returned",
        "_tally", "_unsure", "backoffs", "outcomes", "records", "refused",
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
        hot: list[tuple[Delivery, WithWrites]] = []
        hot_ok = core._hot
        # the common batch: one hot-path outcome object for every delivery (a
        # handler returning ACK): its lists built in C, no loop in Python
        first = items[0][1] if items else None
        todo = items
        if (first.__class__ is Outcome and first.kind in removable
                and [*map(_OUTCOME, items)].count(first) == len(items)):
            removed = [*map(_DELIVERY, items)]
            kinds = [first.kind] * len(removed)
            todo = ()
        elif hot_ok and first.__class__ is WithWrites and HotWrites.every(items, removable):
            hot = [*items]  # type: ignore[list-item]
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
            elif (outcome.__class__ is WithWrites and hot_ok and outcome.kind in removable
                  and outcome.writes):
                hot.append((d, outcome))  # counted by HotWrites
                continue
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
            self._got = []
        self._hot = hw = HotWrites(target, core._cells, hot, self.outcomes) if hot else None
        self._hot_calls = len(hw.calls) if hw is not None else 0
        if hw is not None:  # its calls after the plain removals (whose replies come first)
            commands, owners = hw.place(commands, owners, len(fast))
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
        # the hot path's removals answered in the first round, sent once (see closed_removals)
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
        # Did not run, or outcome unknown: every command is idempotent or gated (a two-step
        # ungated plan's removal is only sent once its copy succeeded): the same round again.
        self._unsure = self._recount = True
        self._attempt += 1
        hw = self._hot  # (its deliveries: hw.items)
        return Step(1, self._attempt, [(
            _WARNING, "%s: finalization of %d deliveries failed (%s); sending again",
            (core.name, len(self._plans) + len(self._removed) + (len(hw.items) if hw else 0), err),
            {"subscription": core.name},
        )])

    def receive(self, replies: Sequence[Any]) -> Step:
        """The replies to :meth:`commands`, in order (error replies as exception values)."""
        commands = self._commands
        if len(replies) != len(commands) or not commands:
            raise RuntimeError(f"receive(): {len(replies)} replies to {len(commands)} commands")
        track = self._core.gates is not None
        owners = self._owners
        # a first round sent once with a known outcome: its replies settle the
        # hot path's removals (see closed_removals); a resend's do not
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
        if self._hot_calls and self._hot is not None:  # the hot path's calls (``_hot_writes``)
            k, n, self._hot_calls = self._n_fast, self._hot_calls, 0
            errors, deferred = self._hot.receive(
                core.target, commands[k:k + n], replies[k:k + n], self._plans, self._returned, got,
                rest, again, again_owners, records, (self._answered, self._answers) if track else None)
        for cmd, r, own in zip(commands, replies, owners, strict=True):
            if not own:  # a hot-path call, read above
                continue
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
                    failures, first = batched_elements(core.name, elements, own, self._plans, got,
                                                       again, again_owners, records)
                    errors += failures
                    if first:
                        deferred = first
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
        """Cancelled (shutdown deadline) with the outcome unknown: the runtime
        copies to hold (:func:`~._settlement.held_on_cancel`)."""
        return held_on_cancel(self._plans)

    def result(self) -> Settlement:
        """The batch's settlement (``_settlement``), once :meth:`commands` is empty."""
        if self._commands:
            raise RuntimeError("result(): the batch is not done")
        core = self._core
        gates = core.gates
        if gates is not None:
            gates.settle(self._items, self._answered, self._answers,
                         self._owners is None and not self.refused)
        name = core.name
        effects: dict[str, int] = {}
        records: list[Record] = []
        later: list[tuple[float, tuple[Command, ...]]] = []
        removed = self._removed
        closed: Sequence[int] = ()
        failed: Sequence[int] = ()
        settled: Sequence[str] = ()
        if removed:
            closed, failed = count_removals(
                name, core.removals, core._stream, core.target, removed, self._kinds, self._tally,
                self._fast_failed, self._n_fast, self._fast_replies,
                self._items if self._debug else None, effects, records)
        plans = self._plans
        hw = self._hot
        wrote = hw.settle(name, self._debug, effects, records) if hw is not None else []
        if plans:
            settled = settle_plans(name, plans, self._returned, self._got, self._unsure,
                                   self._debug, effects, records, later)
        return Settlement(effects, records, later, settled, closed, failed, self._ids,
                          core.removals, removed, self._kinds, plans, wrote)
