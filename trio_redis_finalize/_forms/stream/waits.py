"""Own pending entries whose Backoff is not due yet: found, and held until due.

A delivery that failed under ``on_error=Backoff()`` stays in the PEL, its due
time kept in Redis (``_core._recovery``'s schedule, by the server's clock).
When the own-PEL recovery or a claim (``own_pel.py``) finds such an entry
(this consumer restarted while it waited, or its consumer stopped), it
waits out the rest here: held by the mount (``Context.defer``) and
delivered again as its next attempt when due (``OwnPel.redeliver``).  The
attempt it is held as is ``_core/stream/decode.waiting``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis import exceptions as rexc

from ..._core._recovery import SCHEDULE_LEFT, schedule_key, schedule_left
from ..._core._replies import NOT_RUN, classify
from ..._core.stream.decode import Entry, claimed_waiting, give_back, stream_deliveries, waiting
from ..._deadlines import FINALIZE_TIMEOUT, log
from ..._shutdown import cleanup
from .._port import Context

__all__ = ["claimed_waits", "defer", "recovered_waits", "scheduled"]


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


def defer(ctx: Context, entries: Sequence[Entry], left: dict[bytes, tuple[float, int]]) -> set[bytes]:
    """Entries in the own PEL whose Backoff is not due yet (``left``: seconds
    left, the attempt that failed): they wait, held, and come back as
    their next attempt when due (the mount's redeliverer,
    ``OwnPel.redeliver``).  Returns the ids that wait (the others: deliver now)."""
    if not left:
        return set()
    counts = waiting(left)
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
        p = give_back(t.source, t.group, ctx.consumer.name, claimed_waiting(held, left))
        if p is not None:
            await ctx.client.pipeline(p.commands, timeout=FINALIZE_TIMEOUT)
    if held is None:
        raise rexc.TimeoutError(f"reading the Backoff schedule {schedule_key(t)!r} of "
                                f"{len(live)} claimed entries: no reply within {FINALIZE_TIMEOUT} s")
    return [e for e in live if e[0] not in held]
