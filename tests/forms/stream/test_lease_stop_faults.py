"""The stream lease through a stop's grace, its renewals meeting faults.

A stream consumer's lease (``Reader.holding``: ``LEASE`` of ``Context.leased``
every ``lease_every``) runs past its reader, until its finalizer ends: a
handler still running at the stop keeps its entry from a claiming peer.
Here a renewal during the stop's grace meets a fault (the command proxy): its
reply lost (it ran), an error reply instead of running (READONLY, OOM), or a
silent link (no reply ever).  The lease goes on at its next turn: the entry
never idles ``min_idle``, the peer never starts it, the handler's ACK is
committed once and the stop ends.  A silent renewal waits at most a lease
period (``lease_timeout``) and the next one goes out at once; before, it
waited ``FINALIZE_TIMEOUT`` (5 s) and slept a period more: with ``min_idle``
6 s the entry idled 9 s, the peer claimed it and ran its handler a second
time beside the first.  Timeouts are bounds, never expectations.
"""

from __future__ import annotations

import pytest
import trio
from _paths import TESTS
from _procs import HoldFirst, child_lines, eventually
from faults.cmdproxy import BLACKHOLE, LOST, CommandProxy, Fault, error, serving

from trio_redis_finalize import Mode, StreamSubscription, open_consumer
from trio_redis_finalize._core._recovery import LEASE
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(90)

S, G = "s", "g"
PROC = str(TESTS / "_stream_proc.py")
LEASE_KIND = f"EVALSHA:{LEASE.name}"
CASES: dict[str, tuple[float, list[tuple[int, Fault]]]] = {
    # min_idle (A's and B's: A renews every third of it), the renewals after the
    # stop began that meet a fault: the first and the third (one through between)
    "lost": (3.0, [(0, LOST), (2, LOST)]),
    "READONLY": (3.0, [(0, error("READONLY")), (2, error("READONLY"))]),
    "OOM": (3.0, [(0, error("OOM")), (2, error("OOM"))]),
    # a silent link: its wait bounded by the period (2 s), not FINALIZE_TIMEOUT
    "blackhole": (6.0, [(0, BLACKHOLE)]),
}


async def _pending(client: Client) -> dict[str, str]:
    """Entry id -> the consumer it is pending for."""
    rows = await client.execute("XPENDING", S, G, "-", "+", 100)
    return {r[0].decode(): r[1].decode() for r in rows}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_failed_lease_renewal_during_the_stop_keeps_the_running_handlers_entry(
    redis_server: RedisServer, flavour: str, redis_url: str, client: Client, case: str,
) -> None:
    """A (through the proxy; RECLAIM) reads one entry; its handler runs on
    through A's stop (grace 60 s).  Once the stop began, A's lease renewals
    meet the case's faults.  Peer B (a process, RECLAIM, the same
    ``min_idle``) looks for idle entries meanwhile, two ``min_idle`` long: it
    never starts A's.  Released, A's handler ACKs: nothing pending, the stop
    ends."""
    min_idle, faults = CASES[case]
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    eid = (await client.execute("XADD", S, "*", "n", "0")).decode()
    handler, stop, a_done = HoldFirst(), trio.Event(), trio.Event()

    async def consumer_a(url: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                         ) -> None:
        async with open_consumer(url, name="a", shutdown_grace=60.0) as a:
            await a.mount(StreamSubscription(S, G, mode=Mode.RECLAIM, min_idle=min_idle,
                                             block=0.05), handler)
            task_status.started()
            await stop.wait()
        a_done.set()

    with trio.fail_after(80):  # a bound
        async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy, \
                trio.open_nursery() as nursery:
            await nursery.start(consumer_a, proxy.url)
            await eventually(lambda: handler.seen, 10, "A's handler started")
            stop.set()  # A's stop begins: its reader ends, its handler and lease run on
            for at, fault in faults:
                proxy.arm(LEASE_KIND, fault, at=at)
            async with child_lines(PROC, redis_url, S, G, "b", "reclaim", str(min_idle), "1.0") as b:
                assert await b.read(lambda w: w == ["R"], 20), b.lines
                await eventually(lambda: len(proxy.fired) == len(faults), 20,
                                 lambda: f"the renewals met the faults ({proxy.fired})")
                end = trio.current_time() + 2 * min_idle  # B's claims look on
                while trio.current_time() < end:
                    await b.read(lambda w: w[:1] == ["H"], 0.2)
                    assert not b.words("H"), f"B started A's entry, its handler still running: {b.lines}"
                    assert (await _pending(client)).get(eid) == "a"
                handler.release.set()
                with trio.fail_after(20):  # a bound
                    await a_done.wait()
                assert await _pending(client) == {}  # A's ACK
                await b.read(None, 0.5)
                assert not b.words("H"), b.lines
