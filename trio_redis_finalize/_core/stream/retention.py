"""Stream retention, sans-IO: which entries every group of a stream is done with.

An entry is still *needed* by a consumer group while the group has it
pending (its PEL) or has not read it yet (its id is above the group's
last-delivered id).  For each group the oldest needed entry is therefore

    min(first pending id, the id right after the last-delivered id)

and over the whole stream the minimum of that over all groups.  Every entry
below it has been read and acknowledged by every group (Redis 8.2's
``XTRIM ... ACKED`` semantics, here on Redis 6.2+): ``XTRIM key MINID
<that id>`` removes exactly those.

:data:`TRIM_ACKED` does it in one atomic Lua script -- ``XINFO GROUPS``, an
``XPENDING`` summary per group with pending entries, then the ``XTRIM`` --
so no read, acknowledgement or claim can run in between (a non-atomic
version could see a group's last-delivered id, then miss an entry read and
still pending when it looks at the PEL).  One call is a bounded step: an
approximate ``XTRIM MINID ~ id LIMIT n`` (whole stream nodes, at most ``n``
entries); when that removes nothing (what is left below the id sits in the
first node) an exact ``XTRIM MINID id`` finishes, which then touches one
node only.  The reply says whether more may be left, so the caller can step
again at once.

A stream without consumer groups is left alone.  Limits: a group created
later (``XGROUP CREATE ... 0``) or moved back (``XGROUP SETID``) cannot get
back what was trimmed before it existed; a group that never reads holds the
whole stream (``inspect`` shows each group's oldest needed entry).

On Redis 8.2 (``Target.acked``, see ``_caps``) :data:`TRIM_ACKED_NATIVE`
lets the server decide entry by entry where the fallback's threshold stops:
the same approximate step first (whole nodes below the oldest needed entry,
bounded by ``LIMIT``; without ``ACKED``, which in its approximate form
removes nothing on Redis 8.2.3, redis/redis#14656), then, instead of the
exact ``XTRIM MINID <oldest needed>``, ``XTRIM key MINID = bound ACKED``:
it deletes *each* entry below ``bound`` that no group has pending -- also
those above a stuck pending entry, which holds the rest of the stream on the
fallback.  ``bound`` is the minimum over the groups of the id right after
their last-delivered id (everything above it is unread by some group, so
needed, and ``ACKED`` would keep it anyway): it bounds the exact step's scan
to what lies below it -- after a backlog behind a stuck entry, the first
such step deletes that backlog at once (the server's time is proportional
to it, as the fallback's trim of the same entries would be once the stuck
entry goes).  The same guard: a stream without groups is left alone (an
exact ``ACKED`` trim there removes everything), in the same atomic script.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .._commands import Command, Script

__all__ = [
    "MAX_PART",
    "TRIM_ACKED",
    "TRIM_ACKED_NATIVE",
    "TRIM_LIMIT",
    "GroupNeed",
    "TrimResult",
    "delete_refusal",
    "group_rows",
    "id_key",
    "next_id",
    "oldest_needed",
    "parse_trim",
    "trim_command",
    "trim_script",
]

MAX_PART = 2**64 - 1
"""The largest value of each part of a stream id (``ms-seq``)."""

TRIM_LIMIT = 10_000
"""Entries one approximate trim step removes at most (Redis' own default
``LIMIT`` for ``~``: 100 x ``stream-node-max-entries``)."""


def id_key(eid: bytes | str) -> tuple[int, int]:
    """A stream id as a sortable ``(ms, seq)``."""
    if isinstance(eid, bytes):
        eid = eid.decode()
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


def next_id(eid: bytes | str) -> str:
    """The smallest id above ``eid`` (``eid`` itself for the largest id)."""
    ms, seq = id_key(eid)
    if seq < MAX_PART:
        return f"{ms}-{seq + 1}"
    if ms < MAX_PART:
        return f"{ms + 1}-0"
    return f"{ms}-{seq}"


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclasses.dataclass(frozen=True, slots=True)
class GroupNeed:
    """One consumer group, as far as trimming is concerned."""

    name: str
    pending: int
    last_delivered: str
    first_pending: str | None = None

    @property
    def oldest_needed(self) -> str:
        """The oldest entry the group still needs: its first pending entry, or
        the entry after its last-delivered id, whichever is older."""
        after = next_id(self.last_delivered)
        if self.first_pending is not None and id_key(self.first_pending) < id_key(after):
            return self.first_pending
        return after


def group_rows(reply: Sequence[Any]) -> list[GroupNeed]:
    """The groups of an ``XINFO GROUPS`` reply (RESP2), without their PELs.

    ``first_pending`` is ``None`` here: ask ``XPENDING key group`` (summary)
    for the groups with ``pending > 0`` and replace it.
    """
    out = []
    for row in reply:
        info = {_str(k): v for k, v in zip(row[::2], row[1::2], strict=False)}
        out.append(GroupNeed(_str(info["name"]), int(info["pending"]),
                             _str(info["last-delivered-id"])))
    return out


def oldest_needed(groups: Sequence[GroupNeed]) -> str | None:
    """The oldest entry some group needs; ``None`` without groups (trim nothing)."""
    if not groups:
        return None
    return min((g.oldest_needed for g in groups), key=id_key)


def delete_refusal(stream: str, group: str, groups: Sequence[str], *,
                   xackdel: bool = False) -> str | None:
    """Why ``Retention.DELETE_ON_FINALIZE`` must not run on ``stream``, or None.

    ``groups``: the names of the stream's groups.  Deleting an entry takes it
    from every group; other groups than ``group`` would lose what they have
    not read, so the mount is refused, naming them -- unless the removals are
    ``XACKDEL ... ACKED`` (``xackdel``, ``Target.xackdel``: Redis 8.2), which
    delete an entry only once no group references it.
    """
    others = sorted(g for g in groups if g != group)
    if not others or xackdel:
        return None
    names = ", ".join(repr(g) for g in others)
    return (
        f"retention=Retention.DELETE_ON_FINALIZE: stream {stream!r} is also read by group(s) "
        f"{names}; deleting entries when group {group!r} finalizes them would take them from "
        f"those groups unread. Use retention=Retention.TRIM_ACKED (trims what every group "
        f"has finished), or remove the other groups (XGROUP DESTROY)"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class TrimResult:
    """What one :data:`TRIM_ACKED` step did."""

    removed: int
    threshold: str | None  # entries below it were removable; None: no groups, nothing done
    more: bool  # whole nodes were removed: another step may remove more
    groups: tuple[str, ...]


def parse_trim(reply: Sequence[Any]) -> TrimResult:
    removed, threshold, more, *groups = reply
    return TrimResult(int(removed), None if threshold is None else _str(threshold),
                      bool(int(more)), tuple(_str(g) for g in groups))


# KEYS: stream.  ARGV: limit of the approximate step.
# Returns {removed, threshold or nil, more (0/1), group name, ...}.
# Ids are compared and incremented as decimal strings (Lua numbers are
# doubles: ids reach 2^64 - 1).
_TRIM_HEAD = (
    """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return {0, false, 0} end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return {0, false, 0} end
local function split(id)
  local d = string.find(id, '-', 1, true)
  if not d then return id, '0' end
  return string.sub(id, 1, d - 1), string.sub(id, d + 1)
end
local function numlt(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function lt(a, b)
  local am, as = split(a)
  local bm, bs = split(b)
  if am ~= bm then return numlt(am, bm) end
  return numlt(as, bs)
end
local function incr(s)
  local i = #s
  while i >= 1 and string.sub(s, i, i) == '9' do i = i - 1 end
  if i == 0 then return '1' .. string.rep('0', #s) end
  return string.sub(s, 1, i - 1) .. string.char(string.byte(s, i) + 1) .. string.rep('0', #s - i)
end
local MAX = '"""
    + str(MAX_PART)
    + """'
local function after(id)
  local ms, seq = split(id)
  if seq ~= MAX then return ms .. '-' .. incr(seq) end
  if ms ~= MAX then return incr(ms) .. '-0' end
  return id
end
local out = {0, false, 0}
local min = nil
"""
)


def _trim_source(native: bool) -> str:
    """The trim script's Lua.  Both: ``low`` = the oldest entry some group
    needs (pending, or unread), and an approximate step below it (whole
    nodes, no ``ACKED``: every entry below ``low`` is done with).  Then the
    fallback trims exactly below ``low``; the native one (Redis 8.2) exactly
    below ``bound`` (the oldest unread) with ``ACKED``: each entry below it
    that no group has pending goes, also above a stuck one."""
    exact = "'=', bound, 'ACKED'" if native else "low"
    threshold = "bound" if native else "low"
    return _TRIM_HEAD + f"""
local bound = nil
for i, g in ipairs(groups) do
  local name, pending, last
  for j = 1, #g - 1, 2 do
    local k = g[j]
    if k == 'name' then name = g[j + 1]
    elseif k == 'pending' then pending = g[j + 1]
    elseif k == 'last-delivered-id' then last = g[j + 1]
    end
  end
  out[3 + i] = name
  local unread = after(last)
  local need = unread
  if tonumber(pending) > 0 then
    local s = redis.call('XPENDING', KEYS[1], name)
    if s[2] and lt(s[2], need) then need = s[2] end
  end
  if not min or lt(need, min) then min = need end
  if not bound or lt(unread, bound) then bound = unread end
end
local low = min
out[2] = {threshold}
local removed = redis.call('XTRIM', KEYS[1], 'MINID', '~', low, 'LIMIT', ARGV[1])
if removed > 0 then
  out[3] = 1
else
  removed = redis.call('XTRIM', KEYS[1], 'MINID', {exact})
end
out[1] = removed
return out
"""


# KEYS: stream
# ARGV: limit (of the approximate step)
# The reply: see _TRIM_HEAD.
TRIM_ACKED = Script(
    _trim_source(native=False), name="trim_acked", keys=("stream",), argv=("limit",),
)

# KEYS: stream
# ARGV: limit (of the approximate step)
# The same reply.  The threshold is the bound (see the module docstring):
# the server's ACKED keeps every entry below it that some group still has
# pending.
TRIM_ACKED_NATIVE = Script(
    _trim_source(native=True), name="trim_acked_native", keys=("stream",), argv=("limit",),
)


def trim_script(acked: bool) -> Script:
    """The retention trim: :data:`TRIM_ACKED_NATIVE` where the server trims
    with ``ACKED`` (``Target.acked``), else :data:`TRIM_ACKED`."""
    return TRIM_ACKED_NATIVE if acked else TRIM_ACKED


def trim_command(stream: str, limit: int = TRIM_LIMIT, *, acked: bool = False) -> Command:
    """The ``EVALSHA`` of one trim step (:func:`trim_script`) on ``stream``."""
    return trim_script(acked).command((stream,), (limit,))
