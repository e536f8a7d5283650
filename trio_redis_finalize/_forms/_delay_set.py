"""The durable delay set, reader side: move due copies back before a read.

Shared by the stream and reliable-list readers; the move itself is one
atomic Lua script (``MOVE_DUE_TO_STREAM`` / ``MOVE_DUE_TO_LIST``).  A stream
member wider than :data:`MOVE_WIDTH` values is handed back by the script
(reserved for :data:`MOVE_RESERVE_MS`, so no racing mover takes it too) and
written here: XADD first, ZREM second (duplicate, never loss), with the
subscription's ``copy_maxlen`` as the script's (``_core/stream/moves``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .._core._replies import raise_first_error
from .._core.stream.moves import move_back_commands
from .._deadlines import FINALIZE_TIMEOUT
from .._transport import Script
from ._port import Context

__all__ = ["MOVE_LIMIT", "MOVE_RESERVE_MS", "MOVE_WIDTH", "move_due"]

MOVE_LIMIT = 128
"""At most this many due copies move per read."""

MOVE_WIDTH = 20_000
"""Field values (10,000 fields) of the widest stream member the move script
writes itself; wider ones (rare: the script's XADD costs grow with the square
of the width) are handed back and written by the client."""

MOVE_RESERVE_MS = 30_000
"""How long a handed-back member is hidden from other movers."""


async def move_due(ctx: Context, script: Script, block: float) -> float:
    """Move due copies of the delay set of ``ctx`` (a mount) back to its source.

    Returns the seconds until the next copy is due (0 when more are due now,
    at most ``block``), and updates the mount's ``delay_lag``.

    Raises:
        redis.exceptions.ResponseError: Redis refused the move (what was not
            written is still in the set).
    """
    t = ctx.target
    moved, now_ms, first, *back = await ctx.client.evalsha(
        script, (t.delay_key, t.source), (MOVE_LIMIT, MOVE_WIDTH, MOVE_RESERVE_MS),
        timeout=FINALIZE_TIMEOUT,
    )
    moved = int(moved)
    if moved:
        ctx.stats.effects["moved_from_delay_set"] += moved
    if back:
        await _move_back(ctx, back)
    if moved + len(back) >= MOVE_LIMIT:
        return 0.0
    if first is None:
        ctx.stats.delay_lag = None
        return block
    lag = (int(now_ms) - float(first)) / 1000
    ctx.stats.delay_lag = max(lag, 0.0)
    return max(0.0, min(block, -lag))


async def _move_back(ctx: Context, members: Sequence[bytes]) -> None:
    """Write the members the script handed back, then remove those written.

    Each member is tried on its own (one that Redis refuses holds up no
    other); the first refusal is raised once the others are moved.
    """
    t = ctx.target
    if not t.group:  # pragma: no cover - only a stream's (read by a group) are handed back
        raise ValueError(f"{t.name}: members are handed back to a stream's group only")
    client = ctx.client
    adds = move_back_commands(t, members)  # capped at copy_maxlen, as the script's own
    replies = await client.pipeline(adds, raise_on_error=False, timeout=FINALIZE_TIMEOUT)
    written = [m for m, r in zip(members, replies, strict=True) if not isinstance(r, Exception)]
    if written:
        await client.execute("ZREM", t.delay_key, *written, timeout=FINALIZE_TIMEOUT)
        ctx.stats.effects["moved_from_delay_set"] += len(written)
    raise_first_error(adds, replies)
