"""A graceful stop hands its work back at once (issue 34, point 1).

With default settings (heartbeat 30 s, a random consumer name, ``count=100``),
after a graceful stop -- SIGTERM to ``trio-redis-finalize run``, or leaving
``async with open_consumer(...)`` -- every delivery read and not started,
and every one whose handler the grace cut, is available to the group's other
live consumers (and to a consumer started after the stop) within about 2 s of
the stop, at an unchanged attempt (a cut handler's attempt counts, as it
ran); the stopped consumer logs "handed back N" once; the registry marks it
stopped and ``inspect`` shows it so.  Before, the work waited for the
stopped consumer's heartbeat to lapse (about 41 s: heartbeat 30 s, the last
beat covering grace + 11 s).

Each bound below is ``BOUND`` (the promise, 2 s) plus ``LOAD_MARGIN`` for a
loaded machine; the figures measured are printed (``-s``).
"""

from __future__ import annotations

import signal
import sys
from typing import Any

import trio
from _procs import AppProc, Hang

from trio_redis_finalize import (
    ACK,
    Delivery,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._cli._queues import inspect_stream
from trio_redis_finalize._transport import Client

BOUND = 2.0
"""Seconds after the stop within which the work is another consumer's (the promise)."""
LOAD_MARGIN = 2.0
"""Seconds more a loaded machine may take (a bound, not an expectation)."""


class RunProc(AppProc):
    """``trio-redis-finalize run _handback_app:FACTORY`` as a process; its
    stdout lines (with the time each arrived) and its stderr."""

    def __init__(self, url: str, factory: str, key: str, *extra: str, sleep: float = 1.0) -> None:
        super().__init__(url, factory, key, *extra, sleep=sleep)

    def seen(self, prefix: str) -> list[str]:
        return [line for line in self.lines if line.startswith(prefix)]

    async def wait_for(self, prefix: str, n: int = 1, timeout: float = 30.0) -> None:
        with trio.fail_after(timeout):
            while len(self.seen(prefix)) < n:
                if self.proc is not None and self.proc.returncode is not None:
                    raise AssertionError(f"exited {self.proc.returncode}: {self.stderr.decode()}")
                await trio.sleep(0.02)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def exited(self, timeout: float = 30.0) -> float:
        """Wait for the process to end; the time it was seen ended."""
        assert self.proc is not None
        with trio.fail_after(timeout):
            await self.proc.wait()
        return trio.current_time()


class Peer:
    """A handler that records (time, id or data, attempt) and holds each call ``hold`` s."""

    def __init__(self, hold: float = 0.0) -> None:
        self.seen: list[tuple[float, str, int]] = []
        self.hold = hold

    async def __call__(self, d: Delivery) -> Outcome:
        ident = d.id if d.id is not None else (d.data or b"").decode()
        self.seen.append((trio.current_time(), ident, d.attempt))
        await trio.sleep(self.hold)
        return ACK

    def ids(self) -> set[str]:
        return {i for _, i, _ in self.seen}

    async def wait_for(self, ids: set[str], timeout: float) -> None:
        with trio.move_on_after(timeout):
            while not ids <= self.ids():
                await trio.sleep(0.01)


def _took(peer: Peer, ids: set[str], since: float) -> float:
    assert ids <= peer.ids(), f"not handed back: {sorted(ids - peer.ids())}"
    return max(t for t, i, _ in peer.seen if i in ids) - since


# -- streams --------------------------------------------------------------------------

async def test_sigterm_to_run_hands_a_streams_unstarted_entries_to_a_live_peer(
    redis_url: str, client: Client
) -> None:
    """20 entries, handler 1 s, one SIGTERM: the entries ``run`` read and did
    not start are the peer's within the bound of its exit, each at attempt 1
    (unchanged); "handed back N" is logged once, N what it did not finish."""
    ids = [(await client.execute("XADD", "orders", "*", "n", str(i))).decode() for i in range(20)]
    a = RunProc(redis_url, "stream", "orders")
    peer = Peer()
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await a.wait_for("M ")
        await a.wait_for("H ")  # it read all 20 (count=100) and started one
        async with open_consumer(redis_url, name="peer") as consumer:
            await consumer.mount(StreamSubscription("orders", "g"), peer)
            a.signal(signal.SIGTERM)
            term = trio.current_time()
            stopped = await a.exited()
            done = {line.split()[2] for line in a.seen("A ")}
            rest = set(ids) - done
            await peer.wait_for(rest, BOUND + LOAD_MARGIN + 10)
    assert a.proc is not None and a.proc.returncode == 0, a.stderr.decode()
    assert peer.ids() == rest and not done & peer.ids()  # each handled once
    took = _took(peer, rest, stopped)
    print(f"\nstream, SIGTERM: {len(rest)} entries handed back, the peer had them all "
          f"{took + stopped - term:.3f} s after the SIGTERM (a handler of 1 s in flight), "
          f"{took:.3f} s after the process exited")
    assert took < BOUND + LOAD_MARGIN, f"{took:.3f} s"
    assert {att for _, _, att in peer.seen} == {1}
    err = a.stderr.decode()
    assert err.count(f"handed back {len(rest)} entries") == 1, err


async def test_leaving_async_with_hands_back_unstarted_and_grace_cut_entries(
    redis_url: str, client: Client
) -> None:
    """Leaving ``async with``: a handler cut by the grace and the entries read
    behind it go to the live peer within the bound; the unstarted ones at
    attempt 1, the cut one at 2 (its handler ran: it counts, as always)."""
    ids = [(await client.execute("XADD", "orders", "*", "n", str(i))).decode() for i in range(5)]
    hang = Hang()
    peer = Peer()
    async with open_consumer(redis_url, name="peer") as b:
        async with open_consumer(redis_url, shutdown_grace=0.2) as a:
            await a.mount(StreamSubscription("orders", "g"), hang)
            with trio.fail_after(10):
                await hang.started.wait()
            await b.mount(StreamSubscription("orders", "g"), peer)
        stopped = trio.current_time()
        await peer.wait_for(set(ids), BOUND + LOAD_MARGIN + 10)
    took = _took(peer, set(ids), stopped)
    print(f"\nstream, leaving async with: 5 entries (1 cut) handed back, the peer had them "
          f"{took:.3f} s after the exit")
    assert took < BOUND + LOAD_MARGIN, f"{took:.3f} s"
    attempts = {i: att for _, i, att in peer.seen}
    assert attempts == {ids[0]: 2, **dict.fromkeys(ids[1:], 1)}


async def stop_a_holding_its_first_entry(redis_url: str) -> None:
    """Consumer ``a`` (group ``g`` of ``orders``) stops as soon as its handler
    holds its first entry (0.2 s, then ACK): the rest it read is handed back."""
    got = trio.Event()

    async def hold(d: Delivery) -> Outcome:
        got.set()
        await trio.sleep(0.2)
        return ACK

    async with open_consumer(redis_url, name="a") as a:
        await a.mount(StreamSubscription("orders", "g"), hold)
        with trio.fail_after(10):
            await got.wait()


async def test_a_stopped_consumer_is_marked_stopped_and_a_later_one_takes_its_entries_at_once(
    redis_url: str, client: Client
) -> None:
    """No peer at the stop: the registry marks the consumer stopped (not
    lapsed), ``inspect`` shows it so with its pending entries; a consumer
    started afterwards (a new name: a restart with defaults) takes them at
    its mount, at their attempt, and the mark goes."""
    ids = [(await client.execute("XADD", "orders", "*", "n", str(i))).decode() for i in range(3)]
    await stop_a_holding_its_first_entry(redis_url)
    info = await inspect_stream(client, "orders", "g")
    [row] = [c for c in info["groups"][0]["consumer_list"] if c["name"] == "a"]
    assert row["heartbeat"] == "stopped" and row["pending"] == 2, row
    assert await client.execute("EXISTS", "{orders}:heartbeat:g:a") == 0

    peer = Peer()
    t0 = trio.current_time()
    async with open_consumer(redis_url) as b:
        await b.mount(StreamSubscription("orders", "g"), peer)
        await peer.wait_for(set(ids[1:]), BOUND + LOAD_MARGIN + 10)
        took = _took(peer, set(ids[1:]), t0)
        print(f"\nstream, a later consumer: took the 2 handed-back entries {took:.3f} s after "
              "it began to mount")
        assert took < BOUND + LOAD_MARGIN, f"{took:.3f} s"
        assert {att for _, _, att in peer.seen} == {1}
        with trio.fail_after(10):  # the mark goes once nothing is pending for it
            while await client.execute("HEXISTS", "{orders}:consumers:g", "a"):
                await trio.sleep(0.05)


async def test_inspect_prints_a_stopped_consumer_as_stopped(redis_url: str, client: Client) -> None:
    """The CLI's ``inspect`` text for a consumer with the stopped mark."""
    await client.execute("XADD", "orders", "*", "n", "1")
    await client.execute("XADD", "orders", "*", "n", "2")
    await stop_a_holding_its_first_entry(redis_url)
    done = await trio.run_process(
        [sys.executable, "-m", "trio_redis_finalize", "inspect", "orders", "--group", "g",
         "--url", redis_url], capture_stdout=True, capture_stderr=True)
    out = done.stdout.decode()
    [line] = [x for x in out.splitlines() if x.startswith("| a ")]
    assert "stopped (cleanly)" in line and "handed back" in line and "lapsed" not in line, out


# -- reliable lists ---------------------------------------------------------------------

async def test_sigterm_to_run_hands_a_reliable_lists_cut_element_back_at_once(
    redis_url: str, client: Client
) -> None:
    """A reliable list's processing list: the element whose handler the grace
    cut goes back onto the queue at the stop (counted: attempt 2), the peer
    has it within the bound; the processing list and the registration are
    gone."""
    await client.execute("LPUSH", "jobs", b"x")
    a = RunProc(redis_url, "rlist", "jobs", "--shutdown-grace", "0.3", sleep=3600)
    peer = Peer()
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await a.wait_for("H ")
        name = a.seen("H ")[0].split()[1]
        async with open_consumer(redis_url, name="peer") as consumer:
            await consumer.mount(ReliableListSubscription("jobs"), peer)
            a.signal(signal.SIGTERM)
            term = trio.current_time()
            stopped = await a.exited()
            await peer.wait_for({"x"}, BOUND + LOAD_MARGIN + 40)
    assert a.proc is not None and a.proc.returncode == 0, a.stderr.decode()
    took = _took(peer, {"x"}, stopped)
    print(f"\nreliable list, SIGTERM: the cut element was the peer's {took + stopped - term:.3f} "
          f"s after the SIGTERM (grace 0.3 s), {took:.3f} s after the process exited")
    assert took < BOUND + LOAD_MARGIN, f"{took:.3f} s"
    assert [(i, att) for _, i, att in peer.seen] == [("x", 2)]
    assert await client.execute("LLEN", f"{{jobs}}:processing:{name}") == 0
    assert await client.execute("HEXISTS", "{jobs}:consumers", name) == 0
    assert a.stderr.decode().count("handed back 1 element(s)") == 1, a.stderr.decode()


async def test_leaving_async_with_hands_a_reliable_lists_elements_back(
    redis_url: str, client: Client
) -> None:
    """In process: a cut handler's element goes back onto the queue at the
    stop (counted), for the consumer after; one waiting for its Backoff stays
    in the processing list with its schedule (issue 33 point 7: a restart
    delivers it when due, a live consumer once the heartbeat lapsed)."""
    from trio_redis_finalize import Backoff

    await client.execute("LPUSH", "jobs", b"fails", b"hangs")  # "fails" is read first
    calls: list[str] = []

    async def handle(d: Delivery) -> Any:
        calls.append((d.data or b"").decode())
        if d.data == b"fails":
            raise RuntimeError("fails")
        await trio.sleep_forever()

    async with open_consumer(redis_url, name="a", shutdown_grace=0.2) as a:
        await a.mount(ReliableListSubscription("jobs"), handle, concurrency=2,
                      on_error=Backoff(base=60.0, cap=60.0))
        with trio.fail_after(10):
            while len(calls) < 2:
                await trio.sleep(0.02)
    assert await client.execute("LRANGE", "{jobs}:processing:a", 0, -1) == [b"fails"]
    peer = Peer()
    async with open_consumer(redis_url, name="b") as b:
        await b.mount(ReliableListSubscription("jobs"), peer)
        await peer.wait_for({"hangs"}, 10)
    assert sorted((i, att) for _, i, att in peer.seen) == [("hangs", 2)]
