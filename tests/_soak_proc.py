"""The consumer process of the soak tests (``tests/faults/test_soak.py``), killed at will.

    python tests/_soak_proc.py URL FORM NAME LOG [CONCURRENCY]

FORM is ``stream`` or ``list``.  Messages say what their handler does: a
stream entry's ``kind`` field, a list element's ``<kind>:<n>`` bytes:

* ``ack``: ACK;
* ``retry``: RETRY the original, ACK its copy;
* ``later``: ``retry_after(0.05)`` (durable delay set) on the original, ACK
  its copy;
* ``poison``: RETRY every time: dead-lettered at ``max_attempts=3``.

Before every handler call the process appends ``H <token> <origin> <attempt>
<kind>`` to LOG with one unbuffered ``os.write`` (a SIGKILL cannot lose a line
already written, nor leave half of one); ``READY`` once the subscription is
reading.  SIGTERM is a graceful shutdown.
"""

from __future__ import annotations

import os
import signal
import sys

import trio

from trio_redis_finalize import (
    ACK,
    RETRY,
    DelayedRetry,
    Delivery,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
    retry_after,
)

MAX_ATTEMPTS = 3
S, G, S_DEAD = "soak", "soakers", "soak-dead"
Q, Q_DEAD = "soakq", "soakq-dead"


def subscription(form: str) -> StreamSubscription | ReliableListSubscription:
    if form == "stream":
        return StreamSubscription(S, G, delayed_retry=DelayedRetry.DURABLE_ZSET, max_attempts=MAX_ATTEMPTS,
                                  dead_letter=S_DEAD, block=0.1, count=20)
    return ReliableListSubscription(Q, delayed_retry=DelayedRetry.DURABLE_ZSET, max_attempts=MAX_ATTEMPTS,
                                    dead_letter=Q_DEAD, block=0.1, heartbeat=2.0)


def kind_of(d: Delivery) -> str:
    if d.data is not None:
        return d.data.split(b":", 1)[0].decode()
    return d.fields[b"kind"].decode()


def token_of(d: Delivery) -> str:
    """One delivery of one message: the stream entry; for a list the origin
    and its retry counter (a crash re-delivery is bumped: a new attempt)."""
    return d.id if d.id is not None else f"{d.origin_id}/{d.retries}"


async def main(url: str, form: str, name: str, log_path: str, concurrency: int) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, b"START\n")  # a life begins (its handlers may run before READY)

    async def handle(d: Delivery) -> Outcome:
        kind = kind_of(d)
        os.write(fd, f"H {token_of(d)} {d.origin_id} {d.attempt} {kind}\n".encode())
        await trio.sleep(0.002)
        if kind == "poison":
            return RETRY
        if kind in ("retry", "later") and d.retries == 0:
            return RETRY if kind == "retry" else retry_after(0.05)
        return ACK

    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with open_consumer(url, name=name, shutdown_grace=2.0) as consumer:
            await consumer.mount(subscription(form), handle, concurrency=concurrency)
            os.write(fd, b"READY\n")
            async for _ in signals:
                break
    os.write(fd, b"STOPPED\n")


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4],
             int(sys.argv[5]) if len(sys.argv) > 5 else 4)
