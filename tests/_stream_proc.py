"""A stream consumer in its own process, for tests that SIGKILL it mid-handler.

Usage::

    python tests/_stream_proc.py URL STREAM GROUP CONSUMER MODE MIN_IDLE [SLEEP [WINDOW [HEARTBEAT]]]

``MODE`` is a :class:`~trio_redis_finalize.Mode` value (``plain``, ``reclaim``,
``claiming``).  The handler writes ``H <id> <attempt>`` to stdout, sleeps
``SLEEP`` seconds (default: an hour), writes ``A <id>`` and returns ``ACK``.
With ``WINDOW``: ``max_attempts=2``, ``on_error=Backoff(base=0.01, cap=0.01,
window=WINDOW)`` (attempt 2 due ``WINDOW`` s after attempt 1 failed); the
``H`` line ends with ``time.monotonic()`` and attempt 1 raises.
``HEARTBEAT``: the subscription's (default 30 s).
``R`` is written once the subscription is mounted.  Lines are written with
``os.write`` (unbuffered): a SIGKILL loses none that were written.
"""

from __future__ import annotations

import os
import sys
import time

import trio
from _procs import serve

from trio_redis_finalize import ACK, Delivery, Mode, Outcome, StreamSubscription


def out(line: str) -> None:
    os.write(1, (line + "\n").encode())


async def main(url: str, stream: str, group: str, name: str, mode: str, min_idle: float,
               sleep: float, window: float | None, heartbeat: float) -> None:
    async def handler(d: Delivery) -> Outcome:
        if window is None:
            out(f"H {d.id} {d.attempt}")
        else:
            out(f"H {d.id} {d.attempt} {time.monotonic():.6f}")
            if d.attempt == 1:
                raise RuntimeError("fails once")
        await trio.sleep(sleep)
        out(f"A {d.id}")
        return ACK

    sub = StreamSubscription(stream, group, mode=Mode(mode), min_idle=min_idle, block=0.1,
                             heartbeat=heartbeat)
    await serve(url, name, sub, handler, window)


if __name__ == "__main__":
    url, stream, group, name, mode, min_idle = sys.argv[1:7]
    sleep = float(sys.argv[7]) if len(sys.argv) > 7 else 3600.0
    window = float(sys.argv[8]) if len(sys.argv) > 8 else None
    heartbeat = float(sys.argv[9]) if len(sys.argv) > 9 else 30.0
    trio.run(main, url, stream, group, name, mode, float(min_idle), sleep, window, heartbeat)
