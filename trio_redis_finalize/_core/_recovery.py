"""Recovery and leases, sans-IO: what comes back when, and what is still whose.

* **Refused finalizations.**  A finalization Redis refuses for good (an
  error reply that means it can never succeed, e.g. ``WRONGTYPE`` from a
  write's key) leaves the delivery pending (the group's PEL, the processing
  list).  The consumer holds it again and delivers it again, as its next
  attempt, :func:`refused_delay` seconds after the refusal -- on every form,
  under traffic too (the mount's redeliverer, as for a ``Backoff``).
* **The Backoff schedule in Redis.**  When a failed delivery starts waiting
  for its ``Backoff`` delay (and when a reliable list's runtime
  ``retry_after`` copy starts waiting in the scheduler, its original left
  in the processing list), its due time is written to a sorted set
  (:func:`schedule_key`, scored with the server's clock: :data:`SCHEDULE`);
  the recovery after a restart reads it (:data:`SCHEDULE_LEFT`) and lets a
  delivery whose due time is still ahead wait out the rest instead of
  delivering it at once.  Members whose due time has passed carry nothing
  (every script call removes them) and the key expires a minute after its
  last due time, so nothing accumulates.
* **The lease, owner-checked.**  A stream consumer renews the lease of the
  entries it holds (``XCLAIM ... 0 ... JUSTID``) only for those still
  pending *for it*, in the same script (:data:`LEASE`): an entry another
  consumer claimed meanwhile (this one stalled past ``min_idle``) stays
  with that consumer, and :func:`lease_lost` says which ones the caller
  must drop (and not start).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from .._delivery import Delivery
from .._keys import derived
from ._commands import Command, Script
from ._plan import cells_of
from ._types import Target

__all__ = [
    "ATTEMPTS",
    "LEASE",
    "REFUSED_BASE",
    "REFUSED_CAP",
    "SCHEDULE",
    "SCHEDULE_LEFT",
    "lease_lost",
    "refused_delay",
    "schedule_command",
    "schedule_key",
    "schedule_left",
    "schedule_member",
]

REFUSED_BASE = 1.0
"""Seconds after its first refusal a refused finalization's delivery comes back."""
REFUSED_CAP = 30.0
"""At most this many seconds between a refusal and the delivery coming back."""


def refused_delay(attempt: int) -> float:
    """Seconds after a refused finalization of ``attempt`` before the delivery
    comes back: 1 s at attempt 1, doubling per attempt, at most 30 s (a write
    that keeps being refused never loops hot; ``max_attempts`` ends it)."""
    return min(REFUSED_CAP, REFUSED_BASE * 2.0 ** min(max(attempt - 1, 0), 16))


def schedule_key(t: Target) -> str:
    """The sorted set of a subscription's Backoff due times, in the source's slot:
    ``{stream}:backoff:<group>`` (a group's pending entries, by id) or
    ``<processing list>:backoff`` (one consumer's elements, by digest)."""
    if cells_of(t).by_id:
        return derived(t.source, f":backoff:{t.group}")
    return derived(t.processing, ":backoff")


def schedule_member(t: Target, entry_id: str | None, raw: bytes | None) -> bytes | None:
    """A delivery's member in :func:`schedule_key`: a stream entry's id; the
    SHA-1 of a list element's bytes (identical elements share one member,
    which keeps the later due time: each waits at least its own)."""
    if cells_of(t).by_id:
        return entry_id.encode() if entry_id is not None else None
    return hashlib.sha1(raw).hexdigest().encode() if raw is not None else None


_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""


def schedule_command(t: Target, waits: Sequence[tuple[Delivery, float]]) -> Command | None:
    """The :data:`SCHEDULE` call that writes the due times of ``waits``
    (deliveries, seconds until due) to :func:`schedule_key`; None when none
    has a member (a form without one)."""
    args: list[bytes | int] = []
    for d, delay in waits:
        m = schedule_member(t, d.id, d.raw)
        if m is not None:
            args += [m, max(0, round(delay * 1000)), d.attempt]
    return SCHEDULE.command((schedule_key(t),), args) if args else None


def schedule_left(replies: Sequence[object]) -> list[tuple[float, int]]:
    """:data:`SCHEDULE_LEFT`'s reply: for each member, seconds until it is due
    and the attempt that failed (``(0.0, 0)``: due, or not scheduled)."""
    out: list[tuple[float, int]] = []
    for r in replies:
        if isinstance(r, list) and len(r) == 2 and r[0] > 0:
            out.append((int(r[0]) / 1000, int(r[1])))
        else:
            out.append((0.0, 0))
    return out


ATTEMPTS = 1024
"""A member's score is ``due ms * ATTEMPTS + attempt``: its due time by the
server's clock, and the attempt that failed (at most ``ATTEMPTS - 1``) --
what a claim, which counts one more delivery, cannot tell by itself.  Both
fit a double exactly (about 51 bits)."""

# KEYS: schedule
# ARGV: [member, delay_ms, attempt]...
# Each member due ``delay`` ms from the server's now (GT: an identical list
# element keeps the later one); members already due are removed; the key
# expires a minute after its last due time.  Returns the number written.
SCHEDULE = Script(
    _NOW_MS + """
local slots = """ + str(ATTEMPTS) + """
local function int(x) return string.format('%.0f', x) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', int(now * slots + slots - 1))
local n = 0
for i = 1, #ARGV, 3 do
  local a = math.min(math.max(tonumber(ARGV[i + 2]), 0), slots - 1)
  redis.call('ZADD', KEYS[1], 'GT', int((now + tonumber(ARGV[i + 1])) * slots + a), ARGV[i])
  n = n + 1
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] then redis.call('PEXPIREAT', KEYS[1], int(math.floor(tonumber(last[2]) / slots) + 60000)) end
return n
""",
    name="backoff_schedule", keys=("schedule",), argv=("[member, delay_ms, attempt]...",),
)

# KEYS: schedule
# ARGV: members...
# For each member, {ms until it is due by the server's clock, the attempt
# that failed}: {0, 0} when due or not scheduled.
SCHEDULE_LEFT = Script(
    _NOW_MS + """
local slots = """ + str(ATTEMPTS) + """
local out = {}
for i = 1, #ARGV do
  local s = redis.call('ZSCORE', KEYS[1], ARGV[i])
  local left, a = 0, 0
  if s then
    s = tonumber(s)
    a = s % slots
    left = math.floor((s - a) / slots) - now
    if left <= 0 then left, a = 0, 0 end
  end
  out[i] = {left, a}
end
return out
""",
    name="backoff_schedule_left", keys=("schedule",), argv=("members...",),
)

# KEYS: stream
# ARGV: group, consumer, ids... (id, id, ...)
# Renews (idle 0, ``XCLAIM ... JUSTID``: the delivery count unchanged) each
# entry still pending for the consumer; for each id: 1 renewed, 0 not
# pending (finalized, deleted, the group recreated), or the name of the
# consumer it is pending for now (claimed by another: left with it).
LEASE = Script(
    """
local out = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 0 then
    out[#out + 1] = 0
  elseif p[1][2] ~= ARGV[2] then
    out[#out + 1] = p[1][2]
  else
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    out[#out + 1] = 1
  end
end
return out
""",
    name="stream_lease", keys=("stream",), argv=("group", "consumer", "ids..."),
)


def lease_lost(ids: Sequence[str], replies: Sequence[object]) -> dict[str, str]:
    """The entries of a :data:`LEASE` call now pending for another consumer:
    id -> that consumer's name.  (One pending for nobody is not lost to this
    consumer: finalized, its finalization on the way; or its group recreated
    at the last id read, where a queued entry must still be handled.)"""
    out: dict[str, str] = {}
    for eid, r in zip(ids, replies, strict=True):
        if isinstance(r, bytes):
            out[eid] = r.decode("utf-8", "backslashreplace")
    return out

