"""A reliable list's ``received`` counts each delivery read once, across a late heartbeat.

``received`` is "deliveries read, before any handler call" (``Consumer.stats``).
When no heartbeat of a reliable-list consumer went through for ``heartbeat``
seconds (the process stalled, or Redis refused or did not answer the beats),
the reader drops every delivery no handler started (``reader._stalled``: a
live consumer may have moved them back onto the queue meanwhile) and, once
the beat is renewed, its rescan delivers again what the processing list still
holds.  Such a delivery is read again, not a new one: it counts once (before,
it was counted at its first read and again at the rescan's, so ``received``
ran ahead of what the handlers were given and of the summary's "handed back").
Against a real server, the beats refused through the command proxy; timeouts
are bounds.
"""

from __future__ import annotations

import logging

import pytest
import trio
from _procs import HoldFirst, eventually
from _rlist import Q, effects, stats, sub, text
from faults.cmdproxy import CommandProxy, error, serving

from trio_redis_finalize import open_consumer
from trio_redis_finalize._core._identity import RENEW
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(90)

NAMES = [f"e{i}" for i in range(6)]
REFUSED = 8
"""Heartbeats refused in a row: at one every ``heartbeat / 3``, past ``heartbeat``."""


async def test_deliveries_dropped_at_a_late_beat_and_read_again_count_once(
    redis_server: RedisServer, flavour: str, client: Client, caplog: pytest.LogCaptureFixture,
) -> None:
    """Consumer ``c`` (through the proxy, concurrency 1, heartbeat 1 s) starts
    the first element and holds it; the others it read wait unstarted.  Its
    heartbeats are refused (OOM) past the heartbeat: it drops what it read and
    did not start, renews the beat and reads its processing list again.  Each
    element is then handled once and ``received`` is the number of elements."""
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    slow = HoldFirst()
    with trio.fail_after(60):  # a bound
        async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy, \
                open_consumer(proxy.url, name="c", shutdown_grace=1.0) as c:
            await c.mount(sub(heartbeat=1.0), slow, concurrency=1)
            await client.execute("LPUSH", Q, *NAMES)
            await eventually(lambda: slow.seen, 10, "the first element started")
            await eventually(lambda: stats(c)["received"] >= 2, 10,
                             "an element read beside the one started")
            read = stats(c)["received"]
            for k in range(REFUSED):
                proxy.arm(f"EVALSHA:{RENEW.name}", error("OOM"), at=k)
            await eventually(lambda: "no heartbeat went through" in caplog.text, 20,
                             "the late beat dropping what was not started")
            await eventually(lambda: len(proxy.fired) == REFUSED and proxy.seen[
                f"EVALSHA:{RENEW.name}"] > REFUSED, 20, "a beat through again")
            slow.release.set()
            await eventually(lambda: effects(c).get("acked", 0) == len(NAMES), 20,
                             lambda: f"every element acknowledged ({effects(c)})")
            got = stats(c)
    assert sorted(text(d) for d in slow.seen) == NAMES, [text(d) for d in slow.seen]
    assert read >= 2
    assert got["received"] == len(NAMES), got
