"""A stream mount's presence at run time: its heartbeat, the reaper of dead
consumers of its group, and its deregistration at a clean stop.

The keys, the scripts and every decision (who is dead, what to take, what to
warn about) are in :mod:`._core.stream.liveness` and
:mod:`._core.stream.survey`; this module sends the commands
and keeps the times:

* **heartbeat** (a task beside the reader): ``SET`` the heartbeat key with a
  TTL of ``heartbeat`` seconds and ``HSET`` the registration, at set-up (before
  the first read: the claim of the consumer name, refused while another live
  process holds it, see ``_core._identity``) and every ``heartbeat / 3``
  (only while the key is this process's); the last one, as the reader
  stops, lives until the shutdown's handlers and finalizer must have ended
  (``_shutdown.Budget.heartbeat_ttl``), so nobody takes over what they still
  finish;
* **reaper** (a step of the read loop, :meth:`StreamPresence.look`, so that
  what it takes is handed over in turn with the own-PEL recovery and the
  claims): at mount, every ``heartbeat / 2`` (jittered), as soon as a live
  consumer's heartbeat key would lapse (its ``PTTL``) and as soon as a dead
  one's next entry is idle enough;
* **stop probe** (also a step of the read loop): every ``STOP_PROBE`` s an
  ``HGETALL`` of the registry; a new stopped mark makes the next look now,
  so what a peer handed back at its stop is taken within about a second;
  so does a new registration of a peer that claims entries idle less than
  this mount's own guard: the look finds whether it is alive, and the lease
  (``reader``) renews every third of its ``min_idle`` from then on
  (:attr:`StreamPresence.shortest`; ``_core.stream.liveness``, the lease
  period);
* **follow** (a task of the lease, :func:`follows`): while
  the read loop's probe is overdue (it waits for busy handlers) and entries
  are in hand, the same ``HGETALL`` every ``STOP_PROBE``, then the ``PTTL``
  of each such new peer's heartbeat key: the live ones are followed at
  once (no look: taking over and handing over stay the read loop's);
* **hand-back** (:meth:`StreamPresence.deregister`, phase 6 of the
  shutdown): one script (:data:`~._core.stream.liveness.STOP`) makes what is
  still pending for this consumer idle at once (owner and count unchanged),
  deletes the heartbeat key and leaves the stopped mark; a consumer with
  nothing pending is deleted from the group.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import anyio
from redis import exceptions as rexc

from ..._core._commands import Command
from ..._core._identity import heartbeat_value
from ..._core._replies import FINAL, classify, error_code
from ..._core.stream.decode import Entry, parse_reap
from ..._core.stream.liveness import (
    HANDED_BACK_IDLE_MS,
    REAP,
    SEEN_WITHIN,
    STOP,
    STOP_PROBE,
    alive_claimers,
    beat,
    claim_name,
    claimer_probe,
    follow_at,
    stop_probe,
    stopped_value,
)
from ..._core.stream.survey import (
    Heartbeat,
    Survey,
    WarmUp,
    claim_min_idle,
    claimers,
    consumer_rows,
    heartbeat_key,
    lease_every,
    lease_guard,
    legacy_heartbeat_key,
    legacy_registry_key,
    peers,
    registry,
    registry_key,
    shorter_notes,
    survey,
    warm_up,
    warm_up_note,
    warnings,
    watch_notes,
)
from ..._deadlines import FINALIZE_TIMEOUT, log
from ..._identity import NameHold
from ..._shutdown import CLOSING_TIMEOUT, Budget
from .._port import Context

if TYPE_CHECKING:
    from ..._subscription import Mode

__all__ = ["Adopt", "StreamPresence", "follows"]

_LAPSE_MARGIN = 0.005
"""Seconds after a heartbeat key's TTL ends before the look that finds it gone."""

Adopt = Callable[[Context, list[bytes], list[Entry], dict[bytes, int], list[bytes]],
                 Awaitable[None]]
"""The own PEL's hand-over (``own_pel.OwnPel.adopt``) of what a
:data:`~._core.stream.liveness.REAP` of the
candidate ids took into its PEL (the entries, the delivery count each has
now) and of the ids the stream no longer has."""


class StreamPresence:
    """The heartbeat, reaper and deregistration of one stream mount (see the module docstring).

    ``claiming(ids)``: called before a :data:`~._core.stream.liveness.REAP` that
    may take ``ids`` is sent (a reply lost then may have moved them into the
    own PEL unseen, their count raised already); ``adopt``: called with what
    it took.
    """

    def __init__(self, stream: str, group: str, mode: Mode, min_idle: float, heartbeat: float,
                 page: int, claiming: Callable[[list[bytes]], None], adopt: Adopt, *,
                 block: float = 1.0) -> None:
        self.stream = stream
        self.group = group
        self.mode = mode
        self.min_idle = min_idle
        self.heartbeat = heartbeat
        self.block = block
        self.page = page
        self._claiming = claiming
        self._adopt = adopt
        self._next = 0.0  # the next look (0: at once; the first is at mount)
        self._probe = 0.0  # the next stop probe
        self._looked = False  # the first look (at mount) was made
        self._stops: set[tuple[str, float | None]] = set()  # stopped marks seen
        self._warned: set[str] = set()
        self._legacy: set[str] = set()  # consumers registered under the old naming only
        self._hold = NameHold()
        self.more = False
        """A look left entries it can take at once (the next read should not block)."""
        self.claimers: dict[str, float] = {}
        """The group's other live consumers that claim idle entries, each with
        its registered ``min_idle``, as the last look found them
        (``_core.stream.survey.claimers``; none before the first look)."""
        self._seen: set[tuple[str, float | None]] = set()  # registrations the last look read
        self._shorter_warned: set[tuple[str, float]] = set()
        self._shortened: anyio.Event | None = None  # set when the lease period shrinks
        self._registered: float | None = None  # the clock at the first registration's reply
        self._followed = 0.0  # the clock at the lease's last own read of the registry
        self._follow_seen: set[tuple[str, float | None]] = set()  # registrations it PTTL'd
        self._warm: WarmUp | None = None  # the claims' warm-up (the first look decides it)

    @property
    def shortest(self) -> float | None:
        """The shortest ``min_idle`` of :attr:`claimers` (None: none): the
        lease renews every third of it when shorter than this mount's own
        guard (``_core.stream.liveness.lease_every``)."""
        return min(self.claimers.values(), default=None)

    def claim_min_idle(self) -> float:
        """Seconds an entry must idle to be claimed now: this mount's
        ``min_idle``, or longer during the warm-up after its first
        registration (``_core.stream.survey.warm_up``): a live peer found at the
        first look may hold entries idle that long until it sees this one."""
        elapsed = None if self._registered is None else anyio.current_time() - self._registered
        return claim_min_idle(self.min_idle, self._warm, elapsed)

    async def shortened(self) -> None:
        """Return once a look shortens the lease period (a peer that claims
        sooner is found): the lease's wait for its next renewal ends early."""
        if self._shortened is None:
            self._shortened = anyio.Event()
        await self._shortened.wait()

    def _found_claimers(self, ctx: Context, found: dict[str, float]) -> None:
        """The claimers a look found: a warning for each new one that claims
        sooner than this mount's own guard, the lease woken when it shrinks."""
        mode, min_idle, hb = self.mode, self.min_idle, self.heartbeat
        before = lease_every(mode, min_idle, hb, self.shortest)
        self.claimers = found
        after = lease_every(mode, min_idle, hb, self.shortest)
        for level, msg, args, extra in shorter_notes(ctx.name, mode, min_idle, hb, found,
                                                     self._shorter_warned):
            log.log(level, msg, *args, extra=extra)
        self._shorter_warned.update(found.items())
        if after < before:
            if self._shortened is not None:
                self._shortened.set()
            self._shortened = None
        elif after > before:  # a peer that claimed sooner stopped, lapsed or changed
            own = after == lease_every(mode, min_idle, hb)
            log.info("%s: the entries in hand are leased every %g s now (%s)", ctx.name, after,
                     "this subscription's own period: no live peer claims sooner any more"
                     if own else "a third of the shortest min_idle of the live peers",
                     extra={"subscription": ctx.name})

    def _beat(self, ctx: Context, ttl: float) -> Command:
        return beat(self.stream, self.group, ctx.consumer.name, ctx.consumer.token, self.heartbeat,
                    self.mode, ttl, time.time(), self.min_idle, self.block)

    async def register(self, ctx: Context) -> None:
        """The first heartbeat (set-up: before the first read): the claim of
        the consumer name.

        Raises:
            ConsumerNameInUse: another live process holds this consumer's
                heartbeat (and the mount is no ``takeover``).
        """
        me = ctx.consumer.name
        await self._hold.claim(
            ctx, lambda takeover: claim_name(self.stream, self.group, me, ctx.consumer.token,
                                             self.heartbeat, self.mode, takeover, time.time(),
                                             self.min_idle, self.block),
            heartbeat_key(self.stream, self.group, me),
            legacy_heartbeat_key(self.stream, self.group, me), FINALIZE_TIMEOUT)
        if self._registered is None:  # the warm-up counts from the first (replied: visible)
            self._registered = anyio.current_time()

    async def beats(self, ctx: Context) -> None:
        """Renew the heartbeat every ``heartbeat / 3`` (a task beside the reader)."""
        every = self.heartbeat / 3
        while True:
            await anyio.sleep(every)
            try:
                await self._hold.renew(ctx, self._beat(ctx, self.heartbeat), FINALIZE_TIMEOUT)
            except (rexc.RedisError, OSError) as e:
                log.warning("%s: heartbeat failed (%s); after %g s without one other consumers "
                            "take over this consumer's pending entries idle that long (those "
                            "being handled keep their lease)", ctx.name, e, self.heartbeat,
                            extra={"subscription": ctx.name})

    async def last_beat(self, ctx: Context) -> None:
        """The heartbeat as the reader stops: it lives until the handlers and
        the finalizer must have ended (``_shutdown.Budget``)."""
        ttl = max(self.heartbeat, Budget.heartbeat_ttl(ctx.consumer.shutdown_grace))
        await self._hold.renew(ctx, self._beat(ctx, ttl), CLOSING_TIMEOUT)

    # -- the peers, while the read loop does not probe (:func:`follows`) ---------
    def follow_at(self) -> float:
        """When :meth:`follow` is due (:func:`~._core.stream.liveness.follow_at`;
        not before the first look)."""
        if not self._looked:
            return anyio.current_time() + STOP_PROBE
        return follow_at(self._probe, self._followed, self.block)

    async def follow(self, ctx: Context) -> None:
        """The registry (``HGETALL``), then the ``PTTL`` of the heartbeat key
        of each peer registered as claiming sooner than this mount's guard
        that is new (:func:`~._core.stream.liveness.claimer_probe`): the live
        ones join :attr:`claimers` as a look would add them (the lease period
        shrinks, the warning is logged)."""
        self._followed = anyio.current_time()
        client = ctx.client
        regs = registry(await client.execute("HGETALL", self._registry, timeout=FINALIZE_TIMEOUT))
        names = claimer_probe(regs, ctx.consumer.name,
                              lease_guard(self.mode, self.min_idle, self.heartbeat), self.claimers,
                              self._seen | self._follow_seen)
        if not names:
            return
        ttls = await client.pipeline(
            [("PTTL", heartbeat_key(self.stream, self.group, n)) for n in names],
            timeout=FINALIZE_TIMEOUT)
        self._follow_seen.update((n, regs[n].at) for n in names)  # a dead one: not again
        alive = alive_claimers(regs, names, ttls)
        if alive:
            self._found_claimers(ctx, {**self.claimers, **alive})

    # -- the reaper ---------------------------------------------------------------
    def due(self) -> bool:
        now = anyio.current_time()
        return now >= self._next or now >= self._probe

    async def probe(self, ctx: Context) -> bool:
        """Whether the registry holds a stopped mark not seen yet (a peer
        handed its entries back), or a registration the last look did not
        see of a peer that claims entries idle less than this mount's own
        guard (a peer mounted with a shorter ``min_idle``: the lease period
        follows it): then a look is due now."""
        self._probe = anyio.current_time() + STOP_PROBE
        flat = await ctx.client.execute("HGETALL", self._registry, timeout=FINALIZE_TIMEOUT)
        regs = registry(flat)
        me = ctx.consumer.name
        return bool(stop_probe(regs, me, self._stops) or claimer_probe(
            regs, me, lease_guard(self.mode, self.min_idle, self.heartbeat), self.claimers,
            self._seen))

    async def step(self, ctx: Context) -> None:
        """:meth:`look`, as a step of the read loop: what the loop handles
        (connection errors, refusals for now, a group gone) propagates; an
        error reply that can never succeed (a registry key of another type,
        say) is logged and the look tried again ``heartbeat / 2`` later, so it
        never stops the reading."""
        try:
            if anyio.current_time() < self._next and not await self.probe(ctx):
                return
            await self.look(ctx)
        except rexc.ResponseError as e:
            if classify(e) is not FINAL or error_code(e) in ("NOGROUP", "UNBLOCKED"):
                raise
            ctx.stats.read_errors += 1
            wait = self.heartbeat / 2
            self._next = anyio.current_time() + wait
            log.error("%s: looking for dead consumers of the group failed: %s; trying again in "
                      "%g s", ctx.name, e, wait, extra={"subscription": ctx.name})

    async def look(self, ctx: Context) -> Survey:
        """Look at the group, take over dead consumers, warn about stranded work.

        Per dead consumer whose entries are to be taken: an ``XPENDING ...
        IDLE`` of one page of candidates, then :data:`~._core.stream.liveness.REAP`
        (which takes each only while still pending for it and idle enough).

        Errors propagate (a step of the read loop: logged, backed off, tried
        again; a reply lost while taking plans the own-PEL recovery).
        """
        client = ctx.client
        me = ctx.consumer.name
        rows, flat, old = await client.pipeline(
            [("XINFO", "CONSUMERS", self.stream, self.group), ("HGETALL", self._registry),
             ("HGETALL", legacy_registry_key(self.stream, self.group))],
            timeout=FINALIZE_TIMEOUT,
        )
        self._probe = anyio.current_time() + STOP_PROBE
        registered = registry(flat)
        # consumers of an earlier version (the old key naming): their own keys
        legacy = {n: r for n, r in registry(old).items() if n not in registered}
        self._legacy = set(legacy)
        registered.update(legacy)
        self._stops = {(n, r.at) for n, r in registered.items() if r.stopped}
        others = [n for n in registered if n != me]
        ttls: dict[str, int] = {}
        if others:
            replies = await client.pipeline(
                [("PTTL", self._heartbeat_of(n)) for n in others], timeout=FINALIZE_TIMEOUT)
            ttls = {n: int(t) for n, t in zip(others, replies, strict=True)}
        found = survey(me, self.mode, self.heartbeat, self.page,
                       peers(consumer_rows(rows), registered, ttls))
        self._seen = {(n, r.at) for n, r in registered.items()}
        self._follow_seen.clear()
        self._found_claimers(ctx, claimers(found))
        notes = warnings(ctx.name, self.mode, self.min_idle, found, self._warned)
        if not self._looked:  # at mount: also the live ones that hold entries
            self._looked = True
            notes += watch_notes(ctx.name, found, time.time())
            self._warm = warm_up(self.mode, self.min_idle, self.block, SEEN_WITHIN, found)
            if self._warm is not None:
                notes.append(warm_up_note(ctx.name, self.min_idle, self._warm))
        for level, msg, args, extra in notes:
            log.log(level, msg, *args, extra=extra)
        self._warned.update(p.name for p in found.peers if p.stranded)
        wake = [self.heartbeat / 2 * random.uniform(0.8, 1.0)]
        if found.wake is not None:
            wake.append(found.wake + _LAPSE_MARGIN)
        more = False
        left = found.stranded
        for r in found.reap:
            ids: list[bytes] = []
            if r.page:
                candidates = await client.execute(*r.candidates(self.stream, self.group),
                                                  timeout=FINALIZE_TIMEOUT)
                ids = [row[0] for row in candidates]
                self._claiming(ids)  # a reply lost now may leave them in the own PEL unseen
            got = parse_reap(await client.evalsha(
                REAP, (self.stream, self._heartbeat_of(r.peer.name),
                       self._registry_of(r.peer.name)),
                r.args(self.group, me, ids), timeout=FINALIZE_TIMEOUT,
            ))
            if got is None:  # its heartbeat came back: nothing taken
                if r.page:
                    await self._adopt(ctx, ids, [], {}, [])
                continue
            taken = len(got.entries) + len(got.gone)
            left -= min(taken, r.peer.pending)
            if got.wait is not None:
                wake.append(got.wait + _LAPSE_MARGIN)
                more = more or got.wait == 0
            if r.page:
                if taken and r.peer.heartbeat is Heartbeat.STOPPED:
                    ctx.stats.effects["recovered"] += len(got.entries)
                    log.info("%s: took over %d entries consumer %r handed back at its stop%s",
                             ctx.name, len(got.entries), r.peer.name,
                             f"; {len(got.gone)} more were deleted while pending"
                             if got.gone else "", extra={"subscription": ctx.name})
                elif taken:
                    ctx.stats.effects["recovered"] += len(got.entries)
                    log.warning("%s: consumer %r stopped its heartbeat; took over %d of its "
                                "pending entries (their attempt counts the crash)%s", ctx.name,
                                r.peer.name, len(got.entries),
                                f"; {len(got.gone)} more were deleted while pending"
                                if got.gone else "", extra={"subscription": ctx.name})
                await self._adopt(ctx, ids, got.entries, got.counts, got.gone)
            if got.forgotten:
                self._warned.discard(r.peer.name)
                log.info("%s: removed dead consumer %r from the group (nothing pending for it)",
                         ctx.name, r.peer.name, extra={"subscription": ctx.name})
        ctx.stats.stranded = max(0, left)
        self.more = more
        self._next = anyio.current_time() + min(wake)
        return found

    # -- a clean stop ---------------------------------------------------------------
    async def deregister(self, ctx: Context, ids: Sequence[str], *, whole: bool) -> int:
        """Hand back what is still pending for this consumer, and leave the
        stopped mark (:data:`~._core.stream.liveness.STOP`): ``whole``: the whole
        own PEL; else only ``ids`` (CLAIMING: its PEL holds delayed retries,
        which keep their delay).  Returns how many entries were handed back."""
        me = ctx.consumer.name
        args: list[str | int] = [self.group, me,
                                 stopped_value(self.heartbeat, self.mode, time.time()),
                                 HANDED_BACK_IDLE_MS, 1 if whole else 0,
                                 heartbeat_value(ctx.consumer.token, self.heartbeat)]
        if not whole:
            args += sorted(ids)
        n, left = await ctx.client.evalsha(
            STOP, (self.stream, self._heartbeat_of(me), self._registry), args,
            timeout=CLOSING_TIMEOUT,
        )
        n = int(n)
        if n:
            ctx.stats.effects["handed_back"] += n
            log.info("%s: consumer %r handed back %d entr%s: the group's live consumers take "
                     "them at once, at the attempt they had (or this name started again)",
                     ctx.name, me, n, "y" if n == 1 else "ies", extra={"subscription": ctx.name})
        elif left:
            log.info("%s: consumer %r stopped with entries pending (delayed retries of "
                     "Mode.CLAIMING): claimed back once idle min_idle", ctx.name, me,
                     extra={"subscription": ctx.name})
        else:
            log.debug("%s: consumer %r stopped (nothing pending for it)", ctx.name, me,
                      extra={"subscription": ctx.name})
        return n

    @property
    def _registry(self) -> str:
        return registry_key(self.stream, self.group)

    def _registry_of(self, consumer: str) -> str:
        if consumer in self._legacy:
            return legacy_registry_key(self.stream, self.group)
        return self._registry

    def _heartbeat_of(self, consumer: str) -> str:
        if consumer in self._legacy:
            return legacy_heartbeat_key(self.stream, self.group, consumer)
        return heartbeat_key(self.stream, self.group, consumer)


async def follows(presence: StreamPresence, ctx: Context) -> None:
    """Follow the claiming peers that register while the read loop does not
    probe (a task of the lease, ``reader``): from
    :meth:`StreamPresence.follow_at` on, :meth:`StreamPresence.follow` every
    ``STOP_PROBE`` while entries are in hand; a failure is logged (the first
    of a row as a warning) and tried again then."""
    failing = False
    while True:
        at = presence.follow_at()
        if anyio.current_time() < at:
            await anyio.sleep_until(at)
            continue
        if not ctx.leased():
            await anyio.sleep(STOP_PROBE)
            continue
        try:
            await presence.follow(ctx)
        except (rexc.RedisError, OSError) as e:
            log.log(logging.DEBUG if failing else logging.WARNING,
                    "%s: reading the group's registry for new claiming peers while the read "
                    "loop waits failed: %s; trying again in %g s", ctx.name, e, STOP_PROBE,
                    extra={"subscription": ctx.name})
            failing = True
        else:
            failing = False
