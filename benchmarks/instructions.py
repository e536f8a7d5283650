"""Instructions per message, counted by callgrind: the workloads' cost without the noise.

Wall time and CPU time on a shared machine vary by 20-30 % from run to run
(see ``workloads``), more than most of the differences worth knowing.
``valgrind --tool=callgrind`` counts the instructions a process executes:
the same program, inputs and environment give the same count whatever else
the machine is doing.  This module counts, per message:

* **client**: the Python process of a floor of ``workloads`` and of the
  library doing the same work (stream ACK at concurrency 1, reliable list ACK,
  Pub/Sub receive), beside the floor that also awaits a no-op handler per
  message (what the one call per message that no consumer can avoid costs),
  and the floor that also builds the library's deliveries of each batch it
  reads (``floor + decode``: what any handler is given, the bound of a batch
  handler).
  As in ``workloads``, the Pub/Sub contenders publish their messages from the
  same process (counted alike for all three).
  Each contender runs in a child process under callgrind, instrumented only
  while it consumes (``callgrind_control -i on`` / ``off`` around it; the
  data is written beforehand by this process).  Each runs twice, with
  ``N_SMALL`` and ``N`` messages: the difference divided by ``N - N_SMALL``
  is the cost per message, without the set-up (imports, connections, the
  mount).
* **server**: the redis-server, under callgrind, finalizing ``N`` RETRYs of
  entries read beforehand (100 per batch): the ungated minimum (an ``XADD``
  of each copy and one ``XACK`` of the batch, pipelined), the library's
  batched gated script (``stream_copy_ack_batch``, one call per batch), and
  two scripts that are not correct finalizations but bound what any script
  can cost: a bare Lua loop of the same ``XADD`` s and ``XACK`` (no gate, no
  error handling), and the same loop gated by the one ``XPENDING`` of the
  batch's range the library's script reads.  On Redis 8.2 and later, four
  more rows: the same RETRYs deleting each original (``Retention.
  DELETE_ON_FINALIZE``), ungated and in the library's script, with
  ``XACK`` + ``XDEL`` and with 8.2's one ``XACKDEL``.  Last, the same
  entries finalized as durable delays (``retry_after`` with
  ``DelayedRetry.DURABLE_ZSET``): ungated (a ``ZADD`` of each copy into the delay set and
  one ``XACK``, pipelined; ratios to this row) and the library's
  ``stream_zadd_ack_batch``, one call per batch (their round trip: the
  reads and the finalization; the copies wait in the delay set).
* **writes** (client and server): stream ACKs carrying one ``HINCRBY``, or
  the five writes of ``workloads.five_writes`` built per message from its
  id (a counter, a set member, an event, a hash field, an expiry; the
  library's handler returns ``ACK.with_writes(...)`` per message; the row
  ``five writes once``: one such outcome returned for every message, its
  writes checked and encoded once -- what the rest of the library costs),
  against
  the raw pipeline of the same writes of each entry and the batch's
  ``XACK`` (not exactly once).  On the server, the library's commands are
  the first round of its finalizer's sans-IO core
  (``FinalizerCore(target).batch(items).commands()``), so the count follows
  whatever the finalizer sends; both check that every entry was finalized
  and its writes applied once.

Callgrind runs a process about 50 times slower; a time-driven part of a
contender (the library's flusher, timers, the 50 ms poll of its counters)
then runs more often per message than it would natively, which counts
against the library (a bias of a few per cent at most: the counters are
polled every ``POLL`` seconds).  Ratios are instructions to the floor's
instructions; they rank the costs and say how far apart they are, but an
instruction of a system call or of hiredis is not a nanosecond of Python.

    python -m benchmarks instructions [N]        # needs valgrind on PATH
    python3 dev.py bench instructions
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import trio
from redis import exceptions as rexc

from trio_redis_finalize import ACK, ORIGIN_FIELD, RETRIES_FIELD, Delivery
from trio_redis_finalize._transport import Client, Command, open_client
from trio_redis_finalize.testing import free_port

from ._common import internal, redis_server

N = 12_000
N_SMALL = 2_000
BATCH = 100
POLL = 0.05  # the library contenders' counter poll under callgrind (workloads: 1 ms)
SLOWDOWN = 50
"""How many times slower a process runs under callgrind (about; the library's
time-driven bounds are scaled by it in the child)."""
_ROOT = Path(__file__).resolve().parent.parent


# -- the child: one contender, instrumented while it consumes --------------------------------------

def _wait_for(word: str) -> None:
    """Wait for ``word`` on stdin, waking every 20 ms (callgrind takes its
    commands only while the process runs)."""
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.02)
        if ready:
            line = sys.stdin.readline().strip()
            if line == word:
                return
            raise SystemExit(f"instructions child: expected {word!r}, got {line!r}")


def _child(contender: str, url: str, n: int) -> None:
    from . import workloads as w

    async def nothing(*args: Any) -> None:
        return None

    class NoMeter:
        sample = None

        def __init__(self, client: Any) -> None:
            pass

        async def __aenter__(self) -> NoMeter:
            return self

        async def __aexit__(self, *exc: object) -> None:
            pass

    # the data is written by the parent, before instrumentation; no server stats
    for name, value in {"preload": nothing, "_fill": nothing, "Meter": NoMeter,
                        "POLL": POLL}.items():
        setattr(w, name, value)
    # The handler pool hands its outcomes on at once after a handler call
    # slower than _SLOW_CALL (0.5 ms): under callgrind, ~50 times slower, a
    # call of a few microseconds natively (building five writes) crosses it and
    # every outcome is finalized alone, which natively never happens.  Its
    # time-driven bounds are scaled by the slowdown, as POLL is.
    from trio_redis_finalize import _handlers
    _handlers._SLOW_CALL *= SLOWDOWN
    _handlers._FLUSH_EVERY *= SLOWDOWN

    runs: dict[str, Callable[[Client, Client], Awaitable[object]]] = {
        "stream floor": lambda c, p: w.ovl_ack(c, n),
        "stream floor + call": lambda c, p: w.ovl_ack(c, n, calls=True),
        "stream floor + decode": lambda c, p: w.ovl_ack(c, n, decode=True),
        "stream library": lambda c, p: w.lib_stream(url, c, n),
        "stream library batch": lambda c, p: w.lib_stream(url, c, n, batch=True),
        "stream floor + write": lambda c, p: w.ovl_ack(c, n, writes=1),
        "stream library + write": lambda c, p: w.lib_stream(
            url, c, n, outcome=ACK.with_writes(("HINCRBY", w.TOTALS, "n", 1))),
        "stream floor + five writes": lambda c, p: w.ovl_ack(c, n, writes=5),
        "stream library + five writes": lambda c, p: w.lib_stream(
            url, c, n, outcome_of=w.five_outcome),
        "stream library + five writes once": lambda c, p: w.lib_stream(
            url, c, n, outcome=w.five_outcome(Delivery(source=w.STREAM, id="0-1", fields={},
                                                       data=None, attempt=1, origin_id="0-1"))),
        "list floor": lambda c, p: w.ovl_reliable(c, n),
        "list floor + call": lambda c, p: w.ovl_reliable(c, n, calls=True),
        "list floor + decode": lambda c, p: w.ovl_reliable(c, n, decode=True),
        "list library": lambda c, p: w.lib_reliable(url, c, n),
        "list library batch": lambda c, p: w.lib_reliable(url, c, n, batch=True),
        "list floor + write": lambda c, p: w.ovl_reliable(c, n, writes=True),
        "list library + write": lambda c, p: w.lib_reliable(
            url, c, n, outcome=ACK.with_writes(("HINCRBY", w.TOTALS, "n", 1))),
        "pubsub floor": lambda c, p: w.ovl_pubsub(c, p, n),
        "pubsub floor + call": lambda c, p: w.ovl_pubsub(c, p, n, calls=True),
        "pubsub library": lambda c, p: w.lib_pubsub(url, c, p, n),
    }

    async def main() -> None:
        async with open_client(url) as client, open_client(url) as publisher:
            print("ready", flush=True)
            _wait_for("go")
            await runs[contender](client, publisher)
            print("done", flush=True)
            _wait_for("exit")

    trio.run(main)


# -- the parent ---------------------------------------------------------------------------------

def _parts(out: Path) -> dict[int, int]:
    """The instruction counts of a callgrind run's parts (``callgrind_control
    -d`` ends a part), by part number."""
    parts: dict[int, int] = {}
    for f in out.parent.glob(out.name + "*"):
        # "totals:" (callgrind writes "summary: 0" when instrumentation started off)
        fields = {k: v for k, _, v in (line.partition(": ") for line in f.read_text().splitlines())
                  if k in ("part", "summary", "totals")}
        parts[int(fields.get("part", "1"))] = int(fields.get("totals", fields.get("summary", "0")))
    return parts


def _control(pid: int, switch: str) -> None:
    """Instrumentation ``on`` / ``off``, or ``dump`` (end a part), of a process under callgrind."""
    args = ["-d"] if switch == "dump" else ["-i", switch]
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True,
                   timeout=120)


@contextlib.contextmanager
def _callgrind(cmd: list[str], out: Path, **kw: Any) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        ["valgrind", "-q", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", *cmd],
        text=True, **kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=120)


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"instructions: the child ended (exit {proc.wait()})")
    return line


async def _prepare(client: Client, contender: str, n: int) -> None:
    from . import workloads as w
    from .consume import STREAM, preload

    await client.execute("FLUSHALL")
    if contender.startswith("stream"):
        await preload(client, STREAM, n)
    elif contender.startswith("list"):
        await w._fill(client, n)


def _count_client(url: str, contender: str, n: int, tmp: Path) -> int:
    """Instructions of the child consuming ``n`` messages as ``contender``."""
    async def prepare() -> None:
        async with open_client(url) as client:
            await _prepare(client, contender, n)

    trio.run(prepare)
    out = tmp / f"client.{abs(hash((contender, n)))}.out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "benchmarks.instructions", "--child", contender, url, str(n)]
    with _callgrind(cmd, out, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) as proc:
        assert proc.stdin is not None
        if _line(proc) != "ready":
            raise RuntimeError("instructions: the child did not get ready")
        _control(proc.pid, "on")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        if _line(proc) != "done":
            raise RuntimeError("instructions: the child did not finish")
        _control(proc.pid, "off")
        proc.stdin.write("exit\n")
        proc.stdin.flush()
    return sum(_parts(out).values())


def _client_table(url: str, tmp: Path, n: int, only: list[str]) -> None:
    cells = [
        ("stream ACK, concurrency 1", ["stream floor", "stream floor + call",
                                       "stream floor + decode", "stream library",
                                       "stream library batch"]),
        ("stream ACK carrying one write (HINCRBY)", ["stream floor + write",
                                                    "stream library + write"]),
        ("stream ACK carrying five writes (HINCRBY, SADD, XADD, HSET, EXPIRE; built per message)",
         ["stream floor + five writes", "stream library + five writes",
          "stream library + five writes once"]),
        ("reliable list ACK", ["list floor", "list floor + call", "list floor + decode",
                               "list library", "list library batch"]),
        ("reliable list ACK carrying one write (HINCRBY)", ["list floor + write",
                                                            "list library + write"]),
        ("Pub/Sub receive", ["pubsub floor", "pubsub floor + call", "pubsub library"]),
    ]
    print(f"client (this Python, its transport included): instructions per message, "
          f"({n:,} - {N_SMALL:,} messages) / {n - N_SMALL:,}", flush=True)
    for title, contenders in cells:
        if only and not any(w in c for w in only for c in contenders):
            continue
        print(f"  {title}")
        floor = 0.0
        for contender in contenders:
            start = time.perf_counter()
            big = _count_client(url, contender, n, tmp)
            small = _count_client(url, contender, N_SMALL, tmp)
            per = (big - small) / (n - N_SMALL)
            floor = floor or per
            label = contender.split(" ", 1)[1]
            print(f"    {label:20} {per:9,.0f}   {per / floor:5.2f}x of the floor  "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)


# -- the server: RETRY finalization --------------------------------------------------------------

_MINIMAL = """
local done = {}
local i = 7
local last = #ARGV
while i <= last do
  local n = tonumber(ARGV[i + 1])
  redis.call('XADD', KEYS[2], '*', unpack(ARGV, i + 2, i + 1 + n))
  done[#done + 1] = ARGV[i]
  i = i + 2 + n
end
redis.call('XACK', KEYS[1], ARGV[1], unpack(done))
return 1
"""
_MINIMAL_GATED = """
local pend = {}
for _, e in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[4], ARGV[5], tonumber(ARGV[6]))) do
  pend[e[1]] = true
end
local done = {}
local i = 7
local last = #ARGV
while i <= last do
  local n = tonumber(ARGV[i + 1])
  if pend[ARGV[i]] then
    redis.call('XADD', KEYS[2], '*', unpack(ARGV, i + 2, i + 1 + n))
    done[#done + 1] = ARGV[i]
  end
  i = i + 2 + n
end
redis.call('XACK', KEYS[1], ARGV[1], unpack(done))
return 1
"""


@contextlib.contextmanager
def _server_under_callgrind(binary: str, tmp: Path, name: str
                            ) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    """A redis-server on a free port under callgrind (instrumentation off):
    ``(process, url, callgrind output)``."""
    port = free_port()
    out = tmp / f"{name}.{port}.out"
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--hz", "1", "--slowlog-log-slower-than", "-1"]
    # hz 1 (not 10): the server's timer runs ``hz`` times a second of wall
    # time, so under callgrind ~50 times as often per command as natively,
    # and more on a loaded machine; no slow log: natively a batch's script
    # stays far below its 10 ms, under callgrind every one is logged
    with _callgrind(cmd, out, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        yield proc, f"redis://127.0.0.1:{port}", out


async def _listening(url: str) -> None:
    """Wait until the server at ``url`` answers (callgrind starts it slowly)."""
    for _ in range(600):
        try:
            async with open_client(url):
                return
        except (OSError, rexc.ConnectionError):  # not listening yet
            await trio.sleep(0.1)


def _retry_batches(entries: list[Any], script: Any | None, how: str = "0") -> list[Command]:
    """What finalizes one batch of RETRYs: the copies to ``c`` and the removals
    from ``s`` (group ``g``), ungated (``script`` None) or as one script call
    with the batched script's arguments.  ``how`` as the batched script's
    (``_lua.HOW``): ``'0'`` XACK, ``'1'`` XACK then XDEL (delete on
    finalize), ``'x'`` one XACKDEL (Redis 8.2; ungated: ``XACKDEL ... IDS``,
    inside the script ``XACKDEL ... ACKED IDS``)."""
    if script is None:
        ids = [eid for eid, _ in entries]
        cmds: list[Command] = [("XADD", "c", "*", *flat, RETRIES_FIELD, b"1", ORIGIN_FIELD, eid)
                               for eid, flat in entries]
        if how == "x":
            cmds.append(("XACKDEL", "s", "g", "IDS", len(ids), *ids))
            return cmds
        cmds.append(("XACK", "s", "g", *ids))
        if how == "1":
            cmds.append(("XDEL", "s", *ids))
        return cmds
    from .workloads import _batched

    parts = []
    for eid, flat in entries:
        fields = [*flat, RETRIES_FIELD, b"1", ORIGIN_FIELD, eid]
        parts.append([eid, len(fields), *fields])
    return _batched(script, ("s", "c"), ("g", how, "0"), parts)


def _delay_batches(entries: list[Any], script: Any | None) -> list[Command]:
    """What finalizes one batch of durable delays (``retry_after`` with
    ``DelayedRetry.DURABLE_ZSET``): each copy added to the delay set ``d`` (due now, as the
    library packs it) and the originals removed from ``s``, ungated (a ``ZADD``
    each and one ``XACK``, pipelined) or as one call of the batched ``script``."""
    from trio_redis_finalize._envelope import pack_parts

    members = [pack_parts([eid.rjust(16, b"0")[-16:], *flat, RETRIES_FIELD, b"1", ORIGIN_FIELD, eid])
               for eid, flat in entries]
    if script is None:
        due = int(time.time() * 1000)
        cmds: list[Command] = [("ZADD", "d", due, m) for m in members]
        cmds.append(("XACK", "s", "g", *[eid for eid, _ in entries]))
        return cmds
    from .workloads import _batched

    parts = [[eid, 0, m] for (eid, _), m in zip(entries, members, strict=True)]
    return _batched(script, ("s", "d"), ("g", "0"), parts)


def _count_server(binary: str, script: Any | None, n: int, tmp: Path, how: str = "0"
                  ) -> tuple[int, int]:
    """The server's instructions for ``n`` RETRYs: finalizing them, and the
    whole round trip (reading the originals, finalizing, reading the copies
    and acknowledging them).  ``how`` ``'d'``: durable delays instead (see
    :func:`_delay_batches`; their copies wait in the delay set: the round
    trip is the reads and the finalization)."""
    with _server_under_callgrind(binary, tmp, "server") as (proc, url, out):
        async def read(c: Client, key: str) -> list[list[Any]]:
            batches = []
            while reply := await c.execute("XREADGROUP", "GROUP", "g", "me", "COUNT", BATCH,
                                           "STREAMS", key, ">"):
                batches.append(reply[0][1])
            return batches

        async def run() -> None:
            await _listening(url)
            async with open_client(url) as c:
                if script is not None:
                    await c.execute("SCRIPT", "LOAD", script.source)
                for _ in range(0, n, 1000):
                    await c.pipeline([("XADD", "s", "*", "payload", b"x" * 32, "kind", "k")] * 1000)
                await c.execute("XGROUP", "CREATE", "s", "g", "0")
                await c.execute("XGROUP", "CREATE", "c", "g", "0", "MKSTREAM")
                _control(proc.pid, "on")
                plans = [_delay_batches(b, script) if how == "d" else _retry_batches(b, script, how)
                         for b in await read(c, "s")]
                _control(proc.pid, "dump")  # part 1: the reads
                for p in plans:
                    replies = await c.pipeline(p, raise_on_error=False)
                    bad = [r for r in replies if isinstance(r, Exception)]
                    if bad:
                        raise RuntimeError(f"instructions: {bad[0]}")
                _control(proc.pid, "dump")  # part 2: the finalization
                for b in await read(c, "c"):
                    await c.execute("XACK", "c", "g", *[eid for eid, _ in b])
                _control(proc.pid, "off")  # part 3 (at exit): the copies read and acknowledged
                copies = "ZCARD" if how == "d" else "XLEN"
                if int((await c.execute("XPENDING", "s", "g"))[0]) or int(
                        await c.execute(copies, "d" if how == "d" else "c")) != n:
                    raise RuntimeError("instructions: the RETRYs were not all finalized: "
                                       f"{await c.execute('XPENDING', 's', 'g')!r:.80} "
                                       f"{await c.execute(copies, 'd' if how == 'd' else 'c')}")

        trio.run(run)
    parts = _parts(out)
    return parts.get(2, 0), sum(parts.values())


def _redis_at_least(binary: str, version: tuple[int, int]) -> bool:
    """Whether ``binary`` is a Redis (not Valkey) server of ``version`` or later."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    if not out.startswith("Redis server") or "v=" not in out:
        return False
    major, minor = out.split("v=", 1)[1].split()[0].split(".")[:2]
    return (int(major), int(minor)) >= version


def _server_table(binary: str, tmp: Path, n: int) -> None:
    from trio_redis_finalize._core._commands import Script

    scripts = internal("_scripts")
    rows = [
        ("ungated: XADD + XACK, pipelined", None),
        ("library: stream_copy_ack_batch", scripts.STREAM_COPY_ACK_BATCH),
        ("bare Lua loop of the same", Script(_MINIMAL, name="minimal")),
        ("bare Lua loop + the XPENDING gate", Script(_MINIMAL_GATED, name="minimal_gated")),
    ]
    rows3: list[tuple[str, Any, str]] = [(label, script, "0") for label, script in rows]
    if _redis_at_least(binary, (8, 2)):
        # Redis 8.2's XACKDEL: the removal of Retention.DELETE_ON_FINALIZE
        # (it deletes the original, so a plain RETRY cannot use it)
        batch = scripts.STREAM_COPY_ACK_BATCH
        rows3 += [
            ("deleting: ungated XACK + XDEL", None, "1"),
            ("deleting: ungated XACKDEL", None, "x"),
            ("deleting: library XACK + XDEL", batch, "1"),
            ("deleting: library XACKDEL ACKED", batch, "x"),
        ]
    # durable delays (DelayedRetry.DURABLE_ZSET), ratios to their own ungated row
    rows3 += [
        ("durable delay: ungated ZADD + XACK", None, "d"),
        ("durable delay: stream_zadd_ack_batch", scripts.STREAM_ZADD_ACK_BATCH, "d"),
    ]
    print(f"server ({binary}): instructions per RETRY ({n:,} entries, {BATCH} per batch):\n"
          "  finalized = the copy and the XACK of the original; round trip = also reading the\n"
          "  original, and reading and acknowledging the copy", flush=True)
    print(f"    {'':36} {'finalized':>9}            {'round trip':>10}")
    floors = (0.0, 0.0)
    for label, script, how in rows3:
        if how == "d" and script is None:
            floors = (0.0, 0.0)  # the durable delays' floor
        fin, trip = (x / n for x in _count_server(binary, script, n, tmp, how))
        floors = (floors[0] or fin, floors[1] or trip)
        print(f"    {label:36} {fin:9,.0f}   {fin / floors[0]:5.2f}x   {trip:10,.0f}   "
              f"{trip / floors[1]:5.2f}x", flush=True)


def _library_rounds(target: Any, items: list[Any]) -> list[Command]:
    """The first round the library's finalizer sends for ``items``
    (``(delivery, outcome)`` pairs of one batch): its sans-IO core's
    (``FinalizerCore(target).batch(items).commands()``), or in a checkout
    before that core (``TRF_BENCH_LIB``) ``_batch.first_round`` of each
    outcome's ``plan_writes`` plan."""
    try:
        core = internal("_finalize").FinalizerCore
    except (ModuleNotFoundError, AttributeError):  # an older checkout
        from trio_redis_finalize._core._writes import plan_writes

        return list(internal("_batch").first_round((), [plan_writes(target, d, o)
                                                         for d, o in items])[0])
    return list(core(target).batch(items).commands())


def _writes_commands(target: Any, entries: list[Any], writes: int, library: bool) -> list[Command]:
    """What finalizes one batch of ``entries`` (``(id, flat)`` as read) as ACKs
    carrying writes: ``writes`` 1, one ``HINCRBY``; 5, the five writes of
    ``workloads.five_writes`` (values from each entry).  The raw client's
    pipeline (the writes of each entry and one ``XACK`` of the batch: not
    exactly once), or the library's (:func:`_library_rounds`)."""
    from trio_redis_finalize import Delivery

    from . import workloads as w

    one = ("HINCRBY", w.TOTALS, "n", 1)
    if not library:
        cmds: list[Command] = ([one for _ in entries] if writes == 1 else
                               [c for eid, _ in entries for c in w.five_writes(eid)])
        return [*cmds, ("XACK", "s", "g", *[eid for eid, _ in entries])]
    outcome = ACK.with_writes(one)
    items = []
    for eid, flat in entries:
        i = eid.decode() if isinstance(eid, bytes) else eid
        d = Delivery(source="s", id=i, fields={}, data=None, attempt=1, origin_id=i,
                     flat=tuple(flat))
        items.append((d, outcome if writes == 1 else w.five_outcome(d)))
    return _library_rounds(target, items)


def _count_server_writes(binary: str, library: bool, n: int, tmp: Path, writes: int = 1) -> int:
    """The server's instructions finalizing ``n`` ACKs that carry ``writes``
    writes each (1 or 5, see :func:`_writes_commands`): the raw client's
    pipeline, or what the library's finalizer sends for a batch of them (one
    ``stream_writes_ack_batch`` call or a few, or in a checkout before it a
    ``stream_writes`` script per entry: gate, type check, writes, ``XACK``)."""
    from trio_redis_finalize import StreamSubscription

    from . import workloads as w

    target = StreamSubscription("s", "g").target("me")
    with _server_under_callgrind(binary, tmp, "server-writes") as (proc, url, out):
        async def run() -> None:
            await _listening(url)
            async with open_client(url) as c:
                for _ in range(0, n, 1000):
                    await c.pipeline([("XADD", "s", "*", "payload", b"x" * 32, "kind", "k")] * 1000)
                await c.execute("XGROUP", "CREATE", "s", "g", "0")
                batches = []
                while reply := await c.execute("XREADGROUP", "GROUP", "g", "me", "COUNT", BATCH,
                                               "STREAMS", "s", ">"):
                    batches.append(reply[0][1])
                plans = [_writes_commands(target, b, writes, library) for b in batches]
                # loads the scripts: the library's first round for two ids not pending
                # (their gates closed: nothing written), the raw pipeline's first write
                warm = (_writes_commands(target, [(b"0-1", []), (b"0-2", [])], writes, True)
                        if library else plans[0][:1])
                await c.pipeline(warm, raise_on_error=False)
                await c.execute("DEL", *w.WRITE_KEYS)
                _control(proc.pid, "on")
                for p in plans:
                    replies = await c.pipeline(p, raise_on_error=False)
                    bad = [r for r in replies if isinstance(r, Exception)]
                    if bad:
                        raise RuntimeError(f"instructions: {bad[0]}")
                _control(proc.pid, "off")
                if int((await c.execute("XPENDING", "s", "g"))[0]):
                    raise RuntimeError("instructions: the ACKs with writes were not all finalized")
                await w._check_writes(c, n)

        trio.run(run)
    return sum(_parts(out).values())


def _count_server_list_writes(binary: str, library: bool, n: int, tmp: Path) -> int:
    """The server's instructions finalizing ``n`` reliable-list elements (moved
    to the processing list, as read) as ACKs carrying one ``HINCRBY``: the raw
    client's pipeline (``HINCRBY`` + ``LREM`` each: not exactly once), or what
    the library's finalizer sends for a batch of them (the elements are
    distinct: each counted gate is 1, what the reader's ``ListGates`` leaves)."""
    from trio_redis_finalize import ReliableListSubscription

    from . import workloads as w

    one = ("HINCRBY", w.TOTALS, "n", 1)
    target = ReliableListSubscription(w.QUEUE, processing=w.PROCESSING).target("me", cluster=False)

    def plan(elements: list[bytes]) -> list[Command]:
        if not library:
            return [c for e in elements for c in (one, ("LREM", w.PROCESSING, -1, e))]
        handled, _ = internal("_decode").list_deliveries(target, w.QUEUE, elements)
        return _library_rounds(target, [(d, ACK.with_writes(one)) for d in handled])

    with _server_under_callgrind(binary, tmp, "server-list-writes") as (proc, url, out):
        async def run() -> None:
            await _listening(url)
            async with open_client(url) as c:
                await w._fill(c, n)
                moved: list[list[bytes]] = []
                while len(moved) * BATCH < n:
                    got = await c.pipeline([("LMOVE", w.QUEUE, w.PROCESSING, "RIGHT", "LEFT")]
                                           * BATCH)
                    moved.append([e for e in got if e is not None])
                plans = [plan(b) for b in moved]
                await c.pipeline(plan([b"warm-1", b"warm-2"]), raise_on_error=False)
                await c.execute("DEL", *w.WRITE_KEYS)
                _control(proc.pid, "on")
                for p in plans:
                    replies = await c.pipeline(p, raise_on_error=False)
                    bad = [r for r in replies if isinstance(r, Exception)
                           or (library and isinstance(r, list) and len(r) > 1)]
                    if bad:
                        raise RuntimeError(f"instructions: {bad[0]!r:.200}")
                _control(proc.pid, "off")
                if int(await c.execute("LLEN", w.PROCESSING)):
                    raise RuntimeError("instructions: the list ACKs with writes were not all done")
                await w._check_writes(c, n)

        trio.run(run)
    return sum(_parts(out).values())


def _server_writes_table(binary: str, tmp: Path, n: int) -> None:
    print(f"server ({binary}): instructions per ACK carrying writes ({n:,} entries, "
          f"{BATCH} per pipeline); the library's: what its finalizer sends", flush=True)
    for writes, title, raw in (
            (1, "one write (HINCRBY)", "raw: HINCRBY each + XACK, pipelined"),
            (5, "five writes (HINCRBY, SADD, XADD, HSET, EXPIRE)", "raw: the five each + XACK")):
        print(f"  {title}")
        floor = 0.0
        for label, library in ((raw, False), ("library: its finalizer's batch", True)):
            per = _count_server_writes(binary, library, n, tmp, writes) / n
            floor = floor or per
            print(f"    {label:36} {per:9,.0f}   {per / floor:5.2f}x", flush=True)
    print("  reliable list, one write (HINCRBY)")
    floor = 0.0
    for label, library in (("raw: HINCRBY + LREM each, pipelined", False),
                           ("library: its finalizer's batch", True)):
        per = _count_server_list_writes(binary, library, n, tmp) / n
        floor = floor or per
        print(f"    {label:36} {per:9,.0f}   {per / floor:5.2f}x", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks instructions")
    parser.add_argument("n", nargs="?", type=int, default=N, help=f"messages per run (default {N:,})")
    parser.add_argument("--only", action="append", default=[], metavar="WORD",
                        help="count only the client rows whose contender names contain WORD "
                             "(their whole table, floors included), and the server RETRY table "
                             "for 'retry', the server writes table for 'write' (repeatable)")
    args = parser.parse_args(argv or [])
    only: list[str] = args.only
    if args.n <= N_SMALL:
        raise SystemExit(f"instructions: n must be above {N_SMALL:,}")
    missing = [t for t in ("valgrind", "callgrind_control") if shutil.which(t) is None]
    if missing:
        print(f"instructions: {' and '.join(missing)} not on PATH: nothing counted")
        return
    with tempfile.TemporaryDirectory(prefix="trf-callgrind-") as d, redis_server() as server:
        tmp = Path(d)
        _client_table(server.url, tmp, args.n, only)
        if not only or "retry" in only:
            _server_table(server.binary, tmp, args.n)
        if not only or "write" in only:
            _server_writes_table(server.binary, tmp, args.n)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main(sys.argv[1:])
