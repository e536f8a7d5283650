"""What the stream form's tests share: the stream and group, the subscription's
name, entries added and the group's pending entries."""

from __future__ import annotations

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
