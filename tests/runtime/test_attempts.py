"""Attempts count handler calls that may have happened (issue 12, items 5, 11,
14): a lost read reply, a re-read of the own PEL while a delivery is in flight
and a delivery given back unstarted at shutdown do not count; a crash during a
handler does.  A consumer never hands an entry it holds to a second handler.
Entries deleted while pending are counted once; in claiming mode the delivery
counts come from every id asked about."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from _procs import connection, effects, eventually, stats
from redis import exceptions as rexc

from trio_redis_finalize import ACK, Delivery, Mode, Outcome, StreamSubscription, open_consumer
from trio_redis_finalize._transport import Client, parse_url

S, G = "jobs", "workers"
NAME = f"stream {S!r} group {G!r}"
MODES = [Mode.PLAIN, Mode.RECLAIM, Mode.CLAIMING]


async def counts(client: Client) -> dict[str, int]:
    """Server delivery count per pending id."""
    rows = await client.execute("XPENDING", S, G, "-", "+", 10_000)
    return {r[0].decode(): int(r[3]) for r in rows}


async def pending(client: Client) -> int:
    return int((await client.execute("XPENDING", S, G))[0])


class Recorder:
    def __init__(self, sleep: float = 0.0) -> None:
        self.sleep = sleep
        self.seen: list[Delivery] = []
        self.started = trio.Event()

    async def __call__(self, d: Delivery) -> Outcome:
        self.seen.append(d)
        self.started.set()
        if self.sleep:
            await trio.sleep(self.sleep)
        return ACK

    @property
    def calls(self) -> list[tuple[str | None, int]]:
        return [(d.id, d.attempt) for d in self.seen]


def sub_for(mode: Mode, **kw: Any) -> StreamSubscription:
    kw.setdefault("block", 0.1)
    if mode is not Mode.PLAIN:
        kw.setdefault("min_idle", 0.3)
    return StreamSubscription(S, G, mode=mode, **kw)


async def reader_conn(client: Client, consumer: str) -> dict[str, str]:
    """CLIENT LIST fields of the reader connection of ``consumer`` (empty: none now)."""
    kv, _ = await connection(client, f"trf:{consumer}:reader")
    return kv


async def blocked_reader(client: Client, consumer: str) -> dict[str, str]:
    """The reader connection once it is blocked in ``XREADGROUP ... >``."""
    with trio.fail_after(5):
        while True:
            kv = await reader_conn(client, consumer)
            if "b" in kv.get("flags", "") and kv.get("cmd") == "xreadgroup":
                return kv
            await trio.sleep(0.005)


async def lose_a_read_reply(client: Client, consumer: str, n: str) -> str:
    """XADD an entry into the blocked read of ``consumer``, whose connection then
    dies before the reply is written: the entry is in its PEL, unseen."""
    kv = await blocked_reader(client, consumer)
    eid, _ = await client.pipeline([("XADD", S, "*", "n", n), ("CLIENT", "KILL", "ID", kv["id"])])
    return str(eid.decode())


# -- item 5: lost read replies -----------------------------------------------------------

@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
async def test_lost_read_reply_does_not_spend_an_attempt(
    redis_url: str, client: Client, mode: Mode
) -> None:
    h = Recorder()
    sub = sub_for(mode, max_attempts=1, dead_letter="dead")
    async with open_consumer(redis_url, name="lr") as consumer:
        await consumer.mount(sub, h)
        eid = await lose_a_read_reply(client, "lr", "1")
        await eventually(lambda: stats(consumer)["read_errors"] >= 1, what="read error")
        await eventually(lambda: effects(consumer) != {}, what="finalized")
        await trio.sleep(0.5)
        assert effects(consumer) == {"acked": 1}
    assert h.calls == [(eid, 1)]
    assert await pending(client) == 0
    assert await client.execute("XLEN", "dead") == 0


# -- item 5: re-reads of the own PEL while the delivery is in flight -------------------------

@pytest.mark.parametrize("mode", [Mode.PLAIN, Mode.RECLAIM], ids=["plain", "reclaim"])
async def test_in_flight_rereads_do_not_count_a_crash_does(
    redis_url: str, client: Client, mode: Mode
) -> None:
    """3 read errors during one handler, then a crash: attempt 2 after restart
    (max_attempts=3), not exhausted."""
    eid = await client.execute("XADD", S, "*", "n", "1")
    eid = eid.decode()
    h = Recorder(sleep=3600)
    sub = sub_for(mode, max_attempts=3, dead_letter="dead", min_idle=5.0)
    async with open_consumer(redis_url, name="c1", shutdown_grace=0.0) as consumer:
        await consumer.mount(sub, h)
        with trio.fail_after(5):
            await h.started.wait()
        for i in range(3):
            kv = await blocked_reader(client, "c1")
            await client.execute("CLIENT", "KILL", "ID", kv["id"])
            await eventually(lambda i=i: stats(consumer)["read_errors"] >= i + 1, what="read error")
        await blocked_reader(client, "c1")  # it recovered, and reads again
        assert await counts(client) == {eid: 1}
        # leaving with shutdown_grace=0 cancels the handler mid-call: a crash
    assert h.calls == [(eid, 1)]
    again = Recorder()
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub_for(mode, max_attempts=3, dead_letter="dead", min_idle=5.0), again)
        await eventually(lambda: effects(consumer).get("acked") == 1, what="handled after restart")
    assert again.calls == [(eid, 2)]
    assert await client.execute("XLEN", "dead") == 0


# -- item 5: deliveries given back unstarted at shutdown -----------------------------------

@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
async def test_unstarted_deliveries_given_back_at_shutdown_do_not_count(
    redis_url: str, client: Client, mode: Mode
) -> None:
    ids = [(await client.execute("XADD", S, "*", "n", str(i))).decode() for i in range(6)]
    h = Recorder(sleep=0.5)
    # count=2: [0, 1] in the work queue, [2, 3] waiting in the reader's hand-over
    sub = sub_for(mode, count=2, max_attempts=1, dead_letter="dead")
    async with open_consumer(redis_url, name="c1", shutdown_grace=5.0) as consumer:
        await consumer.mount(sub, h)
        with trio.fail_after(5):
            await h.started.wait()
        await eventually(lambda: stats(consumer)["received"] >= 4,
                         what="second batch read")
        await trio.sleep(0.05)
    assert h.calls == [(ids[0], 1)]  # finished within the grace
    assert await pending(client) == 3  # 1, 2, 3 were read, never started
    again = Recorder()
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub_for(mode, max_attempts=1, dead_letter="dead"), again)
        await eventually(lambda: effects(consumer).get("acked", 0) + effects(consumer).get(
            "dead_lettered", 0) >= 5, what="the rest finalized")
        await trio.sleep(0.2)
    assert sorted(again.calls) == [(i, 1) for i in ids[1:]]
    assert await client.execute("XLEN", "dead") == 0
    assert await pending(client) == 0


# -- item 11: an entry held is never handed to a second handler -----------------------------

@pytest.mark.parametrize("mode", [Mode.RECLAIM, Mode.CLAIMING], ids=["reclaim", "claiming"])
async def test_own_in_flight_entry_is_not_reclaimed_to_a_second_handler(
    redis_url: str, client: Client, mode: Mode
) -> None:
    h = Recorder(sleep=0.8)
    sub = StreamSubscription(S, G, mode=mode, min_idle=0.02, block=0.05)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, h, concurrency=3)
        eid = (await client.execute("XADD", S, "*", "n", "long")).decode()
        await eventually(lambda: effects(consumer).get("acked", 0) >= 1, what="acked")
        await trio.sleep(0.3)
    assert h.calls == [(eid, 1)]
    assert await pending(client) == 0


# -- item 14: deleted while pending, counted once --------------------------------------------

@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
async def test_entries_deleted_while_pending_are_counted_once(
    redis_url: str, client: Client, mode: Mode
) -> None:
    ids = [(await client.execute("XADD", S, "*", "n", str(i))).decode() for i in range(20)]
    await client.execute("XGROUP", "CREATE", S, G, "0")
    await client.execute("XREADGROUP", "GROUP", G, "c1", "COUNT", 100, "STREAMS", S, ">")
    gone = ids[::2]
    assert await client.execute("XDEL", S, *gone) == len(gone)
    await trio.sleep(0.1)  # idle past min_idle
    h = Recorder()
    sub = StreamSubscription(S, G, mode=mode, min_idle=0.05, block=0.05)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, h)
        await eventually(lambda: effects(consumer).get("acked") == 10, what="live ones acked")
        await eventually(lambda: effects(consumer).get("lost_before_handling", 0) >= 10,
                         what="deleted ones reported")
        await trio.sleep(0.5)
        assert effects(consumer) == {"acked": 10, "lost_before_handling": 10}
    assert sorted(d.id for d in h.seen if d.id) == sorted(ids[1::2])
    assert await pending(client) == 0


# -- item 14: the XPENDING window covers every id asked about -------------------------------

async def test_claiming_counts_every_claimed_id(redis_url: str, client: Client) -> None:
    """Claimed ids far apart in the consumer's PEL (1,100 fresh entries between
    them) are handed over with their server count, not as attempt 1."""
    first = (await client.execute("XADD", S, "*", "n", "first")).decode()
    await client.pipeline([("XADD", S, "*", "n", "mid") for _ in range(1100)])
    last = (await client.execute("XADD", S, "*", "n", "last")).decode()
    await client.execute("XGROUP", "CREATE", S, G, "0")
    await client.execute("XREADGROUP", "GROUP", G, "c1", "COUNT", 2000, "STREAMS", S, ">")
    for _ in range(5):  # crashed five more times: count 6
        await client.execute("XCLAIM", S, G, "c1", 0, first, last)
    await trio.sleep(0.4)
    # the middle ones were just renewed (no count bump): not idle min_idle yet
    mids = [r[0] for r in await client.execute("XPENDING", S, G, "-", "+", 2000)
            if r[0].decode() not in (first, last)]
    await client.execute("XCLAIM", S, G, "c1", 0, *mids, "JUSTID")
    h = Recorder()
    sub = StreamSubscription(S, G, mode=Mode.CLAIMING, min_idle=0.3, block=0.05, count=200)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, h)
        await eventually(lambda: {first, last} <= {d.id for d in h.seen}, what="both claimed")
    by_id = {d.id: d.attempt for d in h.seen}
    assert (by_id[first], by_id[last]) == (7, 7)


# -- a failure between a claim and its hand-over ---------------------------------------------

class _LosingClient(Client):
    """A client whose pooled ``XPENDING`` replies are lost, ``lose`` times:
    the server ran the command, the caller sees ``ConnectionError``."""

    def __init__(self, *args: Any, lose: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lose = lose

    async def execute(self, *args: Any, timeout: float | None = None) -> Any:
        reply = await super().execute(*args, timeout=timeout)
        if self.lose and str(args[0]).upper() == "XPENDING" and len(args) == 7:
            self.lose -= 1
            raise rexc.ConnectionError("test: reply of XPENDING lost")
        return reply


async def test_failure_after_a_claim_does_not_count_it_twice(redis_url: str, client: Client) -> None:
    """RECLAIM claims an entry of a dead consumer (count 2: its crash, and this
    delivery); the counts' reply is lost; the recovery that follows hands it
    over as attempt 2, not 3."""
    eid = (await client.execute("XADD", S, "*", "n", "1")).decode()
    await client.execute("XGROUP", "CREATE", S, G, "0")
    await client.execute("XREADGROUP", "GROUP", G, "dead", "COUNT", 10, "STREAMS", S, ">")
    h = Recorder()
    lc = _LosingClient(parse_url(redis_url), name="t", max_connections=8, lose=1)
    try:
        async with open_consumer(lc, name="c2") as consumer:
            # mounted before the entry is idle min_idle: claimed by a later round
            await consumer.mount(sub_for(Mode.RECLAIM, min_idle=0.5, block=0.05), h)
            await eventually(lambda: effects(consumer).get("acked") == 1, what="acked")
            assert stats(consumer)["read_errors"] >= 1
    finally:
        await lc.aclose()
    assert lc.lose == 0
    assert h.calls == [(eid, 2)]


async def test_an_entry_acknowledged_while_its_claim_is_read_goes_to_no_second_handler(
    redis_url: str, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim takes our own entry being handled (its lease lapsed); its handler
    finishes and the entry is acknowledged while the claim reads the counts.  It
    was in hand when the claim was sent: kept, not handed to a second handler
    (before: by then it was no longer in hand, and was delivered again)."""
    from trio_redis_finalize._forms.stream import own_pel, reader

    real = own_pel.claimed_counts
    waited: list[bytes] = []

    async def counts_after_the_ack(ctx: Any, ids: list[bytes]) -> dict[bytes, int]:
        ours = [i for i in ids if i.decode() in ctx.in_hand]
        if ours:  # the handler finishes and its ACK lands while the claim is read
            waited.extend(ours)
            with trio.fail_after(10):
                while any(i.decode() in ctx.in_hand for i in ours):
                    await trio.sleep(0.005)
        return await real(ctx, ids)

    monkeypatch.setattr(own_pel, "claimed_counts", counts_after_the_ack)
    monkeypatch.setattr(reader, "lease_every", lambda *a: 3600.0)  # a stalled lease
    h = Recorder(sleep=0.3)
    sub = StreamSubscription(S, G, mode=Mode.RECLAIM, min_idle=0.02, block=0.05)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, h, concurrency=2)
        eid = (await client.execute("XADD", S, "*", "n", "long")).decode()
        await eventually(lambda: waited, timeout=20, what="a claim taking the entry in hand")
        await eventually(lambda: effects(consumer).get("acked", 0) >= 1, what="acked")
        await trio.sleep(0.3)
    assert [d.id for d in h.seen] == [eid]
    assert await pending(client) == 0
