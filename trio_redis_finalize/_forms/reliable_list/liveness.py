"""A reliable-list consumer's liveness at run time: its heartbeat, the reaper
of dead consumers of its queue, and its hand-back and deregistration at a
clean stop.

The keys (registry, heartbeat keys, receipts), the scripts (:data:`REAP`,
:data:`STOP`) and the counting (:func:`bumped`, :func:`stop_args`) are in
``_core.reliable_list.liveness`` (its docstring says why this differs from a
stream's liveness); this module sends the commands and keeps the times:

* **heartbeat** (a task beside the reader): the heartbeat key, TTL
  ``heartbeat`` seconds, and the registration (name -> processing list), at
  set-up (before the first read: the claim of the consumer name, refused
  while another live process holds it, see ``_core._identity``) and every
  ``heartbeat / 3`` (only while the key is this process's); the last one, as
  the reader stops, lives until the shutdown's handlers and finalizer must
  have ended (``_shutdown.Budget.heartbeat_ttl``);
* **reaper** (a second task): every ``heartbeat / 2`` (jittered 0.8-1.2),
  and as soon as a live peer's heartbeat key would lapse (its ``PTTL``), the
  registry (both namings) is read; a registered consumer whose heartbeat key
  is gone (``PTTL`` -2) is dead: its processing list goes back onto the
  queue page by page (:data:`REAP`, gated on the key still being absent,
  each element's counter bumped), but for the elements waiting out a
  Backoff or a runtime ``retry_after`` (the schedule beside that list):
  those go once due;
* **hand-back** (:meth:`ListLiveness.hand_back`, phase 6 of the shutdown):
  what is left in the own processing list goes back onto the queue at once
  (:data:`STOP`), then the consumer deregisters once the list is empty;
  elements waiting for a Backoff stay with their schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from collections import Counter
from collections.abc import Callable

import anyio
from redis import exceptions as rexc

from ..._core._commands import Command
from ..._core._identity import claim, heartbeat_value, renew
from ..._core._recovery import schedule_key
from ..._core.reliable_list.liveness import (
    ADOPT,
    REAP,
    STOP,
    bumped,
    dec,
    heartbeat_key,
    legacy_heartbeat_key,
    legacy_registry_key,
    moved_key,
    receipts_key,
    registry_key,
    stop_args,
)
from ..._deadlines import FINALIZE_TIMEOUT, log
from ..._hand_over import Lease
from ..._identity import NameHold
from ..._shutdown import CLOSING_TIMEOUT, Budget
from .._port import Context
from . import ReliableListSubscription
from .recovery import schedule_lefts

__all__ = ["ListLiveness"]

_REAP_PAGE = 100
_LAPSE_MARGIN = 0.005
"""Seconds after a peer's heartbeat key's TTL ends before the look that finds it gone."""
_REAP_ROUNDS = 1000


class ListLiveness:
    """The heartbeat, reaper and hand-back of one reliable-list consumer.

    * Dead consumers: a heartbeat key with a TTL of ``heartbeat`` seconds,
      renewed every ``heartbeat / 3``; every ``heartbeat / 2``, and as soon as
      a live one's key would lapse, each consumer
      looks in the registry for consumers whose heartbeat key is gone and
      moves their processing lists back onto the queue (gated script,
      element by element, counter bumped, to the consumer end in their
      original order: recovered elements are read first).  A slow handler
      does not stop the heartbeat; a blocked event loop does.
    * Shutdown: the last heartbeat (:meth:`last_beat`) covers the grace;
      once the shutdown is over (:meth:`hand_back`), what is left in the
      processing list goes back onto the queue at once (counted when a
      handler ran), and the consumer deregisters (its heartbeat key and
      registry entry deleted).
    """

    def __init__(self, sub: ReliableListSubscription,
                 stalled: Callable[[Context], object] | None = None) -> None:
        self.sub = sub
        self._stalled = stalled  # called (before the beat is sent) when a beat comes too late
        self.beat_at = 0.0  # when the last heartbeat that went through was sent
        # the handlers start nothing past it: when the key may lapse (time.monotonic)
        self.lease = Lease()
        self._name_hold = NameHold()  # this consumer name's heartbeat (_identity)
        self._lapse: float | None = None  # seconds until the first live peer's heartbeat lapses
        self._due_in: float | None = None  # seconds until a dead one's first waiting element is due
        self._looked = False  # the first look for dead consumers (at mount) was made

    # -- heartbeat ------------------------------------------------------------------
    async def register(self, ctx: Context) -> None:
        """The first heartbeat: the claim of the consumer name (before the first read)."""
        sub = self.sub
        me = ctx.consumer.name
        keys = (heartbeat_key(sub.queue, me), registry_key(sub.queue),
                legacy_heartbeat_key(sub.queue, me), legacy_registry_key(sub.queue))
        value = heartbeat_value(ctx.consumer.token, sub.heartbeat)
        processing = ctx.target.processing
        self.beat_at = anyio.current_time()
        sent = time.monotonic()
        # what the name was registered with before (another processing list:
        # changed settings), and what an earlier take-over of such a list left
        moved = moved_key(sub.queue)
        flat, legacy, noted = await ctx.client.pipeline(
            [("HGETALL", registry_key(sub.queue)), ("HGET", legacy_registry_key(sub.queue), me),
             ("HGETALL", moved)], timeout=FINALIZE_TIMEOUT)
        before = dict(zip(flat[::2], flat[1::2], strict=True))
        mine = me.encode()
        others = {p for n, p in before.items() if n != mine}
        sharing = [n.decode() for n, p in before.items() if n != mine and p == processing.encode()]
        for other in sharing:  # one processing list, one consumer: a live one's is its own
            if await ctx.client.execute("EXISTS", heartbeat_key(sub.queue, other),
                                        timeout=FINALIZE_TIMEOUT):
                raise ValueError(
                    f"processing: {processing!r} is the processing list of live consumer "
                    f"{other!r} of queue {sub.queue!r}; consumer {me!r} needs its own (the "
                    f"default {{queue}}:processing:<consumer> is one per name)")
        left = [p for p, n in zip(noted[::2], noted[1::2], strict=True) if n == mine]
        olds = [p for p in dict.fromkeys((before.get(mine), legacy, *left))
                if p is not None and p != processing.encode() and p not in others]
        if new := [p for p in olds if p not in left]:  # noted before the claim re-registers
            await ctx.client.execute("HSET", moved, *[x for p in new for x in (p, me)],
                                     timeout=FINALIZE_TIMEOUT)
        await self._name_hold.claim(
            ctx, lambda takeover: claim(keys, value, sub.heartbeat, takeover, me, processing),
            heartbeat_key(sub.queue, me), legacy_heartbeat_key(sub.queue, me), FINALIZE_TIMEOUT)
        if self._stalled is not None:  # a handler that finds it lapsed drops what none started
            self.lease.lapsed = functools.partial(self._stalled, ctx)
            self.lease.until = sent + sub.heartbeat  # (before: none read, none to start)
        for old in olds:
            await self._adopt(ctx, old.decode())

    async def _adopt(self, ctx: Context, old: str) -> None:
        """Take over the processing list this name was registered with before
        (:data:`ADOPT`): what it holds moves into this one, its Backoff
        schedule with it, so the start's rescan counts and delivers those
        elements as a restart does (those waiting out a Backoff wait out the
        rest); the name now registers this list, and no reaper looks at the
        old one again."""
        sub = self.sub
        t = ctx.target
        was = dataclasses.replace(t, processing=old)
        keys = (old, t.processing, registry_key(sub.queue), schedule_key(was), schedule_key(t),
                receipts_key(old), moved_key(sub.queue))
        total = 0
        for _ in range(_REAP_ROUNDS):
            n = int(await ctx.client.evalsha(ADOPT, keys, (ctx.consumer.name, t.processing,
                                                           _REAP_PAGE), timeout=FINALIZE_TIMEOUT))
            if n <= 0:
                break  # all moved (or the name is registered otherwise now)
            total += n
        if total:
            log.warning("%s: consumer %r was registered with processing list %r before (its "
                        "settings changed); took over the %d element(s) left there (delivered "
                        "again as after a restart)", ctx.name, ctx.consumer.name, old, total,
                        extra={"subscription": ctx.name})

    def beat(self, ctx: Context, ttl: float) -> Command:
        """A heartbeat, only while the key is this process's (``_core._identity``)."""
        sub = self.sub
        me = ctx.consumer.name
        return renew(heartbeat_key(sub.queue, me), registry_key(sub.queue),
                     heartbeat_value(ctx.consumer.token, sub.heartbeat), ttl, me,
                     ctx.target.processing)

    def late(self) -> bool:
        """Whether no heartbeat went through for ``heartbeat`` seconds: the key
        may have lapsed, and a live consumer moved the processing list back
        onto the queue (this process stalled, its event loop blocked, or Redis
        was out of reach)."""
        return anyio.current_time() - self.beat_at >= self.sub.heartbeat

    async def renew_now(self, ctx: Context) -> None:
        """A heartbeat now (the key back, if it lapsed: no reaper moves anything from then on)."""
        sent = anyio.current_time()
        held = time.monotonic() + self.sub.heartbeat  # the key lives at least until then
        await self._name_hold.renew(ctx, self.beat(ctx, self.sub.heartbeat), FINALIZE_TIMEOUT)
        self.beat_at = max(self.beat_at, sent)
        self.lease.until = max(self.lease.until, held)

    async def heartbeat(self, ctx: Context) -> None:
        """Renew the heartbeat every ``heartbeat / 3``.  A beat about to be sent
        after the key may have lapsed (:meth:`late`) first calls ``stalled``
        (the reader drops what no handler started, for a rescan once the key
        is back), before anything is sent: a renewal that fails then starts
        nothing meanwhile.  Between two looks, the handlers keep to
        :attr:`lease` themselves: a handler task past it (resumed after a
        stall before this task, or while a renewal hangs on a silent link)
        starts nothing and drops it all the same; the next renewal that goes
        through moves it on."""
        sub = self.sub
        every = sub.heartbeat / 3
        while True:
            await anyio.sleep(every)
            if self.late() and self._stalled is not None:
                self._stalled(ctx)
            try:
                await self.renew_now(ctx)
            except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError, OSError) as e:
                log.warning("%s: heartbeat failed (%s); other consumers may take over this "
                            "consumer's processing list after %.1f s without one",
                            ctx.name, e, sub.heartbeat)

    async def last_beat(self, ctx: Context) -> None:
        """The last heartbeat: the handlers and the finalizer may still finish what
        they hold, so it lasts until they must have ended (``_shutdown.Budget``)."""
        ttl = max(self.sub.heartbeat, Budget.heartbeat_ttl(ctx.consumer.shutdown_grace))
        held = time.monotonic() + ttl
        await self._name_hold.renew(ctx, self.beat(ctx, ttl), CLOSING_TIMEOUT)
        self.lease.until = max(self.lease.until, held)

    # -- the reaper -------------------------------------------------------------------
    async def reaper(self, ctx: Context) -> None:
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
                if self._due_in is not None:
                    wait = min(wait, self._due_in + _LAPSE_MARGIN)
            except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError, OSError) as e:
                log.warning("%s: looking for dead consumers failed: %s", ctx.name, e)
            await anyio.sleep(wait)

    async def reap(self, ctx: Context) -> int:
        """Move the processing lists of dead consumers back onto the queue."""
        sub = self.sub
        client = ctx.client
        me = ctx.consumer.name.encode()
        self._lapse = None
        self._due_in = None
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

    async def _not_due(self, ctx: Context, processing: str, page: list[bytes]) -> set[int]:
        """The indexes of ``page`` (elements of a dead consumer's processing
        list) whose Backoff is not due yet, by the schedule beside that list
        (``_core._recovery``, the server's clock): a restart of that name
        would let them wait out the rest, and so does the reaper.  The
        reaper's next look comes no later than the first is due
        (``_due_in``).  A schedule that cannot be read for good (a key of
        another type): none waits, as the rescan does."""
        t = dataclasses.replace(ctx.target, processing=processing)
        out: set[int] = set()
        for i, left in enumerate(await schedule_lefts(ctx, t, page)):
            if left > 0:
                out.add(i)
                self._due_in = left if self._due_in is None else min(self._due_in, left)
        return out

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
        """Move a dead consumer's processing list back onto the queue, page by
        page; an element waiting out its Backoff (its schedule beside that
        list, :meth:`_not_due`) stays until it is due (the list then stays
        registered, and the reaper looks again by then)."""
        sub = self.sub
        client = ctx.client
        keys = (processing, sub.queue, *self._keys_of(name, old_naming))
        total = 0
        kept = 0  # elements left waiting: at the head of the list, each page read after them
        for _ in range(_REAP_ROUNDS):
            page: list[bytes] = await client.execute(
                "LRANGE", processing, kept, kept + _REAP_PAGE - 1, timeout=FINALIZE_TIMEOUT)
            wait = await self._not_due(ctx, processing, page) if page else set()
            kept += len(wait)
            args: list[bytes | str] = [name]
            for i, e in enumerate(page):  # newest first (see REAP)
                if i not in wait:
                    args += [e, bumped(e) or e]
            n = int(await client.evalsha(REAP, keys, args, timeout=FINALIZE_TIMEOUT))
            if n < 0:
                break  # it came back
            total += n
            if not page:
                # its delayed copies' receipts: a dead consumer resends none
                await client.execute("DEL", receipts_key(processing), timeout=FINALIZE_TIMEOUT)
                break
        if kept:
            log.info("%s: %d element(s) in processing list %r of dead consumer %r wait out the "
                     "rest of their Backoff before they go back onto the queue", ctx.name, kept,
                     processing, name, extra={"subscription": ctx.name})
        if total:
            ctx.stats.effects["recovered"] += total
            log.warning("%s: consumer %r stopped its heartbeat; moved %d element(s) of its "
                        "processing list %r back onto the queue", ctx.name, name, total,
                        processing)
        return total

    # -- the stop ---------------------------------------------------------------------
    async def hand_back(self, ctx: Context, held: dict[bytes, int], abandoned: int,
                        late: int = 0) -> None:
        """After the shutdown: hand back onto the queue what is left in the
        processing list (cut by the grace, waiting for a backoff: counted as
        an attempt, as the reaper would, but at once; stranded by a read cut
        at the stop: as it is), then deregister (heartbeat key, registry
        entry) once it is empty.

        ``held``: what a handler ran on (held, or left pending after a
        failure), a multiset counted down as the pages go; ``abandoned``: the
        elements the reader gave back unstarted at the shutdown (logged);
        ``late``: how many of those are still here (their give-back was never
        answered), moved back here, uncounted (not in ``held``)."""
        sub = self.sub
        me = ctx.consumer.name
        t = ctx.target
        keys = (t.processing, sub.queue, heartbeat_key(sub.queue, me), registry_key(sub.queue),
                receipts_key(t.processing))
        value = heartbeat_value(ctx.consumer.token, sub.heartbeat)
        moved = 0
        left = 1
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
        if moved or abandoned:
            ctx.stats.effects["handed_back"] += moved
            counted = max(moved - late, 0)  # (the late give-backs: among the abandoned)
            log.info("%s: consumer %r handed back %d element(s) onto the queue: %d read and not "
                     "started (their attempt not counted), %d left by handlers cut by the grace "
                     "or held for a backoff (counted)", ctx.name, me, abandoned + counted,
                     abandoned, counted, extra={"subscription": ctx.name})
        if kept and int(left) <= kept:
            log.info("%s: consumer %r stopped with %d element(s) waiting for their Backoff in "
                     "processing list %r: delivered when due by this name started again, or by "
                     "a live consumer once its heartbeat lapsed and they are due", ctx.name, me, int(left),
                     t.processing, extra={"subscription": ctx.name})
        elif int(left):
            log.warning("%s: consumer %r stopped with elements left in processing list %r; a "
                        "live consumer moves them back onto the queue once its heartbeat "
                        "lapses (or this name started again delivers them)", ctx.name, me,
                        t.processing, extra={"subscription": ctx.name})
        else:
            log.debug("%s: deregistered consumer %r (processing list empty)", ctx.name, me,
                      extra={"subscription": ctx.name})
