"""Shutdown in one place: what happens to in-flight deliveries when a consumer stops.

Leaving ``async with open_consumer(...)`` -- normally, by an exception or by
a cancellation -- runs :meth:`Consumer.aclose <trio_redis_finalize.Consumer.aclose>`, which runs the
phases below.  One :class:`Budget`, derived from ``shutdown_grace`` (``g``
below) when shutdown begins (``t0``), times every phase.

1. **Stop reading** (at ``t0``).  Every mount's reader is cancelled, and with
   it the redeliverer: a delivery waiting for its :class:`~trio_redis_finalize.Backoff`
   delay stays pending (stream PEL, processing list), no timer is waited for.
   A read cut while handing over (``HandOver.deliver``) gives back what it had
   not handed over, as phase 3 does: the reader's ``abandon`` plan (stream:
   the delivery counts set back; reliable list: the give-back script moves
   them back to the queue; simple list: ``RPUSH`` back), with the plans it
   had not sent yet, handed to the finalizer within ``FINALIZE_GRACE``.  The
   stream's lease is not the reader's: it goes on until the finalizer ends
   (phase 4), for the entries whose handler runs or whose outcome is on its
   way (a claiming peer never takes an entry still being handled), no longer
   for those no handler started.  The
   reader's ``closing`` step (a stream's or reliable list's last heartbeat, whose TTL,
   :meth:`Budget.heartbeat_ttl`, covers the phases below so that no other
   consumer reaps the processing list meanwhile) gets ``CLOSING_TIMEOUT``.
2. **Handlers drain**, until ``t0 + g`` (:attr:`Budget.handlers`): each
   handler task finishes the delivery it holds and starts nothing new; its
   outcome goes to the finalizer ("waiting for N handlers" is logged at
   ``t0``).  A handler still running at the deadline is cancelled: its
   delivery stays pending and is delivered again later (streams, reliable
   lists), or is gone (simple lists, Pub/Sub: at-most-once); a warning per
   subscription names those deliveries (``Mount.cut``).
3. **One give-back plan**: what was read but no handler started goes back in
   one plan from the reader's ``abandon`` (stream: the give-back script
   ``stream_give_back`` sets each delivery count back to the count it had,
   so the read does not count as an attempt, while the entry is still this
   consumer's at the count it was handed with; reliable list: back to the
   queue; simple list: ``RPUSH``; Pub/Sub: logged, gone), handed to the
   finalizer within ``FINALIZE_GRACE`` (``HandOver.give_back``).
4. **The finalizer drains** every outcome and plan it was given, to the end
   of its stream (the reader and every handler task closed their senders),
   until ``t0 + g + FINALIZE_GRACE`` (:attr:`Budget.finalizer`); each round
   trip is bounded by ``FINALIZE_TIMEOUT``.  A finalization cut by that
   deadline with its outcome unknown hands its runtime delayed copy to the
   scheduler (a duplicate, never a loss); what was not finalized stays
   pending.  Should a mount's tasks still run at ``Budget.finalizer +
   CLOSE_MARGIN`` (:attr:`Budget.mounts`), they are cancelled.
5. **Scheduler flush**: every runtime ``retry_after`` copy still held in
   memory is sent at once (early rather than lost), until
   :attr:`Budget.flush` (``+ FLUSH_GRACE``); from then on the scheduler's
   own task sends nothing.
6. **Hand-back** (the stop is graceful: nothing waits for a heartbeat to
   lapse): each mount's reader gets its ``closed`` step (``CLOSING_TIMEOUT``,
   all at once).  A stream consumer runs one script
   (``STOP``, ``_core/stream/liveness.py``): what is still pending for it -- read and not
   started (its count set back by phase 3, or here should the finalizer
   never have sent that give-back: stuck on a stalled request), cut by the
   grace, waiting for a backoff -- is made idle at once (``XCLAIM ... IDLE``,
   owner and delivery count unchanged), its heartbeat key is deleted and its registration
   becomes the stopped mark, which the group's live consumers honour at their
   next look (they probe the registry every ``STOP_PROBE`` = 0.5 s): they
   take those entries within about a second, at the attempt each had (a cut
   handler's attempt counts; CLAIMING keeps its delayed retries pending with
   their delay).  With nothing pending it is deleted from the group and the
   registry.  A reliable-list consumer moves what is left in its processing
   list back onto the queue (a cut or waiting element counted, as the reaper
   would; one given back unstarted whose give-back was never answered, not),
   then deletes its heartbeat key and registration.  "handed back N"
   is logged once per mount.  Should this step fail (the server silent), the
   last heartbeat (phase 1) lapses and a live consumer takes the work over,
   as after a crash.
7. **Close**: the client's connections (the pool's and each reader's own)
   are closed (``open_consumer``'s exit).  Once the scheduler's task has
   ended, each copy it still holds (the server refused it or did not answer
   until the deadline) is counted ``held_lost`` and logged
   (:meth:`Scheduler.abandon <trio_redis_finalize._scheduler.Scheduler.abandon>`).

Only a crash, or a server that refuses or stays silent through these
deadlines, loses something: the runtime delayed copies held in memory (use
``DelayedRetry.DURABLE_ZSET`` to keep them in Redis) and, on simple lists and
Pub/Sub, what was popped or received.  Every such loss at shutdown is
logged: a finalization cut at phase 4's deadline (a warning with the number
of outcomes Redis had not confirmed) and the copies of phase 7.

Every cleanup scope of the runtime is made by :func:`cleanup` or
:func:`cleanup_until`: shielded from the cancellation that stops the
runtime, and bounded.  Two more shields keep the runtime's tasks out of a
cancellation of the consumer's task group until ``aclose`` has run these
phases: each mount's task scope (shielded once the mount is reading, ended at
:attr:`Budget.mounts`) and the scheduler task's (cancelled after phase 5).
"""

from __future__ import annotations

import dataclasses

import anyio

__all__ = ["CLOSE_MARGIN", "CLOSING_TIMEOUT", "FINALIZE_GRACE", "FLUSH_GRACE", "Budget", "cleanup"]

FINALIZE_GRACE = 10.0
"""Seconds the finalizer keeps sending after the handlers' deadline (phase 4)."""
FLUSH_GRACE = 10.0
"""Seconds the scheduler keeps trying to send the held delayed copies (phase 5)."""
CLOSE_MARGIN = 1.0
"""Seconds past the finalizer's deadline before a mount's tasks are cancelled."""
CLOSING_TIMEOUT = 1.0
"""Seconds a reader's ``closing`` step (phase 1) or ``closed`` step (phase 6) may take."""


@dataclasses.dataclass(frozen=True, slots=True)
class Budget:
    """The deadlines of one shutdown (absolute times of the async clock)."""

    start: float
    grace: float
    handlers: float
    """Phase 2: handlers still running now are cancelled."""
    finalizer: float
    """Phase 4: the finalizer stops sending."""
    mounts: float
    """A mount's tasks still running now are cancelled."""
    flush: float
    """Phase 5: held delayed copies not sent by now are lost."""

    @classmethod
    def from_now(cls, grace: float) -> Budget:
        """The budget of a shutdown that begins now, with ``shutdown_grace=grace``."""
        start = anyio.current_time()
        finalizer = start + grace + FINALIZE_GRACE
        return cls(start=start, grace=grace, handlers=start + grace, finalizer=finalizer,
                   mounts=finalizer + CLOSE_MARGIN, flush=finalizer + CLOSE_MARGIN + FLUSH_GRACE)

    @staticmethod
    def heartbeat_ttl(grace: float) -> float:
        """Seconds a reliable list's last heartbeat must live: until the finalizer's deadline."""
        return grace + FINALIZE_GRACE + CLOSE_MARGIN


def cleanup(seconds: float) -> anyio.CancelScope:
    """A shielded scope that ends after ``seconds``: for cleanup that must run
    although its task is being cancelled, and must end.

    Use it as ``with cleanup(FINALIZE_TIMEOUT) as scope:``; ``scope.cancelled_caught``
    tells that the time ran out.
    """
    return anyio.CancelScope(shield=True, deadline=anyio.current_time() + seconds)


def cleanup_until(deadline: float) -> anyio.CancelScope:
    """:func:`cleanup` up to an absolute ``deadline`` (a :class:`Budget` field)."""
    return anyio.CancelScope(shield=True, deadline=deadline)
