"""Simple lists: ``ListSubscription`` (BRPOP; nothing to acknowledge)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
from redis import exceptions as rexc

from .._core._decode import list_delivery
from .._core._plan import Effect, Plan, Target
from .._core._replies import NOT_RUN, classify
from .._deadlines import FINALIZE_TIMEOUT, READ_MARGIN, backoff, log
from .._delivery import Delivery
from .._shutdown import cleanup
from .._subscription import Form, Subscription, check_key, check_limits, check_positive
from .._transport import Connection
from ._port import Context, hand_over
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

    pending = None  # nothing stays pending (at-most-once)
    gates = None

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
        raw: bytes = reply[1]
        try:
            await hand_over(ctx, [list_delivery(ctx.target, sub.key, raw)])
        except BaseException:
            # popped but not handed over (shutdown): put it back
            await self._give_back(ctx, [raw])
            raise

    def failed(self, ctx: Context, err: Exception) -> float | None:
        return None

    async def closing(self, ctx: Context) -> None:
        pass

    async def closed(self, ctx: Context) -> None:
        pass  # nothing registered

    async def _give_back(self, ctx: Context, raws: list[bytes]) -> None:
        with cleanup(FINALIZE_TIMEOUT) as scope:
            attempt = 0
            while True:
                try:
                    await ctx.client.execute("RPUSH", self.sub.key, *reversed(raws),
                                             timeout=FINALIZE_TIMEOUT)
                    return
                except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError) as e:
                    if classify(e) is NOT_RUN:  # OOM, READONLY ...: did not run, again
                        await anyio.sleep(backoff(attempt))
                        attempt += 1
                        continue
                    log.error("%s: could not push %d popped elements back: %s",
                              ctx.name, len(raws), e)
                    return
        if scope.cancelled_caught:
            log.error("%s: could not push %d popped elements back within %g s", ctx.name,
                      len(raws), FINALIZE_TIMEOUT)

