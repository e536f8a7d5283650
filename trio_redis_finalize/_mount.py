"""The runtime of one mounted subscription: reader -> handlers -> finalizer.

::

    reader task --(batches)--> work queue --(one delivery at a time)--> N handler tasks
         |                                                                    |
         |                                                        (lists of outcomes)
         |                                                                    v
         +------------(precomputed plans: dead, lost)-----------------> finalizer task

Everything in between is bounded.  :class:`Mount` wires the parts and runs
their lifecycle; it is the :class:`~._forms._port.Context` its reader sees,
whose ``deliver`` is the one hand-over of what a reader read (``_hand_over``:
plans first, then the deliveries into the work queue; cut by the shutdown,
what was not handed over is given back).  The parts have modules of their
own: the hand-over and its work queue (``_hand_over``), the handler pool and
its flusher (``_handlers``), the ``on_error`` policy (``_on_error``), the
waiting set of deliveries backing off, with its redeliverer (``_backoffs``),
the finalizer (``_finalizer``).  The reader owns a dedicated connection;
the finalizer uses the pool, and drains the outcome receiver until every
sender (the reader's and the handlers') has closed.

The finalizer sends each batch in one pipeline.  An error reply is
classified (``_transport.classify``): one that did not run (OOM, BUSY,
READONLY ...) is sent again after a backoff, alone; a final one is logged
with its command and key and counted (effect ``failed``).  A plan of two
ungated steps (a copy to another Redis Cluster slot, then the removal of
the original) sends its removal in a later round, only once the copy
succeeded.  Effects are counted from the replies (``_plan.settle``).  At
the last attempt (``max_attempts``) the finalizer dead-letters a failed
delivery (or drops it with a warning) as it would a ``RETRY``; before it, a
``Backoff`` waits in the waiting set (``_backoffs``).

Shutdown (:meth:`Mount.stop`): phases 1 to 4 of ``_shutdown``, which
describes what happens to in-flight deliveries.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream as Recv
from anyio.streams.memory import MemoryObjectSendStream as Send
from redis import exceptions as rexc

from ._backoffs import Backoffs
from ._core._types import Target
from ._deadlines import log
from ._delivery import Delivery
from ._finalizer import Finalizer
from ._forms import FORMS
from ._forms._port import BatchHandler, ConsumerInfo, Handler, Item, Reader
from ._forms._read_loop import drive, retry_not_run
from ._hand_over import HandOver, WorkQueue
from ._handlers import HandlerPool
from ._history import History
from ._on_error import OnError
from ._outcome import Backoff, Outcome
from ._scheduler import LaterGates
from ._shutdown import CLOSE_MARGIN, CLOSING_TIMEOUT, Budget, cleanup, cleanup_until
from ._stats import MountStats
from ._subscription import Subscription

if TYPE_CHECKING:
    from ._scheduler import Scheduler
    from ._transport import Client

__all__ = ["Mount"]


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
        self.in_hand: set[str] = set()  # stream ids read and not yet finalized
        # handlers start nothing past the reader's lease (a reliable list's heartbeat)
        self._queue = WorkQueue(reader.lease)
        policy = OnError(self.name, target, on_error, self.stats)
        self.pool = HandlerPool(self.name, target, consumer, handler, self._queue, self.stats,
                                policy, batch=batch)
        # the reader's way in (Context.deliver, send_plans): the hand-over's own
        self.hand_over = HandOver(self.name, self._queue, self.in_hand, self.stats,
                                  by_id=FORMS[target.form].by_id, abandon=reader.abandon)
        self.deliver = self.hand_over.deliver
        self.send_plans = self.hand_over.send_plans
        # instrumentation (trio_redis_finalize.otel): learns the mount, watches finalization
        bind = getattr(handler, "trf_bind", None)
        self.settled: Callable[[list[tuple[Delivery, str]]], None] | None = bind(self) if bind else None
        # Backoff: failed deliveries waiting to be delivered again (whatever
        # on_error is: a finalization Redis refused waits there too)
        hooks = reader.pending
        self.backoffs = Backoffs(self, hooks, self.settled,
                                 backs_off=isinstance(policy.again, Backoff))
        gates = reader.gates  # a reliable list's: its delayed copies numbered when sent
        self.later_gates = gates if isinstance(gates, LaterGates) else None
        self.finalizer = Finalizer(
            name=self.name, target=target, client=client, stats=self.stats, in_hand=self.in_hand,
            scheduler=scheduler, owner=self, wait_out=self.backoffs.wait_out,
            gates=reader.gates, settled=self.settled,
            refused=self.backoffs.refused if hooks is not None else None,
            schedule=self.backoffs.schedule if self.backoffs.backs_off else None,
        )
        self.reading = False  # mount() returned: the reader set itself up
        self.done = anyio.Event()
        self._reader_scope = anyio.CancelScope()
        # shielded once the mount is reading (shutdown is stop()'s); not before:
        # mount() honours its caller's cancellation during set-up
        self._outer_scope = anyio.CancelScope()
        # per-minute counts in Redis for the dashboard, written beside the reader (_history)
        self._history = History.of(target.form, target.source, target.group, self.stats)
        self._history_scope = anyio.CancelScope()
        self._holding_scope = anyio.CancelScope()  # the reader's holding task (a stream's lease)
        osend, orecv = anyio.create_memory_object_stream[list[Item]](max(4, 2 * concurrency))
        self._outcome_send: Send[list[Item]] = osend
        self._outcome_recv: Recv[list[Item]] = orecv

    @property
    def cut(self) -> list[Delivery]:
        """Deliveries whose handler call the shutdown's grace deadline cancelled
        (they stay pending on streams and reliable lists; logged)."""
        return self.pool.cut

    # -- the rest of the port (Context) -----------------------------------------
    @property
    def waiting(self) -> int:
        """How many failed deliveries wait for their :class:`Backoff` delay now."""
        return len(self.backoffs.waiting)

    def handling(self) -> bool:
        """Whether a stream entry read is in hand: neither finalized nor waiting
        for its backoff (waiting entries are held too)."""
        return len(self.in_hand) > len(self.backoffs.waiting)

    def backing_off(self) -> list[Delivery]:
        """The deliveries waiting for their Backoff (see ``Context.backing_off``)."""
        return self.backoffs.backing_off()

    def leased(self) -> list[str]:
        """The stream ids whose lease is kept (see ``Context.leased``)."""
        if not self.pool.stopping:
            return sorted(self.in_hand)
        unstarted = {d.id for d in self._queue.items}
        return sorted(i for i in self.in_hand if i not in unstarted)

    def defer(self, d: Delivery, delay: float) -> bool:
        """A recovered delivery whose Backoff is due in ``delay`` seconds waits
        (``Backoffs.defer``); False: the caller delivers it now."""
        return self.backoffs.defer(d, delay)

    def disown(self, others: dict[str, str]) -> list[Delivery]:
        """Stream entries this consumer no longer owns (its lease found them pending
        for another consumer; id -> that consumer): those no handler started are
        taken out of the work queue, never started (returned), and those waiting
        for a Backoff stop waiting; all leave the lease (``in_hand``) whatever
        their state (one being handled finishes; its finalization finds its
        gate as the other consumer left it)."""
        dropped = self._queue.remove(set(others))
        self.in_hand.difference_update(others)
        self.backoffs.disown(others)
        return dropped

    def drop_unstarted(self, drop: Callable[[Delivery], bool]) -> list[Delivery]:
        """Deliveries no handler started for which ``drop`` is true: taken out of
        the work queue, never started (returned; see ``Context.drop_unstarted``)."""
        return self._queue.remove_where(drop)

    # -- lifecycle ----------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            with self._outer_scope:
                async with anyio.create_task_group() as tg:
                    self.hand_over.send = self._outcome_send.clone()
                    handler_senders = [self._outcome_send.clone() for _ in range(self.concurrency)]
                    await self._outcome_send.aclose()
                    tg.start_soon(self._finalize)
                    if (holding := self.reader.holding(self)) is not None:
                        tg.start_soon(self._hold, holding)
                    tg.start_soon(self.pool.run, handler_senders, self.hand_over.give_back)
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
            async with self.hand_over.send:
                with self._reader_scope:
                    pending = self.reader.pending
                    if pending is None:
                        await drive(self.reader, self, task_status=status)
                    else:
                        # the redeliverer lives as long as the reader (cancelled with it)
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(self.backoffs.run, pending)
                            await drive(self.reader, self, task_status=status)
        except BaseException:
            if not status.done:
                # mount() fails: let the handlers and finalizer end too
                self.pool.scope.cancel()
                self.finalizer.scope.cancel()
            raise
        finally:
            self._queue.close()
            self._history_scope.cancel()  # the history lives as long as the reader

    async def _finalize(self) -> None:
        try:
            await self.finalizer.run(self._outcome_recv)
        finally:
            self._holding_scope.cancel()  # what the handlers held is finalized, or left

    async def _hold(self, holding: Callable[[], Coroutine[Any, Any, None]]) -> None:
        with self._holding_scope:
            await holding()

    async def _record_history(self, history: History) -> None:
        with self._history_scope:
            await history.run(self.client)

    async def stop(self, budget: Budget) -> None:
        """Phases 1 to 4 of the shutdown (``_shutdown``); returns when the
        mount's tasks have all ended."""
        self.pool.stopping = True
        self._reader_scope.cancel()  # 1: stop reading (and redelivering)
        self.pool.scope.deadline = budget.handlers  # 2, then 3 (the give-back)
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
