"""The lease of entries in hand follows a peer that claims sooner, against a
real server.

Two consumers of one group with different ``min_idle`` (a rolling deploy
that changes the setting, two services with different configurations): A
holds an entry in a slow handler, B claims what is idle past its own,
shorter, ``min_idle``.  A's lease renews every third of the shortest
``min_idle`` among itself and the live peers registered as claiming (as
its last look at the group found them; a registry probe between two reads
makes the look as soon as B registers), so B never takes the entry and the
handler runs once (``DESIGN.md`` section 5: duplicates only from faults).
Before, A renewed every third of its own ``min_idle`` only and B took the
entry as soon as it had idled B's: the handler ran twice, with no fault.

Timeouts are bounds, never expectations.
"""

from __future__ import annotations

import logging
import time

import pytest
import trio
from _procs import effects, eventually
from _stream import HeldAndQuick, warned_once_about_b

from trio_redis_finalize import ACK, Delivery, Mode, Outcome, StreamSubscription, open_consumer
from trio_redis_finalize._core.stream.liveness import registration_value, registry_key
from trio_redis_finalize._transport import Client

pytestmark = pytest.mark.timeout(60)

S, G = "s", "g"
A_MIN_IDLE = 9.0
"""A's own ``min_idle``: its lease renewed every third of it (3 s) alone."""
B_MIN_IDLE = 1.5
"""B's: it claims what idled 1.5 s, every 0.75 s -- well inside A's own
period, so B takes the entry at once on the code before; A's lease, once it
follows B, renews every 0.5 s, a margin of 1 s each time on a busy machine."""
HOLD = 5.0
"""How long A's handler holds the entry: past A's own period and two of B's claims."""


@pytest.mark.parametrize(("a_mode", "b_mode"), [(Mode.RECLAIM, Mode.CLAIMING),
                                                (Mode.CLAIMING, Mode.RECLAIM)],
                         ids=["reclaim-beside-claiming", "claiming-beside-reclaim"])
async def test_a_peer_with_a_shorter_min_idle_does_not_take_an_entry_in_hand(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture, a_mode: Mode, b_mode: Mode,
) -> None:
    """A (``min_idle`` 9 s) reads the one entry and its handler holds it for
    5 s; B (``min_idle`` 1.5 s) mounts as soon as A's handler began.  The
    entry stays pending for A all along, B never starts it, A's handler runs
    once and ACKs; A warned once about B, naming both settings."""
    caplog.set_level(logging.INFO, logger="trio_redis_finalize")
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    eid = (await client.execute("XADD", S, "*", "n", "0")).decode()
    h = HeldAndQuick()
    calls, holding, release, slow, fast = h.calls, h.holding, h.release, h.held, h.quick

    with trio.fail_after(40):  # a bound
        async with open_consumer(redis_url, name="a") as a, \
                open_consumer(redis_url, name="b") as b:
            await a.mount(StreamSubscription(S, G, mode=a_mode, min_idle=A_MIN_IDLE, block=0.05),
                          slow)
            await holding.wait()
            await b.mount(StreamSubscription(S, G, mode=b_mode, min_idle=B_MIN_IDLE, block=0.05),
                          fast)
            end = trio.current_time() + HOLD
            while trio.current_time() < end:
                rows = await client.execute("XPENDING", S, G, "-", "+", 10)
                owners = {r[0].decode(): r[1].decode() for r in rows}
                assert owners == {eid: "a"}, f"B took A's entry in hand: {owners}, {calls}"
                assert calls == [("a", eid)], calls
                await trio.sleep(0.05)
            release.set()
            await eventually(lambda: effects(a).get("acked") == 1, what="A acks its entry")
    assert calls == [("a", eid)]
    assert effects(b) == {}
    assert await client.execute("XPENDING", S, G, "-", "+", 10) == []
    warned_once_about_b(caplog.records)


def _told(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


async def test_the_lease_follows_peers_that_come_stop_and_come_back_with_another_min_idle(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture,
) -> None:
    """A (CLAIMING, ``min_idle`` 9 s, a short heartbeat: it looks at the group
    often, its own lease period is a third of ``min_idle`` alone) beside:
    a registration of a consumer whose heartbeat lapsed (``min_idle``
    0.1 s: not followed, nothing told); B (RECLAIM, ``min_idle`` 1.5 s):
    told once, the lease follows it; B stopped: the lease is A's own again;
    B back under its name with ``min_idle`` 1.2 s: told again, with the new
    value."""
    caplog.set_level(logging.INFO, logger="trio_redis_finalize")
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    await client.execute("HSET", registry_key(S, G), "ghost",
                         registration_value(30.0, Mode.RECLAIM, time.time() - 60, min_idle=0.1))

    async def ack(d: Delivery) -> Outcome:
        return ACK

    def b_sub(min_idle: float) -> StreamSubscription:
        return StreamSubscription(S, G, mode=Mode.RECLAIM, min_idle=min_idle, block=0.05)

    with trio.fail_after(40):  # a bound
        async with open_consumer(redis_url, name="a") as a:
            await a.mount(StreamSubscription(S, G, mode=Mode.CLAIMING, min_idle=A_MIN_IDLE,
                                             heartbeat=0.5, block=0.05), ack)
            async with open_consumer(redis_url, name="b") as b:
                await b.mount(b_sub(B_MIN_IDLE), ack)
                await eventually(lambda: _told(caplog, "consumer 'b' of the group claims"),
                                 what="A told about B")
            await eventually(lambda: _told(caplog, "leased every 3 s now (this subscription's"),
                             what="A's own period again once B stopped")
            async with open_consumer(redis_url, name="b") as b:
                await b.mount(b_sub(1.2), ack)
                await eventually(
                    lambda: len(_told(caplog, "consumer 'b' of the group claims")) == 2,
                    what="A told about B's new min_idle")
    first, again = _told(caplog, "consumer 'b' of the group claims")
    assert "min_idle=1.5 s" in first and "leased every 0.5 s" in first, first
    assert "min_idle=1.2 s" in again and "leased every 0.4 s" in again, again
    assert not _told(caplog, "consumer 'ghost' of the group claims")  # lapsed: not followed
