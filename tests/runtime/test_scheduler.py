"""The runtime delay scheduler (``retry_after`` copies held in memory).

Ordering, counting and overflow run under trio's
``MockClock(autojump_threshold=0)`` (pytest-trio's ``autojump_clock``) with a
client object that records its ``pipeline`` calls and when they came: no
Redis semantics are imitated, the stub only answers "OK" (or raises a
connection error once).  Sending to Redis is checked against a real server
with the normal clock: under the autojump clock a wait for a socket counts as
blocked, so the clock could jump to a command's timeout mid-round-trip.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from redis import exceptions as rexc

from trio_redis_finalize._deadlines import FINALIZE_TIMEOUT
from trio_redis_finalize._scheduler import Scheduler
from trio_redis_finalize._stats import MountStats
from trio_redis_finalize._transport import Client, open_client

TIMEOUT = 1_000.0  # mock seconds (the clock jumps: a hang fails at once)
REAL_TIMEOUT = 10.0  # seconds, for the tests on a real server


class FakeMount:
    """What the scheduler needs of a mount: a name and its stats."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats = MountStats(subscription=name)
        self.later_gates = None

    def __repr__(self) -> str:
        return f"FakeMount({self.name!r})"


class RecordingClient:
    """A client object whose ``pipeline`` records (mock time, commands).

    ``fail``: how many calls raise ``ConnectionError`` first (nothing sent).
    ``hang``: how many calls (after those) never return, whatever their
    ``timeout`` (a round trip stuck past every deadline of its own).
    ``rtt``: mock seconds each call takes (default: none, one checkpoint).
    """

    def __init__(self, fail: int = 0, hang: int = 0, rtt: float = 0.0) -> None:
        self.calls: list[tuple[float, list[tuple[Any, ...]]]] = []
        self.failed: list[float] = []
        self.hung: list[float] = []
        self.fail = fail
        self.hang = hang
        self.sent = trio.Event()
        self.rtt = rtt
        self.t0 = 0.0
        """When its scheduler's run task started (set by :func:`scheduled`)."""

    async def pipeline(
        self, commands: Sequence[Any], *, raise_on_error: bool = True, timeout: float | None = None
    ) -> list[Any]:
        await trio.sleep(self.rtt)
        if self.fail:
            self.fail -= 1
            self.failed.append(trio.current_time())
            raise rexc.ConnectionError("connection lost (test)")
        if self.hang:
            self.hang -= 1
            self.hung.append(trio.current_time())
            await trio.sleep_forever()
        self.calls.append((trio.current_time(), [tuple(c) for c in commands]))
        self.sent.set()
        return [b"OK"] * len(commands)

    def sends(self, since: float | None = None) -> list[tuple[float, list[bytes]]]:
        """(seconds after ``since``, by default ``t0``, the values sent) of each call."""
        t0 = self.t0 if since is None else since
        return [(round(t - t0, 6), [c[2] for c in cmds]) for t, cmds in self.calls]

    def sent_commands(self) -> list[tuple[Any, ...]]:
        return [c for _, cmds in self.calls for c in cmds]


@asynccontextmanager
async def scheduled(
    client: Any = None, timeout: float = TIMEOUT, **kw: Any
) -> AsyncIterator[tuple[Any, Any]]:
    """A scheduler (``kw``: its settings) with its ``run`` task, over ``client``
    (a recording client by default), all within ``timeout`` (a bound); the task
    is cancelled on leaving."""
    client = client or RecordingClient()
    scheduler = Scheduler(client, **kw)
    with trio.fail_after(timeout):
        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            if isinstance(client, RecordingClient):
                client.t0 = trio.current_time()
            yield scheduler, client
            nursery.cancel_scope.cancel()


def cmd(n: int | str) -> tuple[tuple[bytes, ...]]:
    return ((b"LPUSH", b"copies", str(n).encode()),)


async def test_copies_go_out_at_their_due_times_in_due_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    m = FakeMount("orders")
    async with scheduled() as (scheduler, client):
        for delay in (5, 1, 3, 8):
            scheduler.hold(m, delay, cmd(delay))
        assert len(scheduler) == 4
        await trio.sleep(20)
    sends = client.sends()
    assert sends == [(1, [b"1"]), (3, [b"3"]), (5, [b"5"]), (8, [b"8"])]
    assert len(scheduler) == 0
    assert m.stats.effects["released"] == 4


async def test_copies_due_together_go_out_in_one_batch_in_hold_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    m = FakeMount("orders")
    async with scheduled() as (scheduler, client):
        for n in ("a", "b", "c"):
            scheduler.hold(m, 2.0, cmd(n))
        await trio.sleep(3)
    assert len(client.calls) == 1
    assert [c[2] for c in client.sent_commands()] == [b"a", b"b", b"c"]


async def test_a_copy_due_sooner_wakes_the_scheduler_early(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Held while the task sleeps towards a later due time: it goes out at its own."""
    m = FakeMount("orders")
    async with scheduled() as (scheduler, client):
        scheduler.hold(m, 100, cmd("late"))
        await trio.sleep(1)
        scheduler.hold(m, 2, cmd("soon"))
        await trio.sleep(200)
    sends = client.sends()
    assert sends == [(3, [b"soon"]), (100, [b"late"])]


async def test_held_by_counts_each_mounts_waiting_copies(autojump_clock: trio.abc.Clock) -> None:
    a, b, other = FakeMount("a"), FakeMount("b"), FakeMount("other")
    async with scheduled() as (scheduler, _):
        scheduler.hold(a, 1, cmd(1))
        scheduler.hold(a, 10, cmd(2))
        scheduler.hold(b, 5, cmd(3))
        assert (scheduler.held_by(a), scheduler.held_by(b), scheduler.held_by(other)) == (2, 1, 0)
        await trio.sleep(2)
        assert (scheduler.held_by(a), scheduler.held_by(b)) == (1, 1)
        await trio.sleep(5)
        assert (scheduler.held_by(a), scheduler.held_by(b)) == (1, 0)
        await trio.sleep(5)
        assert (scheduler.held_by(a), scheduler.held_by(b)) == (0, 0)
        assert len(scheduler) == 0


async def test_past_max_held_a_copy_goes_out_at_once_with_one_warning(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    m = FakeMount("orders")
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    async with scheduled(max_held=2) as (scheduler, client):
        scheduler.hold(m, 100, cmd("held1"))
        scheduler.hold(m, 100, cmd("held2"))
        for n in range(3):  # a burst over the limit
            scheduler.hold(m, 100, cmd(f"now{n}"))
        await trio.sleep(1)
        assert scheduler.held_by(m) == 2  # the limit, not more
        assert client.sends() == [
            (0, [b"now0", b"now1", b"now2"])]
        warnings = [r for r in caplog.records if "max_held_copies=2" in r.getMessage()]
        assert len(warnings) == 1  # one warning for the burst
        assert "sending 1 delayed retry now" in warnings[0].getMessage()
        # the ones counted silently are reported with the next warning
        await trio.sleep(10)
        scheduler.hold(m, 100, cmd("now3"))
        await trio.sleep(1)
        warnings = [r for r in caplog.records if "max_held_copies=2" in r.getMessage()]
        assert len(warnings) == 2
        assert "sending 3 delayed retries now" in warnings[1].getMessage()
        await trio.sleep(200)
    sent = [c[2] for c in client.sent_commands()]
    assert sorted(sent) == sorted([b"held1", b"held2", b"now0", b"now1", b"now2", b"now3"])
    assert sent[-2:] == [b"held1", b"held2"]  # at their due time, after the rest
    assert m.stats.effects["released"] == 6


async def test_flush_sends_every_held_copy_at_once(autojump_clock: trio.abc.Clock) -> None:
    a, b = FakeMount("a"), FakeMount("b")
    async with scheduled() as (scheduler, client):
        scheduler.hold(a, 100, cmd("a100"))
        scheduler.hold(b, 50, cmd("b50"))
        scheduler.hold(a, 200, cmd("a200"))
        await trio.sleep(1)
        t_flush = trio.current_time()
        await scheduler.flush(t_flush + 10)
        assert client.sends(t_flush) == [
            (0, [b"b50", b"a100", b"a200"])]  # early, in due order, in one round trip
        assert (len(scheduler), scheduler.held_by(a), scheduler.held_by(b)) == (0, 0, 0)
        await trio.sleep(300)  # nothing is sent again at the old due times
    assert len(client.calls) == 1
    assert (a.stats.effects["released"], b.stats.effects["released"]) == (2, 1)


async def test_a_failed_send_is_sent_again_not_dropped(autojump_clock: trio.abc.Clock) -> None:
    m = FakeMount("orders")
    async with scheduled(RecordingClient(fail=3)) as (scheduler, client):
        scheduler.hold(m, 1, cmd("x"))
        await client.sent.wait()
        await trio.sleep(100)
    assert round(client.failed[0] - client.t0, 6) == 1  # due, failed ...
    assert len(client.failed) == 3
    assert client.sent_commands() == list(cmd("x"))  # ... then sent once
    assert client.calls[0][0] >= client.failed[-1]
    assert m.stats.effects["released"] == 1
    assert len(scheduler) == 0


async def test_held_by_counts_a_copy_through_every_failed_send(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``held`` is the copies in memory: a copy out of the heap being sent, or
    back in it after a failed send, is counted at every moment until Redis
    confirmed it (before: 0 while in flight, a gauge that dipped under faults)."""
    client = RecordingClient(fail=5, rtt=0.5)  # each failed round trip takes 0.5 s
    m = FakeMount("orders")
    samples: list[tuple[int, int]] = []  # (held_by, released) at each sample
    async with scheduled(client) as (scheduler, _):
        scheduler.hold(m, 1, cmd("x"))
        while not m.stats.effects["released"]:
            samples.append((scheduler.held_by(m), m.stats.effects["released"]))
            await trio.sleep(0.001)
        samples.append((scheduler.held_by(m), m.stats.effects["released"]))
    assert len(client.failed) == 5 and client.sent_commands() == list(cmd("x"))
    assert set(samples[:-1]) == {(1, 0)}  # counted throughout, in flight or waiting
    assert samples[-1] == (0, 1)
    assert len(samples) > 1_000  # sampled across the backoffs, not once


async def test_a_batch_stuck_in_flight_goes_back_into_the_heap_at_its_bound(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The batch being sent is shielded (taken out of the heap: it must not be
    lost to a cancellation) and bounded (3 x FINALIZE_TIMEOUT): a round trip
    stuck past its own timeout ends there, and the whole batch goes back into
    the heap, sent again after a backoff -- a duplicate at worst, never lost."""
    m = FakeMount("orders")
    async with scheduled(RecordingClient(hang=1)) as (scheduler, client):
        scheduler.hold(m, 1, cmd("x"))
        scheduler.hold(m, 1, cmd("y"))
        await trio.sleep(2)  # due at 1: in flight, stuck
        assert client.hung and len(scheduler) == 0 and not client.calls
        assert scheduler.held_by(m) == 2  # out of the heap, still in memory
        await client.sent.wait()
        await trio.sleep(100)
    assert round(client.hung[0] - client.t0, 6) == 1
    bound = 3 * FINALIZE_TIMEOUT
    assert client.calls[0][0] - client.hung[0] >= bound  # given up at the bound, not before
    assert client.sent_commands() == [*cmd("x"), *cmd("y")]  # then sent again, whole, once
    assert m.stats.effects["released"] == 2
    assert len(scheduler) == 0 and scheduler.held_by(m) == 0


async def test_flush_retries_a_failed_send_until_its_deadline(autojump_clock: trio.abc.Clock) -> None:
    client = RecordingClient(fail=2)
    scheduler = Scheduler(client)  # type: ignore[arg-type]
    m = FakeMount("orders")
    with trio.fail_after(TIMEOUT):
        scheduler.hold(m, 100, cmd("x"))
        await scheduler.flush(trio.current_time() + 60)
    assert len(client.failed) == 2
    assert client.sent_commands() == list(cmd("x"))
    assert m.stats.effects["released"] == 1
    assert m.stats.effects["held_lost"] == 0


async def test_flush_counts_what_it_could_not_send_by_its_deadline(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    client = RecordingClient(fail=10_000)
    scheduler = Scheduler(client)  # type: ignore[arg-type]
    m = FakeMount("orders")
    with trio.fail_after(TIMEOUT):
        scheduler.hold(m, 100, cmd("x"))
        scheduler.hold(m, 100, cmd("y"))
        await scheduler.flush(trio.current_time() + 5)
    assert not client.calls
    assert scheduler.held_by(m) == 2  # still held: counted once the scheduler has stopped
    assert scheduler.abandon() == 2
    assert m.stats.effects["held_lost"] == 2
    assert scheduler.held_by(m) == 0 and len(scheduler) == 0
    [record] = [r for r in caplog.records if "before shutting down" in r.getMessage()]
    assert record.levelno == logging.ERROR and record.subscription == "orders"  # type: ignore[attr-defined]
    assert "could not publish 2 held runtime delayed copies" in record.getMessage()


async def test_a_flush_cut_mid_send_leaves_its_copies_counted_lost(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A round trip that hangs past the shutdown's own deadline: the flush is
    cancelled mid-send (before: its copies vanished, neither logged nor
    counted).  They stay held until abandon() counts each ``held_lost``."""
    client = RecordingClient(hang=1)
    scheduler = Scheduler(client)  # type: ignore[arg-type]
    a, b = FakeMount("a"), FakeMount("b")
    with trio.fail_after(TIMEOUT):
        scheduler.hold(a, 100, cmd("x"))
        scheduler.hold(b, 100, cmd("y"))
        with trio.move_on_after(3):
            await scheduler.flush(trio.current_time() + 2)
    assert client.hung and not client.calls
    assert (scheduler.held_by(a), scheduler.held_by(b)) == (1, 1)
    assert scheduler.abandon() == 2
    assert (a.stats.effects["held_lost"], b.stats.effects["held_lost"]) == (1, 1)
    lost = sorted(r.getMessage() for r in caplog.records if "before shutting down" in r.getMessage())
    assert [m.split(":")[0] for m in lost] == ["a", "b"]  # one line per subscription


async def test_a_flush_cut_while_run_is_stuck_sending_leaves_the_batch_counted_lost(
    autojump_clock: trio.abc.Clock,
) -> None:
    """run() is stuck mid-send (shielded, up to 3 x FINALIZE_TIMEOUT) when the
    shutdown's flush begins and is cut waiting for it: the batch goes back
    into the heap at run()'s bound, run() sends nothing more, and abandon()
    counts it."""
    m = FakeMount("orders")
    async with scheduled(client=RecordingClient(hang=1)) as (scheduler, client):
        scheduler.hold(m, 1, cmd("x"))
        await trio.sleep(2)  # due at 1: in flight, stuck
        assert client.hung and scheduler.held_by(m) == 1
        with trio.move_on_after(3):
            await scheduler.flush(trio.current_time() + 2)
        await trio.sleep(3 * FINALIZE_TIMEOUT + 100)  # run()'s bound, and long after
    assert not client.calls  # nothing sent after the flush began
    assert scheduler.held_by(m) == 1
    assert scheduler.abandon() == 1 and m.stats.effects["held_lost"] == 1


async def test_run_sends_nothing_once_flush_has_begun(autojump_clock: trio.abc.Clock) -> None:
    """What the flush could not send by its deadline is not sent by run()
    afterwards (run() would hold the shutdown up to 3 x FINALIZE_TIMEOUT more)."""
    m = FakeMount("orders")
    async with scheduled(client=RecordingClient(fail=10_000)) as (scheduler, client):
        scheduler.hold(m, 100, cmd("x"))
        await scheduler.flush(trio.current_time() + 5)
        tried = len(client.failed)
        await trio.sleep(200)  # long past its due time and any backoff
        assert len(client.failed) == tried
    assert scheduler.abandon() == 1 and m.stats.effects["held_lost"] == 1


# -- a real server ---------------------------------------------------------------


class Observed:
    """A real client whose ``pipeline`` calls are signalled (no polling)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.replies: list[list[Any]] = []
        self.changed = trio.Event()

    async def pipeline(self, commands: Sequence[Any], **kw: Any) -> list[Any]:
        try:
            replies: list[Any] = await self.client.pipeline(commands, **kw)
            self.replies.append(replies)
            return replies
        finally:
            self.changed.set()
            self.changed = trio.Event()


async def test_held_copies_reach_a_real_server_in_due_order(client: Client) -> None:
    observed = Observed(client)
    m = FakeMount("orders")
    async with scheduled(observed, timeout=REAL_TIMEOUT) as (scheduler, _):
        scheduler.hold(m, 0.3, ((b"RPUSH", b"copies", b"third"),))
        scheduler.hold(m, 0.0, ((b"RPUSH", b"copies", b"first"),))
        scheduler.hold(m, 0.1, ((b"XADD", b"stream", b"*", b"n", b"1"),
                                (b"RPUSH", b"copies", b"second"),))  # a chain: in order
        while m.stats.effects["released"] < 3:
            await observed.changed.wait()
    assert await client.execute("LRANGE", "copies", 0, -1) == [b"first", b"second", b"third"]
    assert await client.execute("XLEN", "stream") == 1
    assert scheduler.held_by(m) == 0


async def test_flush_writes_every_held_copy_to_a_real_server(client: Client) -> None:
    scheduler = Scheduler(client)
    m = FakeMount("orders")
    with trio.fail_after(REAL_TIMEOUT):
        for n in range(20):
            scheduler.hold(m, 3600 - n, ((b"RPUSH", b"copies", str(n).encode()),))
        await scheduler.flush(trio.current_time() + 5)
    # in due order: the last held is due first
    assert await client.execute("LRANGE", "copies", 0, -1) == [str(n).encode() for n in reversed(range(20))]
    assert m.stats.effects["released"] == 20


async def test_a_final_error_reply_is_counted_not_retried(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """WRONGTYPE from a real server: logged with the key, counted failed, not sent again."""
    await client.execute("SET", "not-a-list", "x")
    observed = Observed(client)
    m = FakeMount("orders")
    async with scheduled(observed, timeout=REAL_TIMEOUT) as (scheduler, _):
        scheduler.hold(m, 0.0, ((b"RPUSH", b"not-a-list", b"copy"),))
        scheduler.hold(m, 0.0, ((b"RPUSH", b"copies", b"ok"),))
        while sum(len(r) for r in observed.replies) < 2:
            await observed.changed.wait()
        with trio.move_on_after(0.5):  # would it be sent again? (it must not)
            await observed.changed.wait()
    assert len(observed.replies) == 1
    assert m.stats.effects["failed"] == 1
    assert m.stats.effects["released"] == 1
    assert m.stats.finalize_errors == 1
    assert await client.execute("LRANGE", "copies", 0, -1) == [b"ok"]
    assert any("not-a-list" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


@pytest.fixture
async def fresh_client(fresh_redis_server: Any) -> AsyncIterator[tuple[Any, Client]]:
    async with open_client(fresh_redis_server.url) as c:
        yield fresh_redis_server, c


async def test_copies_held_while_the_server_is_down_arrive_once_it_is_back(
    fresh_client: tuple[Any, Client],
) -> None:
    server, client = fresh_client
    observed = Observed(client)
    m = FakeMount("orders")
    async with scheduled(observed, timeout=REAL_TIMEOUT * 3) as (scheduler, _):
        server.stop()
        for n in range(3):
            scheduler.hold(m, 0.0, ((b"RPUSH", b"copies", str(n).encode()),))
        await observed.changed.wait()  # a first attempt, failed
        assert m.stats.effects["released"] == 0
        await trio.to_thread.run_sync(server.start)
        while m.stats.effects["released"] < 3:
            await observed.changed.wait()
    assert await client.execute("LRANGE", "copies", 0, -1) == [b"0", b"1", b"2"]
