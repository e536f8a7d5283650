"""A reliable-list consumer in its own process, for tests that stop it (SIGSTOP) mid-handler.

Usage::

    python tests/_list_proc.py URL QUEUE CONSUMER HEARTBEAT SLEEP

The handler writes ``H <data> <attempt>`` to stdout, sleeps ``SLEEP``
seconds, writes ``A <data>`` and returns ``ACK`` carrying ``HINCRBY done
<data> 1`` (each finalization's effect, committed once).  ``R`` is written
once the subscription is mounted.  Lines are written with ``os.write``
(unbuffered): a SIGKILL loses none that were written.
"""

from __future__ import annotations

import os
import sys

import trio

from trio_redis_finalize import ACK, Delivery, Outcome, ReliableListSubscription, open_consumer


def out(line: str) -> None:
    os.write(1, (line + "\n").encode())


async def main(url: str, queue: str, name: str, heartbeat: float, sleep: float) -> None:
    async def handler(d: Delivery) -> Outcome:
        data = (d.data or b"").decode()
        out(f"H {data} {d.attempt}")
        await trio.sleep(sleep)
        out(f"A {data}")
        return ACK.with_writes(("HINCRBY", "done", data, 1))

    sub = ReliableListSubscription(queue, heartbeat=heartbeat, block=0.1)
    async with open_consumer(url, name=name, shutdown_grace=0.0) as consumer:
        await consumer.mount(sub, handler)
        out("R")
        await trio.sleep_forever()


if __name__ == "__main__":
    url, queue, name, heartbeat, sleep = sys.argv[1:6]
    trio.run(main, url, queue, name, float(heartbeat), float(sleep))
