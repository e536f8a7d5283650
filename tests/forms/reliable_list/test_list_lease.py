"""A reliable-list consumer starts nothing once its heartbeat may have lapsed.

The last heartbeat that went through, sent at ``t``, keeps the consumer's
key until ``t + heartbeat`` at least; past that a live consumer's reaper may
have moved its processing list back onto the queue and be handling those
elements.  The heartbeat task drops what no handler started when it finds
the beat late (``reader._stalled``), but only at its next look: while its
renewal hangs on a silent link, or when a handler task runs before it after
the event loop was blocked, a handler task could take a delivery from the
work queue and start it, and the element ran twice (a silent link below;
the stall after SIGSTOP in ``test_list_joint_faults``).  The handler tasks keep
to the lease themselves (``_hand_over.Lease``): past it they start nothing
and drop it all.  And the lease moves on with the next heartbeat that goes
through: a lost or silent beat does not stop the consumer for good.

Against a real server, faults through the command proxy; timeouts are bounds.
"""

from __future__ import annotations

import logging

import pytest
import trio
from _procs import eventually
from _rlist import Q, done_counts, lrange, proc, stats, sub, text
from faults.cmdproxy import BLACKHOLE, LOST, CommandProxy, serving

from trio_redis_finalize import ACK, Delivery, Outcome, open_consumer
from trio_redis_finalize._core._identity import RENEW
from trio_redis_finalize._forms.reliable_list import liveness as _liveness
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(90)

NAMES = [f"e{i}" for i in range(6)]
RENEW_KIND = f"EVALSHA:{RENEW.name}"


async def test_a_consumer_whose_beat_hangs_past_its_heartbeat_starts_nothing_moved_back(
    redis_server: RedisServer, flavour: str, client: Client, caplog: pytest.LogCaptureFixture,
) -> None:
    """Consumer A (through the proxy; concurrency 2, heartbeat 1 s) reads all
    six elements and starts two, which wait for ``release``; the other four
    wait unstarted in its work queue.  A's next heartbeat renewal meets a
    silent link (it hangs until its own deadline, 5 s): A's key lapses, and
    consumer B's reaper moves A's processing list back onto the queue; B
    starts all six.  Then A's two handlers return: A starts none of the four
    (before: its handler tasks took them at once, each ran twice), and each
    element's write is committed once."""
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    release = trio.Event()
    a_started: list[str] = []
    b_started: list[tuple[str, int]] = []

    async def held(d: Delivery) -> Outcome:
        a_started.append(text(d))
        await release.wait()
        return ACK.with_writes(("HINCRBY", "done", text(d), 1))

    async def record(d: Delivery) -> Outcome:
        b_started.append((text(d), d.attempt))
        return ACK.with_writes(("HINCRBY", "done", text(d), 1))

    with trio.fail_after(60):  # a bound
        async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy, \
                open_consumer(proxy.url, name="a", shutdown_grace=0.5) as a:
            await a.mount(sub(heartbeat=1.0), held, concurrency=2)
            await client.execute("LPUSH", Q, *NAMES)
            await eventually(lambda: len(a_started) == 2, 10, "A started two")
            await eventually(lambda: stats(a)["received"] == len(NAMES), 10, "A read all six")
            proxy.arm(RENEW_KIND, BLACKHOLE)  # A's next beat: a silent link
            async with open_consumer(redis_server.url, name="b") as b:
                await b.mount(sub(heartbeat=1.0), record, concurrency=10)
                await eventually(lambda: proxy.fired, 10, "A's beat met the silent link")
                await eventually(lambda: len(b_started) == len(NAMES), 15,
                                 "B's reaper moved A's list back, B started all six")
                release.set()  # A's handlers return; A's beat still hangs
                await eventually(lambda: len(a_started) > 2
                                 or "no heartbeat went through" in caplog.text, 10,
                                 "A started more, or dropped what it had not started")
                await trio.sleep(0.3)  # a window: one started now would show
                await eventually(lambda: _done(client), 10, "every write committed")
    assert sorted(a_started) == ["e0", "e1"], a_started
    assert sorted(b_started) == [(n, 2) for n in NAMES], b_started  # reaped: attempt 2
    assert sorted(await done_counts(client)) == NAMES  # each write once
    assert await lrange(client, Q) == [] and await lrange(client, proc("a")) == []


@pytest.mark.parametrize("fault", ["lost", "blackhole"])
async def test_a_lost_or_silent_beat_does_not_stop_the_consumer_for_good(
    redis_server: RedisServer, flavour: str, client: Client, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, fault: str,
) -> None:
    """Consumer A alone (through the proxy; concurrency 2, heartbeat 1 s, 0.1 s
    per element) handles 60 elements; one heartbeat renewal loses its reply
    (the key renewed, A does not know it) or hangs on a silent link until
    its deadline (2 s: the key lapses).  A starts nothing past the last beat
    it knows of plus the heartbeat, and once a beat goes through again it
    starts again: each element handled once, as attempt 1 (nobody moved
    any), each write committed once, nothing left."""
    monkeypatch.setattr(_liveness, "FINALIZE_TIMEOUT", 2.0)  # the silent beat's own deadline
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    names = [f"n{i:02}" for i in range(60)]
    seen: list[tuple[str, int]] = []

    async def slow(d: Delivery) -> Outcome:
        seen.append((text(d), d.attempt))
        await trio.sleep(0.1)
        return ACK.with_writes(("HINCRBY", "done", text(d), 1))

    with trio.fail_after(60):  # a bound
        async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy, \
                open_consumer(proxy.url, name="a", shutdown_grace=0.5) as a:
            await a.mount(sub(heartbeat=1.0), slow, concurrency=2)
            proxy.arm(RENEW_KIND, LOST if fault == "lost" else BLACKHOLE)
            await client.execute("LPUSH", Q, *names)
            await eventually(lambda: proxy.fired, 10, "the beat met the fault")
            await eventually(lambda: len({n for n, _ in seen}) == len(names), 30,
                             lambda: f"every element handled ({len(seen)})")
            await eventually(lambda: _done(client, names), 10, "every write committed")
            await trio.sleep(0.3)  # a window: one handled again now would show
    assert sorted(seen) == [(n, 1) for n in names], seen
    if fault == "blackhole":  # the beat hung past the heartbeat: A dropped, then read again
        assert "no heartbeat went through" in caplog.text
    assert await lrange(client, Q) == [] and await lrange(client, proc("a")) == []


async def _done(client: Client, names: list[str] = NAMES) -> bool:
    return sorted(await done_counts(client)) == names
