"""The stream's Lua scripts: its finalizations, their batched calls, the
runtime delayed copy, the delay-set mover, a Backoff redelivery and the
requeue of a dead entry.

Each finalization script checks that the original is still pending (in the
group's PEL) and only then runs its steps in the order of the contract: the
copy is written first, the original removed second.  A repeated or racing
finalization of the same delivery finds the gate closed and makes no second
copy, so a finalization whose reply was lost may be sent again.

Built from the snippets of ``_core._lua``; each script declares its layout
(``keys=``/``argv=``, see ``_commands.Script``) under its ``# KEYS`` /
``# ARGV`` header, and the code that builds or reads a call of it
(``_plan``, ``_batch``, ``_writes``) does so by those names.
"""

from __future__ import annotations

import functools

from .._commands import Script
from .._lua import (
    BATCH_GATE,
    BATCH_SETTLE,
    BATCH_TAIL,
    BATCH_WRITES_LUA,
    HOW,
    LUA_XADD,
    LUA_XADD_ANY,
    LUA_XADD_CAPPED,
    LUA_XADD_CAPPED_TO,
    LUA_XADD_TO,
    MOVE_ARGV,
    MOVE_HEAD,
    MOVE_TAIL,
    NOW_MS,
    SERVER_TIME,
    STREAM_GATE,
    UNPACK_MAX,
    WRITES_LUA,
    ZADD_DUE,
    batch_head,
    batch_writes,
    run_writes,
)
from .._lua_writes import SAME_WRITES

__all__ = [
    "COPY_MARK_TTL", "CORRUPT_FIELD", "MOVE_DUE_TO_STREAM", "REDELIVER", "REQUEUE_STREAM",
    "STREAM_COPY_ACK", "STREAM_COPY_ACK_BATCH", "STREAM_COPY_ACK_EX", "STREAM_COPY_ONCE",
    "STREAM_REMOVE_RECEIPT", "STREAM_WRITES", "STREAM_WRITES_ACK_BATCH", "STREAM_XADD",
    "STREAM_ZADD_ACK", "STREAM_ZADD_ACKDEL", "STREAM_ZADD_ACK_BATCH", "STREAM_ZADD_ACK_DEL",
    "move_due_to_stream",
]

# KEYS: stream, dest (the destination stream)
# ARGV: group, id, fields... (field, value, ...: any number, wide entries
#   included, see LUA_XADD)
STREAM_COPY_ACK = Script(
    LUA_XADD
    + STREAM_GATE
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
        STREAM_GATE
        + NOW_MS
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
# ARGV: group, id, how ('0', '1' or 'x', see HOW), cap ('0': none),
#   fields... (field, value, ...)
STREAM_COPY_ACK_EX = Script(
    LUA_XADD_ANY
    + HOW
    + STREAM_GATE
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

# KEYS: stream, dest (the destination stream)
# ARGV: group, how ('0', '1' or 'x', see HOW), cap ('0': none), lo, hi,
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
    + batch_head(4)
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
    + BATCH_GATE
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
    + BATCH_SETTLE
    + """
  i = to + 1
end
"""
    + BATCH_TAIL,
    name="stream_copy_ack_batch", keys=("stream", "dest"),
    argv=("group", "how", "cap", "lo", "hi", "count", "[id, n, fields...]..."),
)

# KEYS: stream, delays (the delay set)
# ARGV: group, how ('0', '1' or 'x', see HOW), lo, hi, count (the gates'
#   range), [id, delay_ms, member]... (per delivery)
# Each as STREAM_ZADD_ACK (_DEL with '1', STREAM_ZADD_ACKDEL with 'x'); its reply
# as STREAM_COPY_ACK_BATCH's (a delivery not listed: its copy added to the
# delay set, its original removed; the single script's due time), its loop
# as inline: a ZADD in ``redis.pcall`` per delivery, which answers an
# integer, or an error reply as its table (that delivery's element).  A
# delay that is not a number is that delivery's error (ERR), as the single
# script's would be (its error there fails its script).
STREAM_ZADD_ACK_BATCH = Script(
    batch_head(3)
    + NOW_MS
    + """
local k = 0
for i = 6, #argv, 3 do
  local id = argv[i]
  k = k + 1
"""
    + BATCH_GATE
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
    + BATCH_SETTLE
    + """
end
"""
    + BATCH_TAIL,
    name="stream_zadd_ack_batch", keys=("stream", "delays"),
    argv=("group", "how", "lo", "hi", "count", "[id, delay_ms, member]..."),
)

CORRUPT_FIELD = b"trf-delayed-corrupt"
"""Field of the stream entry that carries a delay-set member that does not decode."""

def _move_due_to_stream_source(cap: int | None) -> str:
    xadd = "xadd(KEYS[2], ps, 2)" if cap is None else f"xadd_capped(KEYS[2], '{cap}', ps, 2)"
    head = "KEYS[2], '*'" if cap is None else f"KEYS[2], 'MAXLEN', '~', '{cap}', '*'"
    return (
        LUA_XADD
        + ("" if cap is None else LUA_XADD_CAPPED)
        + MOVE_HEAD
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
        + MOVE_TAIL
    )


# KEYS: delays (the delay set), stream
# ARGV: limit, width?, reserve_ms?
# Member parts: unique id, field, value, ...  Returns {moved, server time ms,
# score of the earliest member left or nil, handed-back member, ...}: members
# of more than ``width`` field values (none without a width) are handed back
# (see ``_lua.MOVE_HEAD``).  A member that does not decode is added as one
# field CORRUPT_FIELD.
MOVE_DUE_TO_STREAM = Script(
    _move_due_to_stream_source(None), name="move_due_to_stream", keys=("delays", "stream"), argv=MOVE_ARGV,
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
                  keys=("delays", "stream"), argv=MOVE_ARGV)

# KEYS: stream, dest (a stream for 'copy', the delay set for 'zadd', the
#   stream itself for 'ack'), write_keys... (the writes' keys, declared for
#   Redis Cluster)
# ARGV: group, id, op ('ack', 'copy', 'zadd'), how (the original's removal:
#   '0', '1' or 'x', see HOW), cap ('0': none), writes... (nw, the writes),
#   own... (the op's: 'copy': field, value, ...; 'zadd': delay ms, member)
# Returns false (gate closed), or what the cell's script returns: 1 ('ack'),
# the copy's id, the due time.
STREAM_WRITES = Script(
    LUA_XADD_ANY
    + HOW
    + WRITES_LUA
    + """
local group, id = ARGV[1], ARGV[2]
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], group, id, id, 1)
if not ok or #p == 0 then return false end
"""
    + run_writes(6)
    + """
local op = ARGV[3]
local r = 1
if op == 'copy' then
  r = xadd_any(KEYS[2], ARGV[5], ARGV, i)
elseif op == 'zadd' then
"""
    + ZADD_DUE
    + """
end
remove_one(KEYS[1], group, id, ARGV[4])
return r
""",
    name="stream_writes", keys=("stream", "dest", "write_keys..."),
    argv=("group", "id", "op", "how", "cap", "writes...", "own..."),
)

# KEYS: stream, write_keys... (the writes' keys of every delivery, each
#   once, declared for Redis Cluster)
# ARGV: group, how ('0', '1' or 'x', see HOW), lo, hi, count (the gates'
#   range, see STREAM_COPY_ACK_BATCH), [id, writes...]... (per delivery: its
#   id, nw, its writes as STREAM_WRITES reads them; or its id, SAME_WRITES)
# Each delivery as STREAM_WRITES with op 'ack' (the ACK or DROP of an outcome carrying
# writes): its gate, its writes' key types checked (a refusal: nothing of
# it written, its error; each key's type read once per call, the writes of
# the deliveries before it seen, see ``_lua_writes``), its writes run in
# order, its removal.  The
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
    batch_head(3)
    + BATCH_WRITES_LUA
    + """
local i, k, last, wa, wn = 6, 0, #argv  -- (wa, wn: the writes of the delivery before)
while i <= last do
  local id = argv[i]
  local at, nw, skip = i + 2, argv[i + 1]
  if nw == '""" + SAME_WRITES + """' then at, nw, skip = wa, wn, at else nw = wnum[nw]; wa, wn = at, nw end
  local to
  k = k + 1
"""
    + BATCH_GATE
    + """
  if open then
"""
    + batch_writes("at")
    + BATCH_SETTLE
    + """
  i = skip or to or wskip(at, nw)
end
"""
    + BATCH_TAIL,
    name="stream_writes_ack_batch", keys=("stream", "write_keys..."),
    argv=("group", "how", "lo", "hi", "count", "[id, writes...]..."),
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
# ARGV: group, id, how ('0', '1' or 'x', see HOW), writes... (nw, the writes)
# Returns 1 (removed by this finalization, now or by an earlier send of it)
# or false (the gate closed by another finalization: nothing written).
STREAM_REMOVE_RECEIPT = Script(
    HOW
    + WRITES_LUA
    + """
local group, id = ARGV[1], ARGV[2]
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], group, id, id, 1)
if not ok or #p == 0 then
  if redis.call('EXISTS', KEYS[2]) == 1 then return 1 end
  return false
end
"""
    + run_writes(4)
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
# A plain XADD (not gated) that writes a last value SERVER_TIME as the
# server's clock: a dead letter written to another Redis Cluster slot than
# its source (the removal of the original follows as its own command).
STREAM_XADD = Script(
    LUA_XADD_ANY
    + """
return xadd_any(KEYS[1], ARGV[1], ARGV, 2)
""",
    name="stream_xadd", keys=("stream",), argv=("cap", "fields..."),
)


# -- a Backoff redelivery (``_forms/stream``) ----------------------------------------------

# KEYS: stream
# ARGV: group, consumer, [id, count]...
# Each entry still pending for the consumer is claimed by it again (idle 0)
# with its delivery count set to ``count``: its reply is the entry; 0 when
# it is not pending for the consumer (any more); 1 when the stream no longer
# has it (deleted while pending).  The attempt it sets: ``decode.redelivered``.
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
    name="stream_redeliver", keys=("stream",), argv=("group", "consumer", "[id, count]..."),
)


# -- the requeue of a dead letter (``trio-redis-finalize requeue``, the dashboard) ----------

# KEYS: dead (the dead letter), dest (the destination)
# ARGV: id (the entry's), fields... (field, value, ...)
# Gated on the entry still being in the dead letter: racing requeues move it once.
REQUEUE_STREAM = Script(
    LUA_XADD  # an entry of any width (Lua's unpack stops near 8,000 values)
    + """
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return false end
local new = xadd(KEYS[2], ARGV, 2)
redis.call('XDEL', KEYS[1], ARGV[1])
return new
""",
    name="requeue_stream", keys=("dead", "dest"), argv=("id", "fields..."),
)
