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
B claims what idled its own ``min_idle`` again.  A peer whose read blocks
longer than B's (3 s, idle: its probe runs after the read) sees B later:
the warm-up counts the ``block`` A registered.

Timeouts are bounds, never expectations.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

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
            await _a_keeps(client, HOLD, {gid: "ghost", eid: "a"}, calls, eid,
                           lambda: client.execute("XCLAIM", S, G, "ghost", 0, gid, "JUSTID"))
            # the warm-up is over: B claims what idled its own min_idle
            await eventually(lambda: ("b", gid) in calls, timeout=20,
                             what="B claims the entry the ghost left, once idle 1.5 s")
            release.set()
            await eventually(lambda: _settled(client), what="both entries acknowledged")
    assert calls == [("a", eid), ("b", gid)], calls
    _told_once_about_a(caplog.records, A_BOUND)


async def _idle(client: Client, eid: str) -> bool:
    idle = await _idle_ms(client, eid)
    return MOUNT_AT * 1000 <= idle < (MOUNT_AT + 0.5) * 1000


async def _settled(client: Client) -> bool:
    return not await client.execute("XPENDING", S, G, "-", "+", 10)


async def _a_keeps(client: Client, seconds: float, owners: dict[str, str],
                   calls: list[tuple[str, str | None]], eid: str,
                   each: Callable[[], Awaitable[object]] | None = None) -> None:
    """For ``seconds``: the pending entries' ``owners`` stay as they are and
    the only handler call is A's of ``eid`` (``each``: awaited first, every
    50 ms)."""
    end = trio.current_time() + seconds
    while trio.current_time() < end:
        if each is not None:
            await each()
        rows = await client.execute("XPENDING", S, G, "-", "+", 10)
        now = {r[0].decode(): r[1].decode() for r in rows}
        assert now == owners, f"B took A's entries in hand: {now}, {calls}"
        assert calls == [("a", eid)], calls
        await trio.sleep(0.05)


def _told_once_about_a(records: list[logging.LogRecord], bound: float) -> None:
    """B's one note that its claims wait for A's bound, naming A."""
    told = [r.getMessage() for r in records
            if r.levelno == logging.INFO and "this subscription claims entries idle" in
            r.getMessage()]
    assert len(told) == 1, told
    assert "consumer 'a'" in told[0] and f"min_idle={bound:g} s" in told[0], told


# -- a peer whose read ``block`` is longer than the new mount's ---------------------------

A_BLOCK = 3.0
"""A's read ``block``: its registry probe runs between two reads, so with
nothing to read it sees B up to 3 s after B registered."""
A_MIN_IDLE = 3.0
"""A's (RECLAIM, ``heartbeat`` 30 s): its lease renews every 1 s until it sees B."""
B_SHORT = 0.5
"""B's ``min_idle``: A renews every third of it (0.17 s) once it sees B."""
RENEWED = 0.1
"""B mounts once A's lease has renewed its entry at most this long ago (ms
from ``XPENDING``): the entry idles past 0.5 s, from 1.55 s on in each
second, until A's read ends and A sees B."""


async def _blocked_reads(client: Client) -> int:
    """Connections blocked in an ``XREADGROUP`` now (``CLIENT LIST``, flag ``b``)."""
    text = (await client.execute("CLIENT", "LIST")).decode()
    fields = [dict(f.split("=", 1) for f in line.split(" ") if "=" in f)
              for line in text.splitlines()]
    return sum(1 for f in fields if f.get("cmd") == "xreadgroup" and "b" in f.get("flags", ""))


async def test_the_warm_up_waits_for_a_peer_whose_read_blocks_longer(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture,
) -> None:
    """A (``block`` 3 s) holds an entry in a slow handler and its read loop
    blocks idle; B (``block`` 0.05 s, ``min_idle`` 0.5 s) registers just
    as A's read begins and just after A's lease renewed the entry.  B's
    warm-up counts A's registered ``block``: 1 + 3 + 1 + 0.5 s.  A's entries
    stay A's all along; each handler call runs once.  Before, the warm-up
    counted B's own ``block`` (1 + 0.05 + 1 + 0.5 s): it ended before A's
    read did, the entry had idled past 0.5 s since A's last renewal, and B's
    claim took it from A's running handler: the handler ran twice, with no
    fault."""
    caplog.set_level(logging.INFO, logger="trio_redis_finalize")
    h = HeldAndQuick()
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    eid = (await client.execute("XADD", S, "*", "n", "0")).decode()
    with trio.fail_after(40):  # a bound
        async with open_consumer(redis_url, name="a") as a, \
                open_consumer(redis_url, name="b") as b:
            await a.mount(StreamSubscription(S, G, mode=Mode.RECLAIM, min_idle=A_MIN_IDLE,
                                             block=A_BLOCK), h.held)
            await h.holding.wait()
            # just after a renewal of A's entry, a new entry ends A's read: A reads it (it
            # waits in the work queue, in hand) and blocks again with nothing to read
            while not 0 <= await _idle_ms(client, eid) <= RENEWED * 1000:
                await trio.sleep(0.005)
            wake = (await client.execute("XADD", S, "*", "n", "wake")).decode()
            while not await _blocked_reads(client):
                await trio.sleep(0.005)
            await b.mount(StreamSubscription(S, G, mode=Mode.CLAIMING, min_idle=B_SHORT,
                                             block=0.05), h.quick)
            # B's warm-up (1 + 3 + 1 + 0.5 s), and a second of its own claims after it
            await _a_keeps(client, 1 + A_BLOCK + A_MIN_IDLE / 3 + 0.5 + 1.0,
                           {eid: "a", wake: "a"}, h.calls, eid)
            h.release.set()
            await eventually(lambda: _settled(client), what="both entries acknowledged")
    assert h.calls == [("a", eid), ("a", wake)], h.calls
    _told_once_about_a(caplog.records, A_MIN_IDLE)
