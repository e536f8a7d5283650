"""The runtime of one mounted subscription: reader -> handlers -> finalizer.

::

    reader task --(batches)--> work queue --(one delivery at a time)--> N handler tasks
         |                                                                    |
         |                                                        (lists of outcomes)
         |                                                                    v
         +------------(precomputed plans: dead, lost)-----------------> finalizer task

Everything in between is bounded.  The work queue (:class:`~._work_queue.WorkQueue`) takes
a whole batch from the reader once it is empty, and each handler task takes
one delivery at a time from it: fast handlers drain a batch in one task
without a switch per delivery, slow ones share it delivery by delivery (no
task idles behind another's slow delivery).  Outcomes travel in lists over a
bounded channel, flushed when the queue runs dry or every ``_FLUSH_EVERY``
seconds (a flusher task hands on what waits while its handler task runs a
slow handler, so no outcome waits behind another delivery); the finalizer
drains the outcome receiver until every sender (the reader's and the
handlers') has closed.  The reader owns a dedicated
connection; the finalizer uses the pool.

The finalizer sends each batch in one pipeline.  An error reply is
classified (``_transport.classify``): one that did not run (OOM, BUSY,
READONLY ...) is sent again after a backoff, alone; a final one is logged
with its command and key and counted (effect ``failed``).  A plan of two
ungated steps (a copy to another Redis Cluster slot, then the removal of
the original) sends its removal in a later round, only once the copy
succeeded.  Effects are counted from the replies (``_plan.settle``).

Handler errors (``on_error``): a :class:`~trio_redis_finalize.Backoff`
(the default) on a stream or a reliable list sends nothing: the delivery
stays pending (the group's PEL / the processing list) and still "held" by
this consumer (``Mount.in_hand``, the reader's counts), so no lease lapses,
no other consumer claims it and no own-PEL re-read or rescan delivers it
early.  It waits in the mount's waiting set (a heap by due time, at most
:data:`MAX_WAITING` deliveries) for ``Backoff.delay(attempt, max_attempts)`` seconds; a
redeliverer task, beside the reader and cancelled with it, then hands it
to the reader's ``redeliver(mount, deliveries)``, which takes it again as
the next attempt (stream: ``XCLAIM ... RETRYCOUNT attempt+1`` of an entry
still pending for this consumer; reliable list: its retry counter bumped
in place, ``LSET``) -- so the attempt counts before the handler runs and a
crash cannot undo it -- and delivers it like any read.  At the last
attempt (``max_attempts``) the finalizer dead-letters it (or drops it with
a warning) as it would a ``RETRY``.  Past :data:`MAX_WAITING` a failed
delivery is left pending without a timer, for the ordinary recovery: the
reader's ``leave_pending(mount, deliveries)`` forgets it (see the readers).
On simple lists and Pub/Sub (nothing pending to leave) a ``Backoff`` is a
logged ``DROP``.  While ``max_attempts`` is None, a delivery that keeps
failing is logged as a warning at attempts 10, 100, 1000, ...

Shutdown (:meth:`Mount.stop`): phases 1 to 4 of ``_shutdown``, which
describes what happens to in-flight deliveries.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import sys
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from time import monotonic
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream as Recv
from anyio.streams.memory import MemoryObjectSendStream as Send
from redis import exceptions as rexc

from ._core._finalize import log_extra
from ._core._plan import Effect, Target
from ._core._recovery import refused_delay, schedule_command, schedule_key
from ._core._writes import check_outcome
from ._deadlines import backoff, log
from ._delivery import Delivery, record_error
from ._finalizer import Finalizer
from ._forms._port import BatchHandler, ConsumerInfo, Handler, Item, Reader
from ._forms._read_loop import drive, retry_not_run
from ._history import History
from ._outcome import DROP, REJECT, Backoff, Outcome, Rejected, WithWrites, reject
from ._scheduler import LaterGates
from ._shutdown import CLOSE_MARGIN, CLOSING_TIMEOUT, FINALIZE_GRACE, Budget, cleanup, cleanup_until
from ._stats import DURATION_BOUNDS, MountStats
from ._subscription import Form, Subscription
from ._work_queue import WorkQueue

if TYPE_CHECKING:
    from ._scheduler import Scheduler
    from ._transport import Client

__all__ = ["MAX_WAITING", "Mount"]

_FLUSH_EVERY = 0.05
_SLOW_CALL = 0.0005
"""Seconds of a handler call after which its outcome is sent on at once."""
MAX_WAITING = 10_000
"""Failed deliveries that wait for their :class:`Backoff` delay, per mount, at
most (memory); past it a failed delivery is left pending for the ordinary
recovery instead (see the readers' ``leave_pending``)."""
_REDELIVER_BATCH = 100
"""At most this many due deliveries go to the reader's ``redeliver`` at once."""
_WARN_FULL_EVERY = 5.0
_POSTPONE = 0.05
"""Seconds before a redelivery the reader put off is tried again."""
_CUT_SHOWN = 20
"""At most this many ids of deliveries cancelled by the shutdown in its log line."""


class _Status:
    """Wraps a task status to remember whether ``started()`` was called."""

    def __init__(self, inner: TaskStatus[None]) -> None:
        self.inner = inner
        self.done = False

    def started(self, value: None = None) -> None:
        self.done = True
        self.inner.started()


class Mount:
    """One subscription mounted on a consumer (internal; see ``Consumer.mount``)."""

    def __init__(
        self,
        consumer: ConsumerInfo,
        client: Client,
        scheduler: Scheduler,
        subscription: Subscription,
        handler: Handler | BatchHandler,
        reader: Reader,
        target: Target,
        *,
        concurrency: int,
        on_error: Outcome | Backoff,
        batch: bool = False,
        takeover: bool = False,
    ) -> None:
        self.consumer = consumer
        self.takeover = takeover
        self.client = client
        self.scheduler = scheduler
        self.subscription = subscription
        self.handler = handler
        self.reader = reader
        self.target = target
        self.concurrency = concurrency
        self.on_error = on_error
        self.batch = batch
        self.name = target.name
        self.stats = MountStats(subscription=self.name)
        # what a handler error becomes: a Backoff where the form can leave the
        # delivery pending, else (simple lists, Pub/Sub) a logged DROP
        no_ack = target.form in (Form.LIST, Form.CHANNEL, Form.PATTERN)
        self._on_error: Outcome | Backoff = on_error
        if isinstance(on_error, Backoff):
            self._on_error_text = f"{on_error!r}: it stays pending and is delivered again later"
            if no_ack:
                self._on_error = DROP
                self._on_error_text = (f"dropped ({on_error!r}: a {target.form.value} has nothing "
                                       "to leave pending)")
        else:
            self._on_error_text = f"outcome {on_error!r}"
        again = self._on_error
        self._warn_repeats = target.max_attempts is None and (
            isinstance(again, Backoff) or again.is_retry)
        # Backoff: failed deliveries waiting to be delivered again (due, seq, delivery)
        hooks = reader.pending
        # (whatever on_error is: a finalization Redis refused waits here too)
        self._redeliver: Callable[[Mount, list[Delivery]], Awaitable[list[Delivery]]] | None = (
            hooks.redeliver if hooks is not None else None)
        self._backs_off = hooks is not None and isinstance(self._on_error, Backoff)
        self._leave: Callable[[Mount, list[Delivery]], None] | None = (
            hooks.leave_pending if hooks is not None else None)
        self._waiting: list[tuple[float, int, Delivery]] = []
        self._waiting_seq = itertools.count()
        self._waiting_wake = anyio.Event()
        self._full_warned_at = -math.inf
        self._full_count = 0
        # instrumentation (trio_redis_finalize.otel): learns the mount, watches finalization
        bind = getattr(handler, "trf_bind", None)
        self.settled: Callable[[list[tuple[Delivery, str]]], None] | None = bind(self) if bind else None
        self.in_hand: set[str] = set()  # stream ids read and not yet finalized
        self._ids = target.form is Form.STREAM
        gates = reader.gates  # a reliable list's: its delayed copies numbered when sent
        self.later_gates = gates if isinstance(gates, LaterGates) else None
        self.finalizer = Finalizer(
            name=self.name, target=target, client=client, stats=self.stats, in_hand=self.in_hand,
            scheduler=scheduler, owner=self, wait_out=self._wait_out,
            gates=reader.gates, settled=self.settled,
            refused=self._refused if hooks is not None else None,
            schedule=self._schedule if self._backs_off else None,
        )
        self.stopping = False
        self.cut: list[Delivery] = []
        """Deliveries whose handler call the shutdown's grace deadline cancelled
        (they stay pending on streams and reliable lists; logged)."""
        self.reading = False  # mount() returned: the reader set itself up
        self.done = anyio.Event()
        self._reader_scope = anyio.CancelScope()
        self._handlers_scope = anyio.CancelScope()
        # shielded once the mount is reading (shutdown is stop()'s); not before:
        # mount() honours its caller's cancellation during set-up
        self._outer_scope = anyio.CancelScope()
        self._flusher_idle = True
        self._flusher_wake = anyio.Event()
        self._queue = WorkQueue()
        # per-minute counts in Redis for the dashboard, written beside the reader (_history)
        self._history = History.of(target.form, target.source, target.group, self.stats)
        self._history_scope = anyio.CancelScope()
        osend, orecv = anyio.create_memory_object_stream[list[Item]](max(4, 2 * concurrency))
        self._outcome_send: Send[list[Item]] = osend
        self._outcome_recv: Recv[list[Item]] = orecv

    # -- reader side --------------------------------------------------------
    async def deliver(self, ready: Sequence[Delivery], direct: Sequence[Item] = (), *,
                      give_back: bool = False) -> None:
        """The one hand-over of what a reader read: ``direct`` (deliveries
        finalized without a handler, each with its precomputed plan: dead
        letter, lost or foreign entry) to the finalizer first, then ``ready``
        to the handlers, all or nothing (waits while they are busy; cancelled
        meanwhile, none of ``ready`` reached a handler).

        ``give_back``: should the hand-over end early (the shutdown cancels
        the reader), what it did not hand over goes to the finalizer at once,
        shielded (:meth:`_give_back`): ``direct``'s plans if not sent yet, and
        ``ready`` with the reader's ``abandon`` plan -- the shutdown's own
        give-back (phase 3, ``_shutdown``): so its NOT_RUN retries, a reliable
        list's counted gates and its error logs apply.  The exception goes on.
        """
        sent = not direct
        try:
            if direct:
                await self._reader_outcomes.send(list(direct))
                sent = True
            if ready:
                self.stats.received += len(ready)
                if self._ids:  # stream entries (other forms have no id: nothing held by id)
                    self.in_hand.update([d.id for d in ready])  # type: ignore[misc]  # it has its id
                # all or nothing: cancelled while waiting, nothing was handed over
                await self._queue.put(ready)
        except BaseException:
            if give_back:
                await self._give_back(self._reader_outcomes, ready, () if sent else direct)
            raise

    async def send_plans(self, items: list[Item]) -> None:
        """Send precomputed plans (dead letter, lost entry) to the finalizer."""
        if items:
            await self._reader_outcomes.send(items)

    async def _give_back(self, send: Send[list[Item]], unstarted: Sequence[Delivery],
                         direct: Sequence[Item] = ()) -> None:
        """Give back deliveries read and never started (the reader's ``abandon``
        plan: stream, delivery counts set back; reliable list, back to the
        queue; simple list, ``RPUSH`` back; Pub/Sub, logged and gone), with
        ``direct``'s plans not sent yet: handed to the finalizer on ``send``,
        shielded, within ``FINALIZE_GRACE``; should that fail (the finalizer
        gone) they stay where they are (pending; a simple list's are lost), logged."""
        items = list(direct)
        plan = self.reader.abandon(unstarted) if unstarted else None
        if plan is not None:
            items.append((unstarted[0], plan))
        if not items:
            return
        with cleanup(FINALIZE_GRACE) as scope:
            try:
                await send.send(items)
                return
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        log.error("%s: could not give back %d deliveries read and not handled%s", self.name,
                  len(unstarted) + len(direct),
                  f" within {FINALIZE_GRACE:g} s" if scope.cancelled_caught else "",
                  extra={"subscription": self.name})

    @property
    def waiting(self) -> int:
        """How many failed deliveries wait for their :class:`Backoff` delay now."""
        return len(self._waiting)

    def handling(self) -> bool:
        """Whether a stream entry read is in hand: neither finalized nor waiting
        for its backoff (waiting entries are held too)."""
        return len(self.in_hand) > len(self._waiting)

    def backing_off(self) -> list[Delivery]:
        """The deliveries waiting for their Backoff (see ``Context.backing_off``)."""
        return [d for _, _, d in self._waiting]

    def disown(self, others: dict[str, str]) -> list[Delivery]:
        """Stream entries this consumer no longer owns (its lease found them pending
        for another consumer; id -> that consumer): those no handler started are
        taken out of the work queue, never started (returned), and those waiting
        for a Backoff stop waiting; all leave the lease (``in_hand``) whatever
        their state (one being handled finishes; its finalization finds its
        gate as the other consumer left it)."""
        dropped = self._queue.remove(set(others))
        self.in_hand.difference_update(others)
        waiting = self._waiting
        if any(d.id in others for _, _, d in waiting):  # waiting for a Backoff: theirs now
            waiting[:] = [w for w in waiting if w[2].id not in others]  # in place: the redeliverer's
            heapq.heapify(waiting)
        return dropped

    # -- backoff ------------------------------------------------------------------
    def _park(self, d: Delivery, delay: float) -> None:
        waiting = self._waiting
        heapq.heappush(waiting, (anyio.current_time() + delay, next(self._waiting_seq), d))
        if waiting[0][2] is d:  # the next due: the redeliverer's timer changes
            self._waiting_wake.set()

    def _wait_out(self, d: Delivery, b: Backoff) -> float | None:
        """A failed delivery under ``on_error=Backoff`` before its last attempt
        (the finalizer's core dead-letters that one): it waits for its delay
        (returned: the finalizer has it written to Redis, :meth:`_schedule`),
        or, with no room, is left pending for the ordinary recovery (None)."""
        stats = self.stats
        extra = log_extra(self.name, d, b)
        delay: float | None = None
        if self._redeliver is None or len(self._waiting) >= MAX_WAITING:
            # no room (memory): pending all the same, for the ordinary recovery
            if self._leave is not None:
                self._leave(self, [d])
            stats.effects[Effect.LEFT_PENDING.value] += 1
            self._full_count += 1
            now = anyio.current_time()
            if now - self._full_warned_at >= _WARN_FULL_EVERY:
                log.warning("%s: %d failed deliveries already wait for their backoff "
                            "(MAX_WAITING=%d); %d more left pending for the ordinary recovery "
                            "(latest: %s, attempt %d)", self.name, len(self._waiting),
                            MAX_WAITING, self._full_count, d.id or d.origin_id, d.attempt,
                            extra=extra)
                self._full_warned_at = now
                self._full_count = 0
            effect = Effect.LEFT_PENDING.value
        else:
            delay = b.delay(d.attempt, self.target.max_attempts)
            self._park(d, delay)
            stats.effects["backed_off"] += 1
            effect = "backed_off"
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s: %s (attempt %d) backs off: delivered again in %.3f s", self.name,
                          d.id or d.origin_id, d.attempt, delay, extra={**extra, "effect": effect})
        if self.settled is not None:
            self.settled([(d, effect)])
        return delay

    async def _schedule(self, waits: list[tuple[Delivery, float]]) -> None:
        """Write the due times of deliveries that started waiting for their
        Backoff to Redis (``_core._recovery.SCHEDULE``): a restart meanwhile
        lets them wait out the rest.  Shielded and bounded (a graceful stop
        keeps it); should it fail, a restart before they are due delivers
        them at once, as before (logged)."""
        cmd = schedule_command(self.target, waits)
        if cmd is None:
            return
        with cleanup(CLOSING_TIMEOUT):
            try:
                await self.client.pipeline([cmd], timeout=CLOSING_TIMEOUT)
            except (rexc.RedisError, OSError) as e:
                log.warning("%s: writing the Backoff due times of %d deliveries to %r failed (%s); "
                            "a restart before they are due delivers them at once", self.name,
                            len(waits), schedule_key(self.target), e,
                            extra={"subscription": self.name})

    def _refused(self, deliveries: list[Delivery]) -> None:
        """Deliveries whose finalization Redis refused for good (they stay
        pending): held again and delivered again, as their next attempt,
        ``_core._recovery.refused_delay`` seconds later (1 s at attempt 1,
        doubling, at most 30 s); with no room (:data:`MAX_WAITING`) left to the
        ordinary recovery."""
        hooks = self.reader.pending
        if hooks is None or self._redeliver is None:
            return
        for d in deliveries:
            if len(self._waiting) >= MAX_WAITING:
                return
            hooks.hold_again(self, d)
            delay = refused_delay(d.attempt)
            self._park(d, delay)
            log.warning("%s: %s (attempt %d): its finalization was refused; delivered again in "
                        "%.1f s", self.name, d.id or d.origin_id, d.attempt, delay,
                        extra=log_extra(self.name, d, None, "failed"))

    def defer(self, d: Delivery, delay: float) -> bool:
        """A delivery recovered (a restart, a claim) whose Backoff due time is
        ``delay`` seconds ahead: it waits (held) and is then delivered again as
        its next attempt; False when it cannot wait here (on_error is not a
        Backoff now, or no room): the caller delivers it now."""
        if not self._backs_off or self._redeliver is None or len(self._waiting) >= MAX_WAITING:
            return False
        if d.id is not None:
            self.in_hand.add(d.id)
        self._park(d, delay)
        return True

    async def _redeliverer(
        self, redeliver: Callable[[Mount, list[Delivery]], Awaitable[list[Delivery]]]
    ) -> None:
        """Hand due deliveries to the reader's ``redeliver``; runs beside the
        reader, cancelled with it (what still waits stays pending)."""
        waiting = self._waiting
        failures = 0
        while True:
            now = anyio.current_time()
            if not waiting or waiting[0][0] > now:
                wake = self._waiting_wake = anyio.Event()
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
                for d in await redeliver(self, batch):
                    self._park(d, _POSTPONE)  # not now (the reader's say), soon
                failures = 0
            except (rexc.RedisError, OSError) as e:
                # none was delivered: still pending (and held); wait again
                self.stats.read_errors += 1
                delay = backoff(failures, cap=5.0)
                failures += 1
                log.warning("%s: delivering %d failed deliveries again failed (%s); they stay "
                            "pending, trying again in %.2f s", self.name, len(batch), e, delay,
                            extra={"subscription": self.name})
                for d in batch:
                    self._park(d, delay)

    # -- lifecycle ----------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            with self._outer_scope:
                async with anyio.create_task_group() as tg:
                    self._reader_outcomes = self._outcome_send.clone()
                    handler_senders = [self._outcome_send.clone() for _ in range(self.concurrency)]
                    await self._outcome_send.aclose()
                    tg.start_soon(self.finalizer.run, self._outcome_recv)
                    tg.start_soon(self._handlers, handler_senders)
                    await tg.start(self._read)
                    self.reading = True
                    self._outer_scope.shield = True
                    task_status.started()
                    if self._history is not None:
                        tg.start_soon(self._record_history, self._history)
        finally:
            self.done.set()

    async def _read(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        status = _Status(task_status)
        try:
            async with self._reader_outcomes:
                with self._reader_scope:
                    if self._redeliver is None:
                        await drive(self.reader, self, task_status=status)
                    else:
                        # the redeliverer lives as long as the reader (cancelled with it)
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(self._redeliverer, self._redeliver)
                            await drive(self.reader, self, task_status=status)
        except BaseException:
            if not status.done:
                # mount() fails: let the handlers and finalizer end too
                self._handlers_scope.cancel()
                self.finalizer.scope.cancel()
            raise
        finally:
            self._queue.close()
            self._history_scope.cancel()  # the history lives as long as the reader

    async def _record_history(self, history: History) -> None:
        with self._history_scope:
            await history.run(self.client)

    async def stop(self, budget: Budget) -> None:
        """Phases 1 to 4 of the shutdown (``_shutdown``); returns when the
        mount's tasks have all ended."""
        self.stopping = True
        self._reader_scope.cancel()  # 1: stop reading (and redelivering)
        self._handlers_scope.deadline = budget.handlers  # 2, then 3 (the give-back)
        self.finalizer.scope.deadline = budget.finalizer  # 4: to the end of its stream
        self._outer_scope.deadline = budget.mounts  # whatever still runs then is cancelled
        with cleanup_until(budget.mounts + CLOSE_MARGIN):
            await self.done.wait()

    async def deregister(self) -> None:
        """Phase 6 of the shutdown (``_shutdown``): the reader's ``closed`` step
        (a stream's or reliable list's consumer deregisters when nothing is
        left pending for it), shielded, within ``CLOSING_TIMEOUT``, asked
        again while the server refuses it for now."""
        if not self.reading:
            return
        with cleanup(CLOSING_TIMEOUT):
            try:
                # asked again while the server says it did not run it (OOM, BUSY ...)
                await retry_not_run(self, partial(self.reader.closed, self),
                                    deadline=anyio.current_time() + CLOSING_TIMEOUT,
                                    what="deregistering")
            except (rexc.RedisError, OSError) as e:
                log.warning("%s: deregistering consumer %r failed (%s); its heartbeat lapses "
                            "and a live consumer removes it", self.name, self.consumer.name, e,
                            extra={"subscription": self.name})

    # -- handlers -------------------------------------------------------------
    async def _handlers(self, senders: list[Send[list[Item]]]) -> None:
        try:
            with self._handlers_scope:
                async with anyio.create_task_group() as outer:
                    waiting: list[tuple[list[Item], Send[list[Item]]]] = []
                    outer.start_soon(self._flusher, waiting)
                    async with anyio.create_task_group() as tg:
                        loop = self._batch_loop if self.batch else self._handler_loop
                        for send in senders:
                            results: list[Item] = []
                            waiting.append((results, send))
                            tg.start_soon(loop, send, results)
                    outer.cancel_scope.cancel()  # every loop ended: so does the flusher
        finally:
            if self.cut:
                self._log_cut()
            # phase 3: stopped, or cancelled at the grace deadline: what no
            # handler started goes back (one cancelled mid-handler stays pending)
            await self._give_back(senders[0], self._queue.drain())
            with cleanup(FINALIZE_GRACE):
                for s in senders:
                    await s.aclose()

    def _log_cut(self) -> None:
        """Say which deliveries stay pending (or, at-most-once, are gone)
        because the shutdown cancelled their handler."""
        t = self.target
        cut = self.cut
        names = _shown([d.id or d.origin_id for d in cut])
        if t.form is Form.STREAM:
            fate = (f"entries {names}: left pending in the PEL of group {t.group!r} (consumer "
                    f"{self.consumer.name!r}), handed back at the stop (the group's live "
                    "consumers take them at once; this attempt counts)")
        elif t.form is Form.RELIABLE_LIST:
            fate = (f"elements {names} (origin ids): left in the processing list "
                    f"{t.processing!r}, handed back onto the queue at the stop (this attempt "
                    "counts)")
        else:
            fate = f"messages {names} (origin ids): gone (a {t.form.value} is at-most-once)"
        grace = self.consumer.shutdown_grace
        log.warning("%s: shutdown_grace (%g s) ended with %d handler(s) still running, "
                    "cancelled: %s", self.name, grace, len(cut), fate,
                    extra={"subscription": self.name, "cancelled": [d.id or d.origin_id for d in cut]})

    async def _handler_loop(self, send: Send[list[Item]], results: list[Item]) -> None:
        """Call the handler on one delivery after another; hand outcomes on in lists.

        ``results``: the outcomes not handed on yet.  The same list object all
        along (copied and cleared, never replaced): :meth:`_flusher` hands on
        what waits in it while this task runs a slow handler.
        """
        queue = self._queue
        handler: Handler = self.handler  # type: ignore[assignment]  # batch=False
        stats = self.stats
        items = queue.items
        popleft = items.popleft
        idle = queue.idle
        append = results.append
        # the handler-duration histogram, inline (Durations.observe: a call per delivery)
        durations = stats.durations
        counts = durations.counts
        first, slow, every = DURATION_BOUNDS[0], _SLOW_CALL, _FLUSH_EVERY
        # One clock read per delivery: a call starts when the previous one
        # ended (``now``), unless this task waited in between (then read again).
        now = monotonic()
        flush_by = now + every  # when what gathers in ``results`` is handed on at the latest
        outcome: Outcome | Backoff
        try:
            while not self.stopping:
                if not items:
                    if results:  # another task took the batch's last delivery
                        batch = results[:]
                        results.clear()
                        await send.send(batch)
                    if not await queue.wait():
                        return
                    now = monotonic()
                    flush_by = now + every
                    continue
                # A run of handler calls, one after the other without a wait in
                # between: in flight all along (only a scrape thread could see
                # the instants between two calls), not while it sends or waits.
                stats.in_flight += 1
                # the run's calls in the histogram's first bucket: added to it
                # when the run ends (a local per call), with the run's time
                # (each call starts when the one before ended: their sum)
                fast = 0
                began = now
                try:
                    while True:
                        d = popleft()  # queue.take(), inline
                        if items:
                            if idle and not queue.waking:
                                queue.wake_one()
                        elif queue.room is not None:
                            queue.emptied()
                        start = now
                        try:  # the handler call, inline: one coroutine less per delivery
                            outcome = await handler(d)
                        except Exception:
                            outcome = self._raised(d)
                        except BaseException as e:
                            if self._own_exit(e):
                                self.cut.append(d)  # cancelled mid-handler: logged by _handlers
                                raise
                            outcome = self._raised(d)  # e.g. asyncio.CancelledError of another task
                        else:
                            if outcome.__class__ is not Outcome:
                                if outcome.__class__ is WithWrites:
                                    outcome = self._checked(d, outcome)
                                elif not isinstance(outcome, Outcome):
                                    outcome = self._not_outcome(d, outcome)
                        append((d, outcome))
                        now = monotonic()
                        took = now - start
                        if took <= first:
                            fast += 1
                        else:
                            counts[bisect_left(DURATION_BOUNDS, took)] += 1
                        # Hand the outcomes on at the end of a batch (or once another
                        # task took the rest of it), after a slow handler call (the
                        # send costs little beside it), when the oldest has waited
                        # _FLUSH_EVERY, or at a stop; else gather more (and should
                        # the next call be slow, the flusher hands them on meanwhile).
                        if not items or took > slow or now > flush_by or self.stopping:
                            break
                        if self._flusher_idle:
                            self._flusher_idle = False
                            self._flusher_wake.set()
                finally:
                    stats.in_flight -= 1
                    counts[0] += fast
                    durations.sum += now - began
                if self.stopping:
                    break  # the outcomes are handed on below
                batch = results[:]
                results.clear()
                await send.send(batch)
                now = monotonic()
                flush_by = now + every
        finally:
            if results:
                batch = results[:]
                results.clear()
                with cleanup(FINALIZE_GRACE):
                    await send.send(batch)

    async def _batch_loop(self, send: Send[list[Item]], results: list[Item]) -> None:
        """``batch=True``: call the handler on every delivery waiting in the
        queue at once (one read's batch), hand their outcomes on in one list.

        ``results`` is unused (nothing gathers between calls: each call's
        outcomes go on when it returns); it keeps the flusher's bookkeeping
        the same for both loops.
        """
        queue = self._queue
        handler: Callable[[list[Delivery]], Awaitable[object]] = self.handler  # type: ignore[assignment]  # batch=True
        stats = self.stats
        items = queue.items
        durations = stats.durations
        counts = durations.counts
        while not self.stopping:
            if not items:
                if not await queue.wait():
                    return
                continue
            batch = list(items)  # queue.take() of all of them
            items.clear()
            queue.emptied()
            stats.in_flight += 1
            start = monotonic()
            try:
                try:
                    result = await handler(batch)
                except BaseException as e:  # an Exception, or one that is not this task's exit
                    if not isinstance(e, Exception) and self._own_exit(e):
                        self.cut.extend(batch)  # cancelled mid-call: logged by _handlers
                        raise
                    outcomes = self._batch_raised(batch)
                else:
                    outcomes = self._batch_outcomes(batch, result)
            finally:
                stats.in_flight -= 1
                took = monotonic() - start
                counts[bisect_left(DURATION_BOUNDS, took)] += 1
                durations.sum += took
            with cleanup(FINALIZE_GRACE):  # the call returned: its outcomes must go on
                await send.send(list(zip(batch, outcomes, strict=True)))

    def _batch_outcomes(self, batch: list[Delivery], result: object) -> list[Outcome | Backoff]:
        """A batch handler's return: one outcome for all, or one per delivery."""
        if isinstance(result, Outcome):
            if result.__class__ is WithWrites:
                if len(batch) > 1:
                    return self._batch_invalid(
                        batch, result, "one outcome carrying writes for a batch of "
                        f"{len(batch)} deliveries would commit its writes {len(batch)} times: "
                        "return one outcome per delivery")
                return [self._checked(batch[0], result)]
            return [result] * len(batch)
        if isinstance(result, (list, tuple)) and len(result) == len(batch):
            out: list[Outcome | Backoff] = []
            for d, o in zip(batch, result, strict=True):
                if o.__class__ is Outcome:
                    out.append(o)
                elif o.__class__ is WithWrites:
                    out.append(self._checked(d, o))
                else:
                    out.append(self._not_outcome(d, o))
            return out
        return self._batch_invalid(
            batch, result, f"a batch handler returns one Outcome, or a list or tuple of "
            f"{len(batch)} (one per delivery), not {_what(result)}")

    def _batch_raised(self, batch: list[Delivery]) -> list[Outcome | Backoff]:
        """The batch handler raised (called inside the ``except``): every
        delivery of the call failed; one log line for all."""
        exc = sys.exc_info()[1]
        if isinstance(exc, Rejected):
            return [self._rejected(d, exc) for d in batch]
        for d in batch:
            record_error(d, exc)  # for the dead-letter entries
        self._batch_failed(batch, "raised", exc)
        return [self._on_error] * len(batch)

    def _batch_invalid(self, batch: list[Delivery], result: object,
                       why: str) -> list[Outcome | Backoff]:
        self._batch_failed(batch, f"returned {_what(result)}", TypeError(why))
        return [self._on_error] * len(batch)

    def _batch_failed(self, batch: list[Delivery], what: str, exc: BaseException | None) -> None:
        self.stats.handler_errors += len(batch)
        fates: dict[str, list[str]] = {}
        for d in batch:
            fates.setdefault(self._error_text(d), []).append(
                f"{d.id or d.origin_id} (attempt {d.attempt})")
            if self._warn_repeats:
                self._keeps_failing(d)
        text = "; ".join(f"{_shown(ids)}: {fate}" for fate, ids in fates.items())
        if exc is not None and not any(map(self._traceback, batch)):  # one line in between
            what = f"{what} ({type(exc).__name__}: {exc})"
            exc = None
        log.error("%s: batch handler %s on %d deliveries: %s", self.name, what, len(batch), text,
                  exc_info=exc, extra={"subscription": self.name,
                                       "entry_ids": [d.id for d in batch],
                                       "origin_ids": [d.origin_id for d in batch],
                                       "attempts": [d.attempt for d in batch]})

    async def _flusher(self, waiting: list[tuple[list[Item], Send[list[Item]]]]) -> None:
        """Hand on outcomes that wait in a handler task's list while it runs a slow
        handler: an outcome reaches the finalizer within about ``_FLUSH_EVERY``
        of its handler returning, whatever the other handlers do.  Idle (no
        timer) while no outcome waits."""
        while True:
            if self._flusher_idle:
                await self._flusher_wake.wait()
            await anyio.sleep(_FLUSH_EVERY)
            found = False
            for results, send in waiting:
                if results:
                    found = True
                    batch = results[:]
                    results.clear()
                    # taken out of the list: must reach the finalizer
                    with cleanup(FINALIZE_GRACE):
                        await send.send(batch)
            if not found:
                self._flusher_wake = anyio.Event()
                self._flusher_idle = True

    def _own_exit(self, e: BaseException) -> bool:
        """Whether ``e``, raised by a handler, must end the handler task.

        KeyboardInterrupt, SystemExit, GeneratorExit, and a cancellation of
        this task's own (shutdown, an outer cancel scope) do; anything else
        -- an ``asyncio.CancelledError`` of a task the handler awaited, any
        other ``BaseException`` -- is a handler error like an exception.
        """
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            return True
        # a cancelled scope around this task: the effective deadline is -inf
        return anyio.current_effective_deadline() == -math.inf

    def _traceback(self, d: Delivery) -> bool:
        """Whether a failure of ``d`` is logged with its full traceback: at its
        first attempt and at its last (``max_attempts``, or an ``on_error``
        that does not try again); one line in between."""
        again = self._on_error
        if d.attempt <= 1 or not (isinstance(again, Backoff) or again.is_retry):
            return True
        m = self.target.max_attempts
        return m is not None and d.attempt >= m

    def _rejected(self, d: Delivery, exc: Rejected) -> Outcome:
        """The handler raised :class:`Rejected`: the outcome ``reject(reason)``."""
        log.warning("%s: handler rejected %s (attempt %d): %s", self.name, d.id or d.origin_id,
                    d.attempt, exc, extra=log_extra(self.name, d, REJECT))
        return reject(str(exc))

    def _raised(self, d: Delivery) -> Outcome | Backoff:
        """The handler raised (called inside the ``except``): count, log, ``on_error``."""
        exc = sys.exc_info()[1]
        if isinstance(exc, Rejected):
            return self._rejected(d, exc)
        self.stats.handler_errors += 1
        record_error(d, exc)  # for the dead-letter entry
        if self._traceback(d):
            log.error(
                "%s: handler raised on %s (attempt %d); %s%s",
                self.name, d.id or d.origin_id, d.attempt, self._error_text(d), backend_hint(exc),
                exc_info=exc, extra=log_extra(self.name, d, self._on_error),
            )
        else:  # between the first and the last attempt: one line
            log.error(
                "%s: handler raised on %s (attempt %d): %s: %s; %s (traceback logged at the "
                "first and the last attempt)",
                self.name, d.id or d.origin_id, d.attempt, type(exc).__name__, exc,
                self._error_text(d), extra=log_extra(self.name, d, self._on_error),
            )
        if self._warn_repeats:
            self._keeps_failing(d)
        return self._on_error

    def _checked(self, d: Delivery, outcome: Outcome) -> Outcome | Backoff:
        """An outcome with writes this subscription cannot commit (a key in
        another Cluster slot, a form without a gate ...) is a handler error:
        its ``ValueError`` is logged and ``on_error`` applies."""
        try:
            check_outcome(self.target, d, outcome)
        except ValueError:
            return self._raised(d)
        return outcome

    def _not_outcome(self, d: Delivery, result: object) -> Outcome | Backoff:
        """The handler returned something that is not an outcome: count, log, ``on_error``."""
        self.stats.handler_errors += 1
        log.error(
            "%s: handler returned %r, not an Outcome, for %s (attempt %d); %s",
            self.name, result, d.id or d.origin_id, d.attempt, self._error_text(d),
            exc_info=TypeError(f"handler returned {type(result).__name__}, not an Outcome"),
            extra=log_extra(self.name, d, self._on_error),
        )
        if self._warn_repeats:
            self._keeps_failing(d)
        return self._on_error

    def _error_text(self, d: Delivery) -> str:
        """What becomes of ``d`` after its handler failed, for the log line: at
        the last attempt a Backoff or a retry outcome dead-letters (or drops)
        it, as the finalizer's core decides (``_core._finalize``, ``plan``)."""
        t = self.target
        again = self._on_error
        if (t.max_attempts is None or d.attempt < t.max_attempts
                or not (isinstance(again, Backoff) or again.is_retry)):
            return self._on_error_text
        reached = f"max_attempts={t.max_attempts} reached"
        if t.dead_letter is not None and t.form in (Form.STREAM, Form.RELIABLE_LIST):
            return f"{reached}: dead-lettered to {t.dead_letter!r}"
        return f"{reached}: dropped (no dead_letter)"

    def _keeps_failing(self, d: Delivery) -> None:
        """Without ``max_attempts`` nothing ends a delivery that always fails:
        say so at attempts 10, 100, 1000, ..."""
        digits = str(d.attempt)
        if len(digits) < 2 or digits[0] != "1" or digits.count("0") != len(digits) - 1:
            return
        log.warning(
            "%s: %s (origin %s) failed again at attempt %d and will be delivered again; "
            "no max_attempts is set, so nothing ends it: set max_attempts= (and dead_letter=)",
            self.name, d.id or d.origin_id, d.origin_id, d.attempt,
            extra=log_extra(self.name, d, self._on_error),
        )



def backend_hint(exc: BaseException | None) -> str:
    """For an asyncio-only handler under trio ("no running event loop"): how to
    run it under asyncio; else ""."""
    if not isinstance(exc, RuntimeError) or "no running event loop" not in str(exc):
        return ""
    try:
        import sniffio  # anyio's dependency; only on this error

        if sniffio.current_async_library() != "trio":
            return ""
    except Exception:  # no library detected: say nothing
        return ""
    return ("; the handler needs asyncio but runs under trio: run the consumer under asyncio "
            "(trio-redis-finalize run ... --backend asyncio, or anyio.run(main, "
            "backend='asyncio'))")


def _what(result: object) -> str:
    """A handler's wrong return, named for its log line."""
    if isinstance(result, (list, tuple)):
        return f"a {type(result).__name__} of {len(result)}"
    return repr(result) if result is None else f"a {type(result).__name__}"


def _shown(ids: list[str]) -> str:
    """At most ``_CUT_SHOWN`` of ``ids``, and how many more."""
    more = len(ids) - _CUT_SHOWN
    return ", ".join(ids[:_CUT_SHOWN]) + (f" and {more} more" if more > 0 else "")
