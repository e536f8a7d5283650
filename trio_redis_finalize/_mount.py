"""The runtime of one mounted subscription: reader -> handlers -> finalizer.

::

    reader task --(batches)--> work queue --(one delivery at a time)--> N handler tasks
         |                                                                    |
         |                                                        (lists of outcomes)
         |                                                                    v
         +------------(precomputed plans: dead, lost)-----------------> finalizer task

Everything in between is bounded.  The work queue (:class:`_WorkQueue`) takes
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
this consumer (``Mount.held``, the reader's counts), so no lease lapses,
no other consumer claims it and no own-PEL re-read or rescan delivers it
early.  It waits in the mount's waiting set (a heap by due time, at most
:data:`MAX_WAITING` deliveries) for ``Backoff.delay(attempt)`` seconds; a
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

Shutdown (:meth:`Mount.stop`): cancel the reader (and with it the
redeliverer: what waits for its backoff stays pending, no timer is waited
for); handlers finish what they hold within ``shutdown_grace`` and start
nothing new; the finalizer sends every outcome it was given (shielded,
time-bounded), then the mount ends.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from time import monotonic
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream as Recv
from anyio.streams.memory import MemoryObjectSendStream as Send
from redis import exceptions as rexc

from ._delivery import Delivery, record_error
from ._errors import AckUnsupported
from ._outcome import DROP, Backoff, Outcome, OutcomeKind
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
)
from ._stats import MountStats
from ._subscription import Form, Subscription
from ._transport import FINAL, NOT_RUN, Client, Command, classify

if TYPE_CHECKING:
    from ._consumer import Consumer

__all__ = ["MAX_WAITING", "Handler", "Item", "Mount", "Reader", "backoff"]

log = logging.getLogger("trio_redis_finalize")

Handler = Callable[[Delivery], Awaitable[Outcome]]
Item = tuple[Delivery, "Outcome | Plan | Backoff"]

FINALIZE_TIMEOUT = 5.0
"""Seconds one finalization round trip may take before it counts as failed."""
FINALIZE_GRACE = 10.0
"""Seconds the finalizer keeps trying after the handlers stopped, at shutdown."""
SETUP_PATIENCE = 15.0
"""Seconds ``mount()`` keeps trying a set-up the server refused for now (OOM, BUSY, LOADING ...)."""
_FLUSH_EVERY = 0.05
_SLOW_CALL = 0.0005
"""Seconds of a handler call after which its outcome is sent on at once."""
_MAX_BATCH = 1000
MAX_WAITING = 10_000
"""Failed deliveries that wait for their :class:`Backoff` delay, per mount, at
most (memory); past it a failed delivery is left pending for the ordinary
recovery instead (see the readers' ``leave_pending``)."""
_REDELIVER_BATCH = 100
"""At most this many due deliveries go to the reader's ``redeliver`` at once."""
_WARN_FULL_EVERY = 5.0
_POSTPONE = 0.05
"""Seconds before a redelivery the reader put off is tried again."""


def backoff(attempt: int, *, base: float = 0.05, cap: float = 2.0) -> float:
    """Capped exponential backoff with full jitter."""
    return float(random.uniform(0, min(cap, base * 2 ** min(attempt, 16))))


class Reader(Protocol):
    """What a subscription form provides: the loop that reads and delivers.

    Forms that leave failed deliveries pending (streams, reliable lists)
    also offer, looked up with ``getattr``: ``redeliver(mount, deliveries)``
    (take due :class:`Backoff` deliveries again as their next attempt and
    deliver them; returns those to try again a moment later; raises having
    delivered none, when it could not), and
    ``leave_pending(mount, deliveries)`` (forget them: they stay pending for
    the ordinary recovery).
    """

    async def run(self, mount: Mount, *, task_status: TaskStatus[None]) -> None: ...

    def abandon(self, deliveries: Sequence[Delivery]) -> Plan | None:
        """Commands that give back deliveries read but never started (or None)."""
        ...


class _Status:
    """Wraps a task status to remember whether ``started()`` was called."""

    def __init__(self, inner: TaskStatus[None]) -> None:
        self.inner = inner
        self.done = False

    def started(self, value: None = None) -> None:
        self.done = True
        self.inner.started()


class _WorkQueue:
    """Deliveries read and not yet taken by a handler task (work sharing).

    :meth:`put` waits until the queue is empty, then adds a whole batch at once,
    so a cancelled ``put`` hands over nothing (producers -- the reader, the
    redeliverer -- share one wake-up, each waits its turn).  Handler tasks :meth:`take`
    one delivery at a time.  A task that takes one while more wait wakes one
    idle task, unless one is already woken and has not run yet: slow
    deliveries spread over the tasks one by one (none idles behind another's
    slow delivery), and a handler that never blocks drains a whole batch in
    one task, with a single other task woken in vain.
    """

    __slots__ = ("_idle", "_room", "_waking", "closed", "items")

    def __init__(self) -> None:
        self.items: deque[Delivery] = deque()
        self._idle: deque[anyio.Event] = deque()  # handler tasks waiting for work
        self._waking = 0  # of those, woken and not yet running
        self._room: anyio.Event | None = None  # producers waiting for the queue to empty
        self.closed = False

    async def put(self, deliveries: Sequence[Delivery]) -> None:
        while self.items:
            room = self._room
            if room is None:
                room = self._room = anyio.Event()
            await room.wait()
        self.items.extend(deliveries)
        self._wake_one()

    def take(self) -> Delivery | None:
        """The next delivery, or None when there is none now."""
        items = self.items
        if not items:
            return None
        d = items.popleft()
        if items:
            self._wake_one()
        elif self._room is not None:
            self._room.set()
            self._room = None
        return d

    async def wait(self) -> bool:
        """Wait for work: True when there is some, False once closed and empty."""
        while not self.items:
            if self.closed:
                return False
            ev = anyio.Event()
            self._idle.append(ev)
            try:
                await ev.wait()
            except BaseException:
                if ev.is_set():
                    self._waking -= 1
                    self._wake_one()  # pass on the wake-up this task will not use
                else:
                    self._idle.remove(ev)
                raise
            self._waking -= 1
        return True

    def _wake_one(self) -> None:
        if self._idle and not self._waking:
            self._waking += 1
            self._idle.popleft().set()

    def close(self) -> None:
        """No more puts: wake every idle task (each ends once the queue is empty)."""
        self.closed = True
        while self._idle:
            self._waking += 1
            self._idle.popleft().set()

    def drain(self) -> list[Delivery]:
        """Take out every delivery no handler started."""
        items = list(self.items)
        self.items.clear()
        if self._room is not None:
            self._room.set()
            self._room = None
        return items


class Mount:
    """One subscription mounted on a consumer (internal; see ``Consumer.mount``)."""

    def __init__(
        self,
        consumer: Consumer,
        subscription: Subscription,
        handler: Handler,
        reader: Reader,
        target: Target,
        *,
        concurrency: int,
        on_error: Outcome | Backoff,
    ) -> None:
        self.consumer = consumer
        self.client: Client = consumer.client
        self.subscription = subscription
        self.handler = handler
        self.reader = reader
        self.target = target
        self.concurrency = concurrency
        self.on_error = on_error
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
        self._redeliver: Callable[[Mount, list[Delivery]], Awaitable[list[Delivery]]] | None = (
            getattr(reader, "redeliver", None) if isinstance(self._on_error, Backoff) else None)
        self._leave: Callable[[Mount, list[Delivery]], None] | None = getattr(
            reader, "leave_pending", None)
        self._waiting: list[tuple[float, int, Delivery]] = []
        self._waiting_seq = itertools.count()
        self._waiting_wake = anyio.Event()
        self._full_warned_at = -math.inf
        self._full_count = 0
        # instrumentation (trio_redis_finalize.otel): learns the mount, watches finalization
        bind = getattr(handler, "trf_bind", None)
        self.settled: Callable[[list[tuple[Delivery, str]]], None] | None = bind(self) if bind else None
        self._removals = plain_removals(target)
        self._removal_kinds = tuple(self._removals)
        # reliable lists: identical elements' removals get their count (_plan.list_counted)
        self._prepare = getattr(reader, "prepare", None)
        self._settle = getattr(reader, "settle", None)
        self._resend = getattr(reader, "resend", None)
        self.held: set[str] = set()  # stream ids read and not yet finalized
        self.stopping = False
        self._cut_warned = False  # claiming: a retry_after longer than min_idle was logged
        self.done = anyio.Event()
        self._reader_scope = anyio.CancelScope()
        self._handlers_scope = anyio.CancelScope()
        self._finalizer_scope = anyio.CancelScope()
        # shielded once the mount is reading (shutdown is stop()'s); not before:
        # mount() honours its caller's cancellation during set-up
        self._outer_scope = anyio.CancelScope()
        self._flusher_idle = True
        self._flusher_wake = anyio.Event()
        self._queue = _WorkQueue()
        osend, orecv = anyio.create_memory_object_stream[list[Item]](max(4, 2 * concurrency))
        self._outcome_send: Send[list[Item]] = osend
        self._outcome_recv: Recv[list[Item]] = orecv

    # -- reader side --------------------------------------------------------
    async def deliver(self, deliveries: Sequence[Delivery]) -> None:
        """Hand deliveries to the handlers (waits while they are busy)."""
        if not deliveries:
            return
        self.stats.received += len(deliveries)
        self.held.update([d.id for d in deliveries if d.id is not None])
        # all or nothing: cancelled while waiting, nothing was handed over
        await self._queue.put(deliveries)

    async def finalize_now(self, items: list[Item]) -> None:
        """Send precomputed plans (dead letter, lost entry) to the finalizer."""
        if items:
            await self._reader_outcomes.send(items)

    @property
    def waiting(self) -> int:
        """How many failed deliveries wait for their :class:`Backoff` delay now."""
        return len(self._waiting)

    def handling(self) -> bool:
        """Whether a stream entry read is in hand: neither finalized nor waiting
        for its backoff (waiting entries are held too)."""
        return len(self.held) > len(self._waiting)

    # -- backoff ------------------------------------------------------------------
    def _park(self, d: Delivery, delay: float) -> None:
        waiting = self._waiting
        heapq.heappush(waiting, (anyio.current_time() + delay, next(self._waiting_seq), d))
        if waiting[0][2] is d:  # the next due: the redeliverer's timer changes
            self._waiting_wake.set()

    def _back_off(self, d: Delivery, b: Backoff) -> Plan | None:
        """A failed delivery under ``on_error=Backoff``: wait, or the dead letter at the end."""
        stats = self.stats
        stats.outcomes["backoff"] += 1
        t = self.target
        if t.max_attempts is not None and d.attempt >= t.max_attempts:
            # as a RETRY at the last attempt: dead letter (copy, then remove) or drop
            return plan_dead(t, d, f"max_attempts={t.max_attempts} reached at attempt {d.attempt}")
        extra = log_extra(self.name, d, b)
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
            delay = b.delay(d.attempt)
            self._park(d, delay)
            stats.effects["backed_off"] += 1
            effect = "backed_off"
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s: %s (attempt %d) backs off: delivered again in %.3f s", self.name,
                          d.id or d.origin_id, d.attempt, delay, extra={**extra, "effect": effect})
        if self.settled is not None:
            self.settled([(d, effect)])
        return None

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
                    tg.start_soon(self._finalizer, self._outcome_recv)
                    tg.start_soon(self._handlers, handler_senders)
                    await tg.start(self._read)
                    self._outer_scope.shield = True
                    task_status.started()
        finally:
            self.done.set()

    async def _read(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        status = _Status(task_status)
        try:
            async with self._reader_outcomes:
                with self._reader_scope:
                    deadline = anyio.current_time() + SETUP_PATIENCE
                    failures = 0
                    while True:
                        try:
                            if self._redeliver is None:
                                await self.reader.run(self, task_status=status)
                            else:
                                # the redeliverer lives as long as the reader (cancelled with it)
                                async with anyio.create_task_group() as tg:
                                    tg.start_soon(self._redeliverer, self._redeliver)
                                    await self.reader.run(self, task_status=status)
                                    tg.cancel_scope.cancel()
                            return
                        except BaseException as e:
                            # The set-up (type checks, group, first reads) got a
                            # reply saying it did not run (OOM, BUSY, LOADING ...):
                            # the server is there but cannot serve now.  Try again
                            # for a while, then let mount() fail with the error.
                            err = _sole(e)
                            if (status.done or not isinstance(err, rexc.RedisError)
                                    or classify(err) is not NOT_RUN
                                    or anyio.current_time() >= deadline):
                                raise
                        self.stats.read_errors += 1
                        delay = min(backoff(failures, cap=1.0), max(0.0, deadline - anyio.current_time()))
                        failures += 1
                        log.warning("%s: set-up refused by the server for now (%s); trying again "
                                    "in %.2f s", self.name, err, delay, extra={"subscription": self.name})
                        await anyio.sleep(delay)
        except BaseException:
            if not status.done:
                # mount() fails: let the handlers and finalizer end too
                self._handlers_scope.cancel()
                self._finalizer_scope.cancel()
            raise
        finally:
            self._queue.close()

    async def stop(self, grace: float) -> None:
        """Graceful stop; returns when the mount's tasks have all ended."""
        self.stopping = True
        self._reader_scope.cancel()
        self._handlers_scope.deadline = anyio.current_time() + grace
        self._finalizer_scope.deadline = anyio.current_time() + grace + FINALIZE_GRACE
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(grace + FINALIZE_GRACE + 1.0):
                await self.done.wait()
            self._outer_scope.cancel()
            await self.done.wait()

    # -- handlers -------------------------------------------------------------
    async def _handlers(self, senders: list[Send[list[Item]]]) -> None:
        try:
            with self._handlers_scope:
                async with anyio.create_task_group() as outer:
                    waiting: list[tuple[list[Item], Send[list[Item]]]] = []
                    outer.start_soon(self._flusher, waiting)
                    async with anyio.create_task_group() as tg:
                        for send in senders:
                            results: list[Item] = []
                            waiting.append((results, send))
                            tg.start_soon(self._handler_loop, send, results)
                    outer.cancel_scope.cancel()  # every loop ended: so does the flusher
        finally:
            # stopped, or cancelled at the grace deadline: what no handler
            # started goes back (one cancelled mid-handler stays pending)
            with anyio.CancelScope(shield=True):
                unstarted = self._queue.drain()
                give_back = self.reader.abandon(unstarted) if unstarted else None
                if give_back is not None:
                    with anyio.move_on_after(FINALIZE_GRACE):
                        await senders[0].send([(unstarted[0], give_back)])
                for s in senders:
                    await s.aclose()

    async def _handler_loop(self, send: Send[list[Item]], results: list[Item]) -> None:
        """Call the handler on one delivery after another; hand outcomes on in lists.

        ``results``: the outcomes not handed on yet.  The same list object all
        along (copied and cleared, never replaced): :meth:`_flusher` hands on
        what waits in it while this task runs a slow handler.
        """
        queue = self._queue
        handler = self.handler
        stats = self.stats
        items = queue.items
        last_flush = monotonic()
        outcome: Outcome | Backoff
        try:
            while not self.stopping:
                d = queue.take()
                if d is None:
                    if results:  # another task took the batch's last delivery
                        batch = results[:]
                        results.clear()
                        await send.send(batch)
                    if not await queue.wait():
                        return
                    last_flush = monotonic()
                    continue
                last = not items  # the last delivery of a batch
                stats.in_flight += 1
                start = monotonic()
                try:  # what _call does, inlined: one coroutine less per delivery
                    outcome = await handler(d)
                except Exception:
                    outcome = self._raised(d)
                except BaseException as e:
                    if self._own_exit(e):
                        raise
                    outcome = self._raised(d)  # e.g. asyncio.CancelledError of another task
                else:
                    if outcome.__class__ is not Outcome and not isinstance(outcome, Outcome):
                        outcome = self._not_outcome(d, outcome)
                finally:
                    stats.in_flight -= 1
                results.append((d, outcome))
                # Hand the outcomes on at the end of a batch, after a slow
                # handler call (the send costs little beside it), or when the
                # oldest has waited _FLUSH_EVERY; else gather more (and should
                # the next call be slow, the flusher hands them on meanwhile).
                now = monotonic()
                stats.durations.observe(now - start)
                if last or now - start > _SLOW_CALL or now - last_flush > _FLUSH_EVERY:
                    batch = results[:]
                    results.clear()
                    await send.send(batch)
                    last_flush = now
                elif self._flusher_idle:
                    self._flusher_idle = False
                    self._flusher_wake.set()
        finally:
            if results:
                batch = results[:]
                results.clear()
                with anyio.CancelScope(shield=True), anyio.move_on_after(FINALIZE_GRACE):
                    await send.send(batch)

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
                    with anyio.CancelScope(shield=True), anyio.move_on_after(FINALIZE_GRACE):
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

    async def _call(self, d: Delivery) -> Outcome | Backoff:
        """One handler call (the handler loop inlines the same steps)."""
        try:
            result = await self.handler(d)
        except Exception:
            return self._raised(d)
        except BaseException as e:
            if self._own_exit(e):
                raise
            return self._raised(d)
        if not isinstance(result, Outcome):
            return self._not_outcome(d, result)
        return result

    def _raised(self, d: Delivery) -> Outcome | Backoff:
        """The handler raised (called inside the ``except``): count, log, ``on_error``."""
        self.stats.handler_errors += 1
        record_error(d, sys.exc_info()[1])  # for the dead-letter entry
        log.exception(
            "%s: handler raised on %s (attempt %d); %s",
            self.name, d.id or d.origin_id, d.attempt, self._on_error_text,
            extra=log_extra(self.name, d, self._on_error),
        )
        if self._warn_repeats:
            self._keeps_failing(d)
        return self._on_error

    def _not_outcome(self, d: Delivery, result: object) -> Outcome | Backoff:
        """The handler returned something that is not an outcome: count, log, ``on_error``."""
        self.stats.handler_errors += 1
        log.error(
            "%s: handler returned %r, not an Outcome, for %s (attempt %d); %s",
            self.name, result, d.id or d.origin_id, d.attempt, self._on_error_text,
            exc_info=TypeError(f"handler returned {type(result).__name__}, not an Outcome"),
            extra=log_extra(self.name, d, self._on_error),
        )
        if self._warn_repeats:
            self._keeps_failing(d)
        return self._on_error

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

    # -- finalizer ------------------------------------------------------------
    async def _finalizer(self, recv: Recv[list[Item]]) -> None:
        with self._finalizer_scope:
            async with recv:
                async for items in recv:
                    batch = list(items)
                    while len(batch) < _MAX_BATCH:
                        try:
                            batch.extend(recv.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    await self._finalize(batch)

    def plan_for(self, d: Delivery, outcome: Outcome | Plan | Backoff) -> Plan | None:
        """The plan for one item; ``None`` when refused (logged and counted) or
        when nothing is to be sent (a :class:`Backoff` that waits)."""
        if isinstance(outcome, Plan):
            return outcome
        if isinstance(outcome, Backoff):
            return self._back_off(d, outcome)
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

    async def _finalize(self, items: list[Item]) -> None:
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
                    owners = [_FAST_ONLY] * len(commands)
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
                    self.consumer.scheduler.hold(self, p.delay, p.later)
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
                self.consumer.scheduler.hold(self, p.delay, p.later)
        if self.settled is not None:  # instrumentation: each delivery and its confirmed effect
            self.settled([(d, self._removals[k].value) for d, k in zip(removed, kinds, strict=True)]
                         + [(d, p.effect.value) for d, p in plans])


_FAST_ONLY = (-1,)
"""Owner of a command that removes the hot path's deliveries (no plan)."""


def first_round(
    fast: Sequence[Command], plans: Sequence[Plan]
) -> tuple[list[Command], list[tuple[int, ...]], list[list[Command]]]:
    """The first pipeline of a batch: commands, their owners, the steps left.

    ``owners[i]``: the indexes of the plans that command ``i`` serves (``-1``:
    the hot path's removals ``fast``).  Single-``XACK`` commands merge per
    stream and group, as :func:`merge_commands` does.  A plan that is not
    gated and has several steps (a cross-slot copy, then the removal of the
    original) sends only its first step; ``rest[j]`` holds the others, each
    sent once the one before it succeeded: a removal never follows a copy
    that failed or whose outcome is unknown.
    """
    out: list[Any] = []
    owners: list[list[int]] = []
    rest: list[list[Command]] = [[] for _ in plans]
    xacks: dict[tuple[Any, Any], int] = {}

    def add(cmds: Sequence[Command], j: int) -> None:
        if len(cmds) == 1 and cmds[0][0] == "XACK":
            c = cmds[0]
            key = (c[1], c[2])
            at = xacks.get(key)
            if at is None:
                xacks[key] = len(out)
                out.append(["XACK", c[1], c[2], *c[3:]])
                owners.append([j])
            else:
                out[at].extend(c[3:])
                if j not in owners[at]:
                    owners[at].append(j)
            return
        for c in cmds:
            out.append(c)
            owners.append([j])

    if len(fast) == 1:
        add(fast, -1)
    else:
        for c in fast:
            add((c,), -1)
    for j, p in enumerate(plans):
        cmds = p.commands
        if len(cmds) == 1 and cmds[0][0] != "XACK":  # one script (the common case), inline
            out.append(cmds[0])
            owners.append([j])
            continue
        if not p.gated and len(cmds) > 1:
            rest[j] = list(cmds[1:])
            cmds = cmds[:1]
        add(cmds, j)
    commands: list[Command] = [tuple(c) if isinstance(c, list) else c for c in out]
    return commands, [tuple(o) for o in owners], rest


def _sole(exc: BaseException) -> BaseException:
    """The one exception inside nested one-member groups, else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


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


def describe_error(err: Exception, cmd: Command) -> str:
    from ._transport import describe

    return f"{err} ({describe(cmd)})"


def merge_commands(groups: Sequence[Sequence[Command]]) -> list[Command]:
    """Concatenate plans' commands, merging single-XACK plans per stream and group.

    A plan of one ``XACK`` needs no order with other plans, so all of them
    become one ``XACK key group id id ...`` at the place of the first.
    Multi-command plans keep their own order.
    """
    out: list[Command] = []
    xacks: dict[tuple[Any, Any], list[Any]] = {}
    for cmds in groups:
        if len(cmds) == 1 and cmds[0][0] == "XACK":
            c = cmds[0]
            key = (c[1], c[2])
            ids = xacks.get(key)
            if ids is None:
                ids = xacks[key] = ["XACK", c[1], c[2]]
                out.append(ids)  # placeholder list, filled below
            ids.extend(c[3:])
        else:
            out.extend(cmds)
    return [tuple(c) if isinstance(c, list) else c for c in out]
