"""Optional: FastStream's ``StreamSub`` on the same workload as ours, and our ratio to it.

    python -m benchmarks peers        # or: python3 dev.py bench peers / --peers

Not part of the default run (``python -m benchmarks`` skips it): it needs a
third-party package.  It creates a virtualenv of its own (``$TRF_PEERS_VENV``,
default ``/tmp/trf-peers-venv``) with ``pip install faststream[redis]`` on
first use and reuses it afterwards; when that fails it prints why and stops.

The workload is ``workloads``' stream ACK: N = 20,000 preloaded entries
(fields ``payload`` = 32 bytes and ``kind``), a no-op handler, one private
redis-server for both.  FastStream 0.7 runs in a child process (asyncio,
redis-py with hiredis when available) with
``StreamSub(stream, group=..., consumer=..., max_records=100)`` (our
``count``), ``ack_policy=AckPolicy.ACK`` (acknowledge after the handler) and
``logger=None`` (no log line per message); its group is created at ``0``
beforehand, since FastStream would create it at ``$`` and skip preloaded
entries.  Both are timed from start (``broker.start()`` / ``mount()``)
until every entry is acknowledged (FastStream: ``XPENDING`` polled every
2 ms once its handler has seen N; ours: the ``acked`` counter).  Best of 3
interleaved rounds; entries/s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import trio

from trio_redis_finalize._transport import Client, open_client

from ._common import Result, print_table, redis_server
from .consume import COUNT, STREAM, preload
from .workloads import LIB, lib_stream

N = 20_000
ROUNDS = 3
VENV = Path(os.environ.get("TRF_PEERS_VENV", "/tmp/trf-peers-venv"))
PYTHON = VENV / "bin" / "python"
REQUIREMENT = "faststream[redis]"
TARGET = 10.0  # ours >= 10 x FastStream (stream ACK, concurrency 1)

_VERSIONS = (
    "import faststream, redis; from importlib.metadata import version; "
    "print('faststream', version('faststream'), '/ redis-py', redis.__version__)"
)

# Runs in the peers' virtualenv: argv = url, stream, group, n.  Prints seconds.
_CHILD = """
import asyncio, sys, time
from faststream import AckPolicy
from faststream.redis import RedisBroker, StreamSub
import redis.asyncio as aredis

url, stream, group, n, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])

async def main():
    broker = RedisBroker(url, logger=None)
    done = asyncio.Event()
    seen = 0

    @broker.subscriber(stream=StreamSub(stream, group=group, consumer="peer", max_records=count),
                       ack_policy=AckPolicy.ACK)
    async def handle(body) -> None:
        nonlocal seen
        seen += 1
        if seen == n:
            done.set()

    r = aredis.Redis.from_url(url)
    start = time.perf_counter()
    await broker.start()
    await asyncio.wait_for(done.wait(), 600)
    while (await r.xpending(stream, group))["pending"] > 0:
        await asyncio.sleep(0.002)
    seconds = time.perf_counter() - start
    await broker.stop()
    await r.aclose()
    print(seconds)

asyncio.run(main())
"""


def _tail(text: str | bytes | None, lines: int = 15) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").strip().splitlines()[-lines:])


def ensure_venv() -> str | None:
    """The peers' virtualenv, created and filled on first use.

    Returns the installed versions (one line), or None after printing why
    it could not be set up.
    """
    check = [str(PYTHON), "-c", _VERSIONS]
    if PYTHON.exists():
        ok = subprocess.run(check, capture_output=True, text=True)
        if ok.returncode == 0:
            return ok.stdout.strip()
    print(f"peers: creating {VENV} and installing {REQUIREMENT} (once; takes a minute)", flush=True)
    steps = [
        [sys.executable, "-m", "venv", str(VENV)],
        [str(PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check", REQUIREMENT],
    ]
    for cmd in steps:
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
        except subprocess.CalledProcessError as e:
            print(f"peers: `{' '.join(cmd)}` failed (exit {e.returncode}):\n"
                  f"{_tail(e.stderr) or _tail(e.stdout)}", file=sys.stderr)
            return None
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"peers: `{' '.join(cmd)}` failed: {e}", file=sys.stderr)
            return None
    ok = subprocess.run(check, capture_output=True, text=True)
    if ok.returncode != 0:
        print(f"peers: {REQUIREMENT} installed but does not import:\n{_tail(ok.stderr)}",
              file=sys.stderr)
        return None
    return ok.stdout.strip()


_groups = 0


async def faststream_ack(url: str, client: Client, n: int) -> float:
    global _groups
    _groups += 1
    group = f"peer{_groups}"
    await preload(client, STREAM, n)
    await client.execute("XGROUP", "CREATE", STREAM, group, "0")
    out = await trio.run_process(
        [str(PYTHON), "-c", _CHILD, url, STREAM, group, str(n), str(COUNT)],
        capture_stdout=True, capture_stderr=True, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"FastStream run failed (exit {out.returncode}):\n{_tail(out.stderr)}")
    pending = int((await client.execute("XPENDING", STREAM, group))[0])
    assert pending == 0, pending
    return float(out.stdout.split()[-1])


async def _run(url: str, n: int) -> None:
    peer = "FastStream StreamSub"
    ours = f"{LIB}, concurrency 1"
    async with open_client(url) as client:
        await lib_stream(url, client, 500)  # warm-up
        await faststream_ack(url, client, 500)
        best = {peer: float("inf"), ours: float("inf")}
        for _ in range(ROUNDS):
            best[peer] = min(best[peer], await faststream_ack(url, client, n))
            best[ours] = min(best[ours], (await lib_stream(url, client, n)).seconds)
        await client.execute("DEL", STREAM)
    results = [Result(label, n, seconds) for label, seconds in best.items()]
    print_table(f"stream ACK, no-op handler: {n:,} entries, COUNT {COUNT} (best of {ROUNDS})",
                results, baseline=peer, unit="entries/s")
    ratio = results[1].rate / results[0].rate
    print(f"\ntarget: {LIB} >= {TARGET:g} x FastStream on stream ACK: {ratio:.1f}x "
          f"{'met' if ratio >= TARGET else 'MISSED'}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = argv or []
    n = int(args[0]) if args else N
    versions = ensure_venv()
    if versions is None:
        print("peers: skipped (see above)")
        return
    print(f"peers: {versions} in {VENV}", flush=True)
    with redis_server() as server:
        trio.run(_run, server.url, n)


if __name__ == "__main__":
    main(sys.argv[1:])
