"""Simple lists: ``ListSubscription`` (BRPOP; nothing to acknowledge)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from .._core._decode import list_delivery
from .._core._types import Effect, Plan, Target
from .._deadlines import READ_MARGIN
from .._delivery import Delivery
from .._hand_over import Lease
from .._subscription import Form, Subscription, check_key, check_limits, check_positive
from .._transport import Connection
from ._port import Context
from ._read_loop import check_type, reader_connection

__all__ = ["ListReader", "ListSubscription"]


@dataclasses.dataclass(frozen=True, slots=True)
class ListSubscription(Subscription):
    """Pop elements with BRPOP.  At-most-once: a crash during a handler loses
    the element.  ACK/RETRY/DROP are refused (:class:`AckUnsupported`);
    ``retry_after`` LPUSHes a copy back after the delay.

    Args:
        key: the list producers LPUSH onto.
        block: seconds one BRPOP blocks.
        max_attempts: attempts after which a ``retry_after`` copy is dropped
            (with a warning) instead of written.
    """

    key: str
    _: dataclasses.KW_ONLY  # the rest keyword-only, as documented
    block: float = 1.0
    max_attempts: int | None = None

    form = Form.LIST

    def __post_init__(self) -> None:
        check_key("key", self.key)
        check_positive("block", self.block)
        check_limits(self.max_attempts, None)

    @property
    def name(self) -> str:
        return f"list {self.key!r}"

    def target(self, consumer: str, *, cluster: bool = False) -> Target:
        return Target(form=Form.LIST, name=self.name, source=self.key,
                      max_attempts=self.max_attempts, cluster=cluster)


# -- runtime ------------------------------------------------------------------

class ListReader:
    """Pops one :class:`ListSubscription` with BRPOP on a dedicated connection.

    At-most-once: BRPOP removes the element from Redis, so a crash (or a lost
    read reply) loses it.  Elements popped but never started at shutdown are
    pushed back where they came from (:meth:`abandon`).
    """

    def __init__(self, sub: ListSubscription) -> None:
        self.sub = sub
        self._timeout = f"{max(sub.block, 0.001):.3f}"  # "0.000" would block forever
        self.lease = Lease()  # never lapses (``Reader.lease``)

    pending = None  # nothing stays pending (at-most-once)
    gates = None

    def holding(self, ctx: Context) -> None:
        """Nothing to keep beyond the reading (see ``Reader.holding``)."""
        return None

    def abandon(self, deliveries: Sequence[Delivery]) -> Plan | None:
        """RPUSH the elements back, the oldest last (BRPOP takes it first again)."""
        raws = [d.raw for d in deliveries if d.raw is not None]
        if not raws:
            return None
        return Plan(Effect.NOTHING, (("RPUSH", self.sub.key, *reversed(raws)),), gated=False)

    # -- the read loop's steps (_read_loop.drive) ----------------------------------
    async def setup(self, ctx: Context) -> None:
        await check_type(ctx.client, self.sub.key, "list", self.sub.name)

    def background(self, ctx: Context) -> Sequence[Callable[[], Coroutine[Any, Any, None]]]:
        return ()

    def connection(self, ctx: Context) -> AbstractAsyncContextManager[Connection]:
        return reader_connection(ctx, self.sub.key)

    async def connected(self, ctx: Context, conn: Connection) -> None:
        pass

    async def catch_up(self, ctx: Context, conn: Connection) -> None:
        pass

    async def turn(self, ctx: Context, conn: Connection) -> None:
        sub = self.sub
        reply = await conn.execute("BRPOP", sub.key, self._timeout, timeout=sub.block + READ_MARGIN)
        if reply is None:
            return
        d, plan = list_delivery(ctx.target, sub.key, reply[1])
        # popped: cut before a handler has it (shutdown), it is pushed back (abandon)
        if plan is None:
            await ctx.deliver([d], give_back=True)
        else:
            await ctx.deliver((), [(d, plan)], give_back=True)

    def failed(self, ctx: Context, err: Exception) -> float | None:
        return None

    async def closing(self, ctx: Context) -> None:
        pass

    async def closed(self, ctx: Context) -> None:
        pass  # nothing registered
