"""Pub/Sub: ``ChannelSubscription`` and ``PatternSubscription`` (at-most-once)."""

from __future__ import annotations

from ._plan import Target
from ._subscription import Form, Subscription, check_key, check_limits

__all__ = ["ChannelSubscription", "PatternSubscription"]


class ChannelSubscription(Subscription):
    """SUBSCRIBE to one or more channels.  Pub/Sub is at-most-once: what is
    published while no connection is subscribed is gone.  ``retry_after``
    PUBLISHes a copy to the channel the message came on.
    """

    __slots__ = ("channels", "max_attempts")
    form = Form.CHANNEL

    def __init__(self, *channels: str, max_attempts: int | None = None) -> None:
        if not channels:
            raise ValueError("channels: give at least one channel")
        for c in channels:
            check_key("channels", c)
        check_limits(max_attempts, None)
        self.channels: tuple[str, ...] = tuple(dict.fromkeys(channels))
        self.max_attempts = max_attempts

    @property
    def name(self) -> str:
        return "channel " + ",".join(self.channels)

    def __repr__(self) -> str:
        return f"ChannelSubscription({', '.join(map(repr, self.channels))})"

    def target(self, consumer: str, *, cluster: bool = False) -> Target:
        return Target(form=Form.CHANNEL, name=self.name, source=self.channels[0],
                      max_attempts=self.max_attempts, cluster=cluster)


class PatternSubscription(Subscription):
    """PSUBSCRIBE to a glob pattern; :attr:`Delivery.source` is the concrete
    channel.  ``retry_after`` needs ``retry_channel`` (where copies go).
    """

    __slots__ = ("max_attempts", "pattern", "retry_channel")
    form = Form.PATTERN

    def __init__(
        self, pattern: str, *, retry_channel: str | None = None, max_attempts: int | None = None
    ) -> None:
        check_key("pattern", pattern)
        if retry_channel is not None:
            check_key("retry_channel", retry_channel)
        check_limits(max_attempts, None)
        self.pattern = pattern
        self.retry_channel = retry_channel
        self.max_attempts = max_attempts

    @property
    def name(self) -> str:
        return f"pattern {self.pattern!r}"

    def __repr__(self) -> str:
        return f"PatternSubscription({self.pattern!r}, retry_channel={self.retry_channel!r})"

    def target(self, consumer: str, *, cluster: bool = False) -> Target:
        return Target(form=Form.PATTERN, name=self.name, source=self.pattern,
                      retry_channel=self.retry_channel, max_attempts=self.max_attempts,
                      cluster=cluster)
