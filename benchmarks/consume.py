"""Stream consumer throughput and memory: the library against its raw floor.

On one private redis-server, N = 20,000 entries preloaded per run (fields
``payload`` = 32 bytes and ``kind``), each run in a group of its own:

* **ACK**: the library (``StreamSubscription``, a no-op handler returning
  ``ACK``) at concurrency 1 and 16, timed from ``mount()`` until every entry
  is acknowledged (the ``acked`` counter reaches N), against the **raw
  floor**: our transport alone doing ``XREADGROUP COUNT 100`` on a dedicated
  connection and one ``XACK`` of the whole batch on a pool connection.
* **RETRY**: a handler returning ``RETRY`` for every original (and ``ACK`` for
  the copies, which come after the originals); timed until N originals are
  copied and acknowledged, against the floor of one gated script per entry:
  ``XREADGROUP COUNT 100`` then the batch's ``EVALSHA stream_copy_ack``
  commands pipelined in one round trip.
* **memory**: peak RSS (``VmHWM`` in a child process that runs
  only the consumer, ACKing everything) at 20,000 and at 200,000 preloaded
  entries; flat memory means a ratio close to 1.

Rates are the best of 5 rounds (every contender runs once per round, in turn);
entries/s.

    python -m benchmarks.consume [N]
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from trio_redis_finalize import (
    ACK,
    ORIGIN_FIELD,
    RETRIES_FIELD,
    RETRY,
    Delivery,
    Outcome,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._transport import Client, open_client

from ._common import Result, Timer, internal, print_table, redis_server

STREAM_COPY_ACK = internal("_scripts").STREAM_COPY_ACK

N = 20_000
BIG = 200_000
COUNT = 100
REPEAT = 5
STREAM = "bench:stream"
PAYLOAD = b"x" * 32
RAW = "raw transport"
_runs = 0
ROOT = Path(__file__).resolve().parent.parent


def _group() -> str:
    global _runs
    _runs += 1
    return f"g{_runs}"


async def preload(client: Client, stream: str, n: int) -> None:
    await client.execute("DEL", stream)
    for start in range(0, n, 1000):
        await client.pipeline(
            [("XADD", stream, "*", "payload", PAYLOAD, "kind", "bench")
             for _ in range(start, min(start + 1000, n))]
        )


async def _pending(client: Client, stream: str, group: str) -> int:
    return int((await client.execute("XPENDING", stream, group))[0])


# -- raw floors -------------------------------------------------------------------

async def raw_ack(client: Client, n: int) -> float:
    await preload(client, STREAM, n)
    group = _group()
    await client.execute("XGROUP", "CREATE", STREAM, group, "0")
    done = 0
    async with await client.connect(name="bench-raw-reader") as conn:
        with Timer() as t:
            while done < n:
                reply = await conn.execute("XREADGROUP", "GROUP", group, "raw", "COUNT", COUNT,
                                           "STREAMS", STREAM, ">")
                ids = [e[0] for e in reply[0][1]]
                await client.execute("XACK", STREAM, group, *ids)
                done += len(ids)
    assert await _pending(client, STREAM, group) == 0
    return t.seconds


async def raw_retry(client: Client, n: int) -> float:
    await preload(client, STREAM, n)
    group = _group()
    await client.execute("XGROUP", "CREATE", STREAM, group, "0")
    done = 0
    async with await client.connect(name="bench-raw-reader") as conn:
        with Timer() as t:
            while done < n:
                reply = await conn.execute("XREADGROUP", "GROUP", group, "raw", "COUNT",
                                           min(COUNT, n - done), "STREAMS", STREAM, ">")
                cmds = []
                for eid, flat in reply[0][1]:
                    fields = [*flat, RETRIES_FIELD, b"1", ORIGIN_FIELD, eid]
                    cmds.append(STREAM_COPY_ACK.command((STREAM, STREAM), (group, eid, *fields)))
                await client.pipeline(cmds)
                done += len(cmds)
    assert await client.execute("XLEN", STREAM) == 2 * n
    return t.seconds


# -- the library ------------------------------------------------------------------------

async def lib_ack(url: str, client: Client, n: int, concurrency: int) -> float:
    await preload(client, STREAM, n)
    group = _group()
    name = f"stream {STREAM!r} group {group!r}"

    async def handle(d: Delivery) -> Outcome:
        return ACK

    async with open_consumer(url, name="bench") as consumer:
        with Timer() as t:
            await consumer.mount(StreamSubscription(STREAM, group, count=COUNT), handle,
                                 concurrency=concurrency)
            while consumer.stats()[name]["effects"].get("acked", 0) < n:
                await trio.sleep(0.002)
    assert await _pending(client, STREAM, group) == 0
    return t.seconds


async def lib_retry(url: str, client: Client, n: int) -> float:
    await preload(client, STREAM, n)
    group = _group()
    name = f"stream {STREAM!r} group {group!r}"

    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.attempt == 1 else ACK

    async with open_consumer(url, name="bench") as consumer:
        with Timer() as t:
            await consumer.mount(StreamSubscription(STREAM, group, count=COUNT), handle)
            while consumer.stats()[name]["effects"].get("copied", 0) < n:
                await trio.sleep(0.002)
    assert await client.execute("XLEN", STREAM) == 2 * n
    return t.seconds


async def _interleaved(runs: dict[str, Callable[[int], Awaitable[float]]], n: int) -> list[Result]:
    """Best of ``REPEAT`` rounds, each round running every contender once in turn
    (so that a noisy moment of the machine hits them alike)."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(REPEAT):
        for label, run in runs.items():
            best[label] = min(best[label], await run(n))
    return [Result(label, n, seconds) for label, seconds in best.items()]


# -- memory: a child process that only consumes ----------------------------------------------

def _rss_now() -> int:
    """Current resident set size in KiB (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


def _peak_rss() -> int:
    """Peak RSS of this process in KiB: ``VmHWM`` of ``/proc/self/status``.

    Not ``getrusage``'s ``ru_maxrss``: Linux carries that over ``execve``, so
    a child started by a bigger parent reports the parent's size.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


async def _child(url: str, stream: str, group: str, n: int) -> None:
    name = f"stream {stream!r} group {group!r}"

    async def handle(d: Delivery) -> Outcome:
        return ACK

    before = _rss_now()
    highest = before
    async with open_consumer(url, name="bench-rss") as consumer:
        await consumer.mount(StreamSubscription(stream, group, count=COUNT), handle, concurrency=16)
        while consumer.stats()[name]["effects"].get("acked", 0) < n:
            highest = max(highest, _rss_now())
            await trio.sleep(0.01)
    print(f"{_peak_rss()} {before} {highest}", flush=True)


async def peak_rss(url: str, client: Client, n: int) -> tuple[int, int, int, float]:
    """A child consuming ``n`` entries: (peak RSS, RSS before mounting,
    highest RSS sampled while consuming) in KiB, and seconds (start-up included)."""
    stream = f"bench:rss:{n}"
    await preload(client, stream, n)
    group = _group()
    await client.execute("XGROUP", "CREATE", stream, group, "0")
    with Timer() as t:
        out = await trio.run_process(
            [sys.executable, "-m", "benchmarks.consume", "--child", url, stream, group, str(n)],
            capture_stdout=True, cwd=ROOT,
        )
    await client.execute("DEL", stream)
    peak, before, highest = (int(x) for x in out.stdout.split())
    return peak, before, highest, t.seconds


async def _run(url: str, n: int) -> None:
    async with open_client(url) as client:
        # warm-up: connections, script cache, code paths
        await raw_ack(client, 500)
        await raw_retry(client, 500)
        await lib_ack(url, client, 500, 1)
        await lib_retry(url, client, 500)

        lib = "trio_redis_finalize"
        runs: dict[str, Callable[[int], Awaitable[float]]] = {
            RAW: lambda k: raw_ack(client, k),
            f"{lib}, concurrency 1": lambda k: lib_ack(url, client, k, 1),
            f"{lib}, concurrency 16": lambda k: lib_ack(url, client, k, 16),
        }
        ack = await _interleaved(runs, n)
        print_table(f"stream ACK: {n:,} entries, XREADGROUP COUNT {COUNT} (best of {REPEAT})", ack,
                    baseline=RAW, unit="entries/s")
        floor = RAW + " (gated script)"
        runs = {
            floor: lambda k: raw_retry(client, k),
            f"{lib}, concurrency 1": lambda k: lib_retry(url, client, k),
        }
        retry = await _interleaved(runs, n)
        print_table(f"stream RETRY (copy then XACK): {n:,} entries (best of {REPEAT})", retry,
                    baseline=floor, unit="entries/s")
        await client.execute("DEL", STREAM)

        small = await peak_rss(url, client, n)
        big = await peak_rss(url, client, BIG)
        print("\nmemory of a consumer process (concurrency 16, ACK), KiB")
        print(f"  {'entries':>9}  {'peak RSS':>9}  {'RSS before mount':>16}  {'highest while consuming':>23}")
        for k, (peak, before, highest, secs) in ((n, small), (BIG, big)):
            print(f"  {k:>9,}  {peak:>9,}  {before:>16,}  {highest:>23,}   ({k / secs:,.0f} entries/s "
                  "with start-up)")
        print(f"  peak RSS ratio {BIG:,} / {n:,}: {big[0] / small[0]:.3f}; highest-while-consuming "
              f"ratio: {big[2] / max(small[2], 1):.3f}")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    args = argv or []
    n = int(args[0]) if args else N
    with redis_server() as server:
        trio.run(_run, server.url, n)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        url, stream, group, count = sys.argv[2:6]
        trio.run(_child, url, stream, group, int(count))
    else:
        main(sys.argv[1:])
