"""The stream's own PEL taken back, a catch-up's I/O: recovery, claims, the reaper's take.

Whatever the reader takes into this consumer's PEL other than by a read of
new entries goes through :class:`OwnPel`: the own-PEL recovery (``XPENDING``
+ ``XCLAIM ... RETRYCOUNT n``), the claims of RECLAIM and CLAIMING
(``XAUTOCLAIM``, the counts it set, the ids that vanished meanwhile) and
what the reaper of dead consumers took (``liveness.StreamPresence`` calls
:meth:`OwnPel.claiming` and :meth:`OwnPel.adopt`).  Which attempt each
entry counts is ``_core/stream/decode.py``'s.  Everything is handed over
through the mount's :class:`~._port.Context` (:func:`hand_over`), never
through the reader: ``reader.py`` imports this module, not the reverse.
The Backoff redelivery (the mount's :class:`~._port.Pending` hooks) is
``pending.py``'s; it hands over through :meth:`OwnPel.deliver_taken`.

**Backoffs not due yet.**  A delivery that failed under ``on_error=Backoff()``
stays in the PEL, its due time kept in Redis (``_core._recovery``'s
schedule, by the server's clock).  When the recovery or a claim finds such
an entry (this consumer restarted while it waited, or its consumer
stopped), it waits out the rest: held by the mount (``Context.defer``,
:func:`defer`) and delivered again as its next attempt when due
(``pending.StreamPending.redeliver``), held as the attempt that failed
(``_core/stream/decode.waiting``).

``claim_read`` (Redis 8.4, ``_core._caps``): ``XREADGROUP ... CLAIM
min-idle`` would replace ``Mode.CLAIMING``'s ``XAUTOCLAIM``
(:meth:`OwnPel.claim`) before each ``XREADGROUP >``: one command reads idle
pending entries and new ones.  Detected, not used yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio
from redis import exceptions as rexc

from ..._core._recovery import SCHEDULE_LEFT, schedule_key, schedule_left
from ..._core._replies import NOT_RUN, classify
from ..._core._types import Plan
from ..._core.stream.decode import (
    AS_IS,
    Entry,
    as_handed,
    as_str,
    claimed_waiting,
    give_back,
    id_key,
    lapsed_own,
    lost_entry,
    recovered,
    retries_of,
    set_back_claimed,
    stream_deliveries,
    waiting,
)
from ..._deadlines import FINALIZE_TIMEOUT, log
from ..._delivery import Delivery
from ..._shutdown import cleanup
from ..._subscription import Mode
from ..._transport import Connection
from .._port import Context, Item
from .._read_loop import retry_not_run
from . import StreamSubscription

__all__ = ["OwnPel", "claimed_waits", "defer", "hand_over", "recovered_waits", "scheduled"]

_CLAIM_EVERY_MAX = 30.0
_CLAIMED_TIMEOUT = 5.0
"""Seconds the counts of entries just claimed are asked again while the server
answers that it cannot serve now (OOM, BUSY ...): the claim cost an attempt
already, a second claim would cost another."""


async def hand_over(ctx: Context, entries: list[Entry], counts: dict[bytes, int] | None = None) -> None:
    """Hand entries over (decoded by :func:`~._core.stream.decode.stream_deliveries`,
    ``counts``: their delivery counts, 1 when not in it) through
    ``Context.deliver``, the runtime's one hand-over: it gives back what a
    shutdown cut before a handler had it (:meth:`OwnPel.abandon`: their
    delivery counts set back, the counts other than 1 noted by
    :meth:`OwnPel._note` first)."""
    ready, direct = stream_deliveries(ctx.target, entries, counts)
    await ctx.deliver(ready, direct, give_back=True)


async def lost(ctx: Context, ids: Sequence[bytes]) -> None:
    """Acknowledge entries deleted while pending, once each (reported lost)."""
    items: list[Item] = []
    held = ctx.in_hand
    for eid in ids:
        entry_id = eid.decode()
        if entry_id in held:  # reported already (its acknowledgement is on the way), or handled
            continue
        held.add(entry_id)  # until finalized: no second report meanwhile
        items.append(lost_entry(ctx.target, entry_id))
    await ctx.send_plans(items)


async def claimed_counts(ctx: Context, ids: list[bytes]) -> dict[bytes, int]:
    """Server delivery counts of ``ids`` (claimed by this consumer just now).

    One ``XPENDING`` over the range of the ids first; a capped range can
    miss ids when the consumer holds many other entries in between, so
    those missed are then asked one ``XPENDING`` each (pipelined).
    """
    if not ids:
        return {}
    client, t = ctx.client, ctx.target
    rows = await client.execute(
        "XPENDING", t.source, t.group, min(ids, key=id_key), max(ids, key=id_key),
        len(ids) + 100, ctx.consumer.name, timeout=FINALIZE_TIMEOUT,
    )
    wanted = set(ids)
    out = {r[0]: int(r[3]) for r in rows if r[0] in wanted}
    missed = [eid for eid in ids if eid not in out]
    if missed:
        replies = await client.pipeline(
            [("XPENDING", t.source, t.group, eid, eid, 1) for eid in missed],
            timeout=FINALIZE_TIMEOUT,
        )
        out.update((r[0][0], int(r[0][3])) for r in replies if r)
    return out


async def ack_vanished(ctx: Context, start: str, end: str, claimed: set[bytes], page: int) -> None:
    """Acknowledge our pending entries in [start, end) that the stream no longer
    has, ``page`` rows per ``XPENDING``."""
    client, t = ctx.client, ctx.target
    stop = None if end == "0-0" else id_key(end.encode())
    lo = start
    while True:
        rows = await client.execute(
            "XPENDING", t.source, t.group, lo, "+", page, ctx.consumer.name,
            timeout=FINALIZE_TIMEOUT,
        )
        inside = [r[0] for r in rows if stop is None or id_key(r[0]) < stop]
        candidates = [eid for eid in inside if eid not in claimed and eid.decode() not in ctx.in_hand]
        if candidates:
            found = await client.pipeline(
                [("XRANGE", t.source, eid, eid) for eid in candidates], timeout=FINALIZE_TIMEOUT
            )
            await lost(ctx, [eid for eid, hit in zip(candidates, found, strict=True) if not hit])
        if len(rows) < page or len(inside) < len(rows):
            return
        lo = "(" + as_str(rows[-1][0])


# -- Backoffs not due yet (see the module docstring) ----------------------------

async def scheduled(ctx: Context, ids: Sequence[bytes]) -> dict[bytes, tuple[float, int]]:
    """Ids among ``ids`` whose Backoff is not due yet (``_core._recovery``'s
    schedule, by the server's clock): id -> (seconds left, the attempt
    that failed)."""
    if not ids:
        return {}
    t = ctx.target
    try:
        reply = await ctx.client.evalsha(SCHEDULE_LEFT, (schedule_key(t),), list(ids),
                                         timeout=FINALIZE_TIMEOUT)
    except rexc.ResponseError as e:
        if classify(e) is NOT_RUN:
            raise
        # final (the key is of another type ...): recovery goes on without it
        log.warning("%s: reading the Backoff schedule %r failed (%s); %d recovered entries "
                    "are delivered now", ctx.name, schedule_key(t), e, len(ids),
                    extra={"subscription": ctx.name})
        return {}
    return {eid: got for eid, got in zip(ids, schedule_left(reply), strict=True) if got[0] > 0}


def _as_counts(entries: Sequence[Entry], left: dict[bytes, tuple[float, int]]
               ) -> dict[bytes, tuple[float, int]]:
    """``left`` (seconds left, the attempt that failed, as the schedule keeps
    them) of each of ``entries`` with that attempt as the server count it
    is: less the entry's header retries (``_core._types.attempt_of``)."""
    return {eid: (left[eid][0], left[eid][1] - retries_of(flat)) for eid, flat in entries
            if eid in left}


def defer(ctx: Context, entries: Sequence[Entry], left: dict[bytes, tuple[float, int]]) -> set[bytes]:
    """Entries in the own PEL whose Backoff is not due yet (``left``: seconds
    left, the attempt that failed): they wait, held, and come back as
    their next attempt when due (the mount's redeliverer,
    ``pending.StreamPending.redeliver``).  Returns the ids that wait (the
    others: deliver now)."""
    if not left:
        return set()
    counts = waiting(_as_counts(entries, left))
    ready, _direct = stream_deliveries(ctx.target, [e for e in entries if e[0] in left], counts)
    held: set[bytes] = set()
    for d in ready:
        assert d.id is not None
        eid = d.id.encode()
        if ctx.defer(d, left[eid][0]):
            held.add(eid)
    if held:
        log.info("%s: %d recovered entries wait out the rest of their Backoff (kept in %r) "
                 "before they are delivered again: %s", ctx.name, len(held),
                 schedule_key(ctx.target), ", ".join(sorted(e.decode() for e in held)[:20]),
                 extra={"subscription": ctx.name})
    return held


async def recovered_waits(ctx: Context, rows: list[list[Any]]) -> set[bytes]:
    """Of own pending entries (``XPENDING`` rows, none held), those whose
    Backoff is not due yet, set waiting (:func:`defer`) as the attempt
    they failed at (the schedule's; the redelivery sets the server count
    one higher)."""
    left = await scheduled(ctx, [r[0] for r in rows])
    if not left:
        return set()
    ids = list(left)
    found = await ctx.client.pipeline([("XRANGE", ctx.target.source, eid, eid) for eid in ids],
                                      timeout=FINALIZE_TIMEOUT)
    entries: list[Entry] = [(hit[0][0], hit[0][1]) for hit in found if hit]
    return defer(ctx, entries, left)


async def claimed_waits(ctx: Context, live: list[Entry]) -> list[Entry]:
    """Of entries just claimed, those whose Backoff is not due yet (their
    consumer stopped while they waited, or this one restarted) wait out the
    rest (:func:`defer`), their server count set back to the attempt that
    failed (the claim counted a delivery that did not happen); returns the
    others.  Shielded (bounded): a stop in between would leave the count
    one higher for each claim it cut.

    Raises ``TimeoutError`` when the bound cut the schedule's read (a silent
    link): nothing was held, the claimed entries stay pending for this
    consumer and the own-PEL recovery after the reconnect takes them.
    """
    held: set[bytes] | None = None
    t = ctx.target
    with cleanup(FINALIZE_TIMEOUT):
        left = await scheduled(ctx, [e[0] for e in live])
        if not left:
            return live
        held = defer(ctx, live, left)
        p = set_back_claimed(t.source, t.group, ctx.consumer.name,
                             claimed_waiting(held, _as_counts(live, left)))
        if p is not None:
            await ctx.client.pipeline(p.commands, timeout=FINALIZE_TIMEOUT)
    if held is None:
        raise rexc.TimeoutError(f"reading the Backoff schedule {schedule_key(t)!r} of "
                                f"{len(live)} claimed entries: no reply within {FINALIZE_TIMEOUT} s")
    return [e for e in live if e[0] not in held]


class OwnPel:
    """This consumer's PEL, taken back (see the module docstring); the reader's
    give-back of what a stop cut (:meth:`abandon`)."""

    def __init__(self, sub: StreamSubscription) -> None:
        self.sub = sub
        self.me = ""  # the consumer name (set by the reader's setup)
        # The greatest id this reader knows it was handed (by a read, a claim or
        # a recovery), or the group's last delivered id at start: an own
        # pending entry above it came from a read whose reply was lost.
        self.last: bytes | None = None
        # A read (or claim) was sent and its reply not seen: it may have
        # moved entries into the own PEL unseen.
        self.unsure = False
        # When the next RECLAIM claim is due (0: at once, a page is left).
        self.next_claim = 0.0
        self._cursor = "0-0"
        # Server delivery counts of deliveries handed over with a count other
        # than 1 (recovered, claimed): what abandon() sets back.  Pruned.
        self._given: dict[str, int] = {}
        # Own pending entries being taken over, and the attempt each is to
        # count (AS_IS: the server count as it is), until handed over: a
        # recovery after a failure in between counts them alike (no bump twice).
        self._taking: dict[bytes, int | None] = {}
        # Ids given back unstarted at shutdown (abandon), with the delivery count
        # each was handed with: handed back at the stop (the reader's ``closed``
        # sets back those whose give-back the finalizer never sent).
        self.abandoned: dict[str, int] = {}

    # -- the mount's give-back (a stop, a cancelled hand-over) ----------------------
    def abandon(self, deliveries: Sequence[Delivery]) -> Plan | None:
        """Give deliveries read but never started back to the PEL, uncounted.

        Each stays pending for this consumer (recovered at restart, or claimed
        by another in RECLAIM/CLAIMING), its server delivery count set back by
        one with ``XCLAIM ... RETRYCOUNT`` so the next delivery does not count
        a handler call that never happened -- in one script
        (``decode.GIVE_BACK``), only while it is still pending for this
        consumer at the count it was handed with: one another consumer
        claimed meanwhile (its lease stopped with the reader at the
        shutdown's start, or a stall past ``min_idle``) stays its delivery.
        """
        given = as_handed([d.id for d in deliveries if d.id is not None], self._given)
        self.abandoned.update(given)
        return give_back(self.sub.stream, self.sub.group, self.me, given)

    # -- recovery ---------------------------------------------------------------
    async def recover(self, conn: Connection, ctx: Context, *, start: bool = False) -> None:
        """Take back this consumer's own pending entries that no handler holds.

        Page by page: ``XPENDING`` (ids, idle times, delivery counts), then
        ``XCLAIM ... RETRYCOUNT n`` of those entries to this consumer (their
        bodies, the count set to exactly what the next attempt is; only if
        still as idle as seen, so an entry another consumer claimed
        meanwhile stays there).  The attempt counted is
        :func:`~._core.stream.attempts.recovered`'s: ``start`` (the first
        look after a (re)start) one more than the server count, a crash may
        have interrupted the handler; later (after a read error,
        periodically) an entry above the last id this reader was handed came
        from a read whose reply was lost and keeps its count, one at or
        below it was handed before and is handed again: one more (CLAIMING
        takes only the former: the PEL holds its delayed retries, claimed
        back later).

        Entries the stream no longer has are acknowledged and reported lost.
        """
        sub = self.sub
        me = ctx.consumer.name
        start = start or self.last is None  # a reader that knows nothing: a restart
        lo = "-"
        while True:
            rows = await conn.execute(
                "XPENDING", sub.stream, sub.group, lo, "+", sub.count, me, timeout=FINALIZE_TIMEOUT,
            )
            if not rows:
                self._taking.clear()  # the whole PEL seen: what is left there is not ours
                return
            lo = "(" + as_str(rows[-1][0])
            held = ctx.in_hand
            taking = self._taking
            # failed under a Backoff and not due yet (a restart while they waited)
            waits = await recovered_waits(ctx, [r for r in rows if r[0].decode() not in held
                                                and r[0] not in taking])
            free = [r for r in rows if r[0].decode() not in held and r[0] not in waits]
            idle = {r[0]: int(r[2]) for r in free}
            wanted: dict[int, list[tuple[bytes, int]]] = {}  # attempt -> (id, idle ms)
            for eid, n in recovered([(r[0], int(r[3])) for r in free], start=start,
                                    last=self.last, claiming=sub.mode is Mode.CLAIMING,
                                    taking=taking):
                wanted.setdefault(n, []).append((eid, idle[eid]))
            for n, taken in wanted.items():
                await self._take(conn, ctx, taken, n)
            if len(rows) < sub.count:
                self._taking.clear()
                return

    async def _take(self, conn: Connection, ctx: Context, taken: list[tuple[bytes, int]], n: int) -> None:
        """XCLAIM own pending entries with their count set to ``n``; hand them over."""
        sub = self.sub
        ids = [eid for eid, _ in taken]
        self._taking.update(dict.fromkeys(ids, n))
        reply = await conn.execute(
            "XCLAIM", sub.stream, sub.group, ctx.consumer.name, min(idle for _, idle in taken),
            *ids, "RETRYCOUNT", n, timeout=FINALIZE_TIMEOUT,
        )
        entries: list[Entry] = [
            (e[0], e[1]) for e in reply if e is not None and e[1] is not None
        ]
        got = {e[0] for e in entries}
        missing = [eid for eid in ids if eid not in got]
        gone: list[bytes] = []
        if missing:
            # deleted while pending (Redis 7 drops them from the PEL here, 6.2
            # answers nil and keeps them), or claimed by another consumer
            found = await ctx.client.pipeline(
                [("XRANGE", sub.stream, eid, eid) for eid in missing], timeout=FINALIZE_TIMEOUT
            )
            gone = [eid for eid, hit in zip(missing, found, strict=True) if not hit]
        await self.deliver_taken(ctx, entries, dict.fromkeys(got, n), gone)
        for eid in ids:
            self._taking.pop(eid, None)

    # -- claims (RECLAIM, CLAIMING) ---------------------------------------------
    async def claim(self, conn: Connection, ctx: Context, min_idle: float | None = None) -> None:
        """XAUTOCLAIM entries idle ``min_idle`` (any consumer; None: the
        subscription's -- longer in the warm-up after mounting, see
        ``liveness.StreamPresence.claim_min_idle``), one page."""
        sub = self.sub
        min_idle = sub.min_idle if min_idle is None else min_idle
        self.unsure = True
        # the entries in hand when the claim is sent: one of them the claim takes
        # is ours and being handled (its lease lapsed), even if its handler
        # finishes (and it is acknowledged) before the claim's reply is read
        before = set(ctx.in_hand)
        reply = await conn.execute(
            "XAUTOCLAIM", sub.stream, sub.group, ctx.consumer.name,
            round(min_idle * 1000), self._cursor, "COUNT", sub.count,
            timeout=FINALIZE_TIMEOUT,
        )
        start, self._cursor = self._cursor, as_str(reply[0])
        claimed: list[Entry] = [e for e in reply[1] if e is not None]
        # claimed (count + 1), not yet handed over: a recovery after a failure
        # below takes them as they are
        self._taking.update(dict.fromkeys([e[0] for e in claimed], AS_IS))
        if len(claimed) < len(reply[1]):
            # Redis < 7 answers nil (no id) for an entry deleted while pending,
            # and claims it into our PEL: find the vanished ids by hand.
            await ack_vanished(ctx, start, self._cursor, {e[0] for e in claimed}, sub.count + 100)
        deleted: list[bytes] = list(reply[2]) if len(reply) > 2 else []
        held = ctx.in_hand
        for eid in deleted:  # Redis 7+: dropped from the PEL by XAUTOCLAIM itself
            if eid.decode() in held:  # reported already, or being handled
                continue
            ctx.stats.effects["lost_before_handling"] += 1
            log.warning("%s: entry %s was deleted while pending; dropped from the PEL",
                        ctx.name, eid.decode(),
                        extra={"subscription": ctx.name, "entry_id": eid.decode()})
        await lost(ctx, [e[0] for e in claimed if e[1] is None])
        live = [e for e in claimed if e[1] is not None]
        if live:
            ids = [e[0] for e in live]
            counts = await retry_not_run(
                ctx, partial(claimed_counts, ctx, ids),
                deadline=anyio.current_time() + _CLAIMED_TIMEOUT,
                what=f"counts of {len(ids)} claimed entries",
            )
            # our own entries still being handled, whose lease lapsed (a
            # stalled process): never to a second handler, and their claim
            # did not count an attempt
            own = [e[0] for e in live if e[0].decode() in held or e[0].decode() in before]
            if own:
                log.warning("%s: %d entries being handled were idle min_idle=%g s (lease "
                            "renewal late); kept with their handlers", ctx.name, len(own),
                            min_idle, extra={"subscription": ctx.name})
                p = give_back(sub.stream, sub.group, ctx.consumer.name, lapsed_own(own, counts))
                if p is not None:
                    await ctx.client.pipeline(p.commands, timeout=FINALIZE_TIMEOUT)
                mine = set(own)
                live = [e for e in live if e[0] not in mine]
            # failed under a Backoff and not due yet (their consumer stopped, or
            # this one restarted): they wait out the rest, as the attempt they
            # failed at (the claim counted one more)
            live = await claimed_waits(ctx, live)
            await self.deliver_taken(ctx, live, counts, [])
        for e in claimed:
            self._taking.pop(e[0], None)
        self.unsure = False
        interval = min(max(sub.min_idle / 2, 0.05), _CLAIM_EVERY_MAX)
        # a full page or a cursor mid-PEL: claim again at once
        self.next_claim = 0.0 if self._cursor != "0-0" else anyio.current_time() + interval

    # -- the reaper's take (liveness.StreamPresence) -------------------------------
    def claiming(self, ids: list[bytes]) -> None:
        """The reaper is about to claim ``ids`` (their count one higher) into the
        own PEL: should its reply be lost, the own PEL is looked at before the
        next read, and those found there count as they are (the claim counted
        the attempt already)."""
        self.unsure = True
        self._taking.update(dict.fromkeys(ids, AS_IS))

    async def adopt(self, ctx: Context, ids: list[bytes], entries: list[Entry],
                    counts: dict[bytes, int], gone: list[bytes]) -> None:
        """What the reaper's claim of ``ids`` took into the own PEL (``counts``:
        the delivery count of each, set by the claim), handed over; ``gone``:
        ids the stream no longer has, acknowledged and reported lost."""
        self.unsure = False  # its reply is here
        # until handed over: a recovery after a failure in between counts them alike
        self._taking.update(counts)
        try:
            # failed under a Backoff and not due yet: they wait out the rest, as a claim's
            entries = await claimed_waits(ctx, entries) if entries else entries
            await self.deliver_taken(ctx, entries, counts, gone)
        finally:
            for eid in ids:
                self._taking.pop(eid, None)

    # -- handing over -------------------------------------------------------------
    async def deliver_taken(self, ctx: Context, entries: list[Entry], counts: dict[bytes, int],
                             gone: Sequence[bytes]) -> None:
        """Entries taken into the own PEL (a recovery, a claim, a redelivery, the
        reaper), with the delivery count each has now: the ids the stream no
        longer has acknowledged and reported lost, the others remembered
        (:meth:`_note`) and handed over."""
        await lost(ctx, gone)
        if entries:
            self._note(ctx, entries, counts)
            await hand_over(ctx, entries, counts)

    def _note(self, ctx: Context, entries: Sequence[tuple[bytes, Any]], counts: dict[bytes, int]) -> None:
        """Remember what recovery and claims hand over: the last id, counts other than 1."""
        if not entries:
            return
        top = max((e[0] for e in entries), key=id_key)
        if self.last is None or id_key(top) > id_key(self.last):
            self.last = top
        given = self._given
        if len(given) > 2 * len(ctx.in_hand) + 1000:  # forget what was finalized
            self._given = given = {k: v for k, v in given.items() if k in ctx.in_hand}
        for eid, _ in entries:
            n = counts.get(eid, 1)
            if n != 1:
                given[eid.decode()] = n
