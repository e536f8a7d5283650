"""The finalizer: one task per mount that sends what the core decided and
counts what Redis answered.

Every decision is the sans-IO core's (``_core._finalize``): which commands
go in which round (the ACK / DROP hot path, XACK merging, a two-step
ungated plan's removal only once its copy succeeded), what is sent again
after an error reply or a failed round trip, the effects, counters and log
records, the runtime delayed copies.  This module only sends each round in
one pipeline, sleeps the pauses the core asks for, and applies what it
returns: stats, log records, the scheduler's holds, the ids no longer held.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream as Recv
from redis import exceptions as rexc

from ._core._finalize import GO, FinalizeBatch, FinalizerCore, Gates, Item, Record
from ._core._types import FAILED, Target
from ._deadlines import FINALIZE_TIMEOUT, backoff, log
from ._delivery import Delivery
from ._outcome import Backoff

if TYPE_CHECKING:
    from ._scheduler import Owner, Scheduler
    from ._stats import MountStats
    from ._transport import Client

__all__ = ["MAX_BATCH", "Finalizer"]

MAX_BATCH = 1000
"""At most this many outcomes go into one finalization batch."""


@dataclasses.dataclass(eq=False, repr=False, kw_only=True)
class Finalizer:
    """Sends a mount's batches (see the module docstring).

    ``owner``: the mount, whose runtime delayed copies the scheduler holds.
    ``wait_out(delivery, backoff)``: the mount's answer to a :class:`Backoff`
    before the last attempt (the delivery waits in memory, or is left
    pending; the core dead-letters it at the last).  ``gates``: the reader's
    counted gates for removals of identical reliable-list elements, or None.
    ``settled``: instrumentation, told each delivery's effect as Redis answered
    (``failed`` and ``gate_closed`` included).
    """

    name: str
    target: Target
    client: Client
    stats: MountStats
    in_hand: set[str]
    scheduler: Scheduler
    owner: Owner
    wait_out: Callable[[Delivery, Backoff], float | None]
    gates: dataclasses.InitVar[Gates | None]
    settled: Callable[[list[tuple[Delivery, str]]], None] | None
    refused: Callable[[list[Delivery]], None] | None = None
    """Deliveries whose finalization Redis refused for good (effect ``failed``,
    still pending): the mount holds them again and delivers them again later
    (``_core._recovery.refused_delay``)."""
    schedule: Callable[[list[tuple[Delivery, float]]], Awaitable[None]] | None = None
    """Writes the Backoff due times of deliveries that started waiting (the
    delays ``wait_out`` answered) to Redis, so that a restart keeps them."""
    scope: anyio.CancelScope = dataclasses.field(default_factory=anyio.CancelScope, init=False)
    core: FinalizerCore = dataclasses.field(init=False)

    def __post_init__(self, gates: Gates | None) -> None:
        self.core = FinalizerCore(self.target, gates=gates)

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
                    try:
                        await self.finalize(batch)
                    except anyio.get_cancelled_exc_class():
                        if self.scope.cancel_called:  # the shutdown's deadline, not a bug
                            self._cut(len(batch) + _drain(recv))
                        raise

    def _cut(self, n: int) -> None:
        """The shutdown's deadline (``Budget.finalizer``) cut the finalizer with
        ``n`` outcomes Redis had not confirmed: say so once, with what it means."""
        log.warning(
            "%s: the shutdown's deadline cut finalization with %d outcome%s not confirmed by "
            "Redis: on streams and reliable lists those deliveries stay pending and are "
            "delivered again; on simple lists and Pub/Sub a copy not written is lost "
            "(a longer shutdown_grace gives the finalizer more time)",
            self.name, n, "" if n == 1 else "s", extra={"subscription": self.name},
        )

    async def finalize(self, items: list[Item]) -> None:
        """Send the rounds the core decides for ``items``; apply what it settled."""
        stats = self.stats
        batch = FinalizeBatch(self.core, items, log.isEnabledFor(logging.DEBUG))
        counts = stats.outcomes
        for kind, n in batch.outcomes.items():
            counts[kind] += n
        if batch.refused:
            stats.refused += batch.refused
            stats.effects["refused"] += batch.refused
        if batch.records:
            _emit(batch.records)
        waits: list[tuple[Delivery, float]] = []
        for d, b in batch.backoffs:
            delay = self.wait_out(d, b)
            if delay is not None:
                waits.append((d, delay))
        pipeline = self.client.pipeline
        try:
            while commands := batch.commands():
                try:
                    replies: list[Any] = await pipeline(
                        commands, raise_on_error=False, timeout=FINALIZE_TIMEOUT)
                except (rexc.RedisError, OSError) as e:
                    step = batch.failed(e)
                else:
                    step = batch.receive(replies)
                if step is not GO:
                    stats.finalize_errors += step.errors
                    _emit(step.records)
                    if step.pause:
                        await anyio.sleep(backoff(step.pause - 1))
        except anyio.get_cancelled_exc_class():
            # Cancelled (shutdown deadline) with the outcome unknown: a runtime
            # retry_after's XACK may have been applied, so its copy must still
            # go out (the shutdown flush publishes it): duplicate, never loss.
            for delay, later in batch.cancelled():
                self.scheduler.hold(self.owner, delay, later)
            raise
        done = batch.result()
        effects = stats.effects
        for effect, n in done.effects.items():
            effects[effect] += n
        if self.in_hand:
            # forgotten even when failed: held again below (refused)
            self.in_hand.difference_update(done.forget())
        if self.refused is not None and done.effects.get(FAILED):
            self.refused([d for d, e in done.deliveries() if e == FAILED])
        if done.records:
            _emit(done.records)
        for delay, later in done.later:
            self.scheduler.hold(self.owner, delay, later)
        if self.settled is not None:  # instrumentation: each delivery and the effect Redis confirmed
            self.settled(done.deliveries())
        if waits and self.schedule is not None:
            await self.schedule(waits)


def _drain(recv: Recv[list[Item]]) -> int:
    """How many outcomes were still waiting in ``recv`` (taken out: never sent)."""
    n = 0
    while True:
        try:
            n += len(recv.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return n


def _emit(records: Sequence[Record]) -> None:
    """Log the records the core returned."""
    for level, msg, args, extra in records:
        log.log(level, msg, *args, extra=extra)
