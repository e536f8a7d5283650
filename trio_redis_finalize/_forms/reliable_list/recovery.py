"""A reliable-list consumer's own processing list: what it holds that the
reader does not hand over by reading (the list's mirror of a stream's
own-PEL recovery), and the Backoff redeliveries.

* **rescan** (:meth:`ListRecovery.rescan`, a step of the read loop's catch-up:
  at start, after a read error and every minute): the processing list is read; what it
  holds that the reader does not hold (as a multiset:
  ``_core.reliable_list.liveness.stranded``) is delivered again, its retry
  counter bumped in place first (:data:`BUMP`) when it counts as an attempt;
  an element whose Backoff, or runtime ``retry_after``, is not due yet (a
  restart while it waited: the scheduler wrote the copy's due time) is held
  and waits out the rest;
* **Backoff** (the mount's :class:`~.._port.Pending` hooks:
  :meth:`~ListRecovery.redeliver`, :meth:`~ListRecovery.leave_pending`,
  :meth:`~ListRecovery.hold_again`): a failed element waits in the
  processing list, held, and is bumped in place before it is handed over
  again.

What they find is handed over as the reader's reads are (``Context.deliver``
with ``give_back``: cut by the shutdown, the reader's ``abandon`` gives it
back onto the queue).
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
from redis import exceptions as rexc

from ..._core._decode import list_delivery
from ..._core._recovery import SCHEDULE_LEFT, schedule_key, schedule_left, schedule_member
from ..._core._replies import NOT_RUN, classify
from ..._core._types import Plan, Target
from ..._core.reliable_list.gates import ListGates
from ..._core.reliable_list.liveness import BUMP, bumped, dec, doubtful, stranded
from ..._deadlines import FINALIZE_TIMEOUT, log
from ..._delivery import Delivery
from ..._transport import Connection
from .._port import Context
from . import ReliableListSubscription

__all__ = ["ListRecovery", "schedule_lefts"]

_RECHECK = 1.0
"""Seconds after a rescan that may have taken a stranded copy for an identical
one finalized meanwhile before the processing list is looked at again."""


async def schedule_lefts(ctx: Context, t: Target, elements: Sequence[bytes]) -> list[float]:
    """Seconds until each of ``elements`` of processing list ``t.processing``
    is due by its Backoff schedule (``_core._recovery``, the server's clock;
    0: due, or not scheduled).  A schedule that cannot be read for good (its
    key of another type ...): all due, logged; one that did not run raises."""
    members = [schedule_member(t, None, e) or b"" for e in elements]
    try:
        reply = await ctx.client.evalsha(SCHEDULE_LEFT, (schedule_key(t),), members,
                                         timeout=FINALIZE_TIMEOUT)
    except rexc.ResponseError as err:
        if classify(err) is NOT_RUN:
            raise
        log.warning("%s: reading the Backoff schedule %r failed (%s); %d element(s) of "
                    "processing list %r are delivered now", ctx.name, schedule_key(t), err,
                    len(elements), t.processing, extra={"subscription": ctx.name})
        return [0.0] * len(elements)
    return [left for left, _ in schedule_left(reply)]


class ListRecovery:
    """The rescan of one reliable-list consumer's processing list and its
    Backoff redeliveries, on the reader's counted ``gates``.

    * Crash recovery: on start, and after every read error (a lost BLMOVE
      reply strands an element), the processing list is read; what it holds
      that the reader does not hold (as a multiset: identical elements are
      counted) is delivered again.  On start its retry counter is bumped in
      place first (``LSET``): the previous process may have been handling
      it, so a crash counts as an attempt and a poison element that kills
      its consumer reaches ``max_attempts`` (then it is dead-lettered without
      calling the handler).  Later, such an element was stranded by a lost
      read of this process and no handler saw it: delivered as it is (not an
      attempt), unless a copy the reader handled may have been left by its
      removal (a closed gate, an error reply).
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

    def __init__(self, sub: ReliableListSubscription, gates: ListGates) -> None:
        self.sub = sub
        self._gates = gates
        self.recheck_at: float | None = None  # a rescan that may have missed a copy: again then

    async def _built(self, ctx: Context, built: list[tuple[Delivery, Plan | None]]) -> None:
        """The hand-over of deliveries built one by one (``list_delivery``):
        as the reader's (given back onto the queue when the shutdown cuts it)."""
        await ctx.deliver([d for d, p in built if p is None],
                          [(d, p) for d, p in built if p is not None], give_back=True)

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
        meanwhile (reaped after a lapsed heartbeat) is forgotten, and a rescan
        asked for: the bump of an earlier try whose reply was lost may have
        applied, its new bytes in the list and held by nobody.

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
                    # (or bumped by an earlier try whose reply was lost: its new
                    # bytes, held by nobody now, are the rescan's to deliver)
                    self._gates.rescan_wanted = True
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
        (every minute, after a read error, at a start), which delivers them again counted as
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
        Backoff or runtime ``retry_after`` is not due yet (``_core._recovery``'s
        schedule, by the server's clock: a restart while they waited): held,
        they wait out the rest and come back as their next attempt (the
        mount's redeliverer), whatever ``on_error`` is now."""
        t = ctx.target
        lefts = await schedule_lefts(ctx, t, [e for e, _ in elements])
        out: set[int] = set()
        for i, ((e, _), left) in enumerate(zip(elements, lefts, strict=True)):
            if left <= 0:
                continue
            d, plan = list_delivery(t, self.sub.queue, e)
            if plan is not None:
                continue  # dead-lettered now (corrupt, past max_attempts)
            self.hold(e)
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

    def hold(self, raw: bytes) -> None:
        self._gates.hold(raw)

    # -- the rescan -------------------------------------------------------------
    async def rescan(self, conn: Connection, ctx: Context, *, start: bool = True) -> None:
        """Deliver what the processing list holds that this reader does not.

        At start (``start``) every element there is an attempt: the previous
        process may have been handling it (its counter is bumped in place).
        Later, an element this reader does not hold was stranded by a lost
        read reply of this process: delivered as it is (no handler saw it),
        but for copies this reader handled whose removal may have left them.
        """
        t = ctx.target
        self._gates.rescan_wanted = False
        self.recheck_at = None
        # what is held as the LRANGE is sent: a removal answered while it is on
        # its way may have run after it (see _core.reliable_list.liveness.stranded)
        before = dict(self._gates.in_hand)
        items: list[bytes] = await conn.execute("LRANGE", t.processing, 0, -1,
                                                timeout=FINALIZE_TIMEOUT)
        gates = self._gates
        held = gates.in_hand
        lost = stranded(items, held, gates.leftover, gates.delayed,
                        start=start, before=before)
        if doubtful(items, held, before):
            self.recheck_at = anyio.current_time() + _RECHECK
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
            self.hold(raw)
            built.append(list_delivery(ctx.target, self.sub.queue, raw))
        await self._built(ctx, built)
