"""Scale-out: many consumer processes in one stream group, aggregate throughput.

On one private redis-server, every round starts P consumer processes (P = 1,
2, 4), each a ``StreamSubscription(mode=Mode.RECLAIM)`` in the same group
under its own consumer name.  The processes start, connect and then wait on
stdin; once all are ready the stream is preloaded with N entries, every
process is told to mount at the same moment, and the clock runs until the
group has delivered the last entry and nothing is pending (``XPENDING``
polled every 5 ms).  Two handlers:

* **no-op** (returns ``ACK``): the library's own cost per entry, bound by
  the CPU: processes scale up to the cores left beside redis-server;
* **1 ms I/O** (``await trio.sleep(0.001)``, then ``ACK``; concurrency 1):
  a handler that waits on something, so processes scale until Redis or the
  cores are the limit.

Rates are the best of 3 rounds; entries/s; the ratio is to one process.

A third table is the cost of cluster routing: one consumer (in this process)
acknowledging N entries of one stream, through ``redis://`` on the single
server and through ``redis+cluster://`` on a local 3-master cluster
(``testing.RedisCluster``, same binary).

    python -m benchmarks.scale_out [N]

The same module is the consumer process (used by ``tests/runtime/test_scale_out.py``
too)::

    python -m benchmarks.scale_out worker URL STREAM GROUP NAME MIN_IDLE WORK PRINT_IDS

It prints ``R`` once connected, waits for a line on stdin (``go``; EOF also
starts it), mounts, and prints ``M`` once reading.  ``WORK``: seconds the
handler sleeps per entry (0: none).  ``PRINT_IDS`` 1: the handler writes
``A <id>`` (unbuffered) before it returns ``ACK``, so a SIGKILL loses no
line of an entry that was acknowledged.  SIGTERM shuts it down gracefully.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import trio

from trio_redis_finalize import ACK, Delivery, Mode, Outcome, StreamSubscription, open_consumer
from trio_redis_finalize._transport import Client, open_client

ROOT = Path(__file__).resolve().parent.parent
N = 50_000
N_IO = 3_000
REPEAT = 3
PROCESSES = (1, 2, 4)
STREAM = "bench:scale"


# -- the consumer process -------------------------------------------------------------


def _out(line: str) -> None:
    os.write(1, (line + "\n").encode())


async def worker(url: str, stream: str, group: str, name: str, min_idle: float, work: float,
                 print_ids: bool) -> None:
    async def handle(d: Delivery) -> Outcome:
        if work:
            await trio.sleep(work)
        if print_ids:
            _out(f"A {d.id}")
        return ACK

    sub = StreamSubscription(stream, group, mode=Mode.RECLAIM, min_idle=min_idle, block=0.1)
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with open_consumer(url, name=name, shutdown_grace=2.0) as consumer:
            _out("R")
            await trio.to_thread.run_sync(sys.stdin.readline)
            await consumer.mount(sub, handle)
            _out("M")
            async for _ in signals:
                break


def worker_command(url: str, stream: str, group: str, name: str, *, min_idle: float = 60.0,
                   work: float = 0.0, print_ids: bool = False) -> list[str]:
    """The argv of one consumer process (run with ``cwd`` = the repository root)."""
    return [sys.executable, "-m", "benchmarks.scale_out", "worker", url, stream, group, name,
            str(min_idle), str(work), "1" if print_ids else "0"]


# -- the measurement ------------------------------------------------------------------------


def _start(url: str, group: str, processes: int, work: float) -> list[subprocess.Popen[bytes]]:
    procs = [
        subprocess.Popen(worker_command(url, STREAM, group, f"w{i}", work=work), cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for i in range(processes)
    ]
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != b"R":
            raise RuntimeError("a consumer process did not start")
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def _preload(client: Client, n: int) -> bytes:
    last = b""
    for start in range(0, n, 1000):
        replies = await client.pipeline(
            [("XADD", STREAM, "*", "payload", b"x" * 32) for _ in range(start, min(start + 1000, n))]
        )
        last = replies[-1]
    return last


async def _drained(client: Client, group: str, last: bytes) -> bool:
    for g in await client.execute("XINFO", "GROUPS", STREAM):
        info = dict(zip(g[::2], g[1::2], strict=True))
        if info[b"name"] == group.encode():
            return bool(info[b"last-delivered-id"] == last and info[b"pending"] == 0)
    return False


async def one_round(url: str, client: Client, group: str, processes: int, n: int,
                    work: float) -> float:
    await client.execute("DEL", STREAM)
    await client.execute("XGROUP", "CREATE", STREAM, group, "0", "MKSTREAM")
    procs = _start(url, group, processes, work)
    try:
        last = await _preload(client, n)
        start = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.flush()
        while not await _drained(client, group, last):
            await trio.sleep(0.005)
        return time.perf_counter() - start
    finally:
        _stop(procs)


async def measure(url: str, n: int) -> None:
    from ._common import Result, print_table

    rounds = 0
    async with open_client(url) as client:
        for title, work, count in (("no-op handler (CPU-bound)", 0.0, n),
                                   ("1 ms I/O handler, concurrency 1", 0.001, N_IO)):
            best = dict.fromkeys(PROCESSES, float("inf"))
            for _ in range(REPEAT):
                for procs in PROCESSES:
                    rounds += 1
                    seconds = await one_round(url, client, f"g{rounds}", procs, count, work)
                    best[procs] = min(best[procs], seconds)
            results = [Result(f"{p} process{'es' if p > 1 else ''}", count, s) for p, s in best.items()]
            print_table(f"stream RECLAIM, {count:,} entries, {title}; {os.cpu_count()} CPUs",
                        results, baseline="1 process", unit="entries/s")


async def one_consumer(url: str, n: int, group: str) -> float:
    """Seconds one in-process consumer takes to acknowledge ``n`` preloaded entries."""
    name = f"stream {STREAM!r} group {group!r}"

    async def handle(d: Delivery) -> Outcome:
        return ACK

    async with open_client(url) as client:
        await client.execute("DEL", STREAM)
        await _preload(client, n)
        async with open_consumer(client, name="bench") as consumer:
            start = time.perf_counter()
            await consumer.mount(StreamSubscription(STREAM, group), handle)
            while consumer.stats()[name]["effects"].get("acked", 0) < n:
                await trio.sleep(0.002)
            return time.perf_counter() - start


async def routing(single: str, cluster: str, n: int) -> None:
    from ._common import Result, print_table

    best = {"redis://": float("inf"), "redis+cluster://": float("inf")}
    for r in range(REPEAT):
        best["redis://"] = min(best["redis://"], await one_consumer(single, n, f"r{r}"))
        best["redis+cluster://"] = min(best["redis+cluster://"], await one_consumer(cluster, n, f"r{r}"))
    print_table(f"one consumer, one stream, {n:,} entries ACK: single server vs 3-master cluster",
                [Result(k, n, v) for k, v in best.items()], baseline="redis://", unit="entries/s")


def main(argv: list[str] | None = None) -> None:
    from trio_redis_finalize.testing import RedisCluster

    from ._common import redis_server

    args = argv or []
    n = int(args[0]) if args else N
    with redis_server() as server:
        trio.run(measure, server.url, n)
        with RedisCluster() as cluster:
            trio.run(routing, server.url, cluster.url, n)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        url, stream, group, name, min_idle, work, print_ids = sys.argv[2:9]
        trio.run(worker, url, stream, group, name, float(min_idle), float(work), print_ids == "1")
    else:
        main(sys.argv[1:])
