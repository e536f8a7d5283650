"""A claiming mount's first claims do not take an entry a live peer still
holds before that peer has seen it, against a real server.

A holds an entry in a slow handler and renews its lease every third of its
own guard (9 s: every 3 s); the entry has idled past B's ``min_idle``
(1.5 s) when B mounts.  B's first claims come before A's registry probe
finds B (the case ``test_lease_peers`` does not cover: there B mounts while
the entry is still fresh).  B's claims use A's bound (9 s) as their
``min_idle`` for a warm-up after B registered (``_core.stream.survey.warm_up``),
long enough for A to see B and renew every third of B's ``min_idle``; so
the handler runs once (``DESIGN.md`` section 5: duplicates only from
faults).  Before, B's first ``XAUTOCLAIM`` took the entry from A's running
handler and the handler ran twice, with no fault.  Once the warm-up is over,
B claims what idled its own ``min_idle`` again.

Timeouts are bounds, never expectations.
"""

from __future__ import annotations

import logging

import pytest
import trio
from _procs import eventually
from _stream import HeldAndQuick

from trio_redis_finalize import Mode, StreamSubscription, open_consumer
from trio_redis_finalize._transport import Client

pytestmark = pytest.mark.timeout(60)

S, G = "s", "g"
A_BOUND = 9.0
"""A's ``min_idle`` (RECLAIM, CLAIMING) or ``heartbeat`` (PLAIN): its lease
renews every 3 s until it sees B."""
B_MIN_IDLE = 1.5
"""B's: what idled 1.5 s it claims, every 0.75 s."""
MOUNT_AT = 1.9
"""B mounts once A's entry has idled this long (ms read from ``XPENDING``):
past B's ``min_idle``, about a second before A's next renewal."""
HOLD = 5.5
"""Seconds after B mounted that A's handler holds the entry: past B's warm-up
(1 + 0.05 + 3 + 0.5 s) and several of B's claims."""


async def _idle_ms(client: Client, eid: str) -> int:
    rows = await client.execute("XPENDING", S, G, "-", "+", 10)
    return next((int(r[2]) for r in rows if r[0].decode() == eid), -1)


@pytest.mark.parametrize(("a_mode", "b_mode"), [(Mode.RECLAIM, Mode.CLAIMING),
                                                (Mode.CLAIMING, Mode.RECLAIM),
                                                (Mode.PLAIN, Mode.RECLAIM)],
                         ids=["reclaim-then-claiming", "claiming-then-reclaim",
                              "plain-then-reclaim"])
async def test_a_new_peer_does_not_take_an_entry_in_hand_idle_past_its_min_idle(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture, a_mode: Mode, b_mode: Mode,
) -> None:
    """A's entry is held 5 s past B's mount, pending for A all along, B never
    starts it, A's handler runs once; B told once that its claims wait for
    A's bound, naming A.  After the warm-up, an entry a consumer without a
    heartbeat left pending (its idle time kept at 0 until then) is claimed
    by B once idle B's own ``min_idle`` (A claims it only after 9 s, or
    never in PLAIN)."""
    caplog.set_level(logging.INFO, logger="trio_redis_finalize")
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    # an entry a consumer without a heartbeat left pending, kept fresh until B's warm-up is over
    gid = (await client.execute("XADD", S, "*", "n", "ghost")).decode()
    await client.execute("XREADGROUP", "GROUP", G, "ghost", "COUNT", 1, "STREAMS", S, ">")
    eid = (await client.execute("XADD", S, "*", "n", "0")).decode()
    h = HeldAndQuick()
    calls, holding, release, slow, fast = h.calls, h.holding, h.release, h.held, h.quick

    a_sub = (StreamSubscription(S, G, mode=a_mode, heartbeat=A_BOUND, block=0.05)
             if a_mode is Mode.PLAIN else
             StreamSubscription(S, G, mode=a_mode, min_idle=A_BOUND, block=0.05))
    with trio.fail_after(45):  # a bound
        async with open_consumer(redis_url, name="a") as a, \
                open_consumer(redis_url, name="b") as b:
            await a.mount(a_sub, slow)
            await holding.wait()
            await eventually(lambda: _idle(client, eid), timeout=20,
                             what=f"A's entry idle {MOUNT_AT} s")
            await b.mount(StreamSubscription(S, G, mode=b_mode, min_idle=B_MIN_IDLE, block=0.05),
                          fast)
            end = trio.current_time() + HOLD
            while trio.current_time() < end:
                await client.execute("XCLAIM", S, G, "ghost", 0, gid, "JUSTID")  # idle 0
                rows = await client.execute("XPENDING", S, G, "-", "+", 10)
                owners = {r[0].decode(): r[1].decode() for r in rows}
                assert owners == {gid: "ghost", eid: "a"}, \
                    f"B took A's entry in hand: {owners}, {calls}"
                assert calls == [("a", eid)], calls
                await trio.sleep(0.05)
            # the warm-up is over: B claims what idled its own min_idle
            await eventually(lambda: ("b", gid) in calls, timeout=20,
                             what="B claims the entry the ghost left, once idle 1.5 s")
            release.set()
            await eventually(lambda: _settled(client), what="both entries acknowledged")
    assert calls == [("a", eid), ("b", gid)], calls
    told = [r.getMessage() for r in caplog.records
            if r.levelno == logging.INFO and "this subscription claims entries idle" in
            r.getMessage()]
    assert len(told) == 1, told
    assert "consumer 'a'" in told[0] and "min_idle=9 s" in told[0], told


async def _idle(client: Client, eid: str) -> bool:
    idle = await _idle_ms(client, eid)
    return MOUNT_AT * 1000 <= idle < (MOUNT_AT + 0.5) * 1000


async def _settled(client: Client) -> bool:
    return not await client.execute("XPENDING", S, G, "-", "+", 10)
