"""The Lua the library's scripts are built from: the snippets their homes share.

The scripts live in their form's home -- ``_core/stream/scripts.py`` and
``_core/reliable_list/scripts.py`` -- and are composed by string
concatenation of what is here: the gates (``STREAM_GATE``, ``list_gate``),
the server's clock (``NOW_MS``), an XADD of any width (``LUA_XADD*``), how
a stream's original is removed (``HOW``), the frame of a batched call
(``batch_head`` ... ``BATCH_TAIL``), a delay-set member's decoding and the
movers' loop (``DECODE``, ``MOVE_HEAD``, ``MOVE_TAIL``), and an outcome's
writes (``WRITES_LUA``, ``BATCH_WRITES_LUA``, ``run_writes``,
``batch_writes``: written in ``_lua_writes``, re-exported here).  Each script's
layout (``Script(keys=..., argv=...)``, see ``_commands``) is declared
beside it, under its ``# KEYS`` / ``# ARGV`` header.  Text only: nothing
here runs a script.
"""

from __future__ import annotations

from ._lua_writes import BATCH_WRITES_LUA, WRITES_LUA, batch_writes, run_writes

__all__ = [
    "BATCH_GATE", "BATCH_LISTED", "BATCH_SETTLE", "BATCH_TAIL", "BATCH_WRITES_LUA", "DECODE",
    "HOW", "LUA_XADD", "LUA_XADD_ANY", "LUA_XADD_CAPPED", "LUA_XADD_CAPPED_TO", "LUA_XADD_TO",
    "MOVE_ARGV", "MOVE_HEAD", "MOVE_TAIL", "NOW_MS", "SERVER_TIME", "STREAM_BATCH_MAX",
    "STREAM_BATCH_VALUES", "STREAM_GATE", "UNPACK_MAX", "WRITES_LUA", "ZADD_DUE", "batch_head",
    "batch_writes", "list_gate", "run_writes",
]

# -- the gates, the server's clock, an XADD of any width ---------------------------------

# A stream's gate: the entry ARGV[2] pending in the group ARGV[1] of KEYS[1].
STREAM_GATE = """
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if not ok or #p == 0 then return false end
"""


def list_gate(copies: int) -> str:
    """Open while the processing list holds at least n copies of the element.

    n (``ARGV[copies]``, 1 when absent) is how many copies of those bytes the
    consumer holds whose removal was not sent before this one, this one
    included: a finalization sent again after an unknown outcome (the first
    send applied, n - 1 copies left) then finds the gate closed instead of
    removing a copy another handler still holds.  ``RANK -n``: from the
    tail, where the oldest elements are (see ``_plan``); the list holds n
    copies either way.
    """
    return f"""
if not redis.call('LPOS', KEYS[1], ARGV[1], 'RANK', -tonumber(ARGV[{copies}] or 1)) then return false end
"""


NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

UNPACK_MAX = 7000
"""Values handed to one ``unpack``: Lua 5.1 refuses more than ~8,000 at once
(measured: 7,999 pass and 8,000 fail on Redis 6.2, 7.0 and Valkey 9.1)."""

_CHUNK = 200
"""Values a wider XADD gains per step (a Lua call holds at most ~250 registers)."""

SERVER_TIME = b"\x00trf:server-time-ms\x00"
"""A field value the library's XADDs in scripts write as the server's clock
(epoch milliseconds) when it is an entry's last value: a dead letter's
``trf-dead-time``, taken in the same gated step that writes it (never the
client's clock, never the entry id's, which need not be the time)."""

# LUA_XADD defines ``xadd(key, t, from)``: XADD key * t[from], ..., t[#t],
# for any number of values (prefix it to a script that writes entries whose
# width it does not know).  Up to UNPACK_MAX values go in one unpack; a wider list is built up
# in the arguments of tail calls, _CHUNK values put in front at each step
# (the values are copied once per step: about n * n / (2 * _CHUNK) copies,
# ~10 ms for 5,000 fields, ~0.3 s for 100,000).
def _xadd_function(name: str, params: str, head: str, last: str = "#t") -> str:
    """The Lua of an XADD of any width: ``redis.call('XADD', <head>, values...)``
    of ``t[from]`` ... ``t[<last>]``; a last value :data:`SERVER_TIME` is
    written as the server's clock (epoch ms) instead."""
    return (
        f"""
local function {name}({params})
  local n = {last}
  if t[n] == '""" + SERVER_TIME.decode("latin-1") + """' then
    local c = redis.call('TIME')
    t[n] = string.format('%d', tonumber(c[1]) * 1000 + math.floor(tonumber(c[2]) / 1000))
  end
  if n - from < """ + str(UNPACK_MAX) + f""" then
    return redis.call('XADD', {head}, unpack(t, from, n))
  end
  local function go(i, ...)
    if i < from then return redis.call('XADD', {head}, ...) end
    return go(i - """ + str(_CHUNK) + ", "
        + ", ".join(f"t[i - {_CHUNK - 1 - k}]" if k < _CHUNK - 1 else "t[i]" for k in range(_CHUNK))
        + """, ...)
  end
  local r = (n - from + 1) % """ + str(_CHUNK) + """
  return go(n - r, unpack(t, n - r + 1, n))
end
"""
    )


LUA_XADD = _xadd_function("xadd", "key, t, from", "key, '*'")

# LUA_XADD_CAPPED defines ``xadd_capped(key, cap, t, from)``: the same, as
# XADD key MAXLEN ~ cap * ...  (the copy_maxlen / dead_letter_maxlen caps).
LUA_XADD_CAPPED = _xadd_function(
    "xadd_capped", "key, cap, t, from", "key, 'MAXLEN', '~', cap, '*'"
)

# LUA_XADD_ANY: both, and ``xadd_any(key, cap, t, from)``: XADD key * ...
# with cap '0' (none), else XADD key MAXLEN ~ cap * ... (a cap argument).
LUA_XADD_ANY = (
    LUA_XADD
    + LUA_XADD_CAPPED
    + """
local function xadd_any(key, cap, t, from)
  if cap ~= '0' then return xadd_capped(key, cap, t, from) end
  return xadd(key, t, from)
end
"""
)

# LUA_XADD_TO / LUA_XADD_CAPPED_TO: the same, of t[from] ... t[to] (the
# batched scripts: many entries' values in one ARGV).
LUA_XADD_TO = _xadd_function("xadd_to", "key, t, from, to", "key, '*'", "to")
LUA_XADD_CAPPED_TO = _xadd_function(
    "xadd_capped_to", "key, cap, t, from, to", "key, 'MAXLEN', '~', cap, '*'", "to"
)

# How the retention variants remove the original (``how``, ``_plan.copy_how``):
# ``'0'``: XACK; ``'1'``: XACK, then XDEL; ``'x'`` (Redis 8.2, ``_caps``):
# XACKDEL key group ACKED IDS 1 id (acknowledge, and delete once no group
# references it) instead of both.
#
# The caps stay ``MAXLEN ~ n`` on Redis 8.2 too: there ``MAXLEN ~ n ACKED``
# removes nothing (redis/redis#14656, fixed upstream after 8.2.3), and the
# exact ``MAXLEN = n ACKED`` walks every referenced entry at the head on each
# XADD (measured on 8.2.3: 5 ms per XADD behind 100,000 entries a group has
# not read, against 5 us).
HOW = """
local function remove_one(key, group, id, how)
  if how == 'x' then
    redis.call('XACKDEL', key, group, 'ACKED', 'IDS', 1, id)
    return
  end
  redis.call('XACK', key, group, id)
  if how == '1' then redis.call('XDEL', key, id) end
end
"""

# -- batched: one call finalizes many deliveries of one stream ---------------------------
#
# The two-step finalizations of a batch that share their keys (and group,
# retention, cap) go in one script call: the per-call cost of EVALSHA
# (~12 us of server time) is paid once per batch instead of once per
# delivery.  Each delivery is finalized as its single script would: its own
# gate (XPENDING of its id), its copy written first, its original removed
# second.  Its write runs in a ``redis.pcall`` (or a ``pcall``): an error
# (WRONGTYPE of the destination, OOM at its write ...) ends that delivery's
# steps only and
# comes back as that delivery's element of the reply, a nested error reply,
# with the code the single script's reply would carry (Redis 7 / Valkey:
# the inner error's own code; Redis 6.2: ``@user_script: n: -CODE ...``,
# which ``classify`` reads as the wrapped form).  The reply lists, by
# place, the deliveries not finalized, each with what its single script
# would return (nil for a closed gate) or its error (see
# STREAM_COPY_ACK_BATCH, below).
#
# OOM (a write refused under maxmemory) is only checked while the script has
# written nothing, so it meets the first deliveries of a call (each its own
# element, nothing of it written) and never a delivery's second step.

STREAM_BATCH_MAX = 100
"""At most this many deliveries go into one batched script call."""
STREAM_BATCH_VALUES = 20_000
"""At most about this many values go into one batched call (a delivery wider
than that alone goes as its single script)."""

# The gate of each delivery is the single script's (its id in the group's
# PEL), read for the whole call at once: one XPENDING of the range of the
# call's ids (``lo`` .. ``hi``, at most ``count`` rows, the client's bounds)
# finds the ids pending; an id that one did not return (not pending, or
# past ``count``, or outside wrong bounds) gets its own XPENDING, as the
# single script does.  The bounds only save calls: any of them is correct.
# The removals of the deliveries whose copy was written go in one XACK (and
# one XDEL) at the end, after every copy; an id finalized earlier in the same
# call finds its gate closed.  Should that XACK fail, every delivery it
# removes answers its error (copied, still pending: delivered again --
# duplicate, never loss).  ``how`` (ARGV[2]) as HOW says: with ``x`` the
# removals are one XACKDEL ... ACKED IDS n of them all.
def batch_head(lo: int) -> str:
    """Lua, first in a batched script: its globals read once into locals,
    ``bad`` / ``done`` (see BATCH_TAIL), and ``pend`` filled from the one
    XPENDING of the call's range (``ARGV[lo]`` .. ``ARGV[lo + 1]``, at most
    ``ARGV[lo + 2]`` rows): ``pend[id]`` true for an id it found pending."""
    return f"""
local argv, stream, dest = ARGV, KEYS[1], KEYS[2]
local rpcall, unpack, type, tonumber = redis.pcall, unpack, type, tonumber
local group, how = argv[1], argv[2]
local bad, done, nd = {{}}, {{}}, 0
local pend = {{}}
do
  local ok, p = pcall(redis.call, 'XPENDING', stream, group, argv[{lo}], argv[{lo + 1}],
                      tonumber(argv[{lo + 2}]))
  if ok then
    for j = 1, #p do pend[p[j][1]] = true end
  end
end
"""


# Lua, in a batched script's loop, for the delivery ``k`` of id ``id``: its
# gate.  ``pend[id]``: true pending, false finalized earlier in this call,
# nil not read (its own XPENDING, as the single script's).
BATCH_GATE = """
  local open = pend[id]
  if open == nil then
    local ok, p = pcall(redis.call, 'XPENDING', stream, group, id, id, 1)
    open = ok and #p > 0
  end
"""

# Lua, in a batched script's loop, after the write of an open delivery
# (``r``: its ``redis.pcall``'s answer, ``wrote``: whether it is a success):
# its id goes to the removals, or its error to the reply; a closed gate's
# delivery is listed as false (nil in the reply).
BATCH_LISTED = """
    else
      bad[#bad + 1] = k
      bad[#bad + 1] = r
    end
  else
    bad[#bad + 1] = k
    bad[#bad + 1] = false
  end
"""
"""Lua, the end of a batched script's ``if open then ... if <written> then ...``:
a delivery not written listed with its error ``r``, a closed gate's with false."""
BATCH_SETTLE = """
    if wrote then
      pend[id] = false
      nd = nd + 1
      done[nd] = id
""" + BATCH_LISTED

# Lua, last in a batched script: the removals of the deliveries written (one
# XACK, then one XDEL, or one XACKDEL, as ``how`` says), and the reply
# ``{k, at, element ...}`` (see STREAM_COPY_ACK_BATCH).
BATCH_TAIL = """
if nd > 0 then
  local ok, e
  if how == 'x' then
    ok, e = pcall(redis.call, 'XACKDEL', stream, group, 'ACKED', 'IDS', nd, unpack(done))
  else
    ok, e = pcall(redis.call, 'XACK', stream, group, unpack(done))
  end
  if ok and how == '1' then
    ok, e = pcall(redis.call, 'XDEL', stream, unpack(done))
  end
  if not ok then
    -- every delivery written answers the removal's error (still pending)
    if type(e) ~= 'table' then e = {err = tostring(e)} end
    local listed = {}
    for j = 1, #bad, 2 do listed[bad[j]] = true end
    for j = 1, k do
      if not listed[j] then
        bad[#bad + 1] = j
        bad[#bad + 1] = e
      end
    end
  end
end
return {k, unpack(bad)}
"""

# -- the delay set: its members decoded, the movers' loop ---------------------------------

# Decoding a delay-set member (see ``_envelope.pack_parts``).  A member that
# is not one (foreign or damaged bytes) decodes to nil: every length is
# checked against the member's size, so garbage can neither fail the script
# nor make it loop.
DECODE = """
local function u32(s, p)
  local a, b, c, d = string.byte(s, p, p + 3)
  if not d then return nil end
  return ((a * 256 + b) * 256 + c) * 256 + d
end
local function parts(m)
  if string.sub(m, 1, 5) ~= '\\255trd\\1' then return nil end
  local n = u32(m, 6)
  if not n then return nil end
  local size = #m
  local out = {}
  local p = 10
  for i = 1, n do
    local len = u32(m, p)
    if not len or p + 3 + len > size then return nil end
    out[i] = string.sub(m, p + 4, p + 3 + len)
    p = p + 4 + len
  end
  if p ~= size + 1 then return nil end
  return out
end
"""

# Each due member is written to the destination first and removed from the
# set second: a write that fails (wrong type, ...) leaves the member in the
# set and fails the script, it never loses it.  The whole batch is one
# script, so racing movers move every member exactly once.
#
# A member the script does not write itself (``ok`` false: a stream member
# wider than ARGV[2] values) is handed back: reserved (its score set to now +
# ARGV[3] ms, default 30 s, so that no racing mover takes it too) and
# returned after the counts, for the client to write and then remove
# (duplicate, never loss).  It never holds up the members behind it.
MOVE_HEAD = (
    DECODE
    + NOW_MS
    + """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local width = tonumber(ARGV[2])
local reserve = tonumber(ARGV[3]) or 30000
local moved = 0
local back = {}
for _, m in ipairs(due) do
  local ps = parts(m)
  local ok = true
"""
)

MOVE_TAIL = """
  if ok then
    redis.call('ZREM', KEYS[1], m)
    moved = moved + 1
  else
    back[#back + 1] = m
  end
end
for _, m in ipairs(back) do
  redis.call('ZADD', KEYS[1], 'XX', now + reserve, m)
end
local out = {moved, now, false}
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #first == 2 then out[3] = first[2] end
for i, m in ipairs(back) do out[3 + i] = m end
return out
"""

MOVE_ARGV = ("limit", "width?", "reserve_ms?")
"""The ARGV of a delay-set mover (what MOVE_HEAD reads)."""

# -- exactly-once effects: an outcome's writes in its finalization (see ``_writes``) --------
# (WRITES_LUA, BATCH_WRITES_LUA, run_writes, batch_writes: in ``_lua_writes``, re-exported here)

ZADD_DUE = (
    NOW_MS
    + """
  r = now + tonumber(ARGV[i])
  redis.call('ZADD', KEYS[2], r, ARGV[i + 1])
"""
)
"""Lua of the writes scripts' ``zadd``: the copy ``ARGV[i + 1]`` into the delay
set ``KEYS[2]``, due ``ARGV[i]`` ms from the server's clock (``r``)."""
