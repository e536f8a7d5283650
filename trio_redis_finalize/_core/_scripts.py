"""The Lua scripts that make two-step finalizations atomic and gated.

Each script checks that the original is still pending (in the group's PEL,
or in the processing list) and only then runs its steps in the order of the
contract: the copy is written first, the original removed second.  A repeated
or racing finalization of the same delivery finds the gate closed and makes
no second copy, so a finalization whose reply was lost may be sent again.
"""

from __future__ import annotations

import functools

from ._commands import Script

__all__ = [
    "COPY_MARK_TTL",
    "CORRUPT_FIELD",
    "LIST_COPY_REMOVE",
    "LIST_DEAD_PUSH",
    "LIST_REMOVE",
    "LIST_WRITES",
    "LIST_WRITES_REMOVE_BATCH",
    "LIST_ZADD_REMOVE",
    "LUA_XADD",
    "LUA_XADD_ANY",
    "LUA_XADD_CAPPED",
    "MOVE_DUE_TO_LIST",
    "MOVE_DUE_TO_STREAM",
    "SERVER_TIME",
    "STREAM_BATCH_MAX",
    "STREAM_BATCH_VALUES",
    "STREAM_COPY_ACK",
    "STREAM_COPY_ACK_BATCH",
    "STREAM_COPY_ACK_EX",
    "STREAM_COPY_ONCE",
    "STREAM_REMOVE_RECEIPT",
    "STREAM_WRITES",
    "STREAM_WRITES_ACK_BATCH",
    "STREAM_XADD",
    "STREAM_ZADD_ACK",
    "STREAM_ZADD_ACKDEL",
    "STREAM_ZADD_ACK_BATCH",
    "STREAM_ZADD_ACK_DEL",
    "UNPACK_MAX",
    "move_due_to_stream",
    "why_pop",
]

_STREAM_GATE = """
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if not ok or #p == 0 then return false end
"""


def _list_gate(copies: int) -> str:
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


_NOW_MS = """
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
_HOW = """
local function remove_one(key, group, id, how)
  if how == 'x' then
    redis.call('XACKDEL', key, group, 'ACKED', 'IDS', 1, id)
    return
  end
  redis.call('XACK', key, group, id)
  if how == '1' then redis.call('XDEL', key, id) end
end
"""

# KEYS: stream, dest (the destination stream)
# ARGV: group, id, fields... (field, value, ...: any number, wide entries
#   included, see LUA_XADD)
STREAM_COPY_ACK = Script(
    LUA_XADD
    + _STREAM_GATE
    + """
local new = xadd(KEYS[2], ARGV, 3)
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return new
""",
    name="stream_copy_ack", keys=("stream", "dest"), argv=("group", "id", "fields..."),
)


def _stream_zadd_ack(name: str, *, delete: str = "") -> Script:
    """Gated: ZADD the copy to the delay set, due in ``ARGV[3]`` ms (server
    time), XACK the original (and XDEL it, with ``delete="xdel"``; or both in
    one XACKDEL ACKED, with ``delete="xackdel"``); returns the due time."""
    remove = {
        "": "redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])\n",
        "xdel": "redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])\nredis.call('XDEL', KEYS[1], ARGV[2])\n",
        "xackdel": "redis.call('XACKDEL', KEYS[1], ARGV[1], 'ACKED', 'IDS', 1, ARGV[2])\n",
    }[delete]
    return Script(
        _STREAM_GATE
        + _NOW_MS
        + """
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[4])
"""
        + remove
        + "return now + tonumber(ARGV[3])\n",
        name=name, keys=("stream", "delays"), argv=("group", "id", "delay_ms", "member"),
    )


# KEYS: stream, delays (the delay set)
# ARGV: group, id, delay_ms, member
STREAM_ZADD_ACK = _stream_zadd_ack("stream_zadd_ack")

# The retention variants (``StreamSubscription(retention=..., copy_maxlen=...,
# dead_letter_maxlen=...)``): the same gate and order, and
#
# * delete (Retention.DELETE_ON_FINALIZE): the original is deleted (XDEL)
#   right after its XACK, in the same script -- one atomic step, so a crash
#   cannot leave it acknowledged and still in the stream;
# * cap: the copy is written with ``XADD ... MAXLEN ~ cap``.
#
# On Redis 8.2 (``_caps``) one XACKDEL ... ACKED does the XACK + XDEL (``how``
# above), and deletes only what no other group still references; inside a
# script the two calls are atomic anyway, so there it is the cheaper
# command, not a safer one.

# KEYS: stream, dest (the destination stream)
# ARGV: group, id, how ('0', '1' or 'x', see _HOW), cap ('0': none),
#   fields... (field, value, ...)
STREAM_COPY_ACK_EX = Script(
    LUA_XADD_ANY
    + _HOW
    + _STREAM_GATE
    + """
local new = xadd_any(KEYS[2], ARGV[4], ARGV, 5)
remove_one(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
return new
""",
    name="stream_copy_ack_ex",
    keys=("stream", "dest"), argv=("group", "id", "how", "cap", "fields..."),
)

# KEYS: stream, delays (the delay set)
# ARGV: group, id, delay_ms, member
# As STREAM_ZADD_ACK, then XDEL of the original.
STREAM_ZADD_ACK_DEL = _stream_zadd_ack("stream_zadd_ack_del", delete="xdel")

# KEYS: stream, delays (the delay set)
# ARGV: group, id, delay_ms, member
# The same on Redis 8.2: one XACKDEL ... ACKED instead of XACK, XDEL.
STREAM_ZADD_ACKDEL = _stream_zadd_ack("stream_zadd_ackdel", delete="xackdel")

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
# duplicate, never loss).  ``how`` (ARGV[2]) as _HOW says: with ``x`` the
# removals are one XACKDEL ... ACKED IDS n of them all.
def _batch_head(lo: int) -> str:
    """Lua, first in a batched script: its globals read once into locals,
    ``bad`` / ``done`` (see _BATCH_TAIL), and ``pend`` filled from the one
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
_BATCH_GATE = """
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
_BATCH_LISTED = """
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
_BATCH_SETTLE = """
    if wrote then
      pend[id] = false
      nd = nd + 1
      done[nd] = id
""" + _BATCH_LISTED

# Lua, last in a batched script: the removals of the deliveries written (one
# XACK, then one XDEL, or one XACKDEL, as ``how`` says), and the reply
# ``{k, at, element ...}`` (see STREAM_COPY_ACK_BATCH).
_BATCH_TAIL = """
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

# KEYS: stream, dest (the destination stream)
# ARGV: group, how ('0', '1' or 'x', see _HOW), cap ('0': none), lo, hi,
#   count (the gates' range, see above), [id, n, fields...]... (per
#   delivery: its id, n, its n field values)
# Each delivery as STREAM_COPY_ACK (STREAM_COPY_ACK_EX with a delete or a cap).
#
# Its reply is short where all went well (see ``_batch.batch_replies``):
# ``{k, at, element, at, element ...}``, k the number of deliveries, then,
# for each delivery that was not copied and removed, its place (1-based)
# and its element (nil: its gate was closed; or its error).  A delivery not
# listed was copied and its original removed (the single script's new id).
# STREAM_ZADD_ACK_BATCH answers the same way.
# A reply of one element per delivery (a bulk string each, converted from
# Lua and written out one by one) was a large share of what the script
# cost the server beyond its commands (``bench instructions``' server table).
#
# The hot path in the loop is inline: no Lua function call or ``pcall``
# per delivery (the other large share), and the globals it reads
# (``ARGV``, ``redis.pcall``, ``unpack`` ...) read once into locals: each
# read of a global is a table lookup (a third share).  A copy's XADD runs in
# ``redis.pcall``, which
# answers an error reply as its table instead of raising it: that
# delivery's element, classified as the single script's reply would be.
# Only a wide entry (UNPACK_MAX values or more) or one whose last value is
# SERVER_TIME takes the LUA_XADD_TO path, in a ``pcall``.
STREAM_COPY_ACK_BATCH = Script(
    LUA_XADD_TO
    + LUA_XADD_CAPPED_TO
    + _batch_head(4)
    + """
local cap = argv[3]
local function wide(from, to)
  if cap ~= '0' then return xadd_capped_to(dest, cap, ARGV, from, to) end
  return xadd_to(dest, ARGV, from, to)
end
local i, k, last = 7, 0, #argv
while i <= last do
  local id = argv[i]
  local n = tonumber(argv[i + 1])
  local to = i + 1 + n
  k = k + 1
"""
    + _BATCH_GATE
    + """
  if open then
    local r
    if n >= """ + str(UNPACK_MAX) + """ or argv[to] == '""" + SERVER_TIME.decode("latin-1") + """' then
      local ok, e = pcall(wide, i + 2, to)
      if ok or type(e) == 'table' then r = e else r = {err = tostring(e)} end
    elseif cap == '0' then
      r = rpcall('XADD', dest, '*', unpack(argv, i + 2, to))
    else
      r = rpcall('XADD', dest, 'MAXLEN', '~', cap, '*', unpack(argv, i + 2, to))
    end
    local wrote = type(r) == 'string'
"""
    + _BATCH_SETTLE
    + """
  i = to + 1
end
"""
    + _BATCH_TAIL,
    name="stream_copy_ack_batch", keys=("stream", "dest"),
    argv=("group", "how", "cap", "lo", "hi", "count", "[id, n, fields...]..."),
)

# KEYS: stream, delays (the delay set)
# ARGV: group, how ('0', '1' or 'x', see _HOW), lo, hi, count (the gates'
#   range), [id, delay_ms, member]... (per delivery)
# Each as STREAM_ZADD_ACK (_DEL with '1', STREAM_ZADD_ACKDEL with 'x'); its reply
# as STREAM_COPY_ACK_BATCH's (a delivery not listed: its copy added to the
# delay set, its original removed; the single script's due time), its loop
# as inline: a ZADD in ``redis.pcall`` per delivery, which answers an
# integer, or an error reply as its table (that delivery's element).  A
# delay that is not a number is that delivery's error (ERR), as the single
# script's would be (its error there fails its script).
STREAM_ZADD_ACK_BATCH = Script(
    _batch_head(3)
    + _NOW_MS
    + """
local k = 0
for i = 6, #argv, 3 do
  local id = argv[i]
  k = k + 1
"""
    + _BATCH_GATE
    + """
  if open then
    local d, r = tonumber(argv[i + 1])
    if d then
      r = rpcall('ZADD', dest, now + d, argv[i + 2])
    else
      r = {err = 'ERR the delay of ' .. id .. ' is not a number'}
    end
    local wrote = type(r) == 'number'
"""
    + _BATCH_SETTLE
    + """
end
"""
    + _BATCH_TAIL,
    name="stream_zadd_ack_batch", keys=("stream", "delays"),
    argv=("group", "how", "lo", "hi", "count", "[id, delay_ms, member]..."),
)

# KEYS: processing (the processing list)
# ARGV: element, n (see _list_gate; > 1)
# LREM of one copy, gated: returns 1 when removed, 0 when the gate was closed.
# The list scripts remove from the tail (``LREM … -1``), the oldest end (see
# ``_plan``).
LIST_REMOVE = Script(
    """
if not redis.call('LPOS', KEYS[1], ARGV[1], 'RANK', -tonumber(ARGV[2])) then return 0 end
return redis.call('LREM', KEYS[1], -1, ARGV[1])
""",
    name="list_remove", keys=("processing",), argv=("element", "n"),
)

# Why a list element was dead-lettered (``ReliableListSubscription(dead_letter=
# ...)``): a hash beside the dead letter, ``derived(dead_letter, ":why")``
# (the same hash slot), maps the SHA-1 (hex) of a dead element's bytes to its
# reason records, one JSON object a line, oldest first: the k-th copy of
# those bytes from the dead letter's tail (its oldest) has the k-th record.
# The library writes a record in the step that pushes the element and
# removes it in the step that requeues it (``trio-redis-finalize requeue``);
# when the dead letter is empty (Redis deletes it), the next dead-lettering
# and the requeue that empties it delete the hash, so records of elements
# removed by other means live no longer than the dead letter stays non-empty.
#
# Appends one record for ARGV[i] (the element) to KEYS[k] (the hash); the
# record ARGV[r] is a JSON object, the server time goes in front of its
# fields as ``"time_ms"``.  The reads come first: a hash of another type fails
# the script before anything is written.
def _why_push(k: int, i: int | str, r: int | str, dead: int) -> str:
    return (
        _NOW_MS
        + f"""
local why = redis.sha1hex(ARGV[{i}])
local had = redis.call('HGET', KEYS[{k}], why)
if redis.call('EXISTS', KEYS[{dead}]) == 0 and redis.call('EXISTS', KEYS[{k}]) == 1 then
  redis.call('DEL', KEYS[{k}])
  had = false
end
redis.call('LPUSH', KEYS[{dead}], ARGV[{i}])
redis.call('HSET', KEYS[{k}], why,
  (had or '') .. '{{"time_ms":' .. string.format('%d', now) .. ',' .. string.sub(ARGV[{r}], 2) .. '\\n')
"""
    )


def why_pop(k: int, i: int, dead: int) -> str:
    """Lua: remove the oldest reason record of ARGV[i] from KEYS[k] (see above);
    the whole hash when the dead letter KEYS[dead] is empty."""
    return f"""
if redis.call('EXISTS', KEYS[{dead}]) == 0 then
  redis.call('DEL', KEYS[{k}])
else
  local why = redis.sha1hex(ARGV[{i}])
  local v = redis.call('HGET', KEYS[{k}], why)
  if v then
    local nl = string.find(v, '\\n', 1, true)
    if not nl or nl >= #v then
      redis.call('HDEL', KEYS[{k}], why)
    else
      redis.call('HSET', KEYS[{k}], why, string.sub(v, nl + 1))
    end
  end
end
"""


# KEYS: processing (the processing list), dest (the destination list),
#   why? (the reason hash)
# ARGV: element, copy, record?why (sent with the reason hash), n? (see _list_gate)
# With the reason hash (a dead letter, see above) the copy is pushed with its
# reason record.
LIST_COPY_REMOVE = Script(
    """
if not redis.call('LPOS', KEYS[1], ARGV[1], 'RANK', -tonumber(ARGV[#KEYS + 1] or 1)) then return false end
if KEYS[3] then
"""
    + _why_push(3, 2, 3, 2)
    + """
else
  redis.call('LPUSH', KEYS[2], ARGV[2])
end
redis.call('LREM', KEYS[1], -1, ARGV[1])
return 1
""",
    name="list_copy_remove",
    keys=("processing", "dest", "why?"), argv=("element", "copy", "record?why", "n?"),
)

# KEYS: dead (the dead letter), why (its reason hash)
# ARGV: element, record
# The copy step of a
# dead-lettering whose processing list is in another Redis Cluster hash slot
# (the removal, LREM, follows it as its own command: duplicate, never loss).
LIST_DEAD_PUSH = Script(
    _why_push(2, 1, 2, 1) + "\nreturn 1\n",
    name="list_dead_push", keys=("dead", "why"), argv=("element", "record"),
)

# KEYS: processing (the processing list), delays (the delay set)
# ARGV: element, delay_ms, member, n? (see _list_gate)
LIST_ZADD_REMOVE = Script(
    _list_gate(4)
    + _NOW_MS
    + """
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
redis.call('LREM', KEYS[1], -1, ARGV[1])
return now + tonumber(ARGV[2])
""",
    name="list_zadd_remove",
    keys=("processing", "delays"), argv=("element", "delay_ms", "member", "n?"),
)

# Decoding a delay-set member (see ``_envelope.pack_parts``).  A member that
# is not one (foreign or damaged bytes) decodes to nil: every length is
# checked against the member's size, so garbage can neither fail the script
# nor make it loop.
_DECODE = """
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
_MOVE_HEAD = (
    _DECODE
    + _NOW_MS
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

_MOVE_TAIL = """
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

_MOVE_KEYS = ("delays", "stream")
_MOVE_ARGV = ("limit", "width?", "reserve_ms?")

CORRUPT_FIELD = b"trf-delayed-corrupt"
"""Field of the stream entry that carries a delay-set member that does not decode."""

# KEYS: delays (the delay set), stream
# ARGV: limit, width?, reserve_ms?
# Member parts: unique id, field, value, ...  Returns {moved, server time ms, score of the
# earliest member left or nil, handed-back member, ...}: members of more than
# ``width`` field values (none without a width) are handed back, see above.
# A member that does not decode is added as one field CORRUPT_FIELD.
def _move_due_to_stream_source(cap: int | None) -> str:
    xadd = "xadd(KEYS[2], ps, 2)" if cap is None else f"xadd_capped(KEYS[2], '{cap}', ps, 2)"
    head = "KEYS[2], '*'" if cap is None else f"KEYS[2], 'MAXLEN', '~', '{cap}', '*'"
    return (
        LUA_XADD
        + ("" if cap is None else LUA_XADD_CAPPED)
        + _MOVE_HEAD
        + f"""
  if ps and #ps >= 3 and #ps % 2 == 1 then
    if width and #ps - 1 > width then
      ok = false
    else
      {xadd}
    end
  else
    redis.call('XADD', {head}, '"""
        + CORRUPT_FIELD.decode()
        + """', m)
  end
"""
        + _MOVE_TAIL
    )


# KEYS: delays (the delay set), stream
# ARGV: limit, width?, reserve_ms?
MOVE_DUE_TO_STREAM = Script(
    _move_due_to_stream_source(None), name="move_due_to_stream", keys=_MOVE_KEYS, argv=_MOVE_ARGV,
)


@functools.lru_cache(maxsize=64)
def move_due_to_stream(cap: int | None) -> Script:
    """:data:`MOVE_DUE_TO_STREAM`, or the same writing ``XADD ... MAXLEN ~ cap``
    (a stream subscription's ``copy_maxlen``; the cap is part of the script)."""
    if cap is None:
        return MOVE_DUE_TO_STREAM
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap must be an int >= 1 or None, got {cap!r}")
    return Script(_move_due_to_stream_source(cap), name=f"move_due_to_stream_maxlen_{cap}",
                  keys=_MOVE_KEYS, argv=_MOVE_ARGV)

# KEYS: delays (the delay set), list
# ARGV: limit, width?, reserve_ms? (read by the shared head; nothing is
#   handed back here)
# Member parts: unique id, element.  Returns as MOVE_DUE_TO_STREAM (never hands a member back).  A member that
# does not decode is pushed as is.
MOVE_DUE_TO_LIST = Script(
    _MOVE_HEAD
    + """
  if ps and #ps == 2 then
    redis.call('LPUSH', KEYS[2], ps[2])
  else
    redis.call('LPUSH', KEYS[2], m)
  end
"""
    + _MOVE_TAIL,
    name="move_due_to_list", keys=("delays", "list"), argv=_MOVE_ARGV,
)

# -- exactly-once effects: an outcome's writes in its finalization (see ``_writes``) --------

# Lua: the writes at ARGV[i] ..: for each, its count of values, the type its
# key must have ('' for any), then the command (name, arguments).
# ``wcheck(i, nw)``: an error reply naming the write and the key when a key
# holds another type, or a value the write would certainly be refused on
# when run (see below); else the index after the writes.  ``wapply(i, nw)``
# runs them.
#
# A write that passes the type check may still fail when run, after the
# writes before it were applied (scripts do not roll back): those would be
# applied again at every redelivery.  So for every write after the first
# (the first failing applies nothing: no check, no cost for the common
# outcome of one write), what Redis will certainly refuse is refused here
# first, before anything is written: ``INCR``, ``DECR``,
# ``INCRBY``, ``DECRBY`` on a value, or by an increment, that is no integer
# as Redis reads one (digits, an optional ``-``, no leading zero: its
# ``string2ll``), ``HINCRBY`` likewise on the field's value, and ``PFADD``
# on a string that is not a HyperLogLog (no ``HYLL`` header).  A value is
# judged only where no earlier write of the same outcome touched its key
# (which could change it).  What stays unchecked (an overflow, floats, a
# damaged HyperLogLog body) is the README's "a write refused at run time".
_WRITES_LUA = """
local wvalue
local function wchecks()
  local function wnotint(v)
    return not string.find(v, '^%-?%d+$') or string.find(v, '^%-?0.') ~= nil or v == '-0'
  end
  -- each: (index of the write, whether its key's value is as it finds it: no
  -- earlier write of the outcome touched it) -> why it would fail, or nil
  local t = {
    INCR = function(i, fresh)
      if fresh then
        local v = redis.call('GET', ARGV[i + 3])
        if v and wnotint(v) then return 'the value is not an integer' end
      end end,
    INCRBY = function(i, fresh)
      if wnotint(ARGV[i + 4]) then return 'the increment is not an integer' end
      if fresh then
        local v = redis.call('GET', ARGV[i + 3])
        if v and wnotint(v) then return 'the value is not an integer' end
      end end,
    HINCRBY = function(i, fresh)
      if wnotint(ARGV[i + 5]) then return 'the increment is not an integer' end
      if fresh then
        local v = redis.call('HGET', ARGV[i + 3], ARGV[i + 4])
        if v and wnotint(v) then return 'the field ' .. ARGV[i + 4] .. ' holds no integer' end
      end end,
    PFADD = function(i, fresh)
      if fresh and redis.call('EXISTS', ARGV[i + 3]) == 1 and
         redis.call('GETRANGE', ARGV[i + 3], 0, 3) ~= 'HYLL' then
        return 'the key holds a string that is not a HyperLogLog'
      end end,
  }
  t.DECR, t.DECRBY = t.INCR, t.INCRBY
  return t
end
local function wcheck(i, nw)
  local touched
  if nw > 1 then
    touched = {}
    wvalue = wvalue or wchecks()
  end
  for w = 1, nw do
    local argc = tonumber(ARGV[i])
    local want = ARGV[i + 1]
    if want ~= '' then
      local key = ARGV[i + 3]
      local t = redis.call('TYPE', key)['ok']
      if t ~= 'none' and t ~= want then
        return nil, 'WRONGTYPE write ' .. w .. ' of the outcome (' .. ARGV[i + 2] .. ' ' ..
          key .. '): the key holds a ' .. t .. ', not a ' .. want .. '; nothing written'
      end
      local check = w > 1 and wvalue[ARGV[i + 2]]
      if check then
        local why = check(i, not touched[key])
        if why then
          return nil, 'ERR write ' .. w .. ' of the outcome (' .. ARGV[i + 2] .. ' ' .. key ..
            ') would fail: ' .. why .. '; nothing written'
        end
      end
    end
    -- (every argument: a DEL names many keys; one more marked only spares a check)
    if touched then
      for a = i + 3, i + 1 + argc do touched[ARGV[a]] = true end
    end
    i = i + 2 + argc
  end
  return i
end
local function wapply(i, nw)
  for w = 1, nw do
    local argc = tonumber(ARGV[i])
    redis.call(unpack(ARGV, i + 2, i + 1 + argc))
    i = i + 2 + argc
  end
end
"""

_ZADD_DUE = (
    _NOW_MS
    + """
  r = now + tonumber(ARGV[i])
  redis.call('ZADD', KEYS[2], r, ARGV[i + 1])
"""
)
"""Lua of the writes scripts' ``zadd``: the copy ``ARGV[i + 1]`` into the delay
set ``KEYS[2]``, due ``ARGV[i]`` ms from the server's clock (``r``)."""


def _run_writes(at: int) -> str:
    """Lua, after a writes script's gate: the writes whose count is ``ARGV[at]``
    (then the writes themselves) checked, refused as a whole, or run; ``i``
    is left at the op's own arguments."""
    return f"""
local nw = tonumber(ARGV[{at}])
local i, why = wcheck({at + 1}, nw)
if not i then return redis.error_reply(why) end
wapply({at + 1}, nw)
"""


# KEYS: stream, dest (a stream for 'copy', the delay set for 'zadd', the
#   stream itself for 'ack'), write_keys... (the writes' keys, declared for
#   Redis Cluster)
# ARGV: group, id, op ('ack', 'copy', 'zadd'), how (the original's removal:
#   '0', '1' or 'x', see _HOW), cap ('0': none), writes... (nw, the writes),
#   own... (the op's: 'copy': field, value, ...; 'zadd': delay ms, member)
# Returns false (gate closed), or what the cell's script returns: 1 ('ack'),
# the copy's id, the due time.
STREAM_WRITES = Script(
    LUA_XADD_ANY
    + _HOW
    + _WRITES_LUA
    + """
local group, id = ARGV[1], ARGV[2]
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], group, id, id, 1)
if not ok or #p == 0 then return false end
"""
    + _run_writes(6)
    + """
local op = ARGV[3]
local r = 1
if op == 'copy' then
  r = xadd_any(KEYS[2], ARGV[5], ARGV, i)
elseif op == 'zadd' then
"""
    + _ZADD_DUE
    + """
end
remove_one(KEYS[1], group, id, ARGV[4])
return r
""",
    name="stream_writes", keys=("stream", "dest", "write_keys..."),
    argv=("group", "id", "op", "how", "cap", "writes...", "own..."),
)

def _batch_writes(at: str) -> str:
    """Lua, in a batched writes script's loop, for an open delivery whose
    writes start at ``ARGV[at]`` (``nw`` of them): checked (``wcheck``), then
    run (``wapply``), each in a ``pcall``; ``ok`` whether they all ran, else
    ``r`` the error (a table, as ``redis.pcall`` answers it)."""
    return f"""
    local ok, at, why = pcall(wcheck, {at}, nw)
    local r
    if ok and at then
      ok, r = pcall(wapply, {at}, nw)
    elseif ok then
      ok, r = false, {{err = why}}
    else
      r = at
    end
    if not ok and type(r) ~= 'table' then r = {{err = tostring(r)}} end
"""


# KEYS: stream, write_keys... (the writes' keys of every delivery, each
#   once, declared for Redis Cluster)
# ARGV: group, how ('0', '1' or 'x', see _HOW), lo, hi, count (the gates'
#   range, see STREAM_COPY_ACK_BATCH), [id, writes...]... (per delivery: its
#   id, nw, its writes as STREAM_WRITES reads them)
# Each delivery as
# STREAM_WRITES with op 'ack' (the ACK or DROP of an outcome carrying
# writes): its gate, its writes' key types checked (a refusal: nothing of
# it written, its error), its writes run in order, its removal.  The
# removals of the deliveries written go in one XACK (XDEL, XACKDEL) at the
# end of the same script, so a crash finds each delivery written and
# removed, or neither, as with its single script.  The writes run in a
# ``pcall``: a write the server refuses at run time (HINCRBY on text) is
# that delivery's error, the writes before it applied (as its single
# script leaves them), not removed, and the call goes on with the next --
# an error raised out of the loop would leave the deliveries before it
# written and not removed (applied again when delivered again).  Its reply
# as STREAM_COPY_ACK_BATCH's (a delivery not listed: written and removed,
# the single script's 1).
STREAM_WRITES_ACK_BATCH = Script(
    _batch_head(3)
    + _WRITES_LUA
    + """
local i, k, last = 6, 0, #argv
while i <= last do
  local id = argv[i]
  local nw = tonumber(argv[i + 1])
  local to = i + 2
  for w = 1, nw do to = to + 2 + tonumber(argv[to]) end
  k = k + 1
"""
    + _BATCH_GATE
    + """
  if open then
"""
    + _batch_writes("i + 2")
    + """
    local wrote = ok
"""
    + _BATCH_SETTLE
    + """
  i = to
end
"""
    + _BATCH_TAIL,
    name="stream_writes_ack_batch", keys=("stream", "write_keys..."),
    argv=("group", "how", "lo", "hi", "count", "[id, writes...]..."),
)

# KEYS: processing (the processing list), dest (the queue for 'copy', the
#   dead letter for 'dead', the delay set for 'zadd', the processing list
#   for 'remove'), why (the dead letter's reason hash; the processing list
#   when none), write_keys... (the writes' keys)
# ARGV: element, op ('remove', 'copy', 'dead', 'zadd'), writes... (nw, the
#   writes), own... (the op's: 'copy': the copy; 'dead': the copy, its reason
#   record; 'zadd': delay ms, member), n (the counted gate, see
#   ``_plan.list_counted``)
# Returns false (gate closed), 1, or the due time.
LIST_WRITES = Script(
    _WRITES_LUA
    + """
if not redis.call('LPOS', KEYS[1], ARGV[1], 'RANK', -tonumber(ARGV[#ARGV])) then return false end
"""
    + _run_writes(3)
    + """
local op = ARGV[2]
local r = 1
if op == 'copy' then
  redis.call('LPUSH', KEYS[2], ARGV[i])
elseif op == 'dead' then
"""
    + _why_push(3, "i", "i + 1", 2)
    + """
elseif op == 'zadd' then
"""
    + _ZADD_DUE
    + """
end
redis.call('LREM', KEYS[1], -1, ARGV[1])
return r
""",
    name="list_writes", keys=("processing", "dest", "why", "write_keys..."),
    argv=("element", "op", "writes...", "own...", "n"),
)


# KEYS: processing (the processing list), write_keys... (the writes' keys
#   of every element, each once, declared for Redis Cluster)
# ARGV: [element, n, writes...]... (per element: the element, n its counted
#   gate (see ``_plan.list_counted``), nw, its writes)
# Each element as
# LIST_WRITES with op 'remove' (the ACK or DROP of an outcome carrying
# writes), in order: its gate (at least n copies in the processing list),
# its writes' key types checked (a refusal: nothing of it written, its
# error), its writes run, then one copy removed -- at once, so that the
# next element's gate counts what is left (identical elements).  The writes
# run in a ``pcall``, as in STREAM_WRITES_ACK_BATCH: a write refused at run
# time is that element's error (the writes before it applied, the element
# not removed) and the call goes on.  Its reply as STREAM_COPY_ACK_BATCH's
# (an element not listed: written and removed, the single script's 1).
LIST_WRITES_REMOVE_BATCH = Script(
    _WRITES_LUA
    + """
local argv, list = ARGV, KEYS[1]
local rpcall, type, tonumber = redis.pcall, type, tonumber
local bad = {}
local i, k, last = 1, 0, #argv
while i <= last do
  local e = argv[i]
  local n = tonumber(argv[i + 1])
  local nw = tonumber(argv[i + 2])
  local to = i + 3
  for w = 1, nw do to = to + 2 + tonumber(argv[to]) end
  k = k + 1
  local ok, at = pcall(redis.call, 'LPOS', list, e, 'RANK', -n)
  if not ok then  -- as the single script's error (the list of another type)
    if type(at) ~= 'table' then at = {err = tostring(at)} end
    bad[#bad + 1] = k
    bad[#bad + 1] = at
  elseif at then
"""
    + _batch_writes("i + 3")
    + """
    if ok then
      rpcall('LREM', list, -1, e)
"""
    + _BATCH_LISTED
    + """
  i = to
end
return {k, unpack(bad)}
""",
    name="list_writes_remove_batch",
    keys=("processing", "write_keys..."), argv=("[element, n, writes...]...",),
)


# -- a runtime delayed copy: removed with a receipt, written once -------------------------
#
# A runtime ``retry_after`` on a stream removes the original now and writes
# its copy when the delay is over (the scheduler holds it meanwhile).  Two
# finalizations of one delivery may meet (the same consumer finalizing twice,
# a blocked consumer against the one that took its entries over), and either
# may be sent again after an unknown outcome (lost reply, lost request,
# timeout): the copy must exist only when *this* finalization's removal
# removed the original.  So the removal is a gated script that leaves a
# *receipt*, a key of that finalization's own (a fresh name per plan,
# ``{stream}:receipt:<hex>``, in the stream's slot), and the copy is written
# only while that receipt says "removed by me":
#
# * STREAM_REMOVE_RECEIPT: gate (the entry pending in the group), the
#   writes the outcome carries, the removal, then the receipt (``r``, no
#   expiry: a resend may come as long as the finalization is held in
#   memory); 1.  A closed gate answers 1 when the receipt is there (an
#   earlier send of this very finalization removed it: its reply was lost),
#   else false (another finalization did: nothing written, no copy).
# * STREAM_COPY_ONCE (when the delay is over): writes the copy only while
#   the receipt holds ``r``, and turns it into the copy's id, kept
#   COPY_MARK_TTL for a resend after a lost reply to answer that id again.
#   Once it has expired, a resend finds no receipt and writes nothing
#   (false): no clock can reopen the gate, it closes it.  (Redis 8.6's
#   ``XADD ... IDMP`` would do the copy's part natively.)

COPY_MARK_TTL = 600_000
"""Milliseconds a runtime copy's receipt lives once the copy is written (it
then holds the copy's id): how late a resend of the copy still gets that id
back; later, the resend writes nothing and answers nil."""

# KEYS: stream, receipt, write_keys... (the writes' keys, declared for Redis Cluster)
# ARGV: group, id, how ('0', '1' or 'x', see _HOW), writes... (nw, the writes)
# Returns 1 (removed by this finalization, now or by an earlier send of it)
# or false (the gate closed by another finalization: nothing written).
STREAM_REMOVE_RECEIPT = Script(
    _HOW
    + _WRITES_LUA
    + """
local group, id = ARGV[1], ARGV[2]
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], group, id, id, 1)
if not ok or #p == 0 then
  if redis.call('EXISTS', KEYS[2]) == 1 then return 1 end
  return false
end
"""
    + _run_writes(4)
    + """
remove_one(KEYS[1], group, id, ARGV[3])
redis.call('SET', KEYS[2], 'r')
return 1
""",
    name="stream_remove_receipt",
    keys=("stream", "receipt", "write_keys..."), argv=("group", "id", "how", "writes..."),
)

# KEYS: stream, receipt
# ARGV: ttl_ms (the receipt's once written), cap ('0': none), fields...
#   (field, value, ...)
# Returns the copy's id, or false (no receipt: nothing written).
STREAM_COPY_ONCE = Script(
    LUA_XADD_ANY
    + """
local done = redis.call('GET', KEYS[2])
if not done then return false end
if done ~= 'r' then return done end
local id = xadd_any(KEYS[1], ARGV[2], ARGV, 3)
redis.call('SET', KEYS[2], id, 'PX', ARGV[1])
return id
""",
    name="stream_copy_once", keys=("stream", "receipt"), argv=("ttl_ms", "cap", "fields..."),
)


# KEYS: stream
# ARGV: cap ('0': none), fields... (field, value, ...)
# A plain XADD (not
# gated) that writes a last value SERVER_TIME as the server's clock: a dead
# letter written to another Redis Cluster slot than its source (the removal
# of the original follows as its own command).
STREAM_XADD = Script(
    LUA_XADD_ANY
    + """
return xadd_any(KEYS[1], ARGV[1], ARGV, 2)
""",
    name="stream_xadd", keys=("stream",), argv=("cap", "fields..."),
)
