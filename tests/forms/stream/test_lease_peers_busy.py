"""The lease of entries in hand follows a peer that claims sooner while the
read loop waits for busy handlers, against a real server.

A (RECLAIM, ``min_idle`` 9 s, one handler, one entry per read) holds its
first entry in a slow handler; the second waits in the work queue and the
third in the read loop's hand-over, which waits for room: the read loop
makes no read and no registry probe until the handler ends.  B (``min_idle``
1.5 s) mounts while A's entries are fresh.  A's lease reads the registry
itself while the read loop's probe is overdue (``liveness.follows``), finds
B alive and renews every third of B's ``min_idle``; so B, once its warm-up
is over (``_core.stream.survey.warm_up``), takes none of A's entries, and
each handler call runs once (``DESIGN.md`` section 5: duplicates only from
faults).  Before, A never saw B while its handler ran: it renewed every 3 s,
and B's ``XAUTOCLAIM`` took the entries once idle 1.5 s: the handler ran
twice, with no fault.

Timeouts are bounds, never expectations.
"""

from __future__ import annotations

import logging

import pytest
import trio
from _procs import effects, eventually
from _stream import HeldAndQuick, warned_once_about_b
from faults.cmdproxy import LOST, CommandProxy, Fault, error, serving

from trio_redis_finalize import Mode, StreamSubscription, open_consumer
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(60)

S, G = "s", "g"
A_MIN_IDLE = 9.0
"""A's own ``min_idle``: its lease renews every 3 s until it sees B."""
B_MIN_IDLE = 1.5
"""B's: what idled 1.5 s it claims, every 0.75 s once its warm-up is over."""
HOLD = 8.0
"""Seconds after B mounted that A's handler holds the first entry: past B's
warm-up (1 + 0.05 + 3 + 0.5 s) and one of A's own lease periods after it."""


async def _owners(client: Client) -> dict[str, str]:
    rows = await client.execute("XPENDING", S, G, "-", "+", 10)
    return {r[0].decode(): r[1].decode() for r in rows}


@pytest.mark.parametrize(("b_mode", "fault"), [(Mode.RECLAIM, None), (Mode.CLAIMING, None),
                                               (Mode.RECLAIM, LOST),
                                               (Mode.CLAIMING, error("LOADING"))],
                         ids=["reclaim", "claiming", "reclaim-lost", "claiming-refused"])
async def test_a_peer_that_claims_sooner_is_followed_while_the_handlers_are_busy(
    redis_server: RedisServer, flavour: str, redis_url: str, client: Client,
    caplog: pytest.LogCaptureFixture, b_mode: Mode, fault: Fault | None,
) -> None:
    """A's three entries stay pending for A all along B's mount, warm-up and
    claims; B starts none; A handles each once after the release; A warned
    once about B, naming both settings.  With a fault, A (behind the command
    proxy) has the first registry read after B's mount answered by an error
    reply, or its reply lost (the connection cut): the lease's read of the
    registry is tried again and follows B all the same."""
    caplog.set_level(logging.INFO, logger="trio_redis_finalize")
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    ids = [(await client.execute("XADD", S, "*", "n", str(i))).decode() for i in range(3)]
    h = HeldAndQuick()
    calls, holding, release, slow, fast = h.calls, h.holding, h.release, h.held, h.quick

    with trio.fail_after(45):  # a bound
        async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy, \
                open_consumer(proxy.url if fault else redis_url, name="a") as a, \
                open_consumer(redis_url, name="b") as b:
            await a.mount(StreamSubscription(S, G, mode=Mode.RECLAIM, min_idle=A_MIN_IDLE,
                                             block=0.05, count=1), slow, concurrency=1)
            await holding.wait()
            # the third entry read: the read loop waits for the queue (holding the second)
            await eventually(lambda: _all_a(client, ids), what="A read the three entries")
            if fault is not None:  # A's next registry read: its lease's (the read loop waits)
                proxy.arm("HGETALL", fault)
            await b.mount(StreamSubscription(S, G, mode=b_mode, min_idle=B_MIN_IDLE, block=0.05),
                          fast)
            end = trio.current_time() + HOLD
            while trio.current_time() < end:
                owners = await _owners(client)
                assert owners == dict.fromkeys(ids, "a"), \
                    f"B took A's entries in hand: {owners}, {calls}"
                assert calls == [("a", ids[0])], calls
                await trio.sleep(0.05)
            assert fault is None or proxy.fired, "the fault never fired"
            release.set()
            await eventually(lambda: effects(a).get("acked") == 3, what="A acks its entries")
    assert calls == [("a", i) for i in ids], calls
    assert effects(b) == {}
    assert await client.execute("XPENDING", S, G, "-", "+", 10) == []
    warned_once_about_b(caplog.records)


async def _all_a(client: Client, ids: list[str]) -> bool:
    return await _owners(client) == dict.fromkeys(ids, "a")
