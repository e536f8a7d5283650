"""Counters per mounted subscription."""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections import Counter

__all__ = ["DURATION_BOUNDS", "Counts", "Durations", "MountStats"]

DURATION_BOUNDS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
"""Upper bounds (seconds) of the handler-duration histogram buckets."""


class Durations:
    """Handler call durations: counts per bucket of :data:`DURATION_BOUNDS` (+Inf last), sum."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(DURATION_BOUNDS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        # HandlerPool._handler_loop does the same inline (a call per delivery less)
        self.counts[bisect_left(DURATION_BOUNDS, seconds)] += 1
        self.sum += seconds


class Counts(Counter[str]):
    """What ``stats()`` gives for outcomes and effects: one not counted yet
    reads 0 (from 0, as Prometheus), equal to a dict of those counted, shown
    as that dict."""

    __slots__ = ()

    def __repr__(self) -> str:
        return dict.__repr__(self)


@dataclasses.dataclass(slots=True)
class MountStats:
    """Live counters of one mounted subscription (see :meth:`~trio_redis_finalize.Consumer.stats`).

    ``outcomes`` counts what handlers returned (``ack``, ``retry``, ``drop``,
    ``retry_after``); ``effects`` counts what finalization did in Redis
    (``acked``, ``copied``, ``delayed``, ``held``, ``left_pending``,
    ``dead_lettered``, ``exhausted``, ``lost_before_handling``, ...), as
    Redis answered: ``gate_closed`` when a gated script found the original
    no longer pending (nothing written; finalized already, e.g. by a racing
    finalizer), or a reliable list's ``ACK`` / ``DROP`` removed nothing (the
    element was no longer in the processing list: another consumer's takeover
    put it back on the queue, say), or a stream's ``XACK`` of a batch
    acknowledged fewer entries than it named (the rest no longer pending:
    claimed and finalized by another consumer, say; which ones is not
    known, the last of the batch are reported), ``failed`` when a step got a final error reply (the original
    stays pending; the error is logged with command and key), ``released``
    when a runtime delayed copy was written.  ``finalize_errors`` counts
    every error reply or failed round trip of finalization (those that did
    not run, or whose outcome is unknown, are sent again).
    """

    subscription: str
    received: int = 0
    handler_errors: int = 0
    refused: int = 0
    finalize_errors: int = 0
    read_errors: int = 0
    group_recreated: int = 0
    in_flight: int = 0
    delay_lag: float | None = None
    stranded: int | None = None
    """Streams: entries pending for other consumers of the group that have no
    live heartbeat (dead, or never kept one), as the last look at the group
    (at most ``heartbeat / 2`` ago) found them; None for other forms."""
    outcomes: Counter[str] = dataclasses.field(default_factory=Counter)
    effects: Counter[str] = dataclasses.field(default_factory=Counter)
    durations: Durations = dataclasses.field(default_factory=Durations)
    """How long handler calls took (the Prometheus histogram)."""

    def snapshot(self) -> dict[str, object]:
        """A plain dict copy (safe to keep, print or serialize)."""
        return {
            "subscription": self.subscription,
            "received": self.received,
            "handler_errors": self.handler_errors,
            "refused": self.refused,
            "finalize_errors": self.finalize_errors,
            "read_errors": self.read_errors,
            "group_recreated": self.group_recreated,
            "in_flight": self.in_flight,
            "delay_lag": self.delay_lag,
            "stranded": self.stranded,
            "outcomes": Counts(self.outcomes),
            "effects": Counts(self.effects),
        }
