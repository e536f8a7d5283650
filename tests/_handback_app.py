"""Factories for ``trio-redis-finalize run`` in the hand-back and ``--workers``
tests (``tests/runtime/test_handback.py``, ``tests/runtime/test_workers.py``).

Usage: ``python -m trio_redis_finalize run _handback_app:stream`` (or
``:rlist``) with ``tests/`` as the current directory, and in the
environment ``TRF_T_KEY`` (the stream or queue), ``TRF_T_GROUP`` (streams;
default ``g``) and ``TRF_T_SLEEP`` (seconds each handler call sleeps,
default 1).  Default settings otherwise (heartbeat 30 s, ``count=100``).

The handler writes ``H <consumer> <id> <attempt>`` to stdout when it starts
(a list element's id: its data) and ``A <consumer> <id>`` before it returns
ACK; ``M <consumer> <pid>`` is written once mounted.  Lines are written with
``os.write``: a SIGKILL loses none that were written.
"""

from __future__ import annotations

import os

import anyio

from trio_redis_finalize import (
    ACK,
    Consumer,
    Delivery,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
)


def out(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _handler(consumer: Consumer) -> object:
    sleep = float(os.environ.get("TRF_T_SLEEP", "1"))

    async def handle(d: Delivery) -> Outcome:
        ident = d.id if d.id is not None else (d.data or b"").decode()
        out(f"H {consumer.name} {ident} {d.attempt}")
        await anyio.sleep(sleep)
        out(f"A {consumer.name} {ident}")
        return ACK

    return handle


async def stream(consumer: Consumer) -> None:
    key = os.environ["TRF_T_KEY"]
    await consumer.mount(StreamSubscription(key, os.environ.get("TRF_T_GROUP", "g")),
                         _handler(consumer))  # type: ignore[arg-type]
    out(f"M {consumer.name} {os.getpid()}")


async def rlist(consumer: Consumer) -> None:
    await consumer.mount(ReliableListSubscription(os.environ["TRF_T_KEY"]),
                         _handler(consumer))  # type: ignore[arg-type]
    out(f"M {consumer.name} {os.getpid()}")
