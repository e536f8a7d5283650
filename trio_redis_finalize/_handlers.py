"""The handler pool of one mount: N handler tasks, the flusher, and phase 3 of the shutdown.

Part of the runtime (``_mount``)::

    work queue --(one delivery at a time)--> N handler tasks --(lists of outcomes)--> finalizer

The work queue (:class:`~._hand_over.WorkQueue`) takes a whole batch from
the reader once it is empty, and each handler task takes one delivery at a
time from it: fast handlers drain a batch in one task without a switch per
delivery, slow ones share it delivery by delivery (no task idles behind
another's slow delivery).  Outcomes travel in lists over a bounded
channel, flushed when the queue runs dry or every ``_FLUSH_EVERY`` seconds
(a flusher task hands on what waits while its handler task runs a slow
handler, so no outcome waits behind another delivery).  ``batch=True``
calls the handler on a read's whole batch at once instead.

What a handler's failure becomes is the ``on_error`` policy's
(``_on_error``).  :meth:`HandlerPool.run` is the hot path: one delivery
costs no call and no object beyond the handler's own call and its outcome
tuple.  No delivery starts once the reader's lease lapsed (``Lease``,
``_hand_over``: a reliable list's heartbeat).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Sequence
from time import monotonic

import anyio
from anyio.streams.memory import MemoryObjectSendStream as Send

from ._core._types import Target
from ._deadlines import log
from ._delivery import Delivery
from ._forms import FORMS
from ._forms._port import BatchHandler, ConsumerInfo, Handler, Item
from ._hand_over import WorkQueue
from ._on_error import OnError, shown
from ._outcome import Backoff, Outcome, WithWrites
from ._shutdown import FINALIZE_GRACE, cleanup
from ._stats import DURATION_BOUNDS, MountStats

__all__ = ["GiveBack", "HandlerPool", "hand_on", "own_exit"]

_FLUSH_EVERY = 0.05
_SLOW_CALL = 0.0005
"""Seconds of a handler call after which its outcome is sent on at once."""

GiveBack = Callable[[Send[list[Item]], Sequence[Delivery]], Awaitable[None]]
"""Gives deliveries no handler started back, on a sender (``HandOver.give_back``, ``_hand_over``)."""


class HandlerPool:
    """The handler tasks of one mount (``concurrency`` of them, each with its
    own outcome sender) and their flusher.

    ``stopping``: set by the shutdown (``Mount.stop``): each task finishes
    the delivery it holds and starts nothing new; ``scope``: its deadline is
    the shutdown's handler deadline; ``cut``: the deliveries whose handler
    call the shutdown's grace deadline cancelled (they stay pending on
    streams and reliable lists; logged by :meth:`log_cut`).
    """

    def __init__(self, name: str, target: Target, consumer: ConsumerInfo,
                 handler: Handler | BatchHandler, queue: WorkQueue, stats: MountStats,
                 policy: OnError, *, batch: bool) -> None:
        self.name = name
        self.target = target
        self.consumer = consumer
        self.handler = handler
        self.batch = batch
        self.stats = stats
        self.policy = policy
        self._queue = queue
        self.stopping = False
        self.cut: list[Delivery] = []
        self.scope = anyio.CancelScope()
        self._flusher_idle = True
        self._flusher_wake = anyio.Event()

    async def run(self, senders: list[Send[list[Item]]], give_back: GiveBack) -> None:
        """Run ``concurrency`` handler tasks (one per sender) and the flusher
        until the queue is closed and empty, or the shutdown stops them; then
        (phase 3, ``_shutdown``) ``give_back`` what no handler started, on the
        first sender, and close every sender."""
        try:
            with self.scope:
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
                self.log_cut()
            # phase 3: stopped, or cancelled at the grace deadline: what no
            # handler started goes back (one cancelled mid-handler stays pending)
            await give_back(senders[0], self._queue.drain())
            with cleanup(FINALIZE_GRACE):
                for s in senders:
                    await s.aclose()

    def log_cut(self) -> None:
        """Say which deliveries stay pending (or, at-most-once, are gone)
        because the shutdown cancelled their handler."""
        t = self.target
        cut = self.cut
        names = shown([d.id or d.origin_id for d in cut])
        fate = FORMS[t.form].cut_fate.format(names=names, group=t.group,
                                             consumer=self.consumer.name, processing=t.processing)
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
        policy = self.policy  # its calls as locals: no attribute chain per delivery
        raised, checked, not_outcome = policy.raised, policy.checked, policy.not_outcome
        free = policy.free  # outcome kinds whose writes need no check (OnError.checked)
        # Nothing starts at or past the reader's lease (a reliable list's
        # heartbeat, ``Lease``): checked here, once per run of calls; within
        # a run, ``flush_by`` (at most ``until``) ends it before.
        lease = queue.lease
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
                if flush_by >= lease.until:  # the lease ends within this run (rarely)
                    if now >= lease.until:  # lapsed: what no handler started is dropped
                        lease.lapsed()  # (the queue empties)
                        continue
                    flush_by = lease.until
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
                            outcome = raised(d)
                        except BaseException as e:
                            if own_exit(e):
                                self.cut.append(d)  # cancelled mid-handler: logged by run
                                raise
                            outcome = raised(d)  # e.g. asyncio.CancelledError of another task
                        else:
                            if outcome.__class__ is not Outcome:
                                if outcome.__class__ is WithWrites:
                                    if outcome.kind not in free:
                                        outcome = checked(d, outcome)
                                elif not isinstance(outcome, Outcome):
                                    outcome = not_outcome(d, outcome)
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
                        # _FLUSH_EVERY (or the lease ends), or at a stop; else gather more (and should
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
                await hand_on(send, batch, self.name)

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
        lease = queue.lease
        while not self.stopping:
            if not items:
                if not await queue.wait():
                    return
                continue
            if monotonic() >= lease.until:  # lapsed: dropped, not started (see _handler_loop)
                lease.lapsed()
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
                    if not isinstance(e, Exception) and own_exit(e):
                        self.cut.extend(batch)  # cancelled mid-call: logged by run
                        raise
                    outcomes = self.policy.batch_raised(batch)
                else:
                    outcomes = self.policy.batch_outcomes(batch, result)
            finally:
                stats.in_flight -= 1
                took = monotonic() - start
                counts[bisect_left(DURATION_BOUNDS, took)] += 1
                durations.sum += took
            # the call returned: its outcomes must go on
            await hand_on(send, list(zip(batch, outcomes, strict=True)), self.name)

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
                    await hand_on(send, batch, self.name)
            if not found:
                self._flusher_wake = anyio.Event()
                self._flusher_idle = True


async def hand_on(send: Send[list[Item]], items: list[Item], name: str) -> None:
    """Hand outcomes no handler holds any more to the finalizer: they must get there.

    At once when the channel has room (``send_nowait``: no checkpoint, so
    neither a cancellation nor a deadline can cut it); else the wait for room
    is shielded and has no deadline of its own.  The finalizer drains the
    channel until its own deadline (``Budget.finalizer`` at a shutdown), then
    closes it: the deliveries stay pending (logged).

    A deadline here would drop the outcomes without a word while the
    finalizer is merely slow (Redis unreachable for longer, a loaded
    machine that left the task unscheduled past it): their deliveries would
    stay held by this consumer, finalized by nobody, until a restart.
    """
    try:
        try:
            send.send_nowait(items)
            return
        except anyio.WouldBlock:
            pass
        with anyio.CancelScope(shield=True):
            await send.send(items)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        log.warning("%s: %d outcome(s) could not reach the finalizer, which has ended (the "
                    "shutdown's deadline): their deliveries stay pending", name, len(items),
                    extra={"subscription": name})


def own_exit(e: BaseException) -> bool:
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
