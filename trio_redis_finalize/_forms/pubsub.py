"""Pub/Sub: ``ChannelSubscription`` and ``PatternSubscription`` (at-most-once)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from itertools import chain
from typing import Any

import anyio
from redis import exceptions as rexc

from .._core._decode import MESSAGE, PMESSAGE, payload_deliveries
from .._core._types import Plan, Target
from .._deadlines import FINALIZE_TIMEOUT, log
from .._delivery import Delivery
from .._hand_over import Lease
from .._subscription import Form, Subscription, check_key, check_limits
from .._transport import PubSub
from .._value import immutable, setters
from ._port import Context

__all__ = ["ChannelSubscription", "PatternSubscription", "PubSubReader"]


# ``init=False``: ``*channels``, kept once each in their order.  ``eq=False``:
# a Pub/Sub subscription compares by identity.
@immutable
@dataclasses.dataclass(frozen=True, slots=True, eq=False, init=False)
class ChannelSubscription(Subscription):
    """SUBSCRIBE to one or more channels.  Pub/Sub is at-most-once: what is
    published while no connection is subscribed is gone.  ``retry_after``
    PUBLISHes a copy to the channel the message came on.

    Args:
        channels: one or more channel names.
        max_attempts: attempts after which a ``retry_after`` copy is dropped
            (with a warning) instead of published.
    """

    channels: tuple[str, ...]
    max_attempts: int | None

    form = Form.CHANNEL

    def __init__(self, *channels: str, max_attempts: int | None = None) -> None:
        if not channels:
            raise ValueError("channels: give at least one channel")
        for c in channels:
            check_key("channels", c)
        check_limits(max_attempts, None)
        _set_channels(self, tuple(dict.fromkeys(channels)))
        _set_max_attempts(self, max_attempts)

    @property
    def name(self) -> str:
        return "channel " + ",".join(self.channels)

    def __repr__(self) -> str:
        return f"ChannelSubscription({', '.join(map(repr, self.channels))})"

    def target(self, consumer: str, *, cluster: bool = False) -> Target:
        return Target(form=Form.CHANNEL, name=self.name, source=self.channels[0],
                      max_attempts=self.max_attempts, cluster=cluster)


@immutable
@dataclasses.dataclass(frozen=True, slots=True, eq=False)  # eq=False: compared by identity
class PatternSubscription(Subscription):
    """PSUBSCRIBE to a glob pattern; :attr:`Delivery.source` is the concrete
    channel.  ``retry_after`` needs ``retry_channel`` (where copies go).

    Args:
        pattern: a glob-style pattern (``news.*``).
        retry_channel: the channel ``retry_after`` copies are published to;
            without it ``retry_after`` is refused with :class:`AckUnsupported`.
        max_attempts: attempts after which a ``retry_after`` copy is dropped
            (with a warning) instead of published.
    """

    pattern: str
    _: dataclasses.KW_ONLY  # the rest keyword-only, as documented
    retry_channel: str | None = None
    max_attempts: int | None = None

    form = Form.PATTERN

    def __post_init__(self) -> None:
        check_key("pattern", self.pattern)
        if self.retry_channel is not None:
            check_key("retry_channel", self.retry_channel)
        check_limits(self.max_attempts, None)

    @property
    def name(self) -> str:
        return f"pattern {self.pattern!r}"

    def __repr__(self) -> str:
        return f"PatternSubscription({self.pattern!r}, retry_channel={self.retry_channel!r})"

    def target(self, consumer: str, *, cluster: bool = False) -> Target:
        return Target(form=Form.PATTERN, name=self.name, source=self.pattern,
                      retry_channel=self.retry_channel, max_attempts=self.max_attempts,
                      cluster=cluster)


_set_channels, _set_max_attempts = setters(ChannelSubscription, "channels", "max_attempts")

# -- runtime ------------------------------------------------------------------

_IDLE_PING = 5.0
"""Seconds without a message after which the subscription is checked with PING."""
_PING_TIMEOUT = 5.0
_CHUNK = 100
"""At most this many already-received messages are handed over together."""
_MAX_NAMES = 1000
"""Decoded channel names kept at most (a pattern subscription may see many)."""


class PubSubReader:
    """Reads a :class:`ChannelSubscription` or :class:`PatternSubscription`.

    The subscription is confirmed by the server before ``mount()`` returns.
    A connection that fails (or does not answer a PING after a quiet spell)
    is replaced with capped, jittered backoff and the subscription renewed;
    what was published meanwhile is gone (Pub/Sub is at-most-once): the gap
    is logged as a warning with its length and counted in
    ``stats()[name]["effects"]["gaps"]``.
    """

    def __init__(self, sub: ChannelSubscription | PatternSubscription) -> None:
        self.sub = sub
        self._lost_at: float | None = None  # when the connection was lost (a gap began)
        self._names: dict[bytes, str] = {}  # channel names decoded
        self._pattern = isinstance(sub, PatternSubscription)
        self.lease = Lease()  # never lapses (``Reader.lease``)

    pending = None  # nothing stays pending (at-most-once)
    gates = None

    def holding(self, ctx: Context) -> None:
        """Nothing to keep beyond the reading (see ``Reader.holding``)."""
        return None

    def abandon(self, deliveries: Sequence[Delivery]) -> Plan | None:
        if deliveries:
            log.warning("%s: %d received message(s) not handled at shutdown (Pub/Sub is "
                        "at-most-once; they are gone)", self.sub.name, len(deliveries))
        return None

    # -- the read loop's steps (_read_loop.drive) ----------------------------------
    async def setup(self, ctx: Context) -> None:
        pass

    def background(self, ctx: Context) -> Sequence[Callable[[], Coroutine[Any, Any, None]]]:
        return ()

    def connection(self, ctx: Context) -> AbstractAsyncContextManager[PubSub]:
        return ctx.client.pubsub(name=f"trf:{ctx.consumer.name}:pubsub")

    async def connected(self, ctx: Context, ps: PubSub) -> None:
        """Subscribe (confirmed by the server); after a gap, say how long it was."""
        sub = self.sub
        if isinstance(sub, PatternSubscription):
            await ps.psubscribe(sub.pattern, timeout=FINALIZE_TIMEOUT)
        else:
            await ps.subscribe(*sub.channels, timeout=FINALIZE_TIMEOUT)
        if self._lost_at is not None:
            gap = anyio.current_time() - self._lost_at
            ctx.stats.effects["gaps"] += 1
            log.warning("%s: subscribed again after %.2f s without a connection; messages "
                        "published meanwhile are lost (Pub/Sub is at-most-once)", ctx.name, gap,
                        extra={"subscription": ctx.name})
            self._lost_at = None

    async def catch_up(self, ctx: Context, ps: PubSub) -> None:
        pass

    async def turn(self, ctx: Context, ps: PubSub) -> None:
        """Deliver what arrives; a quiet spell is checked with a PING."""
        msg = await ps.get_message(timeout=_IDLE_PING)
        if msg is None:
            await ps.ping(timeout=_PING_TIMEOUT)
            return
        names = self._names
        if len(names) > _MAX_NAMES:  # a pattern may match any number of channels
            names.clear()
        # the first message and what is already received with it, without waiting
        # (in the shape of its subscription's messages, whatever get_message saw)
        pattern = self._pattern
        first = ([PMESSAGE, msg.pattern, msg.channel, msg.data] if pattern
                 else [MESSAGE, msg.channel, msg.data])
        ready, direct, other = payload_deliveries(
            ctx.target, names, chain((first,), ps.received(_CHUNK - 1)), pattern=pattern)
        # the messages read before it first: taking a reply that is not a message
        # may raise (an error reply, one no subscriber expects), and they are here
        await ctx.deliver(ready, direct)  # nothing to give back: at-most-once
        if other is not None:  # a reply that is not a message: as get_message takes it
            ps.other(other)

    def failed(self, ctx: Context, err: Exception) -> float | None:
        if not isinstance(err, rexc.ResponseError) and self._lost_at is None:
            self._lost_at = anyio.current_time()  # the connection is gone: so is what is published
        return None

    async def closing(self, ctx: Context) -> None:
        pass

    async def closed(self, ctx: Context) -> None:
        pass  # nothing registered

