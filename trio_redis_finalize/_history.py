"""Per-minute counts in Redis, so a dashboard started later still shows the last hour.

Each stream or list mount adds, every :data:`EVERY` seconds (off the hot
path: a task beside the reader reads the counters the finalizer already
keeps, :class:`~._stats.MountStats`), what it finalized since its last
write to a hash next to its source key (:func:`history_key`, in the
source's hash slot)::

    <minute>:<counter>  ->  count        minute: server TIME // 60

``counter``: ``ack``, ``retry`` (RETRY, retry_after and handler errors
backed off), ``drop``, ``dead`` (dead-lettered).  One script per write
(:data:`RECORD`) adds the counts under the server's current minute, sets
the key to expire after :data:`KEEP_MINUTES` + 2 minutes of silence and,
once the hash holds more fields than that many minutes need, removes the
minutes older than :data:`KEEP_MINUTES`: the record stays bounded with
any number of consumers, and vanishes when they all stop.

Faults: a write that did not run (OOM, BUSY ... :data:`~._core._replies.NOT_RUN`)
is carried into the next one; one whose outcome is unknown (reply lost,
connection closed) is not sent again (a count missing from a chart is
better than one counted twice).  Counts are approximate by design: the
last ``EVERY`` seconds before a consumer stops are not written.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from redis import exceptions as rexc

from ._core._replies import NOT_RUN, classify
from ._keys import derived
from ._subscription import Form
from ._transport import Script

if TYPE_CHECKING:
    from ._stats import MountStats
    from ._transport import Client

__all__ = ["COUNTERS", "EVERY", "KEEP_MINUTES", "RECORD", "History", "buckets", "history_key"]

log = logging.getLogger("trio_redis_finalize")

EVERY = 10.0
"""Seconds between two writes of one mount's counts."""
KEEP_MINUTES = 60
"""Minutes of counts kept (the dashboard's hour)."""
COUNTERS = ("ack", "retry", "drop", "dead")

# KEYS: history (the history hash)
# ARGV: keep (minutes), [counter, n]...
RECORD = Script(
    """
local t = redis.call('TIME')
local minute = math.floor(tonumber(t[1]) / 60)
local keep = tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], minute .. ':' .. ARGV[i], ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[1], (keep + 2) * 60)
if redis.call('HLEN', KEYS[1]) > (keep + 2) * 4 then
  for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
    local m = tonumber(string.match(f, '^(%d+):'))
    if m == nil or m <= minute - keep then redis.call('HDEL', KEYS[1], f) end
  end
end
return minute
""",
    name="history_record", keys=("history",), argv=("keep", "[counter, n]..."),
)


def history_key(source: str, group: str | None = None) -> str:
    """The history hash of a stream's group (``{stream}:history:<group>``) or of a list."""
    return derived(source, f":history:{group}" if group else ":history")


def counts(stats: MountStats) -> dict[str, int]:
    """The mount's running totals of :data:`COUNTERS`."""
    o = stats.outcomes
    return {
        "ack": o["ack"],
        "retry": o["retry"] + o["retry_after"] + o["backoff"],
        "drop": o["drop"],
        "dead": stats.effects["dead_lettered"],
    }


def buckets(flat: Sequence[Any] | Mapping[Any, Any], now_minute: int,
            minutes: int = KEEP_MINUTES) -> dict[str, list[int]]:
    """A history hash (``HGETALL``) as ``minutes`` counts per counter, oldest first,
    the last one the minute ``now_minute``."""
    pairs = flat.items() if isinstance(flat, Mapping) else zip(flat[::2], flat[1::2], strict=False)
    out = {c: [0] * minutes for c in COUNTERS}
    first = now_minute - minutes + 1
    for f, v in pairs:
        name = f.decode() if isinstance(f, bytes) else str(f)
        m, _, counter = name.partition(":")
        if counter not in out or not m.isdigit():
            continue
        i = int(m) - first
        if 0 <= i < minutes:
            out[counter][i] += int(v)
    return out


class History:
    """Writes one mount's counts to its history hash every :data:`EVERY` seconds."""

    def __init__(self, key: str, stats: MountStats) -> None:
        self.key = key
        self.stats = stats
        self.sent = counts(stats)

    @classmethod
    def of(cls, form: Form, source: str, group: str | None, stats: MountStats) -> History | None:
        """The history of a stream or list mount (``None``: Pub/Sub, no key to keep it by)."""
        if form is Form.STREAM:
            return cls(history_key(source, group), stats)
        if form in (Form.RELIABLE_LIST, Form.LIST):
            return cls(history_key(source), stats)
        return None

    def delta(self) -> tuple[dict[str, int], list[Any]]:
        """The counts now, and the script's arguments for what changed since the last write."""
        now = counts(self.stats)
        args: list[Any] = [KEEP_MINUTES]
        for c in COUNTERS:
            if now[c] != self.sent[c]:
                args += [c, now[c] - self.sent[c]]
        return now, args

    async def write(self, client: Client) -> bool:
        """Write what changed (nothing when nothing did); True when something was written."""
        now, args = self.delta()
        if len(args) == 1:
            return False
        try:
            await client.evalsha(RECORD, (self.key,), args)
        except (rexc.RedisError, OSError) as e:
            if classify(e) is NOT_RUN:
                return False  # did not run: carried into the next write
            log.debug("history %s: write failed (%s); these counts are not sent again", self.key, e)
        self.sent = now
        return True

    async def run(self, client: Client) -> None:
        while True:
            await anyio.sleep(EVERY)
            await self.write(client)
