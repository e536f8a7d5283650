"""A stream consumer in its own process, for tests that SIGKILL it mid-handler.

Usage::

    python tests/_stream_proc.py URL STREAM GROUP CONSUMER MODE MIN_IDLE [SLEEP]

``MODE`` is a :class:`~trio_redis_finalize.Mode` value (``plain``, ``reclaim``,
``claiming``).  The handler writes ``H <id> <attempt>`` to stdout, sleeps
``SLEEP`` seconds (default: an hour), writes ``A <id>`` and returns ``ACK``.
``R`` is written once the subscription is mounted.  Lines are written with
``os.write`` (unbuffered): a SIGKILL loses none that were written.
"""

from __future__ import annotations

import os
import sys

import trio

from trio_redis_finalize import ACK, Delivery, Mode, Outcome, StreamSubscription, open_consumer


def out(line: str) -> None:
    os.write(1, (line + "\n").encode())


async def main(url: str, stream: str, group: str, name: str, mode: str, min_idle: float,
               sleep: float) -> None:
    async def handler(d: Delivery) -> Outcome:
        out(f"H {d.id} {d.attempt}")
        await trio.sleep(sleep)
        out(f"A {d.id}")
        return ACK

    sub = StreamSubscription(stream, group, mode=Mode(mode), min_idle=min_idle, block=0.1)
    async with open_consumer(url, name=name, shutdown_grace=0.0) as consumer:
        await consumer.mount(sub, handler)
        out("R")
        await trio.sleep_forever()


if __name__ == "__main__":
    url, stream, group, name, mode, min_idle = sys.argv[1:7]
    sleep = float(sys.argv[7]) if len(sys.argv) > 7 else 3600.0
    trio.run(main, url, stream, group, name, mode, float(min_idle), sleep)
