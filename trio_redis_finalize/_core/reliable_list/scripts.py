"""The reliable list's Lua scripts: its finalizations (gated on the copies of
an element in the processing list), a dead letter's reason records, the
batched removals with writes, the delay-set mover and the requeue of a dead
element.

Each finalization script checks that the processing list still holds the
element (as many copies as the consumer holds, see ``list_gate``) and only
then runs its steps in the order of the contract: the copy is written first,
the original removed second; a repeated or racing finalization finds the
gate closed and makes no second copy.

Built from the snippets of ``_core._lua``; each script declares its layout
(``keys=``/``argv=``, see ``_commands.Script``) under its ``# KEYS`` /
``# ARGV`` header.  The list's liveness scripts (reap, stop, give back) are
in ``liveness``.
"""

from __future__ import annotations

from .._commands import Script
from .._lua import (
    BATCH_LISTED,
    BATCH_WRITES_LUA,
    MOVE_ARGV,
    MOVE_HEAD,
    MOVE_TAIL,
    NOW_MS,
    WRITES_LUA,
    ZADD_DUE,
    batch_writes,
    list_gate,
    run_writes,
)

__all__ = [
    "DELETE_LIST_DEAD",
    "LIST_COPY_REMOVE",
    "LIST_DEAD_PUSH",
    "LIST_REMOVE",
    "LIST_WRITES",
    "LIST_WRITES_REMOVE_BATCH",
    "LIST_ZADD_REMOVE",
    "MOVE_DUE_TO_LIST",
    "REQUEUE_LIST",
    "REQUEUE_LIST_FORGET",
    "why_pop",
]

# KEYS: processing (the processing list)
# ARGV: element, n (see list_gate; > 1)
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
        NOW_MS
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
# ARGV: element, copy, record?why (sent with the reason hash), n? (see list_gate)
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
# The copy step of a dead-lettering whose processing list is in another
# Redis Cluster hash slot (the removal, LREM, follows it as its own command:
# duplicate, never loss).
LIST_DEAD_PUSH = Script(
    _why_push(2, 1, 2, 1) + "\nreturn 1\n",
    name="list_dead_push", keys=("dead", "why"), argv=("element", "record"),
)

# KEYS: processing (the processing list), delays (the delay set)
# ARGV: element, delay_ms, member, n? (see list_gate)
LIST_ZADD_REMOVE = Script(
    list_gate(4)
    + NOW_MS
    + """
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
redis.call('LREM', KEYS[1], -1, ARGV[1])
return now + tonumber(ARGV[2])
""",
    name="list_zadd_remove",
    keys=("processing", "delays"), argv=("element", "delay_ms", "member", "n?"),
)

# KEYS: delays (the delay set), list
# ARGV: limit, width?, reserve_ms? (read by the shared head; nothing is
#   handed back here)
# Member parts: unique id, element.  Returns as the stream's MOVE_DUE_TO_STREAM
# (never hands a member back).  A member that does not decode is pushed as is.
MOVE_DUE_TO_LIST = Script(
    MOVE_HEAD
    + """
  if ps and #ps == 2 then
    redis.call('LPUSH', KEYS[2], ps[2])
  else
    redis.call('LPUSH', KEYS[2], m)
  end
"""
    + MOVE_TAIL,
    name="move_due_to_list", keys=("delays", "list"), argv=MOVE_ARGV,
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
    WRITES_LUA
    + """
if not redis.call('LPOS', KEYS[1], ARGV[1], 'RANK', -tonumber(ARGV[#ARGV])) then return false end
"""
    + run_writes(3)
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
    + ZADD_DUE
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
# Each element as LIST_WRITES with op 'remove' (the ACK or DROP of an outcome carrying
# writes), in order: its gate (at least n copies in the processing list),
# its writes' key types checked (a refusal: nothing of it written, its
# error; each key's type read once per call, as in STREAM_WRITES_ACK_BATCH),
# its writes run, then one copy removed -- at once, so that the
# next element's gate counts what is left (identical elements).  Once a
# write of the call ran, a gate of one copy (n = 1, the common case) is the
# removal itself: ``LREM -1`` answers whether a copy was there, and an
# element whose writes are then refused is pushed back at the tail (the
# oldest end), still held -- one call per element instead of an ``LPOS``
# and an ``LREM`` (about a sixth of the call, ``bench instructions --only
# write``).  Not before: a script that has written nothing yet is refused
# its first write when memory is over ``maxmemory`` (OOM), one that has
# written is let go on, so a removal first would let the writes past the
# limit.  The writes
# run in a ``pcall``, as in STREAM_WRITES_ACK_BATCH: a write refused at run
# time is that element's error (the writes before it applied, the element
# not removed) and the call goes on.  Its reply as STREAM_COPY_ACK_BATCH's
# (an element not listed: written and removed, the single script's 1).
LIST_WRITES_REMOVE_BATCH = Script(
    BATCH_WRITES_LUA
    + """
local argv, list = ARGV, KEYS[1]
local rpcall, type, tonumber = redis.pcall, type, tonumber
local bad = {}
local i, k, last = 1, 0, #argv
local dirty  -- (a write ran: Redis refuses no later one for memory, see above)
while i <= last do
  local e = argv[i]
  local n = wnum[argv[i + 1]]
  local nw = wnum[argv[i + 2]]
  local to
  k = k + 1
  local at, gone
  if n == 1 and dirty then  -- the gate and the removal in one LREM (a copy or none: its count)
    at = rpcall('LREM', list, -1, e)
    if type(at) ~= 'table' then at, gone = at == 1, at == 1 end
  else
    at = rpcall('LPOS', list, e, 'RANK', -n)
  end
  if type(at) == 'table' then  -- as the single script's error (the list of another type)
    bad[#bad + 1] = k
    bad[#bad + 1] = at
  elseif at then
"""
    + batch_writes("i + 3")
    + """
    if gone and not wrote then rpcall('RPUSH', list, e) end  -- not written: back, held
    if wrote then
      if not gone then rpcall('LREM', list, -1, e) end
      dirty = true
"""
    + BATCH_LISTED
    + """
  i = to or wskip(i + 3, nw)
end
return {k, unpack(bad)}
""",
    name="list_writes_remove_batch",
    keys=("processing", "write_keys..."), argv=("[element, n, writes...]...",),
)


# -- the requeue of a dead letter (``trio-redis-finalize requeue``, the dashboard) ----------

# KEYS: dead (the dead letter), dest (the destination), why (the dead
#   letter's reason hash)
# ARGV: element (as read: the oldest, at the tail), copy (the new element)
# The moved element's reason record (the oldest of those bytes: the tail's)
# goes with it.
REQUEUE_LIST = Script(
    """
if redis.call('LINDEX', KEYS[1], -1) ~= ARGV[1] then return false end
redis.call('LPUSH', KEYS[2], ARGV[2])
redis.call('RPOP', KEYS[1])
"""
    + why_pop(3, 1, 1)
    + """
return 1
""",
    name="requeue_list", keys=("dead", "dest", "why"), argv=("element", "copy"),
)

# KEYS: dead (the dead letter), why (its reason hash)
# ARGV: element
# The removal step of a requeue to another Redis Cluster hash slot (after the
# copy was pushed there).
REQUEUE_LIST_FORGET = Script(
    """
if redis.call('LREM', KEYS[1], -1, ARGV[1]) == 0 then return 0 end
"""
    + why_pop(2, 1, 1)
    + """
return 1
""",
    name="requeue_list_forget", keys=("dead", "why"), argv=("element",),
)

# KEYS: dead (the dead letter), why (its reason hash)
# ARGV: count, newest
# (what the dry run of the delete saw: the length, the SHA-1 in hex of the
# element at the head)
# The delete of a whole list dead letter, confirmed by an operator: only while
# it is as the dry run counted it (as long, the same newest element), so a
# dead letter pushed since (LPUSH, at the head) is never deleted unseen.
# Returns the count deleted, or -1 (changed: nothing deleted).
DELETE_LIST_DEAD = Script(
    """
local n = redis.call('LLEN', KEYS[1])
if n ~= tonumber(ARGV[1]) then return -1 end
if n > 0 and redis.sha1hex(redis.call('LINDEX', KEYS[1], 0)) ~= ARGV[2] then return -1 end
redis.call('DEL', KEYS[1], KEYS[2])
return n
""",
    name="delete_list_dead", keys=("dead", "why"), argv=("count", "newest"),
)
