"""Reliable lists: ``ReliableListSubscription`` (BLMOVE into a processing list)."""

from __future__ import annotations

import dataclasses

from ._keys import derived, same_slot
from ._plan import Target
from ._subscription import (
    DelayedRetry,
    Form,
    Subscription,
    check_key,
    check_limits,
    check_positive,
)

__all__ = ["ReliableListSubscription"]


@dataclasses.dataclass(frozen=True, slots=True)
class ReliableListSubscription(Subscription):
    """Read a list with ``BLMOVE queue processing RIGHT LEFT`` (producers LPUSH: FIFO).

    Args:
        queue: the list producers LPUSH onto.
        processing: this consumer's processing list (default
            ``{queue}:processing:<consumer name>``).
        delayed_retry: RUNTIME (default) or DURABLE_ZSET for ``retry_after``.
        max_attempts: attempts before a RETRY goes to ``dead_letter``.
        dead_letter: list that receives exhausted elements (LPUSH).
        block: seconds one BLMOVE blocks.
        delay_key: the durable delay set (default ``{queue}:delayed``).
        heartbeat: seconds after which a silent consumer counts as dead and
            its processing list is moved back onto the queue by a live one.
    """

    queue: str
    processing: str | None = None
    delayed_retry: DelayedRetry | None = None
    max_attempts: int | None = None
    dead_letter: str | None = None
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
        if self.delayed_retry is not None and not isinstance(self.delayed_retry, DelayedRetry):
            raise ValueError(f"delayed_retry must be a DelayedRetry or None, got {self.delayed_retry!r}")
        if self.delay_key is not None:
            check_key("delay_key", self.delay_key)
            if self.delayed_retry is not DelayedRetry.DURABLE_ZSET:
                raise ValueError("delay_key is only used with delayed_retry=DelayedRetry.DURABLE_ZSET")
        check_limits(self.max_attempts, self.dead_letter)
        if self.dead_letter is not None and self.dead_letter in (self.queue, self.processing):
            raise ValueError("dead_letter must differ from queue and processing")
        if self.delay_key is not None and self.delay_key in (self.queue, self.processing):
            raise ValueError("delay_key must differ from queue and processing")
        check_positive("block", self.block)
        check_positive("heartbeat", self.heartbeat)

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
