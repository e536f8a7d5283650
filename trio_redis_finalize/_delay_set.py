"""The durable delay set, reader side: move due copies back before a read.

Shared by the stream and reliable-list readers; the move itself is one
atomic Lua script (``MOVE_DUE_TO_STREAM`` / ``MOVE_DUE_TO_LIST``).
"""

from __future__ import annotations

from ._mount import FINALIZE_TIMEOUT, Mount
from ._transport import Script

__all__ = ["MOVE_LIMIT", "move_due"]

MOVE_LIMIT = 128
"""At most this many due copies move per read."""


async def move_due(mount: Mount, script: Script, block: float) -> float:
    """Move due copies of ``mount``'s delay set back to its source.

    Returns the seconds until the next copy is due (0 when more are due now,
    at most ``block``), and updates the mount's ``delay_lag``.

    Raises:
        redis.exceptions.ResponseError: Redis refused the move (what was not
            written is still in the set).
    """
    t = mount.target
    moved, now_ms, first = await mount.client.evalsha(
        script, (t.delay_key, t.source), (MOVE_LIMIT,), timeout=FINALIZE_TIMEOUT
    )
    if moved:
        mount.stats.effects["moved_from_delay_set"] += int(moved)
    if int(moved) >= MOVE_LIMIT:
        return 0.0
    if first is None:
        mount.stats.delay_lag = None
        return block
    lag = (int(now_ms) - float(first)) / 1000
    mount.stats.delay_lag = max(lag, 0.0)
    return max(0.0, min(block, -lag))
