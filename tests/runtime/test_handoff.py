"""Outcomes on their way from the handlers to the finalizer are never dropped.

A handler's outcomes travel to the mount's finalizer over a bounded channel.
While the finalizer is stuck on a stalled request (Redis silent for a
while), the channel fills and the handlers wait for room.  Before the fix, a
batch handler's outcomes (and those the flusher hands on) were sent under a
deadline of ``FINALIZE_GRACE``: once it ran out they were dropped without a
word, and their deliveries stayed held by the consumer, finalized by nobody,
until a restart (seen in CI as a reliable-list element left in the
processing list).  A real stalled request (the fault client's ``cancel``
fault: no reply until the request's timeout) fills the channel here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import anyio
import pytest
from _procs import eventually
from faults.shim import FaultMode, open_fault_client

from trio_redis_finalize import (
    ACK,
    Delivery,
    Mode,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    _finalizer,
    _hand_over,
    _handlers,
    _shutdown,
    open_consumer,
)
from trio_redis_finalize._transport import Client

pytestmark = pytest.mark.timeout(90)

N = 30


async def _left(client: Client, form: str) -> int:
    """Messages not finalized yet: pending or unread (stream), queued or in processing (list)."""
    if form == "stream":
        pending = int((await client.execute("XPENDING", "s", "g"))[0])
        info = {g[1]: g[7] for g in await client.execute("XINFO", "GROUPS", "s")}
        last = await client.execute("XREVRANGE", "s", "+", "-", "COUNT", 1)
        return pending + (0 if info.get(b"g") == last[0][0] else 1)
    return sum(await client.pipeline([("LLEN", "q"), ("LLEN", "q:processing")]))


async def _produce(client: Client, form: str) -> None:
    """N messages, one every 0.02 s (most reads then take one)."""
    for i in range(N):
        body = str(i).encode()
        if form == "stream":
            await client.execute("XADD", "s", "*", "n", body)
        else:
            await client.execute("LPUSH", "q", body)
        await anyio.sleep(0.02)


@pytest.mark.parametrize("form", ["stream", "list"])
async def test_a_batch_handlers_outcomes_wait_for_a_stalled_finalizer(
    redis_url: str, client: Client, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the finalizer's first request stalls 1 s; a deadline on the hand-over
    # shorter than that (the old code's FINALIZE_GRACE) dropped outcomes
    monkeypatch.setattr(_finalizer, "FINALIZE_TIMEOUT", 1.0)
    monkeypatch.setattr(_handlers, "FINALIZE_GRACE", 0.05)
    sub = (StreamSubscription("s", "g", block=0.05) if form == "stream"
           else ReliableListSubscription("q", processing="q:processing", block=0.05))
    if form == "stream":
        await client.execute("XGROUP", "CREATE", "s", "g", "$", "MKSTREAM")
    calls: dict[bytes | None, int] = {}

    async def handler(ds: Sequence[Delivery]) -> Outcome:
        for d in ds:
            key = d.data if form == "list" else d.fields[b"n"]
            calls[key] = calls.get(key, 0) + 1
        return ACK

    async with open_fault_client(redis_url) as faulty, \
            open_consumer(faulty, name="c", shutdown_grace=1.0) as consumer:
        faulty.arm(0, FaultMode.BEFORE, cancel=True)  # its first finalization: no reply for 1 s
        await consumer.mount(sub, handler, batch=True)
        # one message per read (each a batch handler call, a list of outcomes
        # on the channel): more lists than the channel holds while it stalls
        await _produce(client, form)
        await eventually(lambda: faulty.fired is not None, 10, "the stalled finalization")

        async def done() -> bool:
            return await _left(client, form) == 0

        await eventually(done, 30, lambda: f"every message finalized ({calls=})")
        assert sorted(calls) == sorted(str(i).encode() for i in range(N))
        assert set(calls.values()) == {1}, calls  # none handed over again: none was dropped


async def test_outcomes_the_ended_finalizer_never_took_stay_pending(
    redis_url: str, client: Client, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The shutdown's deadline ends a finalizer still stuck on its stalled
    request while a batch handler waits for room for its outcomes: the
    consumer still exits (no error), the finalizer says it cut every outcome
    the handlers returned, and their entries stay pending (none acknowledged)."""
    monkeypatch.setattr(_finalizer, "FINALIZE_TIMEOUT", 60.0)  # the stall outlives the shutdown
    await client.execute("XGROUP", "CREATE", "s", "g", "$", "MKSTREAM")
    calls = 0

    async def handler(ds: Sequence[Delivery]) -> Outcome:
        nonlocal calls
        calls += len(ds)
        return ACK

    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    # the finalizer's time after the handlers' deadline, and the give-back's: 1 s, not 10
    for module in (_shutdown, _hand_over):
        monkeypatch.setattr(module, "FINALIZE_GRACE", 1.0)
    with anyio.fail_after(30):  # a bound: the shutdown takes about 0.5 + 1 s
        async with open_fault_client(redis_url) as faulty, \
                open_consumer(faulty, name="c", shutdown_grace=0.5) as consumer:
            faulty.arm(0, FaultMode.BEFORE, cancel=True)
            await consumer.mount(StreamSubscription("s", "g", block=0.05), handler, batch=True)
            for i in range(N):
                await client.execute("XADD", "s", "*", "n", str(i))
                await anyio.sleep(0.02)
            # one call's outcomes with the finalizer, four in the channel, one waiting for room
            await eventually(lambda: calls >= 6, 10, "the channel full")
    # every outcome a handler returned is accounted for: taken out of the channel by
    # the ending finalizer (the one waiting for room too), none dropped unsaid
    cut = [int(m[1]) for r in caplog.records
           if (m := re.search(r"cut finalization with (\d+) outcome", r.getMessage()))]
    assert cut == [calls], [r.getMessage() for r in caplog.records]
    info = {g[1]: g for g in await client.execute("XINFO", "GROUPS", "s")}
    pending, last = int(info[b"g"][5]), info[b"g"][7]
    read = len(await client.execute("XRANGE", "s", "-", last))
    assert pending == read >= 6  # every entry read is still pending: none was acknowledged


async def _finalized(client: Client, form: str) -> dict[bytes, int]:
    """How many times each message was finalized (each ACK carries its own ``HINCRBY``)."""
    raw = await client.execute("HGETALL", "done")
    return {raw[i]: int(raw[i + 1]) for i in range(0, len(raw), 2)}


async def _held_after_exit(client: Client, form: str) -> tuple[int, int]:
    """After the consumer exited: (messages read and still pending in its PEL /
    its processing list, messages read at all / back on the queue)."""
    if form == "stream":
        info = {g[1]: g for g in await client.execute("XINFO", "GROUPS", "s")}
        last = info[b"g"][7]
        read = len(await client.execute("XRANGE", "s", "-", last)) if last != b"0-0" else 0
        return int(info[b"g"][5]), read
    return int(await client.execute("LLEN", "q:processing")), int(await client.execute("LLEN", "q"))


@pytest.mark.parametrize("fault", [FaultMode.BEFORE, FaultMode.AFTER])
@pytest.mark.parametrize("form", ["stream", "stream-claiming", "list"])
async def test_the_handler_loops_own_send_cut_at_shutdown_leaves_its_deliveries_pending(
    redis_url: str, client: Client, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, form: str, fault: FaultMode,
) -> None:
    """Stop 41's decision, checked: the handler loop's ordinary send (not
    ``hand_on``) keeps its checkpoint, so at a shutdown with a stalled
    finalizer the grace deadline cuts it while it waits for room in the
    channel.  Its outcomes are gone, but their deliveries are not: after the
    consumer exited each message is finalized once (``AFTER``: the stalled
    request ran, its reply never read) or still pending in the consumer's PEL
    (a stream, plain or claiming: handed back, idle) or back on the queue (a
    reliable list: the processing list handed back, nothing left in it), and
    a restart delivers and finalizes every one of them once."""
    monkeypatch.setattr(_finalizer, "FINALIZE_TIMEOUT", 60.0)  # the stall outlives the shutdown
    for module in (_shutdown, _hand_over):
        monkeypatch.setattr(module, "FINALIZE_GRACE", 1.0)
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    mode = Mode.CLAIMING if form == "stream-claiming" else Mode.PLAIN
    form = form.split("-")[0]
    if form == "stream":
        await client.execute("XGROUP", "CREATE", "s", "g", "$", "MKSTREAM")

    def sub() -> StreamSubscription | ReliableListSubscription:
        return (StreamSubscription("s", "g", block=0.05, mode=mode) if form == "stream"
                else ReliableListSubscription("q", processing="q:processing", block=0.05))

    calls: dict[bytes, int] = {}

    async def handler(d: Delivery) -> Outcome:
        key = (d.data if form == "list" else d.fields[b"n"]) or b""
        calls[key] = calls.get(key, 0) + 1
        return ACK.with_writes(("HINCRBY", "done", key, 1))

    with anyio.fail_after(30):  # a bound: the shutdown takes about 0.5 + 1 s
        async with open_fault_client(redis_url) as faulty, \
                open_consumer(faulty, name="c", shutdown_grace=0.5) as consumer:
            faulty.arm(0, fault, cancel=True)  # the first finalization: no reply, ever
            await consumer.mount(sub(), handler)
            await _produce(client, form)
            # the finalizer stuck, the channel full, the handler loop's own
            # send waiting for room (the flusher idle: no hand_on of its waits)
            mount = consumer.mounts[0]
            channel = mount._outcome_send
            await eventually(lambda: channel.statistics().tasks_waiting_send == 1
                             and mount.pool._flusher_idle, 10, "the channel full")
    handled = sum(calls.values())
    assert set(calls.values()) == {1}, calls
    first = await _finalized(client, form)
    assert set(first.values()) <= {1}, first
    assert len(first) == (1 if fault is FaultMode.AFTER else 0), first  # the stalled request's
    held, other = await _held_after_exit(client, form)
    if form == "stream":
        # every entry read and not finalized is still pending (in the PEL)
        assert held == other - len(first) >= handled - len(first), (held, other, first)
    else:
        # the processing list handed back: nothing is left held by nobody
        assert held == 0 and other == N - len(first), (held, other, first)

    # a restart delivers and finalizes every message not finalized, once
    async with open_consumer(redis_url, name="c") as consumer:
        await consumer.mount(sub(), handler)

        async def all_done() -> bool:
            return len(await _finalized(client, form)) == N and await _left(client, form) == 0

        await eventually(all_done, 30, lambda: f"every message finalized ({calls=})")
    done = await _finalized(client, form)
    assert done == {str(i).encode(): 1 for i in range(N)}, done
    assert all(calls.get(str(i).encode()) for i in range(N)), calls


async def _read(client: Client, form: str) -> int:
    """Messages read and not finalized: pending (stream), in the processing list (list)."""
    if form == "stream":
        return int((await client.execute("XPENDING", "s", "g"))[0])
    return int(await client.execute("LLEN", "q:processing"))


@pytest.mark.parametrize("form", ["stream", "list"])
async def test_deliveries_no_handler_started_come_back_at_their_attempt_past_a_stalled_finalizer(
    redis_url: str, client: Client, monkeypatch: pytest.MonkeyPatch, form: str,
) -> None:
    """docs/guarantees.rst: what was read and never started at a graceful
    stop is given back without counting an attempt (stream: its delivery
    count set back; reliable list: back onto the queue, uncounted).  Here
    the finalizer is stuck on its first request (no reply until long after
    the shutdown) when the stop gives them back: a restart must still
    deliver every message no handler started at attempt 1 -- only the one
    whose ACK stalled (``0``) and the one whose handler the grace cut
    (``1``) ran, and come back at attempt 2."""
    monkeypatch.setattr(_finalizer, "FINALIZE_TIMEOUT", 60.0)  # the stall outlives the shutdown
    for module in (_shutdown, _hand_over):
        monkeypatch.setattr(module, "FINALIZE_GRACE", 1.0)
    n = 10
    if form == "stream":
        await client.execute("XGROUP", "CREATE", "s", "g", "$", "MKSTREAM")
    for i in range(n):
        if form == "stream":
            await client.execute("XADD", "s", "*", "n", str(i))
        else:
            await client.execute("LPUSH", "q", str(i))

    def sub() -> StreamSubscription | ReliableListSubscription:
        return (StreamSubscription("s", "g", block=0.05) if form == "stream"
                else ReliableListSubscription("q", processing="q:processing", block=0.05))

    first: dict[bytes, list[int]] = {}
    second: dict[bytes, list[int]] = {}
    seen = first

    async def handler(d: Delivery) -> Outcome:
        key = (d.data if form == "list" else d.fields[b"n"]) or b""
        seen.setdefault(key, []).append(d.attempt)
        if seen is first and key == b"1":
            await anyio.sleep_forever()  # started: cut by the grace, its attempt counts
        return ACK

    with anyio.fail_after(30):  # a bound: the shutdown takes about 0.5 + 1 s
        async with open_fault_client(redis_url) as faulty, \
                open_consumer(faulty, name="c", shutdown_grace=0.5) as consumer:
            faulty.arm(0, FaultMode.BEFORE, cancel=True)  # 0's ACK: no reply, ever
            await consumer.mount(sub(), handler)
            await eventually(lambda: faulty.fired is not None, 10, "the stalled finalization")

            async def read_ahead() -> bool:  # 0, 1 and at least two no handler started
                return await _read(client, form) >= 4

            await eventually(read_ahead, 10, "deliveries read ahead of the handler")
    assert sorted(first) == [b"0", b"1"], first  # no other handler started

    # a restart (same name) delivers every message not finalized
    seen = second
    async with open_consumer(redis_url, name="c") as consumer:
        await consumer.mount(sub(), handler)

        async def all_done() -> bool:
            return await _left(client, form) == 0

        await eventually(all_done, 30, lambda: f"every message finalized ({second=})")
    # the two that ran: their attempt counted; the rest: as if never read
    expected = {str(i).encode(): [2 if i < 2 else 1] for i in range(n)}
    wrong = {k: v for k, v in second.items() if expected.get(k) != v}
    assert second == expected, f"attempts seen after the restart, not as expected: {wrong}"
