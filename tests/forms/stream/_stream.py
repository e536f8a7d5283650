"""What the stream form's tests share: the stream and group, the subscription's
name, entries added and the group's pending entries, a held and a quick handler,
the lease-peer tests' check of the warning about a peer."""

from __future__ import annotations

import logging

import trio

from trio_redis_finalize import ACK, Delivery, Outcome
from trio_redis_finalize._transport import Client

S, G = "orders", "billing"
NAME = f"stream {S!r} group {G!r}"


async def xadd(client: Client, stream: str = S, **fields: str) -> str:
    """An entry of ``fields`` added to ``stream``: its id."""
    args: list[str] = []
    for k, v in fields.items():
        args += [k, v]
    eid = await client.execute("XADD", stream, "*", *args)
    return str(eid.decode())


async def pending(client: Client, stream: str = S, group: str = G) -> int:
    return int((await client.execute("XPENDING", stream, group))[0])


async def pending_of(client: Client, stream: str = S, group: str = G) -> dict[str, int]:
    """Pending entries per consumer name."""
    summary = await client.execute("XPENDING", stream, group)
    return {c.decode(): int(n) for c, n in (summary[3] or [])}


class HeldAndQuick:
    """Two handlers that note each call in :attr:`calls` as (who, entry id):
    ``held`` ("a") holds its entry until :attr:`release` is set
    (:attr:`holding` is set once it began), ``quick`` ("b") ACKs at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []
        self.holding, self.release = trio.Event(), trio.Event()

    async def held(self, d: Delivery) -> Outcome:
        self.calls.append(("a", d.id))
        self.holding.set()
        await self.release.wait()
        return ACK

    async def quick(self, d: Delivery) -> Outcome:
        self.calls.append(("b", d.id))
        return ACK


def warned_once_about_b(records: list[logging.LogRecord]) -> None:
    """One warning that consumer 'b' claims sooner (``min_idle`` 1.5 s) than
    this subscription (9 s), among ``records`` (``caplog.records``)."""
    told = [r.getMessage() for r in records
            if r.levelno == logging.WARNING and "consumer 'b' of the group claims" in r.getMessage()]
    assert len(told) == 1, told
    assert "min_idle=1.5 s" in told[0] and "min_idle=9 s" in told[0], told
