"""The Lua of an outcome's writes (see ``_writes``), run in its form's gated
step: the checks before anything is written (``wcheck``), the writes
(``wapply``), both in a batched script's loop (``batch_writes``: most
deliveries cleared by a cheaper pass, run by ``wput``) or after a single
script's gate (``run_writes``).  Composed into the
scripts by ``_lua``'s users (``_lua`` re-exports these).  Text only.
"""

from __future__ import annotations

from .._writes import WRITE_COMMANDS

__all__ = ["BATCH_WRITES_LUA", "SAME_WRITES", "WRITES_LUA", "batch_writes", "run_writes"]


SAME_WRITES = "="
"""In a batched call (``STREAM_WRITES_ACK_BATCH``), the value that stands for
a delivery's writes when its outcome is the one of the delivery before it in
the call: the script runs those writes again from where they are (a value
per delivery instead of each write's: a counter every message bumps costs
the server about an eighth less; ``benchmarks._server_parts``)."""


def _fresh_int(call: str, why: str) -> str:
    """Lua, in WRITES_LUA's checks: the value ``redis.call(<call>)`` reads must
    be an integer where no earlier write of the outcome touched it (``fresh``);
    else ``why``."""
    return f"""      if fresh then
        local v = redis.call({call})
        if v and wnotint(v) then return {why} end
      end end,"""


# The type a write's key must have (or hold nothing) is a function of its
# command's name (``_writes.WRITE_COMMANDS``, the one source): the scripts
# know it, the client does not send it (one value less per write to format,
# parse and hand to Lua: ~0.7k server instructions, Redis 7.0, callgrind).
# A single script (one outcome's writes) compares the name (``_wtype_is``:
# its length, then the names of that length; nothing to build, 0.4k-0.9k a
# lookup).  A batched one looks a name up in ``WKIND`` (``_BATCH``): the
# comparisons run once per name and call, then ~0.1k a lookup.
def _typed() -> dict[str, str]:
    """The typed writes' names and the type their key must have, as listed."""
    typed = {name: spec[0] for name, spec in WRITE_COMMANDS.items() if spec[0]}
    for name, want in typed.items():
        if not (name.isidentifier() and name.isupper() and want.isalpha()):
            raise ValueError(f"WRITE_COMMANDS: {name!r} ({want!r}) cannot be written in Lua")
    return typed


VALUE_CHECKED = ("INCR", "INCRBY", "DECR", "DECRBY", "HINCRBY", "PFADD")
"""The writes whose value ``wcheck`` judges when they are not an outcome's
first (``wchecks``' table; a test holds the two together)."""


def _wtype_is(name: str, indent: str) -> str:
    """Lua statements: ``want`` set to the type the write named ``name``
    wants (left nil: any type), by comparisons: its length first, the
    lengths with the most typed names first (see ``_typed``)."""
    by_len: dict[int, dict[str, list[str]]] = {}
    for n, want in _typed().items():
        by_len.setdefault(len(n), {}).setdefault(want, []).append(n)
    lines = [f"local wl = #{name}"]
    ordered = sorted(by_len.items(), key=lambda lw: -sum(map(len, lw[1].values())))
    for k, (length, wants) in enumerate(ordered):
        lines.append(f"{'if' if k == 0 else 'elseif'} wl == {length} then")
        for j, (want, names) in enumerate(wants.items()):
            cond = " or ".join(f"{name} == '{n}'" for n in names)
            lines.append(f"  {'if' if j == 0 else 'elseif'} {cond} then want = '{want}'")
        lines.append("  end")
    return f"\n{indent}".join([*lines, "end"])


def _want(indent: str) -> str:
    """Lua statements: ``local want``, the type the write named ``name``
    wants (nil: any type), by comparisons."""
    return f"local want\n{indent}" + _wtype_is("name", indent)


_WNUM = """
-- wnum[s]: tonumber(s), each distinct s converted once (tonumber is ~1,000 instructions)
local wnum = setmetatable({}, {__index = function(t, s) local n = tonumber(s); t[s] = n; return n end})
"""


def _memo(x: str) -> str:
    return f"wnum[{x}]"


def _tonumber(x: str) -> str:
    return f"tonumber({x})"


# Lua: the writes at ARGV[i] ..: for each, its count of values, then the
# command (name, arguments); the type its key must have ('want', nil for
# any type) the script looks up by the name (above).
# ``wcheck(i, nw)``: an error reply naming the write and the key when a key
# holds another type, or a value the write would certainly be refused on
# when run (see below); else the index after the writes.  ``wapply(i, nw)``
# runs them (and answers that index); a batched script's ``wslow`` both,
# ``wput`` only runs them (its pass cleared them, ``_BATCH``), ``wskip``
# only answers that index.
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
#
# The types are read once per key and script call (``wtype``, a batch's
# deliveries share it; a single script checks its one outcome's writes once,
# then runs them: its ``wapply`` keeps no type, none is read after):
# ``wtype[key] = t`` says the key holds a t or nothing
# (a typed write may empty its key: HDEL, SREM, ZREM, LTRIM; a removal of
# the script's own only empties one), so t is trusted only when it is the
# type wanted; else TYPE reads it.  A typed write that ran sets its type;
# SET and SETNX (the writes that may give a key another type) forget their
# key's; the other any-type writes (DEL, UNLINK, EXPIRE*, PERSIST) remove a
# key or leave it as it is: what a type remembered already allows for.
def _writes_lua(batched: bool) -> str:
    """WRITES_LUA (``batched`` False) or BATCH_WRITES_LUA (True: also ``wnum``,
    ``WKIND``, ``wslow``, ``wput``, ``wskip``; what a single script would only
    pay for at each call)."""
    num = _memo if batched else _tonumber
    return ((_WNUM if batched else "") + """
local ARGV = ARGV  -- (an upvalue: a global is a table lookup)
local wvalue, wtouched
local wtype = {}
local function wchecks()
  local function wnotint(v)
    return not string.find(v, '^%-?%d+$') or string.find(v, '^%-?0.') ~= nil or v == '-0'
  end
  -- each: (index of the write, whether its key's value is as it finds it: no
  -- earlier write of the outcome touched it) -> why it would fail, or nil
  local t = {
    INCR = function(i, fresh)
""" + _fresh_int("'GET', ARGV[i + 2]", "'the value is not an integer'") + """
    INCRBY = function(i, fresh)
      if wnotint(ARGV[i + 3]) then return 'the increment is not an integer' end
""" + _fresh_int("'GET', ARGV[i + 2]", "'the value is not an integer'") + """
    HINCRBY = function(i, fresh)
      if wnotint(ARGV[i + 4]) then return 'the increment is not an integer' end
""" + _fresh_int("'HGET', ARGV[i + 2], ARGV[i + 3]",
                 "'the field ' .. ARGV[i + 3] .. ' holds no integer'") + """
    PFADD = function(i, fresh)
      if fresh and redis.call('EXISTS', ARGV[i + 2]) == 1 and
         redis.call('GETRANGE', ARGV[i + 2], 0, 3) ~= 'HYLL' then
        return 'the key holds a string that is not a HyperLogLog'
      end end,
  }
  t.DECR, t.DECRBY = t.INCR, t.INCRBY
  -- whether a write from ARGV[from] up to ARGV[to] (not included) names v
  -- (every argument: a DEL names many keys; one more seen only spares a check)
  local function wtouched(from, to, v)
    while from < to do
      local argc = """ + num("ARGV[from]") + """
      for a = from + 2, from + argc do
        if ARGV[a] == v then return true end
      end
      from = from + 1 + argc
    end
    return false
  end
  return t, wtouched
end
""" + (_BATCH if batched else _functions()))


_NEXT_WRITE = """    i = i + 1 + argc
  end
  return i
end
"""
"""Lua: the end of a loop over the writes (``for w = 1, nw``), the index after them answered."""


def _functions() -> str:
    """Lua: a single script's ``wcheck`` and ``wapply``, their lookups of a
    write's type by comparisons."""
    return """local function wcheck(i, nw)
  local from = i
  if nw > 1 and not wvalue then wvalue, wtouched = wchecks() end
  for w = 1, nw do
    local argc = tonumber(ARGV[i])
    local name = ARGV[i + 1]
    """ + _want("    ") + """
""" + _CHECK_TYPE.replace("KEEP", "if nw > 1 then wtype[key] = want end") + """
""" + _NEXT_WRITE + """local function wapply(i, nw)  -- (its one wcheck ran: no type read after)
  for w = 1, nw do
    local argc = tonumber(ARGV[i])
    redis.call(unpack(ARGV, i + 1, i + argc))
""" + _NEXT_WRITE


_CHECK_TYPE = """    if want then
      local key = ARGV[i + 2]
      if wtype[key] ~= want then
        local t = redis.call('TYPE', key)['ok']
        if t ~= 'none' and t ~= want then
          wtype[key] = t
          return nil, 'WRONGTYPE write ' .. w .. ' of the outcome (' .. name .. ' ' ..
            key .. '): the key holds a ' .. t .. ', not a ' .. want .. '; nothing written'
        end
        KEEP
      end
      local check = w > 1 and wvalue[name]
      if check then
        local why = check(i, not wtouched(from, i, key))
        if why then
          return nil, 'ERR write ' .. w .. ' of the outcome (' .. name .. ' ' .. key ..
            ') would fail: ' .. why .. '; nothing written'
        end
      end
    end"""
"""Lua, in ``wcheck``'s loop: the write at ``ARGV[i]`` (``w``-th, ``name``,
wanting ``want``) refused, or its key's type kept (``KEEP``)."""


# A batched script's writes (BATCH_WRITES_LUA, ``batch_writes``).  Per
# delivery the common case is a pass over its writes that reads no key and
# judges no value: each write's key of the type remembered (``wtype``), no
# value to judge (``WKIND`` says, per name: the type its key wants; ``'?'``
# for a later write whose value ``wcheck`` judges, ``VALUE_CHECKED``; false
# for SET and SETNX, which forget their key's type; ``''`` any other), then
# the writes run (``wput``) in a ``pcall``.  Any write the pass cannot
# clear sends the delivery to ``wcheck`` (TYPE reads, value checks), then
# ``wapply`` (the writes, each typed one's key remembered), as before.
# The pass is inline in the script's loop (its tables locals, no call) and
# ``wput`` keeps no types: where the pass cleared every write, each typed
# write's key is remembered as the type it wants already, and stays so
# (a typed write keeps its key's type or empties it).
#
# A delivery whose writes are the ones the delivery before it ran
# (SAME_WRITES), after a pass that cleared them all with no SET or SETNX
# among them, skips the pass (``wsame``): those writes left each typed
# key with its type or nothing, and no value was to judge, so the pass
# would clear them again.
_BATCH = """
local wcall, wunpack, pcall = redis.call, unpack, pcall
local function wkind(t, name, later)
  local want
  """ + _wtype_is("name", "  ") + """
  if want then
    if later and (""" + " or ".join(f"name == '{n}'" for n in VALUE_CHECKED) + """) then want = '?' end
  elseif name == 'SET' or name == 'SETNX' then
    want = false
  else
    want = ''
  end
  t[name] = want
  return want
end
-- WKIND[name]: as an outcome's first write, WKINDN: as a later one (above)
local WKIND = setmetatable({}, {__index = function(t, name) return wkind(t, name, false) end})
local WKINDN = setmetatable({}, {__index = function(t, name) return wkind(t, name, true) end})
local wsame  -- (the index of the writes that may skip the pass)
local function wcheck(i, nw)
  local from = i
  if nw > 1 and not wvalue then wvalue, wtouched = wchecks() end
  for w = 1, nw do
    local argc = wnum[ARGV[i]]
    local name = ARGV[i + 1]
    local want = WKIND[name]
    if want == '' then want = nil end
""" + _CHECK_TYPE.replace("KEEP", "wtype[key] = want") + """
""" + _NEXT_WRITE + """local function wapply(i, nw)
  for w = 1, nw do
    local argc = wnum[ARGV[i]]
    local name = ARGV[i + 1]
    wcall(wunpack(ARGV, i + 1, i + argc))
    local want = WKIND[name]
    if want ~= '' then wtype[ARGV[i + 2]] = want or nil end  -- (SET, SETNX: nil)
""" + _NEXT_WRITE + """local function wslow(i, nw)
  local at, why = wcheck(i, nw)
  if not at then return nil, why end
  return wapply(i, nw)
end
local function wput(i, nw)
  for w = 1, nw do
    local argc = wnum[ARGV[i]]
    wcall(wunpack(ARGV, i + 1, i + argc))
    i = i + 1 + argc
  end
  return i
end
local function wskip(i, nw)
  for w = 1, nw do i = i + 1 + wnum[ARGV[i]] end
  return i
end
"""


WRITES_LUA = _writes_lua(batched=False)
"""The writes' Lua of a single script (``run_writes``)."""
BATCH_WRITES_LUA = _writes_lua(batched=True)
"""The writes' Lua of a batched script (``batch_writes``): also ``wnum``,
``WKIND``, ``wslow``, ``wput`` and ``wskip``."""


def run_writes(at: int) -> str:
    """Lua, after a writes script's gate: the writes whose count is ``ARGV[at]``
    (then the writes themselves) checked, refused as a whole, or run; ``i``
    is left at the op's own arguments."""
    return f"""
local nw = tonumber(ARGV[{at}])
local i, why = wcheck({at + 1}, nw)
if not i then return redis.error_reply(why) end
wapply({at + 1}, nw)
"""

# Where a batched ACK carrying writes spends the server's instructions:
# ``python -m benchmarks._server_parts`` measures the library's call beside
# bare loops of the same writes (fewer values, no gate; docs/performance.rst,
# "server parts").  The gate's ranged XPENDING is about a third of an ACK
# carrying one HINCRBY (~8.5k a delivery: its rows made and turned into Lua
# tables; read in RESP3, ``redis.setresp(3)``, the same on Redis 7.0 and
# 8.2).  With five writes the pass over them is ~6.3k a delivery (~1.3k a
# write: their lookups, each a table read; it replaced a check loop and
# type keeping in ``wapply`` of ~10k), their ``pcall`` ~0.5k; a delivery
# carrying the writes of the one before it (SAME_WRITES) skips the pass.
def batch_writes(at: str) -> str:
    """Lua, in a batched writes script's loop, for an open delivery whose
    writes start at ``ARGV[at]`` (``nw`` of them): the pass over them (or
    none, ``wsame``), then in one ``pcall`` the writes run (``wput``), or
    checked and run (``wslow``: a write the pass did not clear); ``wrote``
    whether they all ran (then ``to`` the index after them), else ``r`` the
    error (a table, as ``redis.pcall`` answers it)."""
    return f"""
    local wat, wrote, r, why = {at}
    local j = wat
    if wat ~= wsame then
      wsame = wat
      local kind = WKIND
      for w = 1, nw do
        local key, want = ARGV[j + 2], kind[ARGV[j + 1]]
        if want ~= wtype[key] then
          if want == false then
            wtype[key], wsame = nil, nil
          elseif want ~= '' then
            j, wsame = nil, nil
            break
          end
        end
        j = j + 1 + wnum[ARGV[j]]
        kind = WKINDN
      end
    end
    if j then
      wrote, r = pcall(wput, wat, nw)
    else
      wrote, r, why = pcall(wslow, wat, nw)
    end
    if wrote and r then
      to = r
    else
      wsame = nil
      if wrote then r = {{err = why}} elseif type(r) ~= 'table' then r = {{err = tostring(r)}} end
      wrote = false
    end
"""
