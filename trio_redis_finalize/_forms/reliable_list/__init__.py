"""The reliable list form's home: :class:`ReliableListSubscription` (``BLMOVE``
into a processing list per consumer), what a user writes to mount one.

Beside it, at run time: :mod:`.reader` (the read loop's steps: BLMOVE,
prefetch, hand-over), :mod:`.recovery` (the processing list's rescan and the
Backoff redeliveries: elements held in place, their counters bumped) and
:mod:`.liveness` (heartbeat, reaper of dead consumers, the stop's hand-back
and deregistration).  The sans-IO half is ``_core.reliable_list`` (keys,
scripts, counted gates, multiset counting).
"""

from __future__ import annotations

import dataclasses

from ..._core._identity import HEARTBEAT_FLOOR
from ..._core._types import Target
from ..._keys import derived, same_slot
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

__all__ = ["ReliableListSubscription"]


@dataclasses.dataclass(frozen=True, slots=True)
class ReliableListSubscription(Subscription):
    """Read a list with ``BLMOVE queue processing RIGHT LEFT`` (producers LPUSH: FIFO).

    Args:
        queue: the list producers LPUSH onto.
        processing: this consumer's processing list (default
            ``{queue}:processing:<consumer name>``), one consumer's own: a
            mount under another name is refused (``ValueError``) while the
            consumer registered with it is alive.
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
