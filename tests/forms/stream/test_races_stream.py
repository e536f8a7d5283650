"""Race enumeration on streams (issue 33): two finalizations of one delivery.

The crash points and the fault matrix give each delivery one finalizer.
Here a second finalization of the same delivery meets the first -- the same
consumer finalizing twice (``consumer.finalize``), another consumer that took
the entry over and acknowledged it -- and the first one's command meets a
fault (:mod:`faults.shim`): its request never reaches Redis (``before``), or
it runs and its reply is lost (``after``); the racing finalization runs right
there, before the finalizer sends again.  The checker reads what Redis holds,
per origin: the copies in the stream (lines of deliveries), and the writes
committed (``HINCRBY`` counters a finalization carries: ``A`` with one, ``B``
with the other, ``copy`` with a copy's own ACK).

What must hold: one line of deliveries -- a runtime ``retry_after`` copy
exists only when that finalization's own gated removal removed the original
(its receipt says so, also to a resend after an unknown outcome) -- and each
finalization's writes are committed once when it won, never when it lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any

import anyio
import pytest
from _procs import FinalizeBatches, always
from faults.shim import FaultClient, FaultMode, open_fault_client
from redis import exceptions as rexc

from trio_redis_finalize import (
    ACK,
    ORIGIN_FIELD,
    Delivery,
    Mode,
    Outcome,
    Retention,
    StreamSubscription,
    _finalizer,
    _hand_over,
    _handlers,
    _shutdown,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core.stream import scripts as stream_scripts
from trio_redis_finalize._transport import Client, open_client, parse_url

S, G = "orders", "billing"
EFFECTS = "{orders}:effects"
NAME = "w1"
SUB = f"stream {S!r} group {G!r}"


def write(name: str) -> tuple[str, str, str, int]:
    return ("HINCRBY", EFFECTS, name, 1)


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[Client]:
    async with open_client(redis_url) as client:
        yield client


class RaceClient(FaultClient):
    """A fault client that runs a racing finalization where its fault fires:
    after the request was dropped (``before``) or after it ran and its reply
    was lost (``after``), and before the caller learns of it (and sends again)."""

    on_fire: Callable[[], Awaitable[None]] | None = None

    async def pipeline(self, commands: Any, **kw: Any) -> list[Any]:
        try:
            return await super().pipeline(commands, **kw)
        except rexc.ConnectionError:
            hook, self.on_fire = self.on_fire, None
            if self.fired is not None and hook is not None:
                await hook()
            raise


def open_race_client(url: str) -> AbstractAsyncContextManager[RaceClient]:
    return aclosing(RaceClient(parse_url(url), max_connections=64))


async def copies(admin: Client, origin: str) -> int:
    """Copies of ``origin`` in the stream (entries carrying it as their origin)."""
    n = 0
    for _, flat in await admin.execute("XRANGE", S, "-", "+"):
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        if fields.get(ORIGIN_FIELD) == origin.encode():
            n += 1
    return n


async def effects(admin: Client) -> dict[str, int]:
    got = await admin.execute("HGETALL", EFFECTS)
    return {k.decode(): int(v) for k, v in zip(got[::2], got[1::2], strict=True)}


async def settled(admin: Client, consumer: Any) -> bool:
    """Nothing pending, nothing unread, nothing held, no handler running."""
    # a finalization batch in progress (its pause before a resend too: a racer's
    # batch may have taken the id out of in_hand), a runtime copy waiting or being sent
    if FinalizeBatches.running or len(consumer.scheduler) or any(
            m.in_hand or m.stats.in_flight or consumer.scheduler.held_by(m) for m in consumer.mounts):
        return False
    if int((await admin.execute("XPENDING", S, G))[0]):
        return False
    last = await admin.execute("XREVRANGE", S, "+", "-", "COUNT", 1)
    info = {g[1]: g[7] for g in await admin.execute("XINFO", "GROUPS", S)}
    return not last or info.get(G.encode()) == last[0][0]


async def until_settled(admin: Client, consumer: Any, budget: float = 15.0) -> None:
    calm = 0
    with anyio.fail_after(budget):  # a bound, never the expectation
        while calm < 3:
            await anyio.sleep(0.05)
            calm = calm + 1 if await settled(admin, consumer) else 0


@dataclasses.dataclass
class Race:
    """The original's first finalization (its handler's outcome, whose command
    ``k`` meets the fault) against a second one run at the fault."""

    id: str
    first: Outcome
    second: Outcome
    # per mode: (copies, committed writes) expected once all settled
    want: dict[str, tuple[int, dict[str, int]]]
    k: int = 0  # the finalization command the fault hits (0: the first's own)
    sub: dict[str, Any] = dataclasses.field(default_factory=dict)


A_RUNTIME = retry_after(0.2).with_writes(write("A"))
B_ACK = ACK.with_writes(write("B"))
RACES = [
    # issue 33 point 2: an unknown outcome of a runtime retry_after with writes
    # against a racing ACK with writes.  Request lost: the ACK wins (its B once,
    # no copy, A never); reply lost: the retry_after won (A once, its copy, whose
    # own ACK commits once), the ACK finds the gate closed (B never).
    Race("runtime-vs-ack", A_RUNTIME, B_ACK,
         {"before": (0, {"B": 1}), "after": (1, {"A": 1, "copy": 1})}),
    Race("runtime-vs-ack-reclaim", A_RUNTIME, B_ACK,
         {"before": (0, {"B": 1}), "after": (1, {"A": 1, "copy": 1})},
         sub={"mode": Mode.RECLAIM, "min_idle": 30.0}),
    Race("runtime-vs-ack-delete", A_RUNTIME, B_ACK,
         {"before": (0, {"B": 1}), "after": (1, {"A": 1, "copy": 1})},
         sub={"retention": Retention.DELETE_ON_FINALIZE}),
    # the other way round: an ACK with writes meets the fault, a runtime
    # retry_after with writes races it
    Race("ack-vs-runtime", B_ACK, A_RUNTIME,
         {"before": (1, {"A": 1, "copy": 1}), "after": (0, {"B": 1})}),
    # two runtime retry_afters of one delivery: one line, one copy
    Race("runtime-vs-runtime", retry_after(0.1).with_writes(write("A")),
         retry_after(0.1).with_writes(write("B")),
         {"before": (1, {"B": 1, "copy": 1}), "after": (1, {"A": 1, "copy": 1})}),
]


@pytest.fixture(autouse=True)
def _quick_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    # a cut finalizer gives up after 0.3 s at shutdown instead of 10 s
    monkeypatch.setattr(_hand_over, "FINALIZE_GRACE", 0.3)
    monkeypatch.setattr(_handlers, "FINALIZE_GRACE", 0.3)
    monkeypatch.setattr(_shutdown, "FINALIZE_GRACE", 0.3)
    FinalizeBatches.watch(monkeypatch)  # the settle check waits for batches in progress


async def _race(url: str, admin: Client, race: Race, mode: str,
                racer: Callable[[Any, Delivery], Awaitable[None]] | None = None,
                ) -> tuple[int, dict[str, int], dict[str, Any]]:
    """Run one race; returns (copies of the original handled, writes committed, stats)."""
    await admin.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    original = (await admin.execute("XADD", S, "*", "n", "1")).decode()
    seen: dict[str, Delivery] = {}
    handled: list[Delivery] = []  # the copies handled (each ACKed: its line ends)

    async def handle(d: Delivery) -> Outcome:
        if d.id == original:
            seen[original] = d
            return race.first
        assert d.origin_id == original
        handled.append(d)
        return ACK.with_writes(write("copy"))  # a copy's own finalization

    async with (open_race_client(url) as client,
                open_consumer(client, name=NAME, shutdown_grace=1.0) as consumer):

        async def second() -> None:
            if racer is not None:
                await racer(consumer, seen[original])
            else:
                await consumer.finalize(seen[original], race.second)

        client.on_fire = second
        client.arm(race.k, FaultMode.AFTER if mode == "after" else FaultMode.BEFORE)
        await consumer.mount(StreamSubscription(S, G, block=0.05, **race.sub), handle)
        with anyio.fail_after(10):
            while client.fired is None:
                await anyio.sleep(0.02)
        await until_settled(admin, consumer)
        stats = consumer.stats()[SUB]
    if race.sub.get("retention") is not Retention.DELETE_ON_FINALIZE:  # (else deleted once ACKed)
        assert await copies(admin, original) == len(handled)
    return len(handled), await effects(admin), stats


@pytest.mark.parametrize("mode", ["before", "after"])
@pytest.mark.parametrize("race", RACES, ids=[r.id for r in RACES])
async def test_two_finalizations_of_one_delivery(
    redis_url: str, admin: Client, race: Race, mode: str,
) -> None:
    n, writes, stats = await _race(redis_url, admin, race, mode)
    want_copies, want_writes = race.want[mode]
    assert (n, writes) == (want_copies, want_writes)
    # counted as Redis answered: the runtime copies written, once each
    assert stats["effects"].get("released", 0) == want_copies


async def test_a_resend_after_the_racer_is_waited_for(
    redis_url: str, admin: Client, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first's reply lost, the racer's ACK run and ended, and a busy
    machine's pause before the first's resend (here longer than the settle
    check's calm window): the check waits for the resend and its copy."""
    monkeypatch.setattr(_finalizer, "backoff", lambda attempt: 0.5)
    race = RACES[0]  # runtime-vs-ack
    n, writes, stats = await _race(redis_url, admin, race, "after")
    assert (n, writes) == race.want["after"] == (1, {"A": 1, "copy": 1})
    assert stats["effects"].get("released", 0) == 1

# -- point 1: a runtime retry_after after a closed gate -------------------------------

@pytest.mark.parametrize("mode", [Mode.PLAIN, Mode.RECLAIM])
async def test_runtime_retry_after_after_an_ack_with_writes_writes_no_copy(
    redis_url: str, admin: Client, mode: Mode,
) -> None:
    """``consumer.finalize(d, retry_after(0.1))`` after ``d`` was ACKed with
    writes: its removal finds the gate closed and no receipt of its own --
    no copy is held or written, the writes are committed once."""
    await admin.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    originals = [(await admin.execute("XADD", S, "*", "n", str(i))).decode() for i in range(5)]
    done: list[Delivery] = []

    async def handle(d: Delivery) -> Outcome:
        if d.id in originals:
            done.append(d)
            return B_ACK
        return ACK.with_writes(write("copy"))

    async with open_client(redis_url) as client, open_consumer(client, name=NAME) as consumer:
        sub = StreamSubscription(S, G, block=0.05, mode=mode, min_idle=30.0)
        await consumer.mount(sub, handle)
        await until_settled(admin, consumer)
        for d in done:
            await consumer.finalize(d, retry_after(0.1))
        await anyio.sleep(0.3)  # past the delay: a held copy would be out
        await until_settled(admin, consumer)
        stats = consumer.stats()[SUB]
    assert [await copies(admin, o) for o in originals] == [0] * 5
    assert await effects(admin) == {"B": 5}
    assert stats["held"] == 0 and stats["effects"]["gate_closed"] == 5
    assert "released" not in stats["effects"]


@pytest.mark.parametrize("mode", [Mode.PLAIN, Mode.RECLAIM])
async def test_a_blocked_consumer_s_retry_after_for_entries_taken_over_and_acked(
    redis_url: str, admin: Client, mode: Mode,
) -> None:
    """A consumer whose handlers return ``retry_after`` only after another
    consumer took their entries over and ACKed them (with writes): an XACK
    would answer 0 (and the copies be held all the same); the receipt's
    removal finds the gate closed -- no copy, no second line."""
    await admin.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    originals = [(await admin.execute("XADD", S, "*", "n", str(i))).decode() for i in range(4)]
    taken = anyio.Event()

    async def handle(d: Delivery) -> Outcome:
        if d.id in originals:
            await taken.wait()
            return retry_after(0.1)
        return ACK.with_writes(write("copy"))

    async with open_client(redis_url) as client, open_consumer(client, name=NAME) as consumer:
        sub = StreamSubscription(S, G, block=0.05, mode=mode, min_idle=30.0)
        await consumer.mount(sub, handle, concurrency=4)
        with anyio.fail_after(10):
            while int((await admin.execute("XPENDING", S, G))[0]) < 4:
                await anyio.sleep(0.02)
        # the other consumer: takes them over, commits its writes, ACKs them
        await admin.execute("XCLAIM", S, G, "w2", 0, *originals, "JUSTID")
        for o in originals:
            await admin.execute("HINCRBY", EFFECTS, "B", 1)
            assert await admin.execute("XACK", S, G, o) == 1
        taken.set()
        await anyio.sleep(0.3)
        await until_settled(admin, consumer)
        stats = consumer.stats()[SUB]
    assert [await copies(admin, o) for o in originals] == [0] * 4
    assert await effects(admin) == {"B": 4}
    assert stats["effects"]["gate_closed"] == 4 and "released" not in stats["effects"]


# -- point 3: no gate a clock can reopen -----------------------------------------------

@pytest.mark.parametrize("mode", ["before", "after"])
async def test_a_held_copy_resent_after_its_marker_s_lifetime_writes_no_second_copy(
    redis_url: str, admin: Client, mode: str,
) -> None:
    """The copy's command meets the fault (``after``: written, reply lost), and
    the server's clock runs past every receipt's lifetime before the scheduler
    sends it again (a 610 s outage, played by expiring what has a TTL): the
    resend writes no second copy, the copy's write is committed once."""

    async def clock(consumer: Any, d: Delivery) -> None:
        del consumer, d
        for key in await admin.execute("KEYS", "*"):  # whatever has a TTL expires
            if int(await admin.execute("PTTL", key)) > 0:
                await admin.execute("PEXPIRE", key, 1)
        await anyio.sleep(0.05)

    race = Race("copy-vs-clock", retry_after(0.1).with_writes(write("A")), ACK, {}, k=1)
    n, writes, stats = await _race(redis_url, admin, race, mode, racer=clock)
    assert n == 1 and writes == {"A": 1, "copy": 1}
    # the resend of a copy whose receipt is gone is counted as what Redis said
    assert stats["effects"].get("released", 0) + stats["effects"].get("gate_closed", 0) == 1
    # the receipt of a copy written: kept for COPY_MARK_TTL at most, none held forever
    for key in await admin.execute("KEYS", "{orders}:receipt:*"):
        assert 0 < int(await admin.execute("PTTL", key)) <= stream_scripts.COPY_MARK_TTL


# -- point 10: a runtime retry_after cut at shutdown -----------------------------------

@pytest.mark.parametrize("mode", ["before", "after"])
async def test_a_runtime_retry_after_cut_at_shutdown_publishes_only_its_own_copy(
    redis_url: str, admin: Client, mode: str,
) -> None:
    """The finalizer is cut by the shutdown's deadline while its runtime
    ``retry_after`` removal waits (request unsent / applied, reply never
    read); meanwhile another consumer took the entry over and ACKed it.
    The flush sends the removal again first: unsent, it finds the gate
    closed (no copy); applied, its receipt answers (one copy)."""
    await admin.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    original = (await admin.execute("XADD", S, "*", "n", "1")).decode()

    async with open_fault_client(redis_url) as client:
        client.arm(0, FaultMode.AFTER if mode == "after" else FaultMode.BEFORE, cancel=True)
        async with open_consumer(client, name=NAME, shutdown_grace=0.0) as consumer:
            await consumer.mount(StreamSubscription(S, G, block=0.05),
                                 always(retry_after(5.0).with_writes(write("A"))))
            with anyio.fail_after(10):
                while client.fired is None:
                    await anyio.sleep(0.02)
            # the other consumer takes it over and ACKs it (when still pending)
            await admin.execute("XCLAIM", S, G, "w2", 0, original, "JUSTID")
            if await admin.execute("XACK", S, G, original):
                await admin.execute("HINCRBY", EFFECTS, "B", 1)
        stats = consumer.stats()[SUB]
    n = await copies(admin, original)
    if mode == "before":
        assert (n, await effects(admin)) == (0, {"B": 1})
        assert stats["effects"].get("released", 0) == 0
    else:
        assert (n, await effects(admin)) == (1, {"A": 1})
        assert stats["effects"]["released"] == 1


# -- point 10: a write refused when run, after the writes before it --------------------

BAD_WRITES = [
    ("incrby-on-text", ("INCRBY", "{orders}:text", 1)),
    ("incr-on-text", ("INCR", "{orders}:text")),
    ("decrby-by-a-float", ("DECRBY", "{orders}:ten", "1.5")),
    ("hincrby-on-text", ("HINCRBY", "{orders}:hash", "f", 1)),
    ("pfadd-on-a-string", ("PFADD", "{orders}:text", "a")),
]


@pytest.mark.parametrize("bad", [b for _, b in BAD_WRITES], ids=[i for i, _ in BAD_WRITES])
async def test_a_write_redis_would_refuse_when_run_is_refused_before_any_write(
    redis_url: str, admin: Client, bad: tuple[Any, ...],
) -> None:
    """A write that passes the type check but that Redis refuses when it runs
    (``INCRBY`` on text, ``PFADD`` on a plain string ...) used to leave the
    writes before it applied, again at every redelivery (scripts do not roll
    back).  What Redis will certainly refuse is refused before anything is
    written: three finalizations of the delivery (as three redeliveries
    would send) apply nothing, and the entry stays pending (nothing lost)."""
    await admin.execute("SET", "{orders}:text", "abc")
    await admin.execute("SET", "{orders}:ten", "10")
    await admin.execute("HSET", "{orders}:hash", "f", "x")
    await admin.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    original = (await admin.execute("XADD", S, "*", "n", "1")).decode()
    outcome = ACK.with_writes(write("before"), bad)
    seen: list[Delivery] = []

    async def handle(d: Delivery) -> Outcome:
        seen.append(d)
        return outcome

    async with open_client(redis_url) as client, open_consumer(client, name=NAME) as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05), handle)
        with anyio.fail_after(10):
            while consumer.stats()[SUB]["effects"].get("failed", 0) < 1:
                await anyio.sleep(0.02)
        for _ in range(2):
            await consumer.finalize(seen[0], outcome)
        stats = consumer.stats()[SUB]
    assert stats["effects"]["failed"] == 3 and "writes" not in stats["effects"]
    assert await effects(admin) == {}  # the write before it: never applied
    assert int((await admin.execute("XPENDING", S, G))[0]) == 1
    assert (await admin.execute("XPENDING", S, G, "-", "+", 1))[0][0].decode() == original


async def test_the_value_checks_refuse_nothing_redis_runs(redis_url: str, admin: Client) -> None:
    """No false refusal: a key an earlier write of the same outcome sets is
    not judged by its old value; integers Redis reads (``-5``, ``0``) pass."""
    await admin.execute("SET", "{orders}:text", "abc")
    await admin.execute("SET", "{orders}:neg", "-5")
    await admin.execute("PFADD", "{orders}:hll", "x")
    await admin.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    await admin.execute("XADD", S, "*", "n", "1")
    await admin.execute("SET", "{orders}:gone", "abc")
    outcome = ACK.with_writes(
        ("SET", "{orders}:text", "5"), ("INCRBY", "{orders}:text", 1),
        ("DEL", "{orders}:x", "{orders}:gone"), ("INCR", "{orders}:gone"),
        ("INCRBY", "{orders}:neg", "-1"), ("INCR", "{orders}:zero"), ("DECR", "{orders}:zero"),
        ("PFADD", "{orders}:hll", "y"), ("HINCRBY", EFFECTS, "n", 0), write("n"),
    )

    async with open_client(redis_url) as client, open_consumer(client, name=NAME) as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05), always(outcome))
        await until_settled(admin, consumer)
        stats = consumer.stats()[SUB]
    assert stats["effects"] == {"acked": 1, "writes": 10}
    assert await admin.execute(
        "MGET", "{orders}:text", "{orders}:neg", "{orders}:zero", "{orders}:gone") == [
        b"6", b"-6", b"0", b"1"]
    assert int(await admin.execute("PFCOUNT", "{orders}:hll")) == 2
    assert await effects(admin) == {"n": 1}


# -- point 10: a group destroyed while a handler holds an ACK with writes ---------------

async def test_a_group_destroyed_while_a_handler_holds_an_ack_with_writes(
    redis_url: str, admin: Client,
) -> None:
    """The group is destroyed (its PEL with it) while a handler runs; the
    handler then returns an ACK with writes.  The gate (the entry pending in
    the group) is closed, whatever the group is now (recreated by the reader
    or not): the writes are not applied, nothing is copied, and the
    finalization is counted gate_closed -- never a write committed for a
    delivery the group no longer has."""
    await admin.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    original = (await admin.execute("XADD", S, "*", "n", "1")).decode()
    destroyed = anyio.Event()
    calls: list[str] = []

    async def handle(d: Delivery) -> Outcome:
        calls.append(d.id or "")
        if d.id == original and len(calls) == 1:
            await destroyed.wait()
        return ACK.with_writes(write(f"call{len(calls)}"))

    async with open_client(redis_url) as client, open_consumer(client, name=NAME) as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05), handle)
        with anyio.fail_after(10):
            while not calls:
                await anyio.sleep(0.02)
        assert await admin.execute("XGROUP", "DESTROY", S, G) == 1
        destroyed.set()
        with anyio.fail_after(10):
            while not consumer.stats()[SUB]["effects"].get("gate_closed"):
                await anyio.sleep(0.02)
        await anyio.sleep(0.3)  # a recreated group would deliver it again meanwhile
        stats = consumer.stats()[SUB]
    # the reader recreated the group at the last id it delivered: the entry
    # is not delivered again, its handled writes are not committed (the
    # group's state went with it), nothing else was written
    assert calls == [original] and stats["group_recreated"] == 1
    assert await effects(admin) == {} and "writes" not in stats["effects"]
    assert stats["effects"] == {"gate_closed": 1}
    assert await copies(admin, original) == 0
