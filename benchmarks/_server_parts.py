"""The server's parts of an ACK carrying writes, measured with variants of the batched script.

Not a benchmark of the library (``instructions --only write`` is): a tool
for the bound of what the server pays per delivery.  Each row runs a
redis-server under callgrind (as ``instructions`` does), reads ``n``
entries (100 a batch) and finalizes them as ACKs carrying one ``HINCRBY``
or the five writes of ``workloads.five_writes``, one call (or pipeline) a
batch, then checks that every entry was removed and its writes applied
once.  The variants other than the library's are bare Lua loops: no
checks, no error handling, not correct finalizations -- bounds::

    raw        the writes and one XACK, pipelined (not exactly once)
    library    what the library's finalizer sends (STREAM_WRITES_ACK_BATCH)
    library_nopass   the same with its pass over each delivery's writes
               taken out (each delivery's writes run unchecked: a bound)
    library_nopcall  the same with its writes run with no ``pcall`` (a
               write refused at run time fails the call: a bound)
    bare       a bare loop of the writes in the library's layout (per
               delivery: id, nw, then argc, command ... per write), gated by
               the one ranged XPENDING, one XACK
    bare_shape per delivery: id, its writes' counts of values in one value
               ('4,3,5,4,3', parsed once per call), the commands
    bare_runs  runs of deliveries whose writes have one shape: the shape and
               how many deliveries once a run, then per delivery: id, the
               commands (no count per delivery or write)
    bare_runs_shared  the same, the writes of a run sent once when every
               delivery of it carries the same (one HINCRBY only)
    *_nogate   the same with no gate (every delivery taken as pending)
    xack_gate  each delivery's own XACK as its gate (removes before it
               writes: not the contract's order, a write refused then
               leaves its delivery removed)

    python -m benchmarks._server_parts [N] [--writes 1,5] [--only NAME,...] [--binary PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from trio_redis_finalize import StreamSubscription
from trio_redis_finalize._core.stream.scripts import STREAM_WRITES_ACK_BATCH
from trio_redis_finalize._transport import Command, open_client

from . import instructions as ins
from . import workloads as w

Build = Callable[[list[Any], int], list[Command]]

HEAD = """
local argv, stream = ARGV, KEYS[1]
local unpack, tonumber = unpack, tonumber
local group = argv[1]
local pend = {}
GATE
local done, nd = {}, 0
local wnum = setmetatable({}, {__index = function(t, s) local n = tonumber(s); t[s] = n; return n end})
"""
XPENDING = """do
  local p = redis.call('XPENDING', stream, group, argv[3], argv[4], tonumber(argv[5]))
  for j = 1, #p do pend[p[j][1]] = true end
end"""
NO_GATE = "setmetatable(pend, {__index = function() return true end})"
TAIL = """
redis.call('XACK', stream, group, unpack(done))
return {0}
"""
BARE = """
local i, last = 6, #argv
while i <= last do
  local id = argv[i]
  local nw = wnum[argv[i + 1]]
  i = i + 2
  local open = pend[id]
  for w = 1, nw do
    local argc = wnum[argv[i]]
    if open then redis.call(unpack(argv, i + 1, i + argc)) end
    i = i + 1 + argc
  end
  if open then nd = nd + 1; done[nd] = id end
end
"""
XACK_GATE = BARE.replace("pend[id]", "redis.call('XACK', stream, group, id) == 1").replace(
    "  if open then nd = nd + 1; done[nd] = id end\n", "") + "return {0}\n"
SHAPES = """
local shapes = setmetatable({}, {__index = function(t, s)
  local shape, n = {}, 0
  for a in string.gmatch(s, '%d+') do shape[#shape + 1] = tonumber(a); n = n + tonumber(a) end
  shape.t = n
  t[s] = shape
  return shape
end})
"""
WRITE = """  if pend[id] then
    for w = 1, #shape do
      local argc = shape[w]
      redis.call(unpack(argv, at, at + argc - 1))
      at = at + argc
    end
    nd = nd + 1; done[nd] = id
  end
"""
"""Lua: an open delivery's writes (their counts of values in ``shape``, from
``argv[at]``) run, its id to the XACK."""
SHAPE = SHAPES + """
local i, last = 6, #argv
while i <= last do
  local id = argv[i]
  local shape = shapes[argv[i + 1]]
  local at = i + 2
  i = at + shape.t
""" + WRITE + """end
"""
RUNS = SHAPES + """
local i, last = 6, #argv
while i <= last do
  local shape = shapes[argv[i]]
  local m, shared = wnum[argv[i + 1]], argv[i + 2] == '1'
  local nw, t = #shape, shape.t
  i = i + 3
  local base
  if shared then base = i; i = i + t end
  for k = 1, m do
    local id = argv[i]
    local at = base or i + 1
    i = i + 1 + (shared and 0 or t)
""" + WRITE.replace("\n  ", "\n    ").replace("  if", "    if", 1) + """  end
end
"""


def _writes(eid: Any, n: int) -> list[tuple[Any, ...]]:
    return [("HINCRBY", w.TOTALS, "n", 1)] if n == 1 else list(w.five_writes(eid))


def _call(src: str, batch: list[Any], n: int, args: Sequence[Any]) -> list[Command]:
    ids = [e for e, _ in batch]
    keys = [w.TOTALS] if n == 1 else list(w.WRITE_KEYS)
    sha = hashlib.sha1(src.encode()).hexdigest()
    return [("EVALSHA", sha, 1 + len(keys), "s", *keys, "g", "0", ids[0], ids[-1], 2 * len(ids),
             *args)]


def _library(b: list[Any], n: int) -> list[Command]:
    target = StreamSubscription("s", "g").target("me")
    return ins._writes_commands(target, b, n, True)


def _edited(edit: Callable[[str], str]) -> tuple[str, Build]:
    """The library's script with ``edit`` made to its text, and what sends it
    (the library's calls, the edited script's sha in them)."""
    script = STREAM_WRITES_ACK_BATCH
    src = edit(script.source.decode())
    sha = hashlib.sha1(src.encode()).hexdigest()

    def build(b: list[Any], n: int) -> list[Command]:
        return [(c[0], sha, *c[2:]) if c[1] == script.sha else c for c in _library(b, n)]
    return src, build


def _no_pass(src: str) -> str:
    """The pass of ``_lua_writes.batch_writes`` taken out."""
    a, b = src.index("    if wat ~= wsame then\n"), src.index("    if j then\n")
    return src[:a] + src[b:]


def _no_pcall(src: str) -> str:
    return src.replace("wrote, r = pcall(wput, wat, nw)", "wrote, r = true, wput(wat, nw)")


def _raw(b: list[Any], n: int) -> list[Command]:
    return ins._writes_commands(StreamSubscription("s", "g").target("me"), b, n, False)


def _layout(src: str) -> Build:
    """The library's layout: per delivery id, nw, (argc, command ...) per write."""
    def build(b: list[Any], n: int) -> list[Command]:
        args: list[Any] = []
        for eid, _ in b:
            ws = _writes(eid, n)
            args += [eid, len(ws)]
            for c in ws:
                args += [len(c), *c]
        return _call(src, b, n, args)
    return build


def _shape(src: str) -> Build:
    def build(b: list[Any], n: int) -> list[Command]:
        args: list[Any] = []
        for eid, _ in b:
            ws = _writes(eid, n)
            args += [eid, ",".join(str(len(c)) for c in ws)]
            for c in ws:
                args += c
        return _call(src, b, n, args)
    return build


def _runs(src: str, shared: bool) -> Build:
    def build(b: list[Any], n: int) -> list[Command]:
        ws0 = _writes(b[0][0], n)
        args: list[Any] = [",".join(str(len(c)) for c in ws0), len(b), "1" if shared else "0"]
        if shared:
            for c in ws0:
                args += c
            args += [eid for eid, _ in b]
        else:
            for eid, _ in b:
                args.append(eid)
                for c in _writes(eid, n):
                    args += c
        return _call(src, b, n, args)
    return build


def _variants() -> dict[str, tuple[list[str], Build, tuple[int, ...]]]:
    """name -> (scripts to load, build(batch, writes), the writes counts it runs)."""
    def lua(gate: str, body: str, tail: str = TAIL) -> str:
        return HEAD.replace("GATE", gate) + body + tail
    bare, bare0 = lua(XPENDING, BARE), lua(NO_GATE, BARE)
    runs, runs0 = lua(XPENDING, RUNS), lua(NO_GATE, RUNS)
    shape = lua(XPENDING, SHAPE)
    xack = lua("", XACK_GATE, "")
    both = (1, 5)
    (nopass, nopass_b), (nopcall, nopcall_b) = _edited(_no_pass), _edited(_no_pcall)
    return {
        "raw": ([], _raw, both), "library": ([], _library, both),
        "library_nopass": ([nopass], nopass_b, both),
        "library_nopcall": ([nopcall], nopcall_b, both),
        "bare": ([bare], _layout(bare), both), "bare_nogate": ([bare0], _layout(bare0), both),
        "bare_shape": ([shape], _shape(shape), both),
        "bare_runs": ([runs], _runs(runs, False), both),
        "bare_runs_nogate": ([runs0], _runs(runs0, False), both),
        "bare_runs_shared": ([runs], _runs(runs, True), (1,)),
        "bare_runs_shared_nogate": ([runs0], _runs(runs0, True), (1,)),
        "xack_gate": ([xack], _layout(xack), both),
    }


def count(binary: str, n: int, writes: int, build: Build, scripts: Sequence[str] = ()) -> float:
    """The server's instructions per delivery finalizing ``n`` ACKs carrying
    ``writes`` writes (1 or 5) as ``build`` sends them, a batch of 100 a call."""
    with tempfile.TemporaryDirectory(prefix="trf-parts-") as d:
        with ins._server_under_callgrind(binary, Path(d), "parts") as (proc, url, out):
            trio.run(_finalize, proc.pid, url, n, writes, build, scripts)
        return sum(ins._parts(out).values()) / n  # (written when callgrind ends)


async def _finalize(pid: int, url: str, n: int, writes: int, build: Build,
                    scripts: Sequence[str]) -> None:
    """One run: the entries written and read, then finalized with the
    instrumentation on; the effects checked."""
    await ins._listening(url)
    async with open_client(url) as c:
        for src in scripts:
            await c.execute("SCRIPT", "LOAD", src)
        for _ in range(0, n, 1000):
            await c.pipeline([("XADD", "s", "*", "payload", b"x" * 32, "kind", "k")] * 1000)
        await c.execute("XGROUP", "CREATE", "s", "g", "0")
        batches = []
        while reply := await c.execute("XREADGROUP", "GROUP", "g", "me", "COUNT", ins.BATCH,
                                       "STREAMS", "s", ">"):
            batches.append(reply[0][1])
        plans = [build(b, writes) for b in batches]
        await c.pipeline(build([(b"0-1", []), (b"0-2", [])], writes), raise_on_error=False)
        await c.execute("DEL", *w.WRITE_KEYS)
        ins._control(pid, "on")
        for p in plans:
            bad = [r for r in await c.pipeline(p, raise_on_error=False)
                   if isinstance(r, Exception) or (isinstance(r, list) and len(r) > 1)]
            if bad:
                raise RuntimeError(f"server parts: {bad[0]!r:.200}")
        ins._control(pid, "off")
        if int((await c.execute("XPENDING", "s", "g"))[0]):
            raise RuntimeError("server parts: not every entry was finalized")
        await w._check_writes(c, n)



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._server_parts")
    parser.add_argument("n", nargs="?", type=int, default=ins.N)
    parser.add_argument("--writes", default="1,5")
    parser.add_argument("--only", default="")
    parser.add_argument("--binary", default=shutil.which("redis-server") or "redis-server")
    args = parser.parse_args(argv)
    variants = _variants()
    names = args.only.split(",") if args.only else list(variants)
    for writes in map(int, args.writes.split(",")):
        floor = 0.0
        for name in names:
            scripts, build, counts = variants[name]
            if writes in counts:
                per = count(args.binary, args.n, writes, build, scripts)
                floor = floor or per
                print(f"{writes} write(s)  {name:24} {per:9,.0f}  {per / floor:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
