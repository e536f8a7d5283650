"""A reliable-list consumer in its own process, for tests that stop it (SIGSTOP) mid-handler.

Usage::

    python tests/_list_proc.py URL QUEUE CONSUMER HEARTBEAT SLEEP [WINDOW]

The handler writes ``H <data> <attempt> <time.monotonic()>`` to stdout,
sleeps ``SLEEP`` seconds, writes ``A <data>`` and returns ``ACK`` carrying
``HINCRBY done <data> 1`` (each finalization's effect, committed once).
With ``WINDOW``: ``max_attempts=2``, ``on_error=Backoff(base=0.01,
cap=0.01, window=WINDOW)`` and attempt 1 raises (attempt 2 due ``WINDOW``
seconds later).  ``R`` is written
once the subscription is mounted.  Lines are written with ``os.write``
(unbuffered): a SIGKILL loses none that were written.
"""

from __future__ import annotations

import os
import sys
import time

import trio
from _procs import serve

from trio_redis_finalize import ACK, Delivery, Outcome, ReliableListSubscription


def out(line: str) -> None:
    os.write(1, (line + "\n").encode())


async def main(url: str, queue: str, name: str, heartbeat: float, sleep: float,
               window: float | None) -> None:
    async def handler(d: Delivery) -> Outcome:
        data = (d.data or b"").decode()
        out(f"H {data} {d.attempt} {time.monotonic():.6f}")
        if window is not None and d.attempt == 1:
            raise RuntimeError("fails once")
        await trio.sleep(sleep)
        out(f"A {data}")
        return ACK.with_writes(("HINCRBY", "done", data, 1))

    sub = ReliableListSubscription(queue, heartbeat=heartbeat, block=0.1)
    await serve(url, name, sub, handler, window)


if __name__ == "__main__":
    url, queue, name, heartbeat, sleep = sys.argv[1:6]
    window = float(sys.argv[6]) if len(sys.argv) > 6 else None
    trio.run(main, url, queue, name, float(heartbeat), float(sleep), window)
