"""The waiting set of one mount: failed deliveries waiting out their
:class:`~trio_redis_finalize.Backoff`, pending, and the redeliverer.

Part of the runtime (``_mount``), beside the handler pool (``_handlers``).
A :class:`~trio_redis_finalize.Backoff` (the default ``on_error``) on a
stream or a reliable list sends nothing: the delivery stays pending (the
group's PEL / the processing list) and still "held" by this consumer
(``Mount.in_hand``, the reader's counts), so no lease lapses, no other
consumer claims it and no own-PEL re-read or rescan delivers it early.  It
waits here (a heap by due time, at most :data:`MAX_WAITING` deliveries) for
``Backoff.delay(attempt, max_attempts)`` seconds; the redeliverer
(:meth:`Backoffs.run`, a task beside the reader, cancelled with it) then hands
it to the reader's ``redeliver`` (its :class:`~._forms._port.Pending` hooks),
which takes it again as the next attempt (stream: ``XCLAIM ... RETRYCOUNT
attempt+1`` of an entry still pending for this consumer; reliable list: its
retry counter bumped in place, ``LSET``) -- so the attempt counts before the
handler runs and a crash cannot undo it -- and delivers it like any read.
Past :data:`MAX_WAITING` a failed delivery is left pending without a timer,
for the ordinary recovery (the reader's ``leave_pending``).  A finalization
Redis refused for good waits here too (:meth:`Backoffs.refused`), whatever
``on_error`` is.

The waiting set knows the form only through its ``Pending`` hooks and the
port's :class:`~._forms._port.Context` it passes them; never the mount.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Callable

import anyio
from redis import exceptions as rexc

from ._core._finalize import log_extra
from ._core._recovery import refused_delay, schedule_command, schedule_key
from ._core._types import Effect
from ._deadlines import backoff, log
from ._delivery import Delivery
from ._forms._port import Context, Pending
from ._outcome import Backoff
from ._shutdown import CLOSING_TIMEOUT, cleanup

__all__ = ["MAX_WAITING", "Backoffs"]

MAX_WAITING = 10_000
"""Failed deliveries that wait for their :class:`Backoff` delay, per mount, at
most (memory); past it a failed delivery is left pending for the ordinary
recovery instead (see the readers' ``leave_pending``)."""
_REDELIVER_BATCH = 100
"""At most this many due deliveries go to the reader's ``redeliver`` at once."""
_WARN_FULL_EVERY = 5.0
_POSTPONE = 0.05
"""Seconds before a redelivery the reader put off is tried again."""


class Backoffs:
    """The deliveries of one mount waiting to be delivered again (due, seq, delivery).

    ``ctx``: the mounted subscription, as its reader sees it (name, target,
    client, stats, ``in_hand``), passed on to the ``pending`` hooks (None:
    nothing stays pending, nothing waits here); ``settled``: the
    instrumentation's view of finalizations (``trf_bind``), or None;
    ``backs_off``: ``on_error`` is a Backoff here (the mount has the due
    times it answers written: :meth:`schedule`).
    """

    def __init__(self, ctx: Context, pending: Pending | None,
                 settled: Callable[[list[tuple[Delivery, str]]], None] | None,
                 *, backs_off: bool) -> None:
        self.ctx = ctx
        self.name = ctx.name
        self.pending = pending
        self.settled = settled
        self.backs_off = backs_off and pending is not None
        self.waiting: list[tuple[float, int, Delivery]] = []
        self._seq = itertools.count()
        self._wake = anyio.Event()
        self._full_warned_at = -math.inf
        self._full_count = 0

    def __len__(self) -> int:
        return len(self.waiting)

    def backing_off(self) -> list[Delivery]:
        """The deliveries waiting for their Backoff (see ``Context.backing_off``)."""
        return [d for _, _, d in self.waiting]

    def disown(self, others: dict[str, str]) -> None:
        """Stream entries now pending for another consumer (id -> its name) stop waiting."""
        waiting = self.waiting
        if any(d.id in others for _, _, d in waiting):  # waiting for a Backoff: theirs now
            waiting[:] = [w for w in waiting if w[2].id not in others]  # in place: the redeliverer's
            heapq.heapify(waiting)

    def _park(self, d: Delivery, delay: float) -> None:
        waiting = self.waiting
        heapq.heappush(waiting, (anyio.current_time() + delay, next(self._seq), d))
        if waiting[0][2] is d:  # the next due: the redeliverer's timer changes
            self._wake.set()

    def wait_out(self, d: Delivery, b: Backoff) -> float | None:
        """A failed delivery under ``on_error=Backoff`` before its last attempt
        (the finalizer's core dead-letters that one): it waits for its delay
        (returned: the finalizer has it written to Redis, :meth:`schedule`),
        or, with no room, is left pending for the ordinary recovery (None)."""
        ctx = self.ctx
        stats = ctx.stats
        extra = log_extra(self.name, d, b)
        delay: float | None = None
        if self.pending is None or len(self.waiting) >= MAX_WAITING:
            # no room (memory): pending all the same, for the ordinary recovery
            if self.pending is not None:
                self.pending.leave_pending(ctx, [d])
            stats.effects[Effect.LEFT_PENDING.value] += 1
            self._full_count += 1
            now = anyio.current_time()
            if now - self._full_warned_at >= _WARN_FULL_EVERY:
                log.warning("%s: %d failed deliveries already wait for their backoff "
                            "(MAX_WAITING=%d); %d more left pending for the ordinary recovery "
                            "(latest: %s, attempt %d)", self.name, len(self.waiting),
                            MAX_WAITING, self._full_count, d.id or d.origin_id, d.attempt,
                            extra=extra)
                self._full_warned_at = now
                self._full_count = 0
            effect = Effect.LEFT_PENDING.value
        else:
            delay = b.delay(d.attempt, ctx.target.max_attempts)
            self._park(d, delay)
            stats.effects["backed_off"] += 1
            effect = "backed_off"
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s: %s (attempt %d) backs off: delivered again in %.3f s", self.name,
                          d.id or d.origin_id, d.attempt, delay, extra={**extra, "effect": effect})
        if self.settled is not None:
            self.settled([(d, effect)])
        return delay

    async def schedule(self, waits: list[tuple[Delivery, float]]) -> None:
        """Write the due times of deliveries that started waiting for their
        Backoff to Redis (``_core._recovery.SCHEDULE``): a restart meanwhile
        lets them wait out the rest.  Shielded and bounded (a graceful stop
        keeps it); should it fail, a restart before they are due delivers
        them at once, as before (logged)."""
        target = self.ctx.target
        cmd = schedule_command(target, waits)
        if cmd is None:
            return
        failed: object = None
        with cleanup(CLOSING_TIMEOUT) as scope:
            try:
                await self.ctx.client.pipeline([cmd], timeout=CLOSING_TIMEOUT)
            except (rexc.RedisError, OSError) as e:
                failed = e
        if scope.cancelled_caught:  # its bound ran out before the request's own timeout
            failed = f"no reply within {CLOSING_TIMEOUT} s"
        if failed is not None:
            log.warning("%s: writing the Backoff due times of %d deliveries to %r failed (%s); "
                        "a restart before they are due delivers them at once", self.name,
                        len(waits), schedule_key(target), failed,
                        extra={"subscription": self.name})

    def refused(self, deliveries: list[Delivery]) -> None:
        """Deliveries whose finalization Redis refused for good (they stay
        pending): held again and delivered again, as their next attempt,
        ``_core._recovery.refused_delay`` seconds later (1 s at attempt 1,
        doubling, at most 30 s); with no room (:data:`MAX_WAITING`) left to the
        ordinary recovery."""
        hooks = self.pending
        if hooks is None:
            return
        for d in deliveries:
            if len(self.waiting) >= MAX_WAITING:
                return
            hooks.hold_again(self.ctx, d)
            delay = refused_delay(d.attempt)
            self._park(d, delay)
            log.warning("%s: %s (attempt %d): its finalization was refused; delivered again in "
                        "%.1f s", self.name, d.id or d.origin_id, d.attempt, delay,
                        extra=log_extra(self.name, d, None, "failed"))

    def defer(self, d: Delivery, delay: float) -> bool:
        """A delivery recovered (a restart, a claim, a reaper's take) whose due
        time in the schedule (a Backoff's, or a reliable list's runtime
        ``retry_after``'s) is ``delay`` seconds ahead: it waits (held) and is
        then delivered again as its next attempt, whatever ``on_error`` is now;
        False when it cannot wait here (a form with nothing pending, or no
        room): the caller delivers it now."""
        if self.pending is None or len(self.waiting) >= MAX_WAITING:
            return False
        if d.id is not None:
            self.ctx.in_hand.add(d.id)
        self._park(d, delay)
        return True

    async def run(self, pending: Pending) -> None:
        """The redeliverer: hand due deliveries to the reader's ``redeliver``;
        runs beside the reader, cancelled with it (what still waits stays pending)."""
        ctx = self.ctx
        waiting = self.waiting
        failures = 0
        while True:
            now = anyio.current_time()
            if not waiting or waiting[0][0] > now:
                wake = self._wake = anyio.Event()
                if waiting:
                    with anyio.move_on_after(waiting[0][0] - now):
                        await wake.wait()
                else:
                    await wake.wait()
                continue
            batch: list[Delivery] = []
            while waiting and waiting[0][0] <= now and len(batch) < _REDELIVER_BATCH:
                batch.append(heapq.heappop(waiting)[2])
            try:
                for d in await pending.redeliver(ctx, batch):
                    self._park(d, _POSTPONE)  # not now (the reader's say), soon
                failures = 0
            except (rexc.RedisError, OSError) as e:
                # none was delivered: still pending (and held); wait again
                ctx.stats.read_errors += 1
                delay = backoff(failures, cap=5.0)
                failures += 1
                log.warning("%s: delivering %d failed deliveries again failed (%s); they stay "
                            "pending, trying again in %.2f s", self.name, len(batch), e, delay,
                            extra={"subscription": self.name})
                for d in batch:
                    self._park(d, delay)
