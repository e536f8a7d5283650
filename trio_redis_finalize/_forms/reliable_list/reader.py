"""Reliable lists: ``ReliableListSubscription`` (BLMOVE into a processing list)."""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
from redis import exceptions as rexc

from ..._context import (
    FINALIZE_TIMEOUT,
    READ_MARGIN,
    Context,
    Item,
    backoff,
    describe_error,
    log,
)
from ..._core._commands import Command
from ..._core._decode import list_deliveries, list_delivery
from ..._core._finalize import Gates
from ..._core._identity import claim, heartbeat_value, renew
from ..._core._plan import Effect, Plan, Target
from ..._core._recovery import SCHEDULE_LEFT, schedule_key, schedule_left, schedule_member
from ..._core._replies import NOT_RUN, classify
from ..._core.reliable_list.gates import ListGates
from ..._core.reliable_list.liveness import (
    BUMP,
    GIVE_BACK,
    REAP,
    STOP,
    bumped,
    dec,
    doubtful,
    heartbeat_key,
    legacy_heartbeat_key,
    legacy_registry_key,
    receipts_key,
    registry_key,
    stop_args,
    stranded,
)
from ..._core.reliable_list.scripts import MOVE_DUE_TO_LIST
from ..._core.stream.liveness import HEARTBEAT_FLOOR
from ..._delivery import Delivery
from ..._identity import NameHold
from ..._keys import derived, same_slot
from ..._shutdown import CLOSING_TIMEOUT, Budget, cleanup
from ..._subscription import (
    DEFAULT_MAX_ATTEMPTS,
    QUEUE_DEAD_LETTER,
    DelayedRetry,
    Form,
    Subscription,
    check_delay,
    check_key,
    check_limits,
    check_positive,
    resolve_dead_letter,
)
from ..._transport import Connection
from .._delay_set import move_due
from .._read_loop import Pending, check_type, reader_connection

__all__ = ["ReliableListReader", "ReliableListSubscription"]


@dataclasses.dataclass(frozen=True, slots=True)
class ReliableListSubscription(Subscription):
    """Read a list with ``BLMOVE queue processing RIGHT LEFT`` (producers LPUSH: FIFO).

    Args:
        queue: the list producers LPUSH onto.
        processing: this consumer's processing list (default
            ``{queue}:processing:<consumer name>``).
        delayed_retry: RUNTIME (default) or DURABLE_ZSET for ``retry_after``.
        max_attempts: attempts before a RETRY (or a failure under
            ``Backoff``) goes to ``dead_letter``; default 10
            (``DEFAULT_MAX_ATTEMPTS``); ``None``: retried forever, no dead letter.
        dead_letter: list that receives exhausted and rejected elements
            (LPUSH); default ``{queue}:dead`` (same hash slot; none when
            ``max_attempts=None``); ``None``: exhausted elements are dropped
            with a warning and ``reject`` is refused.
        block: seconds one BLMOVE blocks.
        delay_key: the durable delay set (default ``{queue}:delayed``).
        heartbeat: seconds after which a silent consumer counts as dead and
            its processing list is moved back onto the queue by a live one.
    """

    queue: str
    _: dataclasses.KW_ONLY  # the rest keyword-only, as documented
    processing: str | None = None
    delayed_retry: DelayedRetry | None = None
    max_attempts: int | None = DEFAULT_MAX_ATTEMPTS
    dead_letter: str | None = QUEUE_DEAD_LETTER
    block: float = 1.0
    delay_key: str | None = None
    heartbeat: float = 30.0

    form = Form.RELIABLE_LIST

    def __post_init__(self) -> None:
        check_key("queue", self.queue)
        if self.processing is not None:
            check_key("processing", self.processing)
            if self.processing == self.queue:
                raise ValueError("processing must differ from queue")
        check_delay(self.delayed_retry, self.delay_key)
        # the default dead letter ({queue}:dead), named now (None without max_attempts)
        object.__setattr__(self, "dead_letter", resolve_dead_letter(
            self.queue if isinstance(self.queue, str) else "", self.max_attempts, self.dead_letter))
        check_limits(self.max_attempts, self.dead_letter)
        if self.dead_letter is not None and self.dead_letter in (self.queue, self.processing):
            raise ValueError("dead_letter must differ from queue and processing")
        if self.delay_key is not None and self.delay_key in (self.queue, self.processing):
            raise ValueError("delay_key must differ from queue and processing")
        if (self.dead_letter is not None and self.delayed_retry is DelayedRetry.DURABLE_ZSET
                and self.dead_letter == (self.delay_key or derived(self.queue, ":delayed"))):
            raise ValueError(f"dead_letter must differ from the delay_key {self.dead_letter!r} "
                             "(the dead letter is a list, the delay set a sorted set)")
        check_positive("block", self.block)
        check_positive("heartbeat", self.heartbeat)
        if self.heartbeat < HEARTBEAT_FLOOR:
            raise ValueError(f"heartbeat must be >= {HEARTBEAT_FLOOR} s (too short to renew a "
                             f"consumer's lease), got {self.heartbeat!r}")

    @property
    def name(self) -> str:
        return f"reliable list {self.queue!r}"

    def processing_key(self, consumer: str) -> str:
        return self.processing or derived(self.queue, f":processing:{consumer}")

    def target(self, consumer: str, *, cluster: bool = False) -> Target:
        """The resolved target.

        Raises:
            ValueError: in Redis Cluster (``cluster=True``), a ``processing``
                list or durable ``delay_key`` in another hash slot than the queue.
        """
        t = Target(
            form=Form.RELIABLE_LIST,
            name=self.name,
            source=self.queue,
            processing=self.processing_key(consumer),
            delayed_retry=self.delayed_retry or DelayedRetry.RUNTIME,
            delay_key=self.delay_key or derived(self.queue, ":delayed"),
            max_attempts=self.max_attempts,
            dead_letter=self.dead_letter,
            cluster=cluster,
        )
        if cluster:
            if not same_slot(t.source, t.processing):
                raise ValueError(
                    f"processing {t.processing!r} must share the hash slot of queue "
                    f"{t.source!r} in Redis Cluster (BLMOVE moves between them)"
                )
            if t.delayed_retry is DelayedRetry.DURABLE_ZSET and not same_slot(t.source, t.delay_key):
                raise ValueError(
                    f"delay_key {t.delay_key!r} must share the hash slot of queue {t.source!r} "
                    "in Redis Cluster (one script moves copies between them)"
                )
        return t


# -- runtime ------------------------------------------------------------------
#
# The keys beside the queue (registry, heartbeats), the reader's scripts and
# its multiset counting are in ``_core._reliable``; its counted gates in
# ``_core._list_gates``.

_PREFETCH_MAX = 64
"""At most this many elements move into the processing list per round trip."""
_CHUNK_WORK = 0.01
"""Seconds of handler work one prefetch aims at (fast handlers: bigger batches)."""
_REAP_PAGE = 100
_LAPSE_MARGIN = 0.005
"""Seconds after a peer's heartbeat key's TTL ends before the look that finds it gone."""
_REAP_ROUNDS = 1000
_RECHECK = 1.0
"""Seconds after a rescan that may have taken a stranded copy for an identical
one finalized meanwhile before the processing list is looked at again."""
_BYTES = {bytes}  # the types of a read's replies when none is an error


class ReliableListReader:
    """Reads one :class:`ReliableListSubscription`.

    * ``BLMOVE queue processing RIGHT LEFT`` on a dedicated connection, with
      up to 63 ``LMOVE`` pipelined behind it when the queue is busy and the
      handlers fast (the prefetch adapts: slow handlers keep it at 1, so
      other consumers get the rest).  The client-side deadline of a read is
      ``block`` + 1 s.
    * Crash recovery: on start, and after every read error (a lost BLMOVE
      reply strands an element), the processing list is read; what it holds
      that this reader does not hold (as a multiset: identical elements are
      counted) is delivered again.  On start its retry counter is bumped in
      place first (``LSET``): the previous process may have been handling
      it, so a crash counts as an attempt and a poison element that kills
      its consumer reaches ``max_attempts`` (then it is dead-lettered without
      calling the handler).  Later, such an element was stranded by a lost
      read of this process and no handler saw it: delivered as it is (not an
      attempt), unless a copy this reader handled may have been left by its
      removal (a closed gate, an error reply).
    * Identical elements: the finalizer asks the reader's counted gates
      (:attr:`gates`, a ``_core._list_gates.ListGates``) for the commands of
      each batch before it is first sent; a removal of an element of which
      this reader holds several copies then carries ``n`` (see
      ``_plan.list_counted``), so that a resend after an unknown outcome
      never removes a copy another handler still holds; the gates count
      answered removals down.  What counting cannot tell apart: a
      removal of X resent after an unknown outcome while a read of another
      X also lost its reply and the rescan has not adopted it yet - "sent
      removal applied + one stranded X" and "removal not applied" leave the
      same list, and the resend removes one X.  For a copying removal
      (RETRY, dead letter, delay) the stranded X lives on as the second copy;
      for ACK / DROP it is gone (two lost replies on identical bytes).
    * Dead consumers: a heartbeat key with a TTL of ``heartbeat`` seconds,
      renewed every ``heartbeat / 3``; every ``heartbeat / 2``, and as soon as
      a live one's key would lapse, each consumer
      looks in the registry for consumers whose heartbeat key is gone and
      moves their processing lists back onto the queue (gated script,
      element by element, counter bumped, to the consumer end in their
      original order: recovered elements are read first).  A slow handler
      does not stop the heartbeat; a blocked event loop does.
    * Shutdown: elements read but never handed to a handler go back onto the
      queue (consumer end, not counted as an attempt); those being handled
      when ``shutdown_grace`` ran out stay in the processing list, and the
      heartbeat is extended to cover the grace.  Once the shutdown is over
      (:meth:`closed`), what is left in the processing list goes back onto
      the queue at once (counted when a handler ran), and the consumer
      deregisters (its heartbeat key and registry entry deleted).
    * ``DelayedRetry.DURABLE_ZSET``: due copies are moved from the delay set
      before each read, and the read blocks no longer than the next is due.
    * ``on_error=Backoff()``: a failed element stays in the processing list,
      held (counted in ``gates.in_hand`` / ``gates.unsent`` as before), while it waits;
      then :meth:`redeliver` bumps its retry counter in place (``LSET``)
      before handing it over, so the attempt counts before the handler runs
      (a crash during the wait or the handler is counted by the next
      start's bump as usual).  A redelivery cut by shutdown between the
      bump and the hand-over gives the bumped element back to the queue:
      one attempt too many, never one too few.  Its due time is kept in
      Redis (``<processing list>:backoff``, by the element's digest): the
      rescan after a restart lets it wait out the rest.
    * A finalization Redis refuses for good leaves the element in the
      processing list: it is held again and delivered again (bumped), as its
      next attempt, 1 s after the refusal (doubling with each attempt, at
      most 30 s), while the consumer runs (no rescan needed).
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
        self._recheck_at: float | None = None  # a rescan that may have missed a copy: again then
        self._started = False  # a catch_up went through (the first rescan bumps counters)
        self._previous = 0  # elements the previous turn handed over
        self._blmove: Command = ()
        self._lmove: Command = ()
        self._name_hold = NameHold()  # this consumer name's heartbeat (_identity)
        self._abandoned = 0  # elements given back unstarted at the shutdown (abandon)
        self._lapse: float | None = None  # seconds until the first live peer's heartbeat lapses
        self._looked = False  # the first look for dead consumers (at mount) was made

    @property
    def pending(self) -> Pending:
        """This reader: failed deliveries stay pending (``redeliver``, ``leave_pending``)."""
        return self

    def abandon(self, deliveries: Sequence[Delivery]) -> Plan | None:
        """Give elements read but never started (shutdown) back to the queue.

        They go to the consumer end, oldest rightmost, so they are read next
        (by any consumer), and their attempt is not counted; should that fail
        they stay in the processing list, recovered later as after a crash.
        """
        raws = [d.raw for d in deliveries if d.raw is not None]
        self._abandoned += len(raws)
        return self._give_back_plan(raws)

    def _give_back_plan(self, raws: Sequence[bytes]) -> Plan | None:
        if not raws or self._target is None:
            return None
        t = self._target
        args: list[bytes | int] = []
        for e in reversed(raws):
            args += [e, 1]  # n: set by prepare() when it is sent
        return Plan(Effect.NOTHING, (GIVE_BACK.command((t.processing, t.source), args),))

    async def _built(self, ctx: Context, built: list[tuple[Delivery, Plan | None]]) -> None:
        """:meth:`_hand_over` of deliveries built one by one (``list_delivery``)."""
        await self._hand_over(
            ctx, [d.raw for d, _ in built if d.raw is not None],
            [d for d, p in built if p is None], [(d, p) for d, p in built if p is not None],
        )

    async def _hand_over(self, ctx: Context, raws: Sequence[bytes], ready: list[Delivery],
                         direct: Sequence[Item]) -> None:
        """:func:`~._context.hand_over`, giving back what was not handed over when cancelled.

        ``raws``: the elements of ``ready`` and ``direct``, in the order they were read.
        """
        sent = False
        try:
            if direct:
                await ctx.send_plans(list(direct))
            sent = True
            # Context.deliver() hands over all or nothing: cancelled means none
            # of them reached a handler, whatever the concurrency
            await ctx.deliver(ready)
        except BaseException:
            back = [d.raw for d in ready if d.raw is not None] if sent else list(raws)
            plan = self._give_back_plan(back)
            if plan is not None:
                commands = self._gates.prepare(list(plan.commands))
                with cleanup(FINALIZE_TIMEOUT):
                    try:
                        replies = await ctx.client.pipeline(commands, timeout=FINALIZE_TIMEOUT)
                        self._gates.settle([], commands, replies)
                    except (rexc.RedisError, OSError) as e:
                        log.warning("%s: could not give %d element(s) back to the queue (%s); "
                                    "they stay in the processing list", ctx.name, len(back), e)
            raise

    # -- on_error=Backoff ---------------------------------------------------------
    async def redeliver(self, ctx: Context, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Deliver again, as their next attempt, elements whose handler failed.

        Called by the mount once their :class:`~trio_redis_finalize.Backoff`
        delay is over; they waited in the processing list, held.  Each gets
        its retry counter one higher in place (``BUMP``: ``LPOS`` + ``LSET``,
        gated on the element still being there), then goes to the handlers.
        While the bump is on the way the reader holds both the old and the
        new bytes, so a rescan meanwhile delivers neither; removals sent
        meanwhile count (``_plan.list_counted``) neither: the old copy is no
        longer theirs, the new one not yet in the list.  An element gone
        meanwhile (reaped after a lapsed heartbeat) is forgotten.

        Identical elements: a bump takes one copy of the bytes out of the
        processing list like a removal, but on its own connection, so it is
        sent only while no removal of the same bytes is on the way (sent,
        not answered) -- else that removal's count (``_plan.list_counted``)
        could meet one copy less than it was counted for.  Those are
        returned, to be tried again a moment later.

        Raises (nothing delivered) when the bumps get no answer; the old bytes
        stay held for the mount's next try, and a rescan is asked for, which
        delivers the new bytes should a bump have been applied after all.
        """
        t = ctx.target
        held, unsent = self._gates.in_hand, self._gates.unsent
        busy = {e for d in deliveries if (e := d.raw) is not None
                and held.get(e, 0) > unsent.get(e, 0)}  # a removal of those bytes on the way
        later = [d for d in deliveries if d.raw in busy]
        failed = [d for d in deliveries if d.raw is not None and d.raw not in busy]
        old = [d.raw for d in failed if d.raw is not None]
        new = [bumped(e) for e in old]  # None: cannot carry a higher counter (delivered as is)
        for e, n in zip(old, new, strict=True):
            if n is not None:
                # the old bytes leave the counts of removals now, the new ones
                # join them once they are in the list (its reply); held both
                # meanwhile, for the rescan
                dec(unsent, e)
                held[n] = held.get(n, 0) + 1
        cmds = [BUMP.command((t.processing,), (e, n))
                for e, n in zip(old, new, strict=True) if n is not None]
        try:
            replies = iter(await ctx.client.pipeline(cmds, timeout=FINALIZE_TIMEOUT) if cmds else [])
        except BaseException:
            for e, n in zip(old, new, strict=True):
                if n is not None:
                    unsent[e] = unsent.get(e, 0) + 1
                    dec(held, n)
            self._gates.rescan_wanted = True
            raise
        built: list[tuple[Delivery, Plan | None]] = []
        for d, e, n in zip(failed, old, new, strict=True):
            if n is None:
                raw = e
            else:
                dec(held, e)
                if next(replies) is None:  # gone from the processing list meanwhile
                    dec(held, n)
                    log.warning("%s: a failed element (origin %s, attempt %d) is no longer in "
                                "processing list %r; not delivered again", ctx.name,
                                d.origin_id, d.attempt, t.processing)
                    continue
                raw = n
                unsent[n] = unsent.get(n, 0) + 1
            built.append(list_delivery(ctx.target, self.sub.queue, raw))
        await self._built(ctx, built)
        return later

    def leave_pending(self, ctx: Context, deliveries: Sequence[Delivery]) -> None:
        """Forget failed elements without a timer (the mount's waiting set is
        full): they stay in the processing list, not held, for the next rescan
        (after a read error, at a start), which delivers them again counted as
        an attempt."""
        leave = self._gates.leave
        for d in deliveries:
            if d.raw is not None:
                leave(d.raw)

    def hold_again(self, ctx: Context, d: Delivery) -> None:
        """An element whose finalization Redis refused for good, still in the
        processing list: held again (its gates counted it out, and left it for
        a rescan) until :meth:`redeliver` bumps it and hands it over."""
        raw = d.raw
        if raw is None:
            return
        gates = self._gates
        dec(gates.leftover, raw)
        gates.hold(raw)

    async def _waits(self, ctx: Context, elements: list[tuple[bytes, bool]]) -> set[int]:
        """Of elements a rescan found (``stranded``), the indexes of those whose
        Backoff is not due yet (``_core._recovery``'s schedule, by the
        server's clock: a restart while they waited): held, they wait out the
        rest and come back as their next attempt (the mount's redeliverer)."""
        t = ctx.target
        members = [schedule_member(t, None, e) or b"" for e, _ in elements]
        try:
            reply = await ctx.client.evalsha(SCHEDULE_LEFT, (schedule_key(t),), members,
                                             timeout=FINALIZE_TIMEOUT)
        except rexc.ResponseError as err:
            if classify(err) is NOT_RUN:
                raise
            # final (the key is of another type ...): the rescan goes on without it
            log.warning("%s: reading the Backoff schedule %r failed (%s); %d element(s) are "
                        "delivered now", ctx.name, schedule_key(t), err, len(elements))
            return set()
        out: set[int] = set()
        for i, ((e, _), (left, _a)) in enumerate(zip(elements, schedule_left(reply), strict=True)):
            if left <= 0:
                continue
            d, plan = list_delivery(t, self.sub.queue, e)
            if plan is not None:
                continue  # dead-lettered now (corrupt, past max_attempts)
            self._hold(e)
            if ctx.defer(d, left):
                out.add(i)
            else:
                self._unhold(e)
        if out:
            log.info("%s: %d element(s) in processing list %r wait out the rest of their "
                     "Backoff (kept in %r) before they are delivered again", ctx.name, len(out),
                     t.processing, schedule_key(t), extra={"subscription": ctx.name})
        return out

    # -- bookkeeping ----------------------------------------------------------
    def _unhold(self, raw: bytes) -> None:
        dec(self._gates.unsent, raw)
        dec(self._gates.in_hand, raw)

    def _hold(self, raw: bytes) -> None:
        self._gates.hold(raw)

    @property
    def gates(self) -> Gates:
        """The counted gates the finalizer's core uses for this reader's
        removals (``_core._list_gates``)."""
        return self._gates

    # -- recovery -------------------------------------------------------------
    async def _rescan(self, conn: Connection, ctx: Context, *, start: bool = True) -> None:
        """Deliver what the processing list holds that this reader does not.

        At start (``start``) every element there is an attempt: the previous
        process may have been handling it (its counter is bumped in place).
        Later, an element this reader does not hold was stranded by a lost
        read reply of this process: delivered as it is (no handler saw it),
        but for copies this reader handled whose removal may have left them.
        """
        t = ctx.target
        self._gates.rescan_wanted = False
        self._recheck_at = None
        # what is held as the LRANGE is sent: a removal answered while it is on
        # its way may have run after it (see _core._reliable.stranded)
        before = dict(self._gates.in_hand)
        items: list[bytes] = await conn.execute("LRANGE", t.processing, 0, -1,
                                                timeout=FINALIZE_TIMEOUT)
        gates = self._gates
        held = gates.in_hand
        lost = stranded(items, held, gates.leftover, gates.delayed,
                        start=start, before=before)
        if doubtful(items, held, before):
            self._recheck_at = anyio.current_time() + _RECHECK
        if not lost:
            return
        waits = await self._waits(ctx, lost)
        if waits:
            lost = [x for i, x in enumerate(lost) if i not in waits]
            if not lost:
                return
        log.warning("%s: %d element(s) in processing list %r were not finalized; "
                    "delivering them again", ctx.name, len(lost), t.processing)
        for i in range(0, len(lost), 500):
            await self._redeliver(ctx, lost[i : i + 500])

    async def _redeliver(self, ctx: Context, elements: list[tuple[bytes, bool]]) -> None:
        t = ctx.target
        news = [bumped(e) if bump else e for e, bump in elements]
        cmds = [BUMP.command((t.processing,), (e, n))
                for (e, bump), n in zip(elements, news, strict=True) if bump and n is not None]
        replies = iter(await ctx.client.pipeline(cmds, timeout=FINALIZE_TIMEOUT) if cmds else [])
        built: list[tuple[Delivery, Plan | None]] = []
        for (e, bump), n in zip(elements, news, strict=True):
            if n is None:  # corrupt: cannot carry a counter, dead-lettered as it is
                raw = e
            elif bump and next(replies) is None:  # gone meanwhile (reaped, finalized)
                continue
            else:
                raw = n
            self._hold(raw)
            built.append(list_delivery(ctx.target, self.sub.queue, raw))
        await self._built(ctx, built)

    # -- heartbeat and reaper -----------------------------------------------------
    def _beat(self, ctx: Context, ttl: float) -> Command:
        """A heartbeat, only while the key is this process's (``_core._identity``)."""
        sub = self.sub
        me = ctx.consumer.name
        return renew(heartbeat_key(sub.queue, me), registry_key(sub.queue),
                     heartbeat_value(ctx.consumer.token, sub.heartbeat), ttl, me,
                     ctx.target.processing)

    async def _heartbeat(self, ctx: Context) -> None:
        every = self.sub.heartbeat / 3
        while True:
            await anyio.sleep(every)
            try:
                await self._name_hold.renew(ctx, self._beat(ctx, self.sub.heartbeat), FINALIZE_TIMEOUT)
            except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError, OSError) as e:
                log.warning("%s: heartbeat failed (%s); other consumers may take over this "
                            "consumer's processing list after %.1f s without one",
                            ctx.name, e, self.sub.heartbeat)

    async def _reaper(self, ctx: Context) -> None:
        """Look for dead consumers every ``heartbeat / 2`` (jittered), and as
        soon as a live one's heartbeat key would lapse (its ``PTTL``): a
        killed consumer's processing list is back on the queue about
        ``heartbeat`` after the kill."""
        every = self.sub.heartbeat / 2
        while True:
            wait = every * random.uniform(0.8, 1.2)
            try:
                await self.reap(ctx)
                if self._lapse is not None:
                    wait = min(wait, self._lapse + _LAPSE_MARGIN)
            except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError, OSError) as e:
                log.warning("%s: looking for dead consumers failed: %s", ctx.name, e)
            await anyio.sleep(wait)

    async def reap(self, ctx: Context) -> int:
        """Move the processing lists of dead consumers back onto the queue."""
        sub = self.sub
        client = ctx.client
        me = ctx.consumer.name.encode()
        self._lapse = None
        flat, old = await client.pipeline(
            [("HGETALL", registry_key(sub.queue)), ("HGETALL", legacy_registry_key(sub.queue))],
            timeout=FINALIZE_TIMEOUT)
        found = dict(zip(flat[::2], flat[1::2], strict=True))
        # consumers of an earlier version (the old key naming): their own keys
        legacy = {n: p for n, p in zip(old[::2], old[1::2], strict=True) if n not in found}
        others = [(n, p, False) for n, p in found.items() if n != me]
        others += [(n, p, True) for n, p in legacy.items() if n != me]
        if not others:
            return 0
        ttls = await client.pipeline(
            [("PTTL", self._keys_of(n.decode(), old_naming)[0]) for n, _, old_naming in others],
            timeout=FINALIZE_TIMEOUT,
        )
        moved = 0
        watch: list[tuple[str, str, float]] = []
        for (name, proc, old_naming), ttl in zip(others, ttls, strict=True):
            if int(ttl) != -2:  # alive (-1: no expiry)
                if int(ttl) >= 0:
                    lapse = int(ttl) / 1000
                    self._lapse = lapse if self._lapse is None else min(self._lapse, lapse)
                    watch.append((name.decode(), proc.decode(), lapse))
                continue
            moved += await self._reap_one(ctx, name.decode(), proc.decode(), old_naming)
        if not self._looked:  # at mount: the live ones holding elements, and when
            self._looked = True
            await self._watch_notes(ctx, watch)
        return moved

    def _keys_of(self, name: str, old_naming: bool) -> tuple[str, str]:
        """A consumer's heartbeat key and registry, in the naming it registered with."""
        q = self.sub.queue
        if old_naming:
            return legacy_heartbeat_key(q, name), legacy_registry_key(q)
        return heartbeat_key(q, name), registry_key(q)

    async def _watch_notes(self, ctx: Context, watch: list[tuple[str, str, float]]) -> None:
        """At mount: a consumer killed moments ago still looks alive; say when
        the elements it holds go back onto the queue should it be dead."""
        if not watch:
            return
        sizes = await ctx.client.pipeline([("LLEN", proc) for _, proc, _ in watch],
                                          timeout=FINALIZE_TIMEOUT)
        now = time.time()
        for (name, proc, lapse), n in zip(watch, sizes, strict=True):
            if int(n):
                log.info("%s: %d element(s) in processing list %r of consumer %r, heartbeat alive "
                         "until %s: should it be dead (killed just now), moved back onto the "
                         "queue in about %.1f s", ctx.name, int(n), proc, name,
                         time.strftime("%H:%M:%S", time.gmtime(now + lapse)) + " UTC", lapse,
                         extra={"subscription": ctx.name})

    async def _reap_one(self, ctx: Context, name: str, processing: str,
                        old_naming: bool = False) -> int:
        sub = self.sub
        client = ctx.client
        keys = (processing, sub.queue, *self._keys_of(name, old_naming))
        total = 0
        for _ in range(_REAP_ROUNDS):
            page: list[bytes] = await client.execute("LRANGE", processing, 0, _REAP_PAGE - 1,
                                                     timeout=FINALIZE_TIMEOUT)
            args: list[bytes | str] = [name]
            for e in page:  # newest first (see REAP)
                args += [e, bumped(e) or e]
            n = int(await client.evalsha(REAP, keys, args, timeout=FINALIZE_TIMEOUT))
            if n < 0:
                break  # it came back
            total += n
            if not page:
                # its delayed copies' receipts: a dead consumer resends none
                await client.execute("DEL", receipts_key(processing), timeout=FINALIZE_TIMEOUT)
                break
        if total:
            ctx.stats.effects["recovered"] += total
            log.warning("%s: consumer %r stopped its heartbeat; moved %d element(s) of its "
                        "processing list %r back onto the queue", ctx.name, name, total,
                        processing)
        return total

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
        me = ctx.consumer.name
        keys = (heartbeat_key(sub.queue, me), registry_key(sub.queue),
                legacy_heartbeat_key(sub.queue, me), legacy_registry_key(sub.queue))
        value = heartbeat_value(ctx.consumer.token, sub.heartbeat)
        await self._name_hold.claim(  # the first heartbeat: the claim of the consumer name
            ctx, lambda takeover: claim(keys, value, sub.heartbeat, takeover, me, t.processing),
            heartbeat_key(sub.queue, me), legacy_heartbeat_key(sub.queue, me), FINALIZE_TIMEOUT)
        self._blmove = ("BLMOVE", sub.queue, t.processing, "RIGHT", "LEFT")
        self._lmove = ("LMOVE", sub.queue, t.processing, "RIGHT", "LEFT")

    def background(self, ctx: Context) -> Sequence[Callable[[], Coroutine[Any, Any, None]]]:
        return (functools.partial(self._heartbeat, ctx), functools.partial(self._reaper, ctx))

    def connection(self, ctx: Context) -> AbstractAsyncContextManager[Connection]:
        return reader_connection(ctx, self.sub.queue)

    async def connected(self, ctx: Context, conn: Connection) -> None:
        self._rescan_planned = True  # at start: the previous process's; later: a lost read's

    async def catch_up(self, ctx: Context, conn: Connection) -> None:
        """Due durable copies onto the queue, then the rescan when one is planned or wanted."""
        if (ctx.target.delayed_retry is DelayedRetry.DURABLE_ZSET
                and anyio.current_time() >= self._next_move):
            wait = await self._move_due(ctx)
            self._next_move = anyio.current_time() + wait
        recheck = self._recheck_at
        if (self._rescan_planned or self._gates.rescan_wanted
                or (recheck is not None and anyio.current_time() >= recheck)):
            await self._rescan(conn, ctx, start=not self._started)
            self._rescan_planned = False
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
        gates = self._gates
        gates.unsent.update(elements)  # held (_hold), all at once
        gates.in_hand.update(elements)
        ready, direct = list_deliveries(ctx.target, self.sub.queue, elements)
        before = anyio.current_time()
        await self._hand_over(ctx, elements, ready, direct)
        self._tune(anyio.current_time() - before, self._previous)
        self._previous = len(elements)

    def failed(self, ctx: Context, err: Exception) -> float | None:
        self._rescan_planned = True  # a lost BLMOVE reply strands an element
        return None

    async def closing(self, ctx: Context) -> None:
        """The last heartbeat: the handlers and the finalizer may still finish what
        they hold, so it lasts until they must have ended (``_shutdown.Budget``)."""
        ttl = max(self.sub.heartbeat, Budget.heartbeat_ttl(ctx.consumer.shutdown_grace))
        await self._name_hold.renew(ctx, self._beat(ctx, ttl), CLOSING_TIMEOUT)

    async def closed(self, ctx: Context) -> None:
        """After the shutdown: hand back onto the queue what is left in the
        processing list (cut by the grace, waiting for a backoff: counted as
        an attempt, as the reaper would, but at once; stranded by a read cut
        at the stop: as it is), then deregister (heartbeat key, registry
        entry) once it is empty."""
        sub = self.sub
        me = ctx.consumer.name
        t = ctx.target
        keys = (t.processing, sub.queue, heartbeat_key(sub.queue, me), registry_key(sub.queue),
                receipts_key(t.processing))
        value = heartbeat_value(ctx.consumer.token, sub.heartbeat)
        moved = 0
        left = 1
        # what a handler ran on (held, or left pending after a failure): counted down
        # as the pages go
        held = dict(Counter(self._gates.in_hand) + Counter(self._gates.leftover))
        # waiting for a Backoff: left in the processing list with its schedule (the
        # rescan of a restart honours it; a live consumer's reaper once the heartbeat lapsed)
        waiting = Counter(d.raw for d in ctx.backing_off() if d.raw is not None)
        kept = sum(waiting.values())
        for _ in range(_REAP_ROUNDS):
            page: list[bytes] = await ctx.client.execute("LRANGE", t.processing, 0, _REAP_PAGE - 1,
                                                         timeout=CLOSING_TIMEOUT)
            wait = Counter(waiting)  # each page is read from the head again
            page = [e for e in page if not dec(wait, e)]
            args: list[bytes | str] = [me, value, *stop_args(page, held)]  # newest first (see STOP)
            n, left = await ctx.client.evalsha(STOP, keys, args, timeout=CLOSING_TIMEOUT)
            moved += int(n)
            if not page or int(left) <= kept or not int(n):
                break
        if int(left) < 0:
            log.info("%s: consumer name %r is another process's now (taken over): its processing "
                     "list is left to it", ctx.name, me, extra={"subscription": ctx.name})
            return
        if moved or self._abandoned:
            ctx.stats.effects["handed_back"] += moved
            log.info("%s: consumer %r handed back %d element(s) onto the queue: %d read and not "
                     "started (their attempt not counted), %d left by handlers cut by the grace "
                     "or held for a backoff (counted)", ctx.name, me, self._abandoned + moved,
                     self._abandoned, moved, extra={"subscription": ctx.name})
        if kept and int(left) <= kept:
            log.info("%s: consumer %r stopped with %d element(s) waiting for their Backoff in "
                     "processing list %r: delivered when due by this name started again, or by "
                     "a live consumer once its heartbeat lapses", ctx.name, me, int(left),
                     t.processing, extra={"subscription": ctx.name})
        elif int(left):
            log.warning("%s: consumer %r stopped with elements left in processing list %r; a "
                        "live consumer moves them back onto the queue once its heartbeat "
                        "lapses (or this name started again delivers them)", ctx.name, me,
                        t.processing, extra={"subscription": ctx.name})
        else:
            log.debug("%s: deregistered consumer %r (processing list empty)", ctx.name, me,
                      extra={"subscription": ctx.name})
