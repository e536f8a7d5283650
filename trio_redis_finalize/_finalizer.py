"""The finalizer: one task per mount that sends the plans of outcomes and
counts what Redis answered.

It sends each batch in one pipeline.  An error reply is classified
(``_core._replies.classify``): one that did not run (OOM, BUSY, READONLY
...) is sent again after a backoff, alone; a final one is logged with its
command and key and counted (effect ``failed``).  A plan of two ungated
steps (a copy to another Redis Cluster slot, then the removal of the
original) sends its removal in a later round, only once the copy
succeeded (``_core._batch.first_round``).  Effects are counted from the
replies (``_core._plan.settle``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream as Recv
from redis import exceptions as rexc

from ._context import FINALIZE_TIMEOUT, Item, backoff, describe_error, log, log_extra
from ._core._batch import FAST_ONLY, first_round
from ._core._commands import Command
from ._core._plan import (
    FAILED,
    GATE_CLOSED,
    Effect,
    Plan,
    Target,
    plain_removals,
    plan,
    removal_commands,
    settle,
)
from ._core._replies import FINAL, classify
from ._delivery import Delivery
from ._errors import AckUnsupported
from ._outcome import Backoff, Outcome, OutcomeKind

if TYPE_CHECKING:
    from ._scheduler import Owner, Scheduler
    from ._stats import MountStats
    from ._transport import Client

__all__ = ["MAX_BATCH", "Finalizer"]

MAX_BATCH = 1000
"""At most this many outcomes go into one finalization batch."""


class Finalizer:
    """Sends a mount's plans (see the module docstring).

    ``owner``: the mount, whose runtime delayed copies the scheduler holds.
    ``back_off(delivery, backoff)``: the mount's answer to a :class:`Backoff`
    outcome (the delivery waits in memory, or its dead letter's plan at the
    last attempt).  ``reader``: the form's reader, whose optional hooks
    ``prepare`` / ``resend`` / ``settle`` gate removals of identical
    reliable-list elements.  ``settled``: instrumentation, told each
    delivery's confirmed effect.
    """

    def __init__(
        self, *, name: str, target: Target, client: Client, stats: MountStats, held: set[str],
        scheduler: Scheduler, owner: Owner, back_off: Callable[[Delivery, Backoff], Plan | None],
        reader: object,
        settled: Callable[[list[tuple[Delivery, str]]], None] | None,
    ) -> None:
        self.name = name
        self.target = target
        self.client = client
        self.stats = stats
        self.held = held
        self.scheduler = scheduler
        self.owner = owner
        self.back_off = back_off
        self.settled = settled
        self.scope = anyio.CancelScope()
        self._removals = plain_removals(target)
        self._removal_kinds = tuple(self._removals)
        # reliable lists: identical elements' removals get their count (_plan.list_counted)
        self._prepare = getattr(reader, "prepare", None)
        self._settle = getattr(reader, "settle", None)
        self._resend = getattr(reader, "resend", None)
        self._cut_warned = False  # claiming: a retry_after longer than min_idle was logged

    async def run(self, recv: Recv[list[Item]]) -> None:
        """Finalize every batch ``recv`` brings, until all its senders closed."""
        with self.scope:
            async with recv:
                async for items in recv:
                    batch = list(items)
                    while len(batch) < MAX_BATCH:
                        try:
                            batch.extend(recv.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    await self.finalize(batch)

    def plan_for(self, d: Delivery, outcome: Outcome | Plan | Backoff) -> Plan | None:
        """The plan for one item; ``None`` when refused (logged and counted) or
        when nothing is to be sent (a :class:`Backoff` that waits)."""
        if isinstance(outcome, Plan):
            return outcome
        if isinstance(outcome, Backoff):
            return self.back_off(d, outcome)
        self.stats.outcomes[outcome.kind._value_] += 1  # not .value: a Python-level property
        try:
            p = plan(self.target, d, outcome)
        except AckUnsupported as e:
            if outcome.kind in (OutcomeKind.ACK, OutcomeKind.DROP):
                return Plan(Effect.NOTHING)
            self.stats.refused += 1
            self.stats.effects["refused"] += 1
            log.error("%s (message %s, attempt %d)", e, d.origin_id, d.attempt,
                      extra=log_extra(self.name, d, outcome))
            return None
        if (p.effect is Effect.LEFT_PENDING and outcome.kind is OutcomeKind.RETRY_AFTER
                and outcome.delay > self.target.min_idle and not self._cut_warned):
            # claiming: the PEL is the delay, and XAUTOCLAIM takes the entry
            # back once it has been idle min_idle, whatever the delay asked
            self._cut_warned = True
            log.warning(
                "%s: %r on a claiming subscription is cut to min_idle=%g s (entry %s, "
                "attempt %d); use delayed_retry=DelayedRetry.DURABLE_ZSET for longer delays "
                "(logged once per subscription)",
                self.name, outcome, self.target.min_idle, d.id, d.attempt,
                extra=log_extra(self.name, d, outcome),
            )
        return p

    async def finalize(self, items: list[Item]) -> None:
        """Send the plans of ``items`` and settle their effects from the replies."""
        plans: list[tuple[Delivery, Plan]] = []
        returned: list[Outcome | Plan | Backoff] = []  # what each plan came from (for logs)
        # The hot path: outcomes that only remove the original (ACK, DROP on
        # a stream or a reliable list) need no plan each: removal_commands()
        # removes them all (one XACK of every id on a stream).
        removals = self._removal_kinds
        removed: list[Delivery] = []
        kinds: list[OutcomeKind] = []  # counted per kind once the batch is sorted out
        for d, outcome in items:
            if removals and outcome.__class__ is Outcome:
                kind = outcome.kind
                if kind in removals:  # a tuple: identity, no Enum.__hash__ call
                    removed.append(d)
                    kinds.append(kind)
                    continue
            p = self.plan_for(d, outcome)
            if p is not None:
                plans.append((d, p))
                returned.append(outcome)
        tally: list[tuple[OutcomeKind, int]] = []
        fast: list[Command] = []
        if removed:
            tally = [(k, n) for k in removals if (n := kinds.count(k))]
            for kind, n in tally:
                self.stats.outcomes[kind.value] += n
            fast = removal_commands(self.target, removed)
        got: list[list[Any]] = []  # per plan: the replies to its commands so far
        fast_failed = False
        if plans:
            commands, owners, rest = first_round(fast, [p for _, p in plans])
            got = [[] for _ in plans]
        else:
            commands, owners, rest = fast, None, []
        if self._prepare is not None:
            # the reader's say on the commands (reliable lists: counted gates
            # for identical elements), once, before the first send: a resend
            # sends the same commands
            later = [c for r in rest for c in r]
            prepared = self._prepare([*commands, *later])
            commands = prepared[: len(commands)]
            it = iter(prepared[len(commands):])
            rest = [[next(it) for _ in r] for r in rest]
        unsure = False  # a send had an unknown outcome (then resent)
        track = self._settle is not None or self._resend is not None
        answered: list[Command] = []  # commands with a final reply, and those replies
        answers: list[Any] = []
        attempt = 0
        recount = False  # a resend: the reader gates removals on what it holds now
        try:
            while commands:
                if recount and self._resend is not None:
                    commands = self._resend(commands, answered, answers)
                try:
                    replies: list[Any] = await self.client.pipeline(
                        commands, raise_on_error=False, timeout=FINALIZE_TIMEOUT
                    )
                except (rexc.RedisError, OSError) as e:
                    if classify(e) is FINAL:
                        replies = [e] * len(commands)
                    else:
                        # Did not run, or outcome unknown: every command is
                        # idempotent or gated (a two-step ungated plan's removal
                        # is only sent once its copy succeeded): send again.
                        unsure = recount = True
                        self.stats.finalize_errors += 1
                        log.warning(
                            "%s: finalization of %d deliveries failed (%s); sending again",
                            self.name, len(plans) + len(removed), e,
                            extra={"subscription": self.name},
                        )
                        await anyio.sleep(backoff(attempt))
                        attempt += 1
                        continue
                if owners is None:
                    # the hot path: only removals; done unless an error reply came
                    for r in replies:
                        if isinstance(r, Exception):
                            break
                    else:
                        if track:
                            answered += commands
                            answers += replies
                        break
                    owners = [FAST_ONLY] * len(commands)
                again: list[Command] = []  # did not run: send again after a backoff
                again_owners: list[tuple[int, ...]] = []
                step: list[Command] = []  # next steps of two-step plans whose copy succeeded
                step_owners: list[tuple[int, ...]] = []
                deferred = ""
                for cmd, r, own in zip(commands, replies, owners, strict=True):
                    if isinstance(r, Exception):
                        if classify(r) is not FINAL:
                            if not again:
                                deferred = describe_error(r, cmd)
                            again.append(cmd)
                            again_owners.append(own)
                            continue
                        self.stats.finalize_errors += 1
                        log.error("%s: finalization command failed: %s", self.name,
                                  describe_error(r, cmd), extra={"subscription": self.name})
                    if track:
                        answered.append(cmd)
                        answers.append(r)
                    for j in own:
                        if j < 0:
                            fast_failed = fast_failed or isinstance(r, Exception)
                            continue
                        got[j].append(r)
                        more = rest[j]
                        if more and not isinstance(r, Exception):
                            step.append(more.pop(0))
                            step_owners.append((j,))
                if again:
                    self.stats.finalize_errors += 1
                    log.warning("%s: finalization deferred by the server (%s); sending again",
                                self.name, deferred,
                                extra={"subscription": self.name})
                    await anyio.sleep(backoff(attempt))
                    attempt += 1
                else:
                    attempt = 0
                commands = again + step
                owners = again_owners + step_owners
                recount = bool(again)
        except anyio.get_cancelled_exc_class():
            # Cancelled (shutdown deadline) with the outcome unknown: a runtime
            # retry_after's XACK may have been applied, so its copy must still
            # go out (the shutdown flush publishes it): duplicate, never loss.
            for _, p in plans:
                if p.delay is not None and p.later:
                    self.scheduler.hold(self.owner, p.delay, p.later)
            raise
        if self._settle is not None:
            self._settle(items, answered, answers)
        debug = log.isEnabledFor(logging.DEBUG)
        if removed:
            if fast_failed:
                self.stats.effects[FAILED] += len(removed)
            else:
                for kind, n in tally:
                    self.stats.effects[self._removals[kind].value] += n
            if self.held:
                # forgotten even when failed: the own-PEL re-read delivers it again
                self.held.difference_update([d.id for d in removed])
            if debug:
                for d, outcome in items:
                    effect = self._removals.get(outcome.kind) if outcome.__class__ is Outcome else None
                    if effect is not None:
                        log.debug("%s: %s (attempt %d) finalized: %s", self.name, d.id or d.origin_id,
                                  d.attempt, effect.value,
                                  extra=log_extra(self.name, d, outcome, effect.value))
        for j, ((d, p), outcome) in enumerate(zip(plans, returned, strict=True)):
            rs = got[j]
            if not p.commands:
                settled = p.effect._value_
            elif (len(rs) == 1 and len(p.commands) == 1 and (r := rs[0]) is not None
                  and r is not False and not isinstance(r, Exception)):
                settled = p.effect._value_  # settle()'s answer for one command that ran, inline
            else:
                settled = settle(p, rs, unsure=unsure)
            self.stats.effects[settled] += 1
            if d.id is not None:
                self.held.discard(d.id)
            if settled == FAILED:
                log.error("%s: finalization of %s (attempt %d, origin %s) failed; it stays "
                          "where it was (pending) and is delivered again", self.name,
                          d.id or d.origin_id, d.attempt, d.origin_id,
                          extra=log_extra(self.name, d, outcome, settled))
                continue
            if settled == GATE_CLOSED:
                log.info("%s: %s (attempt %d) was no longer pending: finalized already, "
                         "nothing written", self.name, d.id or d.origin_id, d.attempt,
                         extra=log_extra(self.name, d, outcome, settled))
                continue
            if p.warning:
                log.warning("%s (attempt %d, origin %s)", p.warning, d.attempt, d.origin_id,
                            extra=log_extra(self.name, d, outcome, settled))
            elif debug:
                log.debug("%s: %s (attempt %d) finalized: %s", self.name, d.id or d.origin_id,
                          d.attempt, settled, extra=log_extra(self.name, d, outcome, settled))
            if p.delay is not None and p.later:
                self.scheduler.hold(self.owner, p.delay, p.later)
        if self.settled is not None:  # instrumentation: each delivery and its confirmed effect
            self.settled([(d, self._removals[k].value) for d, k in zip(removed, kinds, strict=True)]
                         + [(d, p.effect.value) for d, p in plans])
