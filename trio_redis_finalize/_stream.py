"""Stream consumer groups: ``StreamSubscription`` (PLAIN, RECLAIM, CLAIMING)."""

from __future__ import annotations

import dataclasses

from ._keys import derived
from ._plan import Target
from ._subscription import (
    DelayedRetry,
    Form,
    Mode,
    Subscription,
    check_key,
    check_limits,
    check_positive,
)

__all__ = ["StreamSubscription"]


@dataclasses.dataclass(frozen=True, slots=True)
class StreamSubscription(Subscription):
    """Read a stream as consumer ``<consumer name>`` of ``group``.

    The group is created at ``start_id`` (default ``"0"``: entries written
    before the group existed are consumed too) with MKSTREAM when missing.

    Args:
        stream: the stream key.
        group: the consumer group.
        mode: :class:`Mode` ``PLAIN``, ``RECLAIM`` or ``CLAIMING``.
        min_idle: seconds an entry must be idle before RECLAIM/CLAIMING claims it.
        delayed_retry: where ``retry_after`` waits; ``None``: RUNTIME for plain
            and reclaim, the PEL for claiming.
        delay_key: the durable delay set (default ``{stream}:delayed``).
        max_attempts: attempts before a RETRY goes to ``dead_letter``.
        dead_letter: stream that receives exhausted entries.
        block: seconds one XREADGROUP blocks.
        count: entries per read.
        start_id: where a new group starts.
    """

    stream: str
    group: str
    mode: Mode = Mode.PLAIN
    min_idle: float = 60.0
    delayed_retry: DelayedRetry | None = None
    delay_key: str | None = None
    max_attempts: int | None = None
    dead_letter: str | None = None
    block: float = 1.0
    count: int = 100
    start_id: str = "0"

    form = Form.STREAM

    def __post_init__(self) -> None:
        check_key("stream", self.stream)
        check_key("group", self.group)
        if not isinstance(self.mode, Mode):
            raise ValueError(f"mode must be a Mode, got {self.mode!r}")
        check_positive("min_idle", self.min_idle, allow_zero=True)
        check_positive("block", self.block)
        if self.delayed_retry is not None and not isinstance(self.delayed_retry, DelayedRetry):
            raise ValueError(f"delayed_retry must be a DelayedRetry or None, got {self.delayed_retry!r}")
        if self.delay_key is not None:
            check_key("delay_key", self.delay_key)
            if self.delayed_retry is not DelayedRetry.DURABLE_ZSET:
                raise ValueError("delay_key is only used with delayed_retry=DelayedRetry.DURABLE_ZSET")
        check_limits(self.max_attempts, self.dead_letter)
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"count must be an int >= 1, got {self.count!r}")
        check_key("start_id", self.start_id)

    @property
    def name(self) -> str:
        return f"stream {self.stream!r} group {self.group!r}"

    @property
    def resolved_delay(self) -> DelayedRetry | None:
        """The way ``retry_after`` works here; ``None`` means the PEL (claiming)."""
        if self.delayed_retry is not None:
            return self.delayed_retry
        return None if self.mode is Mode.CLAIMING else DelayedRetry.RUNTIME

    def target(self, consumer: str, *, cluster: bool = False) -> Target:
        return Target(
            form=Form.STREAM,
            name=self.name,
            source=self.stream,
            mode=self.mode,
            group=self.group,
            delayed_retry=self.resolved_delay,
            delay_key=self.delay_key or derived(self.stream, ":delayed"),
            max_attempts=self.max_attempts,
            dead_letter=self.dead_letter,
            min_idle=self.min_idle,
            cluster=cluster,
        )
