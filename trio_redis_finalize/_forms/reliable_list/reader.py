"""A reliable list's reader: the read loop's steps (``_read_loop.drive``) of
one :class:`~._forms.reliable_list.ReliableListSubscription`.

Each turn is one ``BLMOVE queue processing RIGHT LEFT`` with up to 63
``LMOVE`` pipelined behind it, handed over to the handlers by the runtime's
one hand-over (``Context.deliver`` with ``give_back``: cut by the shutdown,
what no handler had goes back onto the queue, :meth:`~ReliableListReader.abandon`).
The rest of the form's run time is beside it: :mod:`.recovery` (the
processing list's rescan, the Backoff redeliveries) and :mod:`.liveness`
(heartbeat, reaper, the stop's hand-back).  The keys beside the queue, the
scripts and the multiset counting are in ``_core.reliable_list.liveness``; the
counted gates in ``_core.reliable_list.gates``.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
from redis import exceptions as rexc

from ..._core._commands import Command
from ..._core._decode import list_deliveries
from ..._core._finalize import Gates
from ..._core._replies import describe_error
from ..._core._types import Effect, Plan, Target
from ..._core.reliable_list.gates import ListGates
from ..._core.reliable_list.liveness import GIVE_BACK, dec
from ..._core.reliable_list.scripts import MOVE_DUE_TO_LIST
from ..._deadlines import OWN_LOOK_EVERY, READ_MARGIN, backoff, log
from ..._delivery import Delivery
from ..._hand_over import Lease
from ..._subscription import DelayedRetry
from ..._transport import Connection
from .._delay_set import move_due
from .._port import Context, Pending
from .._read_loop import check_type, reader_connection
from . import ReliableListSubscription
from .liveness import ListLiveness
from .recovery import ListRecovery

__all__ = ["ReliableListReader", "ReliableListSubscription"]

_PREFETCH_MAX = 64
"""At most this many elements move into the processing list per round trip."""
_CHUNK_WORK = 0.01
"""Seconds of handler work one prefetch aims at (fast handlers: bigger batches)."""
_BYTES = {bytes}  # the types of a read's replies when none is an error
_RESCAN_EVERY = OWN_LOOK_EVERY
"""Seconds between two rescans of the processing list, whatever the traffic
(the stream's own-PEL look has the same period): an element left there that
this reader does not hold (a full waiting set, a delayed copy Redis refused)
is delivered again within it."""


class ReliableListReader:
    """Reads one :class:`ReliableListSubscription`.

    * ``BLMOVE queue processing RIGHT LEFT`` on a dedicated connection, with
      up to 63 ``LMOVE`` pipelined behind it when the queue is busy and the
      handlers fast (the prefetch adapts: slow handlers keep it at 1, so
      other consumers get the rest).  The client-side deadline of a read is
      ``block`` + 1 s.
    * Crash recovery and ``on_error=Backoff()``: the processing list's rescan
      (at start, after a read error, every minute) and the redeliveries of failed elements
      are :class:`~.recovery.ListRecovery`'s (:attr:`pending`).
    * Identical elements: the finalizer asks the reader's counted gates
      (:attr:`gates`, a ``_core.reliable_list.gates.ListGates``) for the commands of
      each batch before it is first sent; a removal of an element of which
      this reader holds several copies then carries ``n`` (see
      ``_plan.list_counted``), so that a resend after an unknown outcome
      never removes a copy another handler still holds; the gates count
      answered removals down.  What counting cannot tell apart: a
      removal of X resent after an unknown outcome while a read of another
      X is on its way (its reply not read yet) or lost its reply and the
      rescan has not adopted it yet - "sent removal applied + one unheld X"
      and "removal not applied" leave the same list, and the resend removes
      one X.  For a copying removal (RETRY, dead letter, delay) that X lives
      on as the second copy; for ACK / DROP it is gone.  A read on its way
      is then handed over as usual: its handler runs and its removal finds
      its gate closed (counted ``gate_closed``, not ``acked``): each X was
      handled once and removed once, one counter says so otherwise.
    * Dead consumers, heartbeat, the stop's hand-back and deregistration:
      :class:`~.liveness.ListLiveness`.
    * Shutdown: elements read but never handed to a handler go back onto the
      queue (consumer end, not counted as an attempt); those being handled
      when ``shutdown_grace`` ran out stay in the processing list, and the
      heartbeat is extended to cover the grace.  Once the shutdown is over
      (:meth:`closed`), what is left in the processing list goes back onto
      the queue at once (counted when a handler ran), and the consumer
      deregisters (its heartbeat key and registry entry deleted).
    * ``DelayedRetry.DURABLE_ZSET``: due copies are moved from the delay set
      before each read, and the read blocks no longer than the next is due.
    """

    def __init__(self, sub: ReliableListSubscription) -> None:
        self.sub = sub
        # The multiset of elements this reader delivered, by bytes (identical
        # elements are told apart by count only), and the finalizer's gates
        # on it; the read path adds to its counters directly
        self._gates = ListGates()
        self._per_element = 0.0  # seconds of handler time per element (EMA)
        self._batch = 1
        self._next_move = 0.0
        self._target: Target | None = None
        self._rescan_planned = False
        self._next_rescan = 0.0  # the periodic rescan (_RESCAN_EVERY)
        self._started = False  # a catch_up went through (the first rescan bumps counters)
        self._previous = 0  # elements the previous turn handed over
        self._blmove: Command = ()
        self._lmove: Command = ()
        self._abandoned = 0  # elements given back unstarted at the shutdown (abandon)
        self._handing: list[Delivery] | None = None  # a read's, while the hand-over waits for room
        self._recovery = ListRecovery(sub, self._gates)
        self._liveness = ListLiveness(sub, self._stalled)

    @property
    def lease(self) -> Lease:
        """Until when the handlers may start what this reader read (the
        heartbeat's, :class:`~.liveness.ListLiveness`); past it a handler
        task drops it (:meth:`_stalled`) instead.  The mount hands it to its
        work queue."""
        return self._liveness.lease

    @property
    def pending(self) -> Pending:
        """Failed deliveries stay pending (``redeliver``, ``leave_pending``):
        the processing list's :class:`~.recovery.ListRecovery`."""
        return self._recovery

    @property
    def gates(self) -> Gates:
        """The counted gates the finalizer's core uses for this reader's
        removals (``_core.reliable_list.gates``)."""
        return self._gates

    def holding(self, ctx: Context) -> None:
        """Nothing to keep beyond the reading (see ``Reader.holding``)."""
        return None

    def abandon(self, deliveries: Sequence[Delivery]) -> Plan | None:
        """Give elements read but never started (shutdown) back to the queue.

        They go to the consumer end, oldest rightmost, so they are read next
        (by any consumer), and their attempt is not counted; should that fail
        they stay in the processing list, recovered later as after a crash.
        """
        raws = [d.raw for d in deliveries if d.raw is not None]
        self._abandoned += len(raws)
        self._gates.giving.update(raws)  # until its reply: no attempt of theirs to count
        return self._give_back_plan(raws)

    def _give_back_plan(self, raws: Sequence[bytes]) -> Plan | None:
        if not raws or self._target is None:
            return None
        t = self._target
        args: list[bytes | int] = []
        for e in reversed(raws):
            args += [e, 1]  # n: set by prepare() when it is sent
        return Plan(Effect.NOTHING, (GIVE_BACK.command((t.processing, t.source), args),))

    # -- the read loop's steps (_read_loop.drive) ---------------------------------------
    async def _move_due(self, ctx: Context) -> float:
        """Move due copies from the durable delay set; seconds until the next is due."""
        return await move_due(ctx, MOVE_DUE_TO_LIST, self.sub.block)

    def _tune(self, waited: float, previous: int) -> None:
        """Pick the next prefetch from how long the handlers took per element.

        ``waited``: how long handing over this batch waited for the handlers,
        busy with the ``previous`` elements.  The prefetch at most doubles per
        round, so slow handlers keep it at 1 (other consumers get the rest).
        """
        if previous:
            self._per_element = 0.7 * self._per_element + 0.3 * (waited / previous)
        target = _PREFETCH_MAX if self._per_element <= 0 else int(_CHUNK_WORK / self._per_element)
        self._batch = max(1, min(_PREFETCH_MAX, target, self._batch * 2))

    async def setup(self, ctx: Context) -> None:
        """The keys' types, then the first heartbeat (registered before the first read)."""
        sub = self.sub
        t = self._target = self._gates.target = ctx.target
        client = ctx.client
        await check_type(client, sub.queue, "list", sub.name)
        if t.processing != sub.queue:
            await check_type(client, t.processing, "list", sub.name)
        if t.dead_letter is not None:
            await check_type(client, t.dead_letter, "list", sub.name)
        if t.delayed_retry is DelayedRetry.DURABLE_ZSET:
            await check_type(client, t.delay_key, "zset", sub.name)
        await self._liveness.register(ctx)  # the first heartbeat: the claim of the consumer name
        self._blmove = ("BLMOVE", sub.queue, t.processing, "RIGHT", "LEFT")
        self._lmove = ("LMOVE", sub.queue, t.processing, "RIGHT", "LEFT")
        self._next_rescan = anyio.current_time() + _RESCAN_EVERY

    def background(self, ctx: Context) -> Sequence[Callable[[], Coroutine[Any, Any, None]]]:
        live = self._liveness
        return (functools.partial(live.heartbeat, ctx), functools.partial(live.reaper, ctx))

    def connection(self, ctx: Context) -> AbstractAsyncContextManager[Connection]:
        return reader_connection(ctx, self.sub.queue)

    async def connected(self, ctx: Context, conn: Connection) -> None:
        self._rescan_planned = True  # at start: the previous process's; later: a lost read's

    async def catch_up(self, ctx: Context, conn: Connection) -> None:
        """Due durable copies onto the queue, then the rescan when one is
        planned, wanted, or due (every :data:`_RESCAN_EVERY` seconds); after a
        late heartbeat (:meth:`_stalled`), the heartbeat renewed before it."""
        now = anyio.current_time()
        if ctx.target.delayed_retry is DelayedRetry.DURABLE_ZSET and now >= self._next_move:
            wait = await self._move_due(ctx)
            now = anyio.current_time()
            self._next_move = now + wait
        if self._liveness.late():  # the key may have lapsed: back before the rescan
            self._stalled(ctx)  # (no reaper moves what it delivers once the key is back)
            await self._liveness.renew_now(ctx)
        recheck = self._recovery.recheck_at
        if (self._rescan_planned or self._gates.rescan_wanted or now >= self._next_rescan
                or (recheck is not None and now >= recheck)):
            await self._recovery.rescan(conn, ctx, start=not self._started)
            self._rescan_planned = False
            self._next_rescan = now + _RESCAN_EVERY
        self._started = True  # drive() is started after the first catch_up that went through

    async def turn(self, ctx: Context, conn: Connection) -> None:
        """One BLMOVE and ``_batch - 1`` LMOVE in one round trip, handed over."""
        block = self.sub.block
        if ctx.target.delayed_retry is DelayedRetry.DURABLE_ZSET:
            block = max(0.001, min(block, self._next_move - anyio.current_time()))
        cmds: list[Command] = [(*self._blmove, f"{max(block, 0.001):.3f}")]
        cmds += [self._lmove] * (self._batch - 1)
        replies = await conn.pipeline(cmds, timeout=block + READ_MARGIN)
        # each an element (bytes), None (the queue was empty) or an error reply;
        # a busy queue's read answers elements only (their types: one pass, in C)
        elements: list[bytes] = replies
        if {*map(type, replies)} != _BYTES:
            elements = [r for r in replies if r is not None]
        if elements is not replies and {*map(type, elements)} - _BYTES:
            elements = []
            for cmd, r in zip(cmds, replies, strict=True):
                if isinstance(r, rexc.RedisError):
                    ctx.stats.read_errors += 1
                    log.error("%s: read failed: %s", ctx.name, describe_error(r, cmd))
                elif r is not None:
                    elements.append(r)
            await anyio.sleep(backoff(0))  # a little (the elements read are handed over)
        if not elements:
            return
        if self._liveness.late():  # the read may have come back after a reaper moved them
            self._stalled(ctx, len(elements))  # left in the processing list for the rescan
            return
        gates = self._gates
        gates.unsent.update(elements)  # held (_hold), all at once
        gates.in_hand.update(elements)
        ready, direct = list_deliveries(ctx.target, self.sub.queue, elements)
        before = anyio.current_time()
        # the one hand-over: cut by the shutdown before a handler had them, they
        # go back onto the queue (abandon; the finalizer counts the gates)
        self._handing = ready
        try:
            await ctx.deliver(ready, direct, give_back=True)
        finally:
            self._handing = None
        self._tune(anyio.current_time() - before, self._previous)
        self._previous = len(elements)

    def _stalled(self, ctx: Context, read: int = 0) -> None:
        """No heartbeat went through for ``heartbeat`` seconds (this process
        stalled, or Redis was out of reach): the key may have lapsed, and a
        live consumer moved the processing list back onto the queue and be
        handling those elements.  Nothing read and not started is started
        before that is known: at once, before anything is sent, every
        delivery no handler started is dropped, whether in the work queue or
        waiting for room there (a handler running one finishes; its removal
        finds its gate as the other consumer left it), and a rescan is
        wanted.  The rescan (:meth:`catch_up`) renews the heartbeat first
        (the key back: no reaper moves anything from then on), then delivers
        what the processing list still holds that no handler has, as it
        is (not an attempt).  Called by the first to find the heartbeat
        late: the heartbeat task, :meth:`catch_up`, :meth:`turn`, or a
        handler task about to start a delivery past the :attr:`lease`.  So
        a renewal or a read of the list that fails (lost, silent, refused)
        starts nothing: they are tried again, the dropped elements waiting
        in the processing list meanwhile.
        ``read``: the elements of a read not handed over (left there too)."""
        gates = self._gates
        dropped = ctx.drop_unstarted(lambda d: True)
        waiting = self._handing  # a read's deliveries waiting for room in the work queue
        if waiting:
            taken = {id(d) for d in dropped}
            dropped += [d for d in waiting if id(d) not in taken]
            waiting.clear()  # in place: the work queue takes them from this list once it has room
        # read again by the rescan (or another consumer's now): counted there, not twice
        ctx.stats.received -= len(dropped)
        for d in dropped:
            if d.raw is not None:
                dec(gates.unsent, d.raw)
                dec(gates.in_hand, d.raw)
        gates.rescan_wanted = True
        if dropped or read:
            log.warning("%s: no heartbeat went through for %.1f s (this consumer stalled, or "
                        "Redis was out of reach): %d element(s) read and not started are not "
                        "started now; those still in processing list %r are delivered again "
                        "once the heartbeat is renewed (a live consumer may have moved the "
                        "others back onto the queue meanwhile)", ctx.name, self.sub.heartbeat,
                        len(dropped) + read, ctx.target.processing,
                        extra={"subscription": ctx.name})

    def failed(self, ctx: Context, err: Exception) -> float | None:
        self._rescan_planned = True  # a lost BLMOVE reply strands an element
        return None

    async def closing(self, ctx: Context) -> None:
        """The last heartbeat, until the shutdown's handlers and finalizer must
        have ended (:meth:`~.liveness.ListLiveness.last_beat`)."""
        await self._liveness.last_beat(ctx)

    async def closed(self, ctx: Context) -> None:
        """After the shutdown: what is left in the processing list back onto
        the queue, then deregister (:meth:`~.liveness.ListLiveness.hand_back`)."""
        # what a handler ran on (held, or left pending after a failure): counted down
        # as the pages go; not what was given back unstarted and is still held
        # (the finalizer never sent its give-back: stalled until the deadline)
        gates = self._gates
        late = gates.giving
        held = dict(Counter(gates.in_hand) + Counter(gates.leftover) - late)
        await self._liveness.hand_back(ctx, held, self._abandoned, sum(late.values()))
