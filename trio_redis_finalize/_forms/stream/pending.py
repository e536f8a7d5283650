"""The stream's :class:`~._port.Pending` hooks: the mount's Backoff redeliverer and the own PEL.

A delivery whose handler failed under ``on_error=Backoff()``, or whose
finalization Redis refused for good (:meth:`StreamPending.hold_again`),
stays in the PEL, held by this consumer (the lease keeps other consumers
off it), until the mount's redeliverer
(``_backoffs``) takes it back as its next attempt
(:meth:`StreamPending.redeliver`: one script, the count it sets is
``_core/stream/decode.redelivered``'s); past the waiting set's size it is
left pending for the own-PEL re-read (:meth:`StreamPending.leave_pending`).
What it takes is handed over as a catch-up's takes are
(``own_pel.OwnPel.deliver_taken``).  A catch-up's own takes are
``own_pel.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..._core.stream.decode import Entry, redelivered
from ..._core.stream.scripts import REDELIVER
from ..._deadlines import FINALIZE_TIMEOUT, log
from ..._delivery import Delivery
from .._port import Context
from .own_pel import OwnPel

__all__ = ["StreamPending"]


class StreamPending:
    """The mount's :class:`~._port.Pending` hooks of a stream, over its :class:`~.own_pel.OwnPel`."""

    def __init__(self, own: OwnPel) -> None:
        self.own = own

    async def redeliver(self, ctx: Context, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Deliver again, as their next attempt, entries whose handler failed.

        Called by the mount once their :class:`~trio_redis_finalize.Backoff`
        delay is over.  They stayed in the PEL, held by this consumer (the
        lease kept other consumers off them).  One script takes each back
        only while it is still pending for this consumer (``XPENDING ... me``,
        then ``XCLAIM ... 0 id RETRYCOUNT attempt+1``): its body, and a server
        delivery count that already counts the attempt about to be made, so a
        crash during it is counted (the next start adds one) and a crash
        before it is too (still the failed attempt's count).  An entry another
        consumer took meanwhile (a lease that lapsed) is forgotten, logged;
        so is one whose group was destroyed meanwhile (recreated at the last
        id this reader delivered, its PEL gone) -- as a RETRY of an entry
        being handled then finds its gate closed.  One deleted from the
        stream meanwhile is acknowledged and reported lost.
        Raises (nothing delivered, nothing changed but idempotent counts) when
        the script gets no answer.  Returns what is to be tried again a moment
        later (nothing, for a stream).
        """
        sub = self.own.sub
        me = ctx.consumer.name
        failed: list[tuple[str, int]] = []
        for d in deliveries:
            assert d.id is not None
            failed.append((d.id, d.attempt - d.retries))  # the count of this entry's attempt
        nexts = redelivered(failed)
        args: list[str | int] = [sub.group, me]
        for eid, n in nexts:
            args += [eid, n]
        reply = await ctx.client.evalsha(REDELIVER, (sub.stream,), args, timeout=FINALIZE_TIMEOUT)
        held = ctx.in_hand
        entries: list[Entry] = []
        counts: dict[bytes, int] = {}
        gone: list[bytes] = []
        for d, (_, n), r in zip(deliveries, nexts, reply, strict=True):
            assert d.id is not None
            if isinstance(r, list) and len(r) == 2 and isinstance(r[1], list):
                entries.append((r[0], r[1]))
                counts[r[0]] = n
                continue
            held.discard(d.id)
            if r == 0:
                log.warning("%s: entry %s (attempt %d) is no longer pending for this consumer "
                            "(claimed by another, or acknowledged); not delivered again",
                            ctx.name, d.id, d.attempt,
                            extra={"subscription": ctx.name, "entry_id": d.id, "attempt": d.attempt})
            else:
                gone.append(d.id.encode())
        await self.own.deliver_taken(ctx, entries, counts, gone)
        return []  # nothing to try again later

    def leave_pending(self, ctx: Context, deliveries: Sequence[Delivery]) -> None:
        """Forget failed entries without a timer (the mount's waiting set is
        full): they stay in the PEL, for the own-PEL re-read (after a read
        error, at a start, and every minute while no entry is in hand) and,
        in RECLAIM and CLAIMING, for a claim once idle ``min_idle``."""
        ctx.in_hand.difference_update([d.id for d in deliveries if d.id is not None])

    def hold_again(self, ctx: Context, d: Delivery) -> None:
        """A delivery whose finalization Redis refused for good, still in the
        PEL: held (leased) again until :meth:`redeliver` takes it back."""
        if d.id is not None:
            ctx.in_hand.add(d.id)
