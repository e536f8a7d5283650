"""A consumer process whose handler always raises, for the SIGKILL tests of
``on_error=Backoff()`` (``tests/runtime/test_backoff.py``).

Usage::

    python tests/_backoff_proc.py URL FORM KEY NAME [BASE CAP]

``FORM`` is ``stream`` (``StreamSubscription(KEY, "workers")``) or ``list``
(``ReliableListSubscription(KEY)``).  ``BASE``/``CAP``: the mount's
``Backoff``; without them the mount's own default (no ``on_error=``).  The
handler writes ``H <id or origin> <attempt> <monotonic time>`` to stdout
with one unbuffered ``os.write`` (a SIGKILL loses no line already written)
and raises.  ``R`` is written once the subscription is mounted.
"""

from __future__ import annotations

import os
import sys
import time

import trio

from trio_redis_finalize import (
    Backoff,
    Delivery,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
)

GROUP = "workers"


def out(line: str) -> None:
    os.write(1, (line + "\n").encode())


async def main(url: str, form: str, key: str, name: str, backoff: Backoff | None) -> None:
    async def handler(d: Delivery) -> Outcome:
        out(f"H {d.id or d.origin_id} {d.attempt} {time.monotonic():.6f}")
        raise RuntimeError("always fails")

    sub: StreamSubscription | ReliableListSubscription
    if form == "stream":
        sub = StreamSubscription(key, GROUP, block=0.1)
    else:
        sub = ReliableListSubscription(key, block=0.1, heartbeat=30.0)
    async with open_consumer(url, name=name, shutdown_grace=0.0) as consumer:
        if backoff is None:
            await consumer.mount(sub, handler)  # the default on_error
        else:
            await consumer.mount(sub, handler, on_error=backoff)
        out("R")
        await trio.sleep_forever()


if __name__ == "__main__":
    url, form, key, name = sys.argv[1:5]
    backoff = Backoff(float(sys.argv[5]), float(sys.argv[6])) if len(sys.argv) > 6 else None
    trio.run(main, url, form, key, name, backoff)
