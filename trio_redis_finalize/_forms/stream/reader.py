"""The stream's reader: the read steps of :class:`~.StreamSubscription`.

:class:`StreamReader` is what :func:`~._read_loop.drive` runs for a stream
mount: the group, one ``XREADGROUP`` per turn, the lease of entries in hand
(``holding``: it outlives the reading, to the end of the shutdown's
finalizing), the moves of due durable copies, and the order of what is due before a read.
What it takes back into its own PEL otherwise (recovery, claims, the reaper's
take) is :class:`~.own_pel.OwnPel`'s, the Backoff redelivery
:class:`~.pending.StreamPending`'s; the heartbeat and reaper are
:class:`~.liveness.StreamPresence`'s; the trim is ``retention``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any

import anyio
from redis import exceptions as rexc

from ..._core._recovery import LEASE, lease_lost
from ..._core._replies import NOT_RUN, BusyGroupError, classify, error_code
from ..._core._types import Plan
from ..._core.stream.decode import as_str, give_back, id_key, read_entries
from ..._core.stream.liveness import lease_every, lease_timeout
from ..._core.stream.scripts import move_due_to_stream
from ..._deadlines import FINALIZE_TIMEOUT, OWN_LOOK_EVERY, READ_MARGIN, log
from ..._delivery import Delivery
from ..._hand_over import Lease
from ..._shutdown import CLOSING_TIMEOUT
from ..._subscription import DelayedRetry, Mode
from ..._transport import Client, Connection
from .._delay_set import move_due
from .._port import Context, Pending
from .._read_loop import check_type, reader_connection
from . import MIN_IDLE_FLOOR, StreamSubscription
from .liveness import StreamPresence, follows
from .own_pel import OwnPel, hand_over
from .pending import StreamPending
from .retention import check_retention, trim

__all__ = ["MIN_IDLE_FLOOR", "StreamReader", "StreamSubscription"]

_RECOVER_EVERY = OWN_LOOK_EVERY
"""Seconds between two looks at the own PEL (PLAIN, RECLAIM), whatever the traffic
(the reliable list's rescan has the same period)."""
_MOVE_RETRY = 5.0
"""Seconds before a move of due copies that Redis refused is tried again."""


class StreamReader:
    """Reads one :class:`StreamSubscription` on a dedicated connection.

    The steps of :func:`~._read_loop.drive`: ``setup`` (key types, the group,
    the retention's precondition, the first heartbeat), ``background`` (the
    heartbeat, the retention trim), ``holding`` (the lease of entries in hand,
    run by the mount until its finalizer ends),
    ``connected`` (plans a look at the own PEL), ``catch_up`` (a destroyed
    group recreated, due durable copies moved back, the own PEL recovered,
    dead consumers taken over (``liveness``), claims (``own_pel``)), ``turn`` (one
    ``XREADGROUP``, handed over), ``failed`` (NOGROUP, UNBLOCKED: the group
    recreated; a refused step: a recovery planned) and ``closing`` (the last
    heartbeat, over the shutdown); after the shutdown, ``closed``
    deregisters a consumer with nothing pending.  Entries become
    deliveries in :func:`~._core._decode.stream_deliveries`.
    """

    def __init__(self, sub: StreamSubscription) -> None:
        self.sub = sub
        # The handlers' lease (``Reader.lease``) never lapses: the entries'
        # own is another, kept by ``holding`` until a peer claims them.
        self.lease = Lease()
        self._next_move = 0.0
        self._durable = sub.resolved_delay is DelayedRetry.DURABLE_ZSET
        self._read: tuple[str | int, ...] = ()  # XREADGROUP ... COUNT n (set by setup)
        # The own PEL is to be looked at before the next read (after a
        # (re)connect, a refused step, a lost reply, and every minute while no
        # entry is in hand); the first look after a start counts a crash.
        self._recover_due = False
        self._first_recovery = sub.mode is not Mode.CLAIMING
        self._next_recover = 0.0
        # The group was destroyed: recreate it before the next read.
        self._regroup = False
        # recovery, claims, the reaper's take; the last id handed
        self.own_pel = own = OwnPel(sub)
        # Backoff redelivery (the mount's Pending hooks)
        self._pending = StreamPending(own)
        # the heartbeat, the reaper of dead consumers, the hand-back at a stop
        self._presence = StreamPresence(sub.stream, sub.group, sub.mode, sub.min_idle,
                                        sub.heartbeat, sub.count, own.claiming, own.adopt,
                                        block=sub.block)

    @property
    def pending(self) -> Pending:
        """The own PEL: failed deliveries stay pending (``redeliver``, ``leave_pending``)."""
        return self._pending

    gates = None  # nothing counted: ids are unique

    def abandon(self, deliveries: Sequence[Delivery]) -> Plan | None:
        """Give deliveries read but never started back to the PEL, uncounted
        (:meth:`~.own_pel.OwnPel.abandon`)."""
        return self.own_pel.abandon(deliveries)

    def holding(self, ctx: Context) -> Callable[[], Coroutine[Any, Any, None]]:
        """The lease of the entries in hand, kept until the finalizer ends
        (``Context.leased``: in the shutdown, those whose handler runs or whose
        outcome is on its way; see :meth:`_lease`)."""
        return partial(self._lease, ctx)

    # -- the read loop's steps (_read_loop.drive) --------------------------------
    async def setup(self, ctx: Context) -> None:
        """Key types, the group (created when missing), the retention's
        precondition, and the group's last delivered id."""
        sub = self.sub
        client = ctx.client
        own = self.own_pel
        own.me = ctx.consumer.name
        self._read = ("XREADGROUP", "GROUP", sub.group, own.me, "COUNT", sub.count)
        await check_type(client, sub.stream, "stream", sub.name)
        await self._check_keys(ctx)
        await self._ensure_group(client)
        await self._presence.register(ctx)  # before the first read
        await check_retention(ctx, sub.retention, sub.stream, sub.group, sub.name)
        last = await self._group_last(client)
        if last is not None and (own.last is None or id_key(last) > id_key(own.last)):
            own.last = last
        self._next_recover = anyio.current_time() + _RECOVER_EVERY

    def background(self, ctx: Context) -> Sequence[Callable[[], Coroutine[Any, Any, None]]]:
        tasks: list[Callable[[], Coroutine[Any, Any, None]]] = [
            partial(self._presence.beats, ctx),
        ]
        sub = self.sub
        if sub.retention is not None:
            tasks.append(partial(trim, ctx, sub.retention, sub.stream, sub.group))
        return tasks

    def connection(self, ctx: Context) -> AbstractAsyncContextManager[Connection]:
        return reader_connection(ctx, self.sub.stream)

    async def connected(self, ctx: Context, conn: Connection) -> None:
        # (re)connected: a read's reply may have been lost with the old
        # connection (CLAIMING claims its own PEL back anyway)
        self._plan_recovery()

    async def catch_up(self, ctx: Context, conn: Connection) -> None:
        """The group again if it was destroyed, due durable copies moved back,
        the own PEL recovered when planned, dead consumers taken over when a
        look at the group is due (at mount, then see ``liveness``), one page
        claimed (RECLAIM when due, CLAIMING always)."""
        sub = self.sub
        if self._regroup:  # here, so that a connection error is retried
            await self._ensure_group(ctx.client, self._resume_at())
            self._regroup = False
        own = self.own_pel
        if own.unsure:  # a read's reply was lost: it may have left entries
            self._recover_due, own.unsure = True, False
        if self._durable and anyio.current_time() >= self._next_move:
            wait = await self._move_due(ctx)
            self._next_move = anyio.current_time() + wait
        if self._recover_due:
            await own.recover(conn, ctx, start=self._first_recovery)
            self._recover_due = self._first_recovery = False
        if self._presence.due():
            await self._presence.step(ctx)
        if sub.mode is Mode.CLAIMING or (
            sub.mode is Mode.RECLAIM and anyio.current_time() >= own.next_claim
        ):
            await own.claim(conn, ctx, self._presence.claim_min_idle())

    async def turn(self, ctx: Context, conn: Connection) -> None:
        """One XREADGROUP of new entries, handed over."""
        sub = self.sub
        own = self.own_pel
        now = anyio.current_time()
        own.unsure = True
        if (self._durable and self._next_move <= now) or self._presence.more or (
            sub.mode is not Mode.PLAIN and own.next_claim == 0.0
        ):
            # more due copies to move, or more of the PEL to claim: read what
            # is new without blocking, then go on at once (a BLOCK, however
            # short, can last the server's timer resolution, 100 ms at the
            # default hz)
            reply = await conn.execute(*self._read, "STREAMS", sub.stream, ">",
                                       timeout=FINALIZE_TIMEOUT)
        else:
            block = sub.block
            if self._durable:
                block = max(0.001, min(block, self._next_move - now))
            reply = await conn.execute(
                *self._read, "BLOCK", max(1, round(block * 1000)), "STREAMS", sub.stream, ">",
                timeout=block + READ_MARGIN,
            )
        own.unsure = False
        if reply:
            entries = read_entries(reply)
            own.last = entries[-1][0]
            await hand_over(ctx, entries)
        now = anyio.current_time()
        if sub.mode is not Mode.CLAIMING and now >= self._next_recover:
            self._next_recover = now + _RECOVER_EVERY
            # under traffic too: what is held (read, handled, waiting for a
            # Backoff or a refused finalization's retry) is skipped; what is
            # pending and not held was stranded (a full waiting set ...)
            self._recover_due = True

    def failed(self, ctx: Context, err: Exception) -> float | None:
        """The group destroyed (NOGROUP; UNBLOCKED: the key was deleted while
        the read blocked on it, Redis 7+): recreated at once, at the last id
        this reader delivered.  The server did not run a step (BUSY, OOM, a
        replica after a failover ...): the own PEL is recovered after the
        backoff."""
        if error_code(err) in ("NOGROUP", "UNBLOCKED"):
            ctx.stats.group_recreated += 1
            log.warning("%s: group is gone (%s); recreating it at %s, the last id this reader "
                        "delivered", ctx.name, err, self._resume_at(),
                        extra={"subscription": ctx.name})
            self._regroup = True
            self.own_pel.unsure = False  # the PEL went with the group
            self._plan_recovery()
            return 0.0
        if classify(err) is NOT_RUN:
            self._plan_recovery()
        return None

    async def closing(self, ctx: Context) -> None:
        """The last heartbeat: the handlers and the finalizer may still finish what
        they hold, so it lasts until they must have ended (``_shutdown.Budget``)."""
        await self._presence.last_beat(ctx)

    async def closed(self, ctx: Context) -> None:
        """After the shutdown: hand back what is still pending for this consumer
        (made idle at once, so a live consumer of the group takes it within a
        look; CLAIMING: only what it read and did not finalize, its delayed
        retries keep their delay), leave the stopped mark; nothing pending:
        the consumer is deleted from the group.  An entry waiting for its
        Backoff stays pending as it is (its schedule is kept in Redis: a
        restart of this name delivers it when due; a live consumer takes it
        once idle ``heartbeat``)."""
        waiting = {d.id for d in ctx.backing_off()}
        ids = [i for i in (*ctx.in_hand, *self.own_pel.abandoned) if i not in waiting]
        try:
            await self._set_back(ctx)
        except (rexc.RedisError, OSError) as e:
            log.warning("%s: setting back the delivery counts of entries read and not started "
                        "failed (%s): they come back one attempt higher", ctx.name, e,
                        extra={"subscription": ctx.name})
        await self._presence.deregister(
            ctx, ids, whole=self.sub.mode is not Mode.CLAIMING and not waiting)

    async def _set_back(self, ctx: Context) -> None:
        """The give-back of the entries read and not started at the stop, once
        more, for those the finalizer never sent it for (stuck on a stalled
        request until the shutdown's deadline): the same script
        (``decode.GIVE_BACK``) sets back the count of each entry still pending
        for this consumer with the delivery count it was handed with, so the
        hand-back returns it at the attempt it had.  One whose count was set
        back already, or pending for another consumer now (a claim took it
        meanwhile), is left as it is -- checked in the script itself, so no
        claim can come in between the check and the set-back."""
        given = self.own_pel.abandoned
        sub = self.sub
        p = give_back(sub.stream, sub.group, ctx.consumer.name, given.items())
        if p is not None:
            await ctx.client.pipeline(list(p.commands), timeout=CLOSING_TIMEOUT)

    def _plan_recovery(self) -> None:
        """Look at the own PEL before the next read (CLAIMING: its claims do)."""
        if self.sub.mode is not Mode.CLAIMING:
            self._recover_due = True

    # -- set-up ---------------------------------------------------------------
    async def _check_keys(self, ctx: Context) -> None:
        """The dead letter must be a stream, the durable delay set a sorted set."""
        t = ctx.target
        if t.dead_letter is not None:
            await check_type(ctx.client, t.dead_letter, "stream", f"{self.sub.name}, its dead_letter")
        if t.delayed_retry is DelayedRetry.DURABLE_ZSET:
            await check_type(ctx.client, t.delay_key, "zset", f"{self.sub.name}, its delay_key")

    async def _ensure_group(self, client: Client, at: str | None = None) -> bool:
        try:
            await client.execute(
                "XGROUP", "CREATE", self.sub.stream, self.sub.group, at or self.sub.start_id,
                "MKSTREAM",
            )
            return True
        except BusyGroupError:
            return False

    async def _group_last(self, client: Client) -> bytes | None:
        """The group's last delivered id (``XINFO GROUPS``), None if unknown."""
        for row in await client.execute("XINFO", "GROUPS", self.sub.stream, timeout=FINALIZE_TIMEOUT):
            info = dict(zip(row[::2], row[1::2], strict=False))
            if as_str(info.get(b"name", b"")) == self.sub.group:
                last = info.get(b"last-delivered-id")
                return last if isinstance(last, bytes) else None
        return None

    async def _move_due(self, ctx: Context) -> float:
        """Move due copies from the durable delay set; seconds until the next is due."""
        try:
            return await move_due(ctx, move_due_to_stream(self.sub.copy_maxlen), self.sub.block)
        except rexc.ResponseError as e:
            # Redis refused a write (the stream is of another type now, or at
            # its last possible id, ...): what was not written is still in the
            # set.  Keep reading the stream and try again later, loudly,
            # rather than let one bad key end the consumer.
            t = ctx.target
            ctx.stats.read_errors += 1
            log.error("%s: moving due copies from %r back to %r failed: %s; trying again in %g s",
                      ctx.name, t.delay_key, t.source, e, _MOVE_RETRY,
                      extra={"subscription": ctx.name})
            return _MOVE_RETRY

    async def _lease(self, ctx: Context) -> None:
        """Keep held entries' idle time low so no other consumer claims them.

        Renewed every third of the shortest idle time after which another
        consumer may take an entry (``_core.stream.liveness.lease_every``: the
        reaper's ``heartbeat`` in PLAIN and RECLAIM, ``min_idle`` in
        RECLAIM and CLAIMING, or the shorter ``min_idle`` a live peer that
        claims registered, as the last look found it:
        ``StreamPresence.shortest``; a look that finds a shorter one cuts
        the wait short, and so does the lease's own read of the registry
        while the read loop waits for busy handlers: ``liveness.follows``, a
        task beside the renewals), so an entry being handled stays well
        below it while the process runs -- even should this consumer's heartbeat key
        vanish (evicted, flushed); should one lapse all the same, the claim
        that finds it keeps it with its handler (see :meth:`_claim`).

        It runs until the mount's finalizer ends (``holding``), past the
        reader: through a shutdown's grace a handler still running keeps its
        entry (and an outcome on its way to the finalizer its own), while what
        no handler started is no longer renewed (``Context.leased``: a claiming
        peer may take it; the give-back leaves it with the peer).

        Only entries still pending for this consumer are renewed, checked in
        the same script (``_core._recovery.LEASE``): after a stall longer
        than ``min_idle`` (a stopped process, a blocked event loop) another
        consumer may rightly have claimed some; they stay with it.  Those,
        and those pending for nobody any more, are dropped
        (:meth:`~._port.Context.disown`): the ones no handler started
        never start here; a running handler finishes, its finalization finds
        the gate as the other consumer left it.
        """
        async with anyio.create_task_group() as tg:
            tg.start_soon(follows, self._presence, ctx)
            await self._renewals(ctx)

    async def _renewals(self, ctx: Context) -> None:
        """The renewals of :meth:`_lease` (see there)."""
        sub = self.sub
        presence = self._presence
        due = anyio.current_time()
        while True:  # every interval from the last one's start: a renewal cut late is followed at once
            while True:  # the period may shrink meanwhile (a look found a peer claiming sooner)
                interval = lease_every(sub.mode, sub.min_idle, sub.heartbeat, presence.shortest)
                if anyio.current_time() >= due + interval:
                    break
                with anyio.move_on_at(due + interval):
                    await presence.shortened()
            due = max(due + interval, anyio.current_time())
            timeout = lease_timeout(interval, FINALIZE_TIMEOUT)
            ids = ctx.leased()
            for i in range(0, len(ids), 500):
                part = ids[i : i + 500]
                try:
                    replies = await ctx.client.evalsha(
                        LEASE, (sub.stream,), (sub.group, ctx.consumer.name, *part),
                        timeout=timeout,
                    )
                except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError) as e:
                    log.warning("%s: lease renewal failed: %s", ctx.name, e,
                                extra={"subscription": ctx.name})
                    continue
                others = lease_lost(part, replies)
                if others:
                    _disown(ctx, others)

    def _resume_at(self) -> str:
        """Where a group destroyed mid-run is recreated: the last id handed over."""
        last = self.own_pel.last
        return last.decode() if last is not None else self.sub.start_id


def _disown(ctx: Context, others: dict[str, str]) -> None:
    """Entries the lease found pending for another consumer: dropped, the
    unstarted ones never started; logged.  (One pending for nobody is left
    as it is: finalized meanwhile -- its finalization is on the way --, or
    its group recreated at the last id read, where a queued entry must
    still be handled, not skipped.)"""
    dropped = ctx.disown(others)
    owners = sorted(set(others.values()))
    log.warning("%s: %d entries held by this consumer are now pending for %s (claimed "
                "while this consumer stalled past the lease); left with them, dropped "
                "from this consumer's lease: %s", ctx.name, len(others),
                ", ".join(repr(o) for o in owners), ", ".join(sorted(others)[:20]),
                extra={"subscription": ctx.name, "entry_ids": sorted(others)})
    if dropped:
        log.warning("%s: %d entries read and not started are another consumer's now; "
                    "not started here: %s",
                    ctx.name, len(dropped), ", ".join(str(d.id) for d in dropped[:20]),
                    extra={"subscription": ctx.name, "entry_ids": [d.id for d in dropped]})
