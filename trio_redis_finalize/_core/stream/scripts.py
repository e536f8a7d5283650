"""The stream's Lua scripts, sans-IO: each a :class:`~._commands.Script` value.

Held here for now: :data:`REDELIVER`, the Backoff redelivery's script (the
attempt it sets is :func:`~.attempts.redelivered`'s).
"""

from __future__ import annotations

from .._commands import Script

__all__ = ["REDELIVER"]


# KEYS: stream.  ARGV: group, consumer, id, count, id, count, ...
# Each entry still pending for the consumer is claimed by it again (idle 0)
# with its delivery count set to ``count``: its reply is the entry; 0 when
# it is not pending for the consumer (any more); 1 when the stream no longer
# has it (deleted while pending).
REDELIVER = Script(
    """
local out = {}
for i = 3, #ARGV, 2 do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p == 0 then
    out[#out + 1] = 0
  else
    local c = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'RETRYCOUNT', ARGV[i + 1])
    if c[1] then out[#out + 1] = c[1] else out[#out + 1] = 1 end
  end
end
return out
""",
    name="stream_redeliver",
)
