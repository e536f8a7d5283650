"""The Lua of an outcome's writes (see ``_writes``), run in its form's gated
step: the checks before anything is written (``wcheck``), the writes
(``wapply``), both in a batched script's loop (``wrun``, ``batch_writes``)
or after a single script's gate (``run_writes``).  Composed into the
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
# Two ways to look it up: comparing the name (``_wtype_is``: its length,
# then the names of that length; nothing to build, 0.4k-0.9k a lookup), or
# the table ``WTYPE`` (name -> type, nil for any type: ~7.4k to build at
# each script call, ~300 an entry, then ~0.1k a lookup).  A single script
# (one outcome's writes) compares; a batched one builds the table when its
# call is long enough for its lookups to pay for it (``WTYPE_AT`` values),
# else compares too (its functions written twice, one pair of closures
# made per call): a short call costs the server about what it did with the
# type sent, a long one less.
def _typed() -> dict[str, str]:
    """The typed writes' names and the type their key must have, as listed."""
    typed = {name: spec[0] for name, spec in WRITE_COMMANDS.items() if spec[0]}
    for name, want in typed.items():
        if not (name.isidentifier() and name.isupper() and want.isalpha()):
            raise ValueError(f"WRITE_COMMANDS: {name!r} ({want!r}) cannot be written in Lua")
    return typed


WTYPE_AT = 64
"""Values of a batched call (``#ARGV``) from which it builds the table
``WTYPE`` (about a dozen lookups: where they cost what the table does)."""

WTYPE_LUA = "local WTYPE = {" + ", ".join(f"{n} = '{want}'" for n, want in _typed().items()) + "}"
"""Lua: the table ``WTYPE[name]`` (see ``_typed``)."""


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


def _want(table: bool, indent: str, given: str = "") -> str:
    """Lua statements: ``local want``, the type the write named ``name``
    wants (nil: any type), from the table ``WTYPE`` or by comparisons (then
    ``given``, a type its caller looked up, spares them; it is cleared)."""
    if table:
        return "local want = WTYPE[name]"
    if not given:
        return f"local want\n{indent}" + _wtype_is("name", indent)
    return (f"local want = {given}\n{indent}{given} = nil\n{indent}if not want then\n{indent}  "
            + _wtype_is("name", indent + "  ") + f"\n{indent}end")


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
# ``wcheck(i, nw, want1)``: an error reply naming the write and the key when a key
# holds another type, or a value the write would certainly be refused on
# when run (see below); else the index after the writes (``want1``: the
# first write's type, when its caller looked it up).  ``wapply(i, nw)``
# runs them (and answers that index); ``wrun`` both, ``wskip`` only that index.
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
    ``wrun``, ``wskip``; what a single script would only pay for at each call)."""
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
""" + (f"""local wcheck, wapply, wrun
if #ARGV >= {WTYPE_AT} then  -- (a long call: the table pays)
{WTYPE_LUA}
{_functions(True, True)}else
{_functions(True, False)}end
local function wskip(i, nw)
  for w = 1, nw do i = i + 1 + wnum[ARGV[i]] end
  return i
end
""" if batched else _functions(False, False)))


_NEXT_WRITE = """    i = i + 1 + argc
  end
  return i
end
"""
"""Lua: the end of a loop over the writes (``for w = 1, nw``), the index after them answered."""


def _functions(batched: bool, table: bool) -> str:
    """Lua: ``wcheck``, ``wapply`` and (``batched``) ``wrun``, assigned to
    locals declared before (a batched script's) or declared, their lookups
    of a write's type from the table ``WTYPE`` (``table``) or by comparisons."""
    num = _memo if batched else _tonumber
    def keep(assign: str) -> str:  # (a single script's one write: no later reader)
        return assign if batched else f"if nw > 1 then {assign} end"
    def define(name: str) -> str:
        return f"{name} = function" if batched else f"local function {name}"
    return define("wcheck") + """(i, nw, want1)
  local from = i
  if nw > 1 and not wvalue then wvalue, wtouched = wchecks() end
  for w = 1, nw do
    local argc = """ + num("ARGV[i]") + """
    local name = ARGV[i + 1]
    """ + _want(table, "    ", "want1" if batched else "") + """
    if want then
      local key = ARGV[i + 2]
      if wtype[key] ~= want then
        local t = redis.call('TYPE', key)['ok']
        if t ~= 'none' and t ~= want then
          wtype[key] = t
          return nil, 'WRONGTYPE write ' .. w .. ' of the outcome (' .. name .. ' ' ..
            key .. '): the key holds a ' .. t .. ', not a ' .. want .. '; nothing written'
        end
        """ + keep("wtype[key] = want") + """
      end
      local check = w > 1 and wvalue[name]
      if check then
        local why = check(i, not wtouched(from, i, key))
        if why then
          return nil, 'ERR write ' .. w .. ' of the outcome (' .. name .. ' ' .. key ..
            ') would fail: ' .. why .. '; nothing written'
        end
      end
    end
""" + _NEXT_WRITE + (define("wapply") + """(i, nw)
  for w = 1, nw do
    local argc = wnum[ARGV[i]]
    local name = ARGV[i + 1]
    redis.call(unpack(ARGV, i + 1, i + argc))
    """ + _want(table, "    ") + """
    if want then
      wtype[ARGV[i + 2]] = want
    elseif name == 'SET' or name == 'SETNX' then  -- (another type: a string)
      wtype[ARGV[i + 2]] = nil
    end
""" + _NEXT_WRITE if batched else define("wapply") + """(i, nw)  -- (its one wcheck ran: no type read after)
  for w = 1, nw do
    local argc = tonumber(ARGV[i])
    redis.call(unpack(ARGV, i + 1, i + argc))
""" + _NEXT_WRITE) + (define("wrun") + """(i, nw)
  if nw == 1 then
    -- (the common outcome, inline: wcheck only for a type not known; a typed
    -- write's key then holds the type its check cached)
    local argc, name, key = wnum[ARGV[i]], ARGV[i + 1], ARGV[i + 2]
    """ + _want(table, "    ") + """
    if want and wtype[key] ~= want then
      local at, why = wcheck(i, 1, want)
      if not at then return nil, why end
    end
    redis.call(unpack(ARGV, i + 1, i + argc))
    if not want and (name == 'SET' or name == 'SETNX') then
      wtype[key] = nil
    end
    return i + 1 + argc
  end
  -- wcheck only where it could refuse: a type not known, or a value to judge
  -- (a batch's writes of one shape: their keys' types known after the first)
  if not wvalue then wvalue, wtouched = wchecks() end
  local j = i
  for w = 1, nw do
    local argc, name = wnum[ARGV[j]], ARGV[j + 1]
    """ + _want(table, "    ") + """
    if want and (wtype[ARGV[j + 2]] ~= want or w > 1 and wvalue[name]) then
      local at, why = wcheck(i, nw)
      if not at then return nil, why end
      break
    end
    j = j + 1 + argc
  end
  return wapply(i, nw)
end
""" if batched else "")


WRITES_LUA = _writes_lua(batched=False)
"""The writes' Lua of a single script (``run_writes``)."""
BATCH_WRITES_LUA = _writes_lua(batched=True)
"""The writes' Lua of a batched script (``batch_writes``): also ``wnum``, ``wrun``
and ``wskip``."""


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
# carrying one HINCRBY (its rows turned into Lua tables); a batched call's
# checks cost it little when its deliveries' keys' types are known (see
# ``wrun``: wcheck only where it could refuse).
def batch_writes(at: str) -> str:
    """Lua, in a batched writes script's loop, for an open delivery whose
    writes start at ``ARGV[at]`` (``nw`` of them): checked, then run, in one
    ``pcall`` (``wrun``); ``wrote`` whether they all ran (then ``to`` the
    index after them), else ``r`` the error (a table, as ``redis.pcall``
    answers it)."""
    return f"""
    local wrote, r, why = pcall(wrun, {at}, nw)
    if wrote and r then
      to = r
    else
      if wrote then r = {{err = why}} elseif type(r) ~= 'table' then r = {{err = tostring(r)}} end
      wrote = false
    end
"""
