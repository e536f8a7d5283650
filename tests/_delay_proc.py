"""A consumer process for the SIGKILL tests of ``test_delayed_retry``.

Usage: ``python tests/_delay_proc.py URL WAY NAME DELAY [KEY=VALUE ...]``

Mounts, as consumer NAME, the subscription :func:`subscription` gives for
WAY (``runtime``, ``durable``, ``claiming``: stream ``s`` group ``g``;
``reliable``: reliable list ``q``).  The handler records ``<attempt> <origin
id>`` with RPUSH on the list ``calls`` and returns ``retry_after(DELAY)`` on
the first attempt, ``ACK`` after.  Runs until it is killed.

Options (``tests/runtime/test_memory_joints.py``): ``hold=S`` the handler
sleeps S seconds after it recorded the call and records ``done <attempt>
<origin id>`` on ``calls`` before it returns; ``heartbeat=S`` and
``max_attempts=N`` are the subscription's; ``outcome=retry`` returns
``RETRY`` instead of ``retry_after(DELAY)``; ``hang_at=N`` the handler
hangs at attempt N, after it recorded the call (until the process is killed);
``stamp=1`` records, with RPUSH on the list ``stamps``, the server's clock
(``TIME``, in ms) just before the handler returns; ``min_idle=S`` is the
claiming subscription's; ``timeout=S`` bounds the scheduler's requests (the
write of a held copy's due time) to S seconds instead of 5.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from trio_redis_finalize import (
    ACK,
    RETRY,
    DelayedRetry,
    Delivery,
    Mode,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    _scheduler,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._transport import open_client

CLAIMING_MIN_IDLE = 0.5


def subscription(way: str, **options: str) -> StreamSubscription | ReliableListSubscription:
    """WAY's subscription, with the ``heartbeat``, ``max_attempts`` and ``min_idle`` of ``options``."""
    sub: StreamSubscription | ReliableListSubscription
    if way == "runtime":
        sub = StreamSubscription("s", "g", block=0.1)
    elif way == "durable":
        sub = StreamSubscription("s", "g", delayed_retry=DelayedRetry.DURABLE_ZSET, block=0.1)
    elif way == "claiming":
        sub = StreamSubscription("s", "g", mode=Mode.CLAIMING, min_idle=CLAIMING_MIN_IDLE, block=0.1)
    elif way == "reliable":
        sub = ReliableListSubscription("q", block=0.1)
    else:
        raise ValueError(f"way: unknown {way!r}")
    changes: dict[str, Any] = {}
    if "heartbeat" in options:
        changes["heartbeat"] = float(options["heartbeat"])
    if "max_attempts" in options:
        changes["max_attempts"] = int(options["max_attempts"])
    if "min_idle" in options:
        changes["min_idle"] = float(options["min_idle"])
    return dataclasses.replace(sub, **changes) if changes else sub


async def server_ms(client: Any) -> int:
    """The server's clock, in ms (``TIME``)."""
    sec, usec = await client.execute("TIME")
    return int(sec) * 1000 + int(usec) // 1000


async def main(url: str, way: str, name: str, delay: float, options: dict[str, str]) -> None:
    hold = float(options.get("hold", 0))
    later = RETRY if options.get("outcome") == "retry" else retry_after(delay)
    hang_at = int(options.get("hang_at", 0))
    stamp = options.get("stamp") == "1"
    if "timeout" in options:
        _scheduler.FINALIZE_TIMEOUT = float(options["timeout"])
    async with open_client(url) as client, open_consumer(url, name=name) as consumer:

        async def handler(d: Delivery) -> Outcome:
            await client.execute("RPUSH", "calls", f"{d.attempt} {d.origin_id}")
            if d.attempt == hang_at:
                await trio.sleep_forever()
            if hold:
                await trio.sleep(hold)
                await client.execute("RPUSH", "calls", f"done {d.attempt} {d.origin_id}")
            if stamp:
                await client.execute("RPUSH", "stamps", await server_ms(client))
            return later if d.attempt == 1 else ACK

        await consumer.mount(subscription(way, **options), handler)
        await trio.sleep_forever()


@asynccontextmanager
async def started(url: str, way: str, delay: float, **options: object) -> AsyncIterator[trio.Process]:
    """This script as consumer ``a`` (``options``: its KEY=VALUE options);
    resumed (a test may have stopped it) and killed at the end."""
    args = [f"{k}={v}" for k, v in options.items()]
    proc = await trio.lowlevel.open_process(
        [sys.executable, __file__, url, way, "a", str(delay), *args], stdout=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        with trio.fail_after(10):
            await proc.wait()


if __name__ == "__main__":
    url, way, name, delay = sys.argv[1:5]
    opts = dict(a.split("=", 1) for a in sys.argv[5:])
    trio.run(main, url, way, name, float(delay), opts)
