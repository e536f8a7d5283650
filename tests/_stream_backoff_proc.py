"""A stream consumer in its own process whose handler fails attempt 1 under a
``Backoff``, for tests that stop it (SIGSTOP) while the entry waits.

Usage::

    python tests/_stream_backoff_proc.py URL STREAM GROUP CONSUMER MODE MIN_IDLE WINDOW

``MODE`` is a :class:`~trio_redis_finalize.Mode` value; the mount has
``max_attempts=2`` and ``on_error=Backoff(base=0.01, cap=0.01, window=WINDOW)``
(attempt 2 due ``WINDOW`` seconds after attempt 1 failed).  The handler writes
``H <id> <attempt> <time.monotonic()>`` to stdout, raises at attempt 1 and
acknowledges later attempts.  ``R`` is written once the subscription is
mounted.  Lines are written with ``os.write`` (unbuffered).
"""

from __future__ import annotations

import os
import sys
import time

import trio

from trio_redis_finalize import ACK, Backoff, Delivery, Mode, Outcome, StreamSubscription, open_consumer


def out(line: str) -> None:
    os.write(1, (line + "\n").encode())


async def main(url: str, stream: str, group: str, name: str, mode: str, min_idle: float,
               window: float) -> None:
    async def handler(d: Delivery) -> Outcome:
        out(f"H {d.id} {d.attempt} {time.monotonic():.6f}")
        if d.attempt == 1:
            raise RuntimeError("fails once")
        return ACK

    sub = StreamSubscription(stream, group, mode=Mode(mode), min_idle=min_idle, block=0.1,
                             max_attempts=2)
    async with open_consumer(url, name=name, shutdown_grace=0.0) as consumer:
        await consumer.mount(sub, handler, on_error=Backoff(base=0.01, cap=0.01, window=window))
        out("R")
        await trio.sleep_forever()


if __name__ == "__main__":
    url, stream, group, name, mode, min_idle, window = sys.argv[1:8]
    trio.run(main, url, stream, group, name, mode, float(min_idle), float(window))
