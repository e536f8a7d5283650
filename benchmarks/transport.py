"""XADD throughput of the package's transport against redis-py's asyncio client.

20,000 XADDs, sequential and pipelined (batches of 100), on one private
redis-server, in the same run:

* our transport on trio;
* our transport on anyio's asyncio backend;
* redis-py's ``redis.asyncio`` client (with hiredis) on native asyncio.

Rates are entries/s; the ratio column is relative to redis-py.

    python -m benchmarks.transport [N]
"""

from __future__ import annotations

import asyncio
import sys
from importlib.metadata import version

import anyio
import redis
import redis.asyncio
import trio
from redis.utils import HIREDIS_AVAILABLE

from trio_redis_finalize._transport import open_client

from ._common import Result, Timer, print_table, redis_server

N = 20_000
BATCH = 100
PIPE_REPEAT = 3  # the pipelined run is short (~0.1 s): best of 3
KEY = "bench:xadd"
REDIS_PY = "redis-py asyncio"


async def _ours(url: str, n: int) -> tuple[float, float]:
    async with open_client(url, max_connections=1) as client:
        await client.execute("DEL", KEY)
        for i in range(200):  # warm-up
            await client.execute("XADD", KEY, "*", "n", i)
        with Timer() as seq:
            for i in range(n):
                await client.execute("XADD", KEY, "*", "n", i)
        best = float("inf")
        for _ in range(PIPE_REPEAT):
            with Timer() as pipe:
                for start in range(0, n, BATCH):
                    await client.pipeline(
                        [("XADD", KEY, "*", "n", i) for i in range(start, min(start + BATCH, n))]
                    )
            best = min(best, pipe.seconds)
        assert await client.execute("XLEN", KEY) == (1 + PIPE_REPEAT) * n + 200
        await client.execute("DEL", KEY)
    return seq.seconds, best


async def _redis_py(url: str, n: int) -> tuple[float, float]:
    r = redis.asyncio.Redis.from_url(url)
    try:
        await r.delete(KEY)
        for i in range(200):
            await r.xadd(KEY, {"n": i})
        with Timer() as seq:
            for i in range(n):
                await r.xadd(KEY, {"n": i})
        best = float("inf")
        for _ in range(PIPE_REPEAT):
            with Timer() as pipe:
                for start in range(0, n, BATCH):
                    p = r.pipeline(transaction=False)
                    for i in range(start, min(start + BATCH, n)):
                        p.xadd(KEY, {"n": i})
                    await p.execute()
            best = min(best, pipe.seconds)
        assert await r.xlen(KEY) == (1 + PIPE_REPEAT) * n + 200
        await r.delete(KEY)
    finally:
        await r.aclose()
    return seq.seconds, best


def main(n: int = N) -> None:
    print(
        f"XADD x {n:,}: redis-py {redis.__version__} (hiredis {'yes' if HIREDIS_AVAILABLE else 'NO'}), "
        f"trio {trio.__version__}, anyio {version('anyio')}"
    )
    with redis_server() as server:
        url = server.url
        runs = {
            "ours on trio": trio.run(_ours, url, n),
            "ours on anyio-asyncio": anyio.run(_ours, url, n, backend="asyncio"),
            REDIS_PY: asyncio.run(_redis_py(url, n)),
        }
    print_table(
        f"sequential XADD ({n:,} entries, one round trip each)",
        [Result(label, n, seq) for label, (seq, _) in runs.items()],
        baseline=REDIS_PY,
        unit="entries/s",
    )
    print_table(
        f"pipelined XADD ({n:,} entries, batches of {BATCH}, best of {PIPE_REPEAT})",
        [Result(label, n, pipe) for label, (_, pipe) in runs.items()],
        baseline=REDIS_PY,
        unit="entries/s",
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else N)
