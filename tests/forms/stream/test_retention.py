"""Stream retention (issue 14, item 3): ``StreamSubscription(retention=...,
copy_maxlen=..., dead_letter_maxlen=...)``.

* ``Retention.DELETE_ON_FINALIZE``: every finalization deletes the original
  (plans, scripts, a real consumer over 10,000 messages with RETRYs and dead
  letters: the stream never holds more than the messages in flight); a
  stream other groups read is refused at mount.
* ``Retention.TRIM_ACKED``: the all-groups trim script against a model of
  what each group still needs; three groups at different speeds miss no
  entry and the stream shrinks once all have passed; with no group lagging
  the length stays bounded; a trim that the server refuses (READONLY) is
  logged and tried again, the reader goes on.
* ``copy_maxlen`` / ``dead_letter_maxlen``: ``MAXLEN ~`` on the XADDs, validated.
* Redis 8.2 (the native path, ``_core._caps``): ``XACKDEL ... ACKED`` for
  every removal of ``DELETE_ON_FINALIZE`` (plans, scripts, batched scripts),
  ``ACKED`` on the caps and the retention trim; two groups may share a
  ``DELETE_ON_FINALIZE`` stream (an entry goes once both finalized it); the
  native trim removes acknowledged entries above a stuck pending one.  These
  run on a Redis 8.2 of their own (``redis82_url``) whatever the session's
  server; the tests above run on the session's server with the path its
  capabilities choose.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from _procs import always, eventually
from hypothesis import given
from hypothesis import strategies as st

from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    DelayedRetry,
    Delivery,
    Outcome,
    Retention,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core._caps import Capabilities
from trio_redis_finalize._core._plan import (
    copy_how,
    plain_removals,
    plan,
    plan_dead,
    plan_foreign,
    plan_lost,
    removal_commands,
)
from trio_redis_finalize._core._types import Plan
from trio_redis_finalize._core.stream import scripts as stream_scripts
from trio_redis_finalize._core.stream.retention import (
    MAX_PART,
    TRIM_ACKED,
    TRIM_ACKED_NATIVE,
    GroupNeed,
    delete_refusal,
    group_rows,
    id_key,
    next_id,
    oldest_needed,
    parse_trim,
)
from trio_redis_finalize._core.stream.scripts import (
    STREAM_COPY_ACK,
    STREAM_COPY_ACK_BATCH,
    STREAM_COPY_ACK_EX,
    STREAM_ZADD_ACK,
    STREAM_ZADD_ACK_BATCH,
    STREAM_ZADD_ACK_DEL,
    STREAM_ZADD_ACKDEL,
    move_due_to_stream,
)
from trio_redis_finalize._forms.stream import retention as _stream_retention
from trio_redis_finalize._transport import Client, open_client

S, G = "orders", "billing"
DEAD = "{orders}:dead"
DELETE = Retention.DELETE_ON_FINALIZE
TRIM = Retention.TRIM_ACKED


@pytest.fixture
def quick_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trim step every 20 ms instead of every 5 s."""
    monkeypatch.setattr(_stream_retention, "_TRIM_EVERY", 0.02)


def name_of(stream: str, group: str) -> str:
    return f"stream {stream!r} group {group!r}"


def delivery(eid: str = "1700000000000-7", attempt: int = 1, retries: int = 0) -> Delivery:
    return Delivery(source=S, id=eid, fields={b"n": b"1"}, data=None, attempt=attempt,
                    origin_id=eid, retries=retries, mount="m")


# -- sans-IO: ids, the model ---------------------------------------------------------

ids = st.tuples(st.integers(0, MAX_PART), st.integers(0, MAX_PART)).map(lambda t: f"{t[0]}-{t[1]}")


@given(ids)
def test_next_id_is_the_smallest_id_above(eid: str) -> None:
    nxt = next_id(eid)
    ms, seq = id_key(eid)
    if (ms, seq) == (MAX_PART, MAX_PART):
        assert nxt == eid
        return
    assert id_key(nxt) > id_key(eid)
    # nothing in between: the successor in (ms, seq) order
    assert id_key(nxt) == ((ms, seq + 1) if seq < MAX_PART else (ms + 1, 0))


@given(st.lists(st.tuples(ids, st.one_of(st.none(), ids)), min_size=1, max_size=5))
def test_oldest_needed_is_below_everything_a_group_needs(rows: list[tuple[str, str | None]]) -> None:
    groups = [GroupNeed(f"g{i}", 0 if first is None else 1, last, first)
              for i, (last, first) in enumerate(rows)]
    low = oldest_needed(groups)
    assert low is not None
    for g in groups:
        # unread entries (above last delivered) and pending ones are at or above it
        assert id_key(low) <= id_key(next_id(g.last_delivered))
        if g.first_pending is not None:
            assert id_key(low) <= id_key(g.first_pending)
    assert low in {g.oldest_needed for g in groups}
    assert oldest_needed([]) is None


def test_delete_refusal_names_the_other_groups() -> None:
    assert delete_refusal(S, G, [G]) is None
    assert delete_refusal(S, G, []) is None
    why = delete_refusal(S, G, [G, "audit", "search"])
    assert why is not None and "'audit', 'search'" in why and "TRIM_ACKED" in why


# -- plans -------------------------------------------------------------------------

def target(**kw: Any) -> Any:
    return StreamSubscription(S, G, **kw).target("c1")


def runtime_copy(p: Plan) -> tuple[Any, Any]:
    """(stream, cap) of a runtime ``retry_after``'s later copy: written once
    (``stream_copy_once``, a marker of its own)."""
    (cmd,) = p.later
    assert cmd[:2] == (b"EVALSHA", stream_scripts.STREAM_COPY_ONCE.sha)
    return cmd[3], cmd[6]


def runtime_removal(p: Plan) -> tuple[Any, ...]:
    """(stream, group, id, how) of a runtime ``retry_after``'s removal: gated,
    with its receipt (``stream_remove_receipt``), the copy gated on the same."""
    (cmd,) = p.commands
    assert cmd[:3] == (b"EVALSHA", stream_scripts.STREAM_REMOVE_RECEIPT.sha, 2)
    assert p.later[0][4] == cmd[4]  # one receipt
    assert cmd[8] == 0  # no writes
    return cmd[3], cmd[5], cmd[6], cmd[7]


def without_receipts(commands: Any) -> Any:
    """``commands`` with receipt keys (a fresh name per plan) left out."""
    return [tuple(a for a in c if not (isinstance(a, str) and ":receipt:" in a))
            for c in commands]


def cross_slot_copy(p: Plan) -> tuple[Any, Any]:
    """(dead letter, cap) of the first of a cross-slot plan's two steps: the
    plain XADD (a script: trf-dead-time is the server's clock)."""
    cmd = p.commands[0]
    assert cmd[:2] == (b"EVALSHA", stream_scripts.STREAM_XADD.sha)
    return cmd[3], cmd[4]


def test_delete_on_finalize_plans_delete_every_original() -> None:
    t = target(retention=DELETE, max_attempts=3, dead_letter=DEAD)
    d = delivery()
    xack, xdel = ("XACK", S, G, d.id), ("XDEL", S, d.id)
    assert plan(t, d, ACK).commands == (xack, xdel)
    assert plan(t, d, DROP).commands == (xack, xdel)
    assert plan_lost(t, d).commands == (xack, xdel)
    # another group's copy is that group's: acknowledged, never deleted
    assert plan_foreign(t, d).commands == (xack,)
    # the hot path says the same, for many ids at once
    for kind, effect in plain_removals(t).items():
        assert plan(t, d, Outcome(kind)).commands == tuple(removal_commands(t, [d]))
        assert plan(t, d, Outcome(kind)).effect is effect
    two = [d, delivery("1700000000000-8")]
    assert removal_commands(t, two) == [("XACK", S, G, d.id, "1700000000000-8"),
                                        ("XDEL", S, d.id, "1700000000000-8")]
    # RETRY: the gated script copies, acknowledges, deletes
    (cmd,) = plan(t, d, RETRY).commands
    assert cmd[:4] == (b"EVALSHA", STREAM_COPY_ACK_EX.sha, 2, S) and cmd[5:9] == (G, d.id, "1", 0)
    # dead letter: the same script, to the dead letter
    (cmd,) = plan(t, delivery(attempt=3, retries=2), RETRY).commands
    assert cmd[:5] == (b"EVALSHA", STREAM_COPY_ACK_EX.sha, 2, S, DEAD) and cmd[7] == "1"
    # durable delay: ZADD, XACK, XDEL in one script
    td = target(retention=DELETE, delayed_retry=DelayedRetry.DURABLE_ZSET)
    (cmd,) = plan(td, d, retry_after(1.0)).commands
    assert cmd[:2] == (b"EVALSHA", STREAM_ZADD_ACK_DEL.sha)
    # runtime delay: acknowledged and deleted now, the copy later
    p = plan(t, d, retry_after(1.0))
    assert runtime_removal(p) == (S, G, d.id, "1") and runtime_copy(p) == (S, 0)
    # exhausted without a dead letter
    assert plan_dead(target(retention=DELETE, max_attempts=1, dead_letter=None),
                     d, "x").commands == (xack, xdel)


def test_default_and_trim_acked_plans_are_unchanged() -> None:
    d = delivery()
    for t in (target(), target(retention=TRIM)):
        assert plan(t, d, ACK).commands == (("XACK", S, G, d.id),)
        assert removal_commands(t, [d]) == [("XACK", S, G, d.id)]
        assert plan(t, d, RETRY).commands[0][1] == STREAM_COPY_ACK.sha
        td = target(retention=t.retention, delayed_retry=DelayedRetry.DURABLE_ZSET)
        assert plan(td, d, retry_after(1.0)).commands[0][1] == STREAM_ZADD_ACK.sha


def test_maxlen_caps_go_on_the_library_s_xadds() -> None:
    t = target(copy_maxlen=1000, max_attempts=3, dead_letter=DEAD, dead_letter_maxlen=50)
    d = delivery()
    (cmd,) = plan(t, d, RETRY).commands
    assert cmd[1] == STREAM_COPY_ACK_EX.sha and cmd[5:9] == (G, d.id, "0", 1000)
    (cmd,) = plan(t, delivery(attempt=3, retries=2), RETRY).commands
    assert cmd[4] == DEAD and cmd[5:9] == (G, d.id, "0", 50)
    assert runtime_copy(plan(t, d, retry_after(1.0))) == (S, 1000)
    # Redis Cluster, dead letter on another slot: capped copy, then XACK, XDEL
    tc = StreamSubscription(S, G, retention=DELETE, max_attempts=1, dead_letter="elsewhere",
                            dead_letter_maxlen=7).target("c1", cluster=True)
    p = plan(tc, d, RETRY)
    assert not p.gated
    assert cross_slot_copy(p) == ("elsewhere", 7)
    assert list(p.commands[1:]) == [("XACK", S, G, d.id), ("XDEL", S, d.id)]
    assert move_due_to_stream(None) is move_due_to_stream(None)
    assert move_due_to_stream(5).sha != move_due_to_stream(None).sha


@pytest.mark.parametrize("param", ["copy_maxlen", "dead_letter_maxlen"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "10"])
def test_bad_maxlen_is_a_value_error_naming_it(param: str, bad: Any) -> None:
    with pytest.raises(ValueError, match=param):
        StreamSubscription(S, G, max_attempts=2, dead_letter=DEAD, **{param: bad})


def test_bad_retention_configuration() -> None:
    with pytest.raises(ValueError, match="retention"):
        StreamSubscription(S, G, retention="delete")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dead_letter_maxlen"):
        StreamSubscription(S, G, dead_letter=None, dead_letter_maxlen=10)
    s = StreamSubscription(S, G, retention=TRIM, copy_maxlen=10)
    assert s.target("c").retention is TRIM and s.target("c").copy_maxlen == 10


# -- the scripts on a real server ------------------------------------------------------

async def pending_entry(client: Client, fields: Sequence[str] = ("n", "1")) -> str:
    await client.execute("XGROUP", "CREATE", S, G, "$", "MKSTREAM")
    eid = (await client.execute("XADD", S, "*", *fields)).decode()
    await client.execute("XREADGROUP", "GROUP", G, "c1", "COUNT", 10, "STREAMS", S, ">")
    return str(eid)


async def test_copy_ack_ex_copies_acks_deletes_once(client: Client) -> None:
    eid = await pending_entry(client)
    cmd = STREAM_COPY_ACK_EX.command((S, S), (G, eid, "1", 0, "n", "copy"))
    first, second = await client.pipeline([cmd, cmd])
    assert first is not None and second is None  # the gate: one copy
    rows = await client.execute("XRANGE", S, "-", "+")
    assert [r[0].decode() for r in rows] == [first.decode()]  # the original is gone
    assert int((await client.execute("XPENDING", S, G))[0]) == 0


async def check_zadd_deletes_once(client: Client, script: Any, eid: str) -> None:
    """``script`` (the durable delay's) sent twice for ``eid``, alone on its
    stream: gated, once; the entry deleted, its member in the delay set."""
    cmd = script.command((S, "{orders}:delayed"), (G, eid, 100, b"member"))
    first, second = await client.pipeline([cmd, cmd])
    assert first is not None and second is None
    assert int(await client.execute("XLEN", S)) == 0
    assert int(await client.execute("ZCARD", "{orders}:delayed")) == 1


async def test_zadd_ack_del(client: Client) -> None:
    await check_zadd_deletes_once(client, STREAM_ZADD_ACK_DEL, await pending_entry(client))


async def test_capped_copies_keep_the_destination_near_its_cap(client: Client) -> None:
    async with node_max_entries(client, 4):
        await client.execute("XGROUP", "CREATE", S, G, "$", "MKSTREAM")
        for i in range(60):
            eid = (await client.execute("XADD", S, "*", "n", str(i))).decode()
            await client.execute("XREADGROUP", "GROUP", G, "c1", "STREAMS", S, ">")
            args = (G, eid, "0", 10, "n", str(i))
            assert await client.evalsha(STREAM_COPY_ACK_EX, (S, DEAD), args) is not None
        # MAXLEN ~ 10 with 4-entry nodes: at most one node over the cap
        assert 10 <= int(await client.execute("XLEN", DEAD)) <= 14
        # the capped move of due copies, likewise
        script = move_due_to_stream(10)
        for i in range(40):
            await client.execute("ZADD", "{orders}:delayed", 0, f"corrupt-{i}")
        await client.evalsha(script, ("{orders}:delayed", DEAD), (128,))
        assert 10 <= int(await client.execute("XLEN", DEAD)) <= 14


# -- the all-groups trim against a model ----------------------------------------------

@asynccontextmanager
async def node_max_entries(client: Client, n: int | str) -> AsyncIterator[None]:
    """``stream-node-max-entries`` set to ``n`` meanwhile (back to 100 after)."""
    await client.execute("CONFIG", "SET", "stream-node-max-entries", str(n))
    try:
        yield
    finally:
        await client.execute("CONFIG", "SET", "stream-node-max-entries", "100")


async def trim_all(client: Client, script: Any = TRIM_ACKED) -> int:
    """Trim steps (of ``script``) until one says nothing more is left; entries removed."""
    removed = 0
    for _ in range(1000):
        r = parse_trim(await client.evalsha(script, (S,), (7,)))
        removed += r.removed
        if not r.more:
            return removed
    raise AssertionError("the trim never finished")


async def needs(client: Client) -> list[GroupNeed]:
    """What each group needs, asked the non-atomic way (the test is alone on the server)."""
    out = []
    for g in group_rows(await client.execute("XINFO", "GROUPS", S)):
        first = None
        if g.pending:
            first = (await client.execute("XPENDING", S, g.name))[1].decode()
        out.append(GroupNeed(g.name, g.pending, g.last_delivered, first))
    return out


async def random_groups(client: Client, rng: random.Random) -> list[str]:
    """20 to 300 entries (their ids) read by one to three groups, each of which
    read some and acknowledged about 90% of what it read."""
    n = rng.randrange(20, 300)
    written = [(await client.execute("XADD", S, "*", "n", str(i))).decode() for i in range(n)]
    for gi in range(rng.randrange(1, 4)):
        name = f"g{gi}"
        await client.execute("XGROUP", "CREATE", S, name, "0")
        got = await client.execute("XREADGROUP", "GROUP", name, "c", "COUNT", rng.randrange(0, n + 1)
                                   or 1, "STREAMS", S, ">")
        read = [e[0] for e in got[0][1]] if got else []
        acked = [e for e in read if rng.random() < 0.9]
        if acked:
            await client.execute("XACK", S, name, *acked)
    return written


@pytest.mark.parametrize("seed", range(6))
async def test_trim_removes_exactly_what_every_group_is_done_with(client: Client, seed: int) -> None:
    rng = random.Random(seed)
    async with node_max_entries(client, rng.choice([3, 10, 100])):
        written = await random_groups(client, rng)
        model = oldest_needed(await needs(client))
        assert model is not None
        pending_or_unread = {
            eid for g in await needs(client) for eid in written if id_key(eid) >= id_key(g.oldest_needed)
        }
        await trim_all(client)
        left = [r[0].decode() for r in await client.execute("XRANGE", S, "-", "+")]
        # exactly the entries at or above the oldest needed one are left ...
        assert left == [e for e in written if id_key(e) >= id_key(model)]
        # ... so nothing a group has pending or not read went
        assert pending_or_unread <= set(left)
        assert oldest_needed(await needs(client)) == model  # nothing a group needs changed


async def check_trim_leaves_alone(client: Client, script: Any) -> None:
    """``script`` trims nothing of a missing key or a stream without groups and
    refuses another type."""
    r = parse_trim(await client.evalsha(script, (S,), (100,)))
    assert (r.removed, r.threshold, r.more, r.groups) == (0, None, False, ())  # no key
    for i in range(5):
        await client.execute("XADD", S, "*", "n", str(i))
    r = parse_trim(await client.evalsha(script, (S,), (100,)))
    assert r.threshold is None and int(await client.execute("XLEN", S)) == 5
    await client.execute("SET", "plain", "x")
    with pytest.raises(Exception, match="WRONGTYPE"):
        await client.evalsha(script, ("plain",), (100,))


async def test_trim_leaves_streams_without_groups_and_other_keys_alone(client: Client) -> None:
    await check_trim_leaves_alone(client, TRIM_ACKED)


# -- delete on finalize: a real consumer ------------------------------------------------

async def test_delete_on_finalize_refuses_a_stream_other_groups_read(redis_url: str, client: Client) -> None:
    """On the fallback (forced here, so on every server; Redis 8.2 allows it,
    see the native tests below)."""
    await client.execute("XGROUP", "CREATE", S, "audit", "0", "MKSTREAM")
    async with open_client(redis_url, native=False) as fallback, \
            open_consumer(fallback, name="c1") as consumer:
        with pytest.raises(ValueError, match="'audit'") as info:
            await consumer.mount(StreamSubscription(S, G, retention=DELETE), always(ACK))
        assert "TRIM_ACKED" in str(info.value) and S in str(info.value)
        # TRIM_ACKED is fine there
        await consumer.mount(StreamSubscription(S, G, retention=TRIM, block=0.05), always(ACK))


async def test_a_group_added_later_is_reported(redis_url: str, client: Client, quick_trim: None,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="trio_redis_finalize")
    async with open_client(redis_url, native=False) as fallback, \
            open_consumer(fallback, name="c1") as consumer:  # (on 8.2 not a loss: see below)
        await consumer.mount(StreamSubscription(S, G, retention=DELETE, block=0.05), always(ACK))
        await client.execute("XGROUP", "CREATE", S, "late", "$")

        def reported() -> bool:
            return any("'late'" in r.getMessage() for r in caplog.records)

        await eventually(reported, what="the late group reported")


async def test_delete_on_finalize_10000_messages_length_never_above_in_flight(
    redis_url: str, client: Client
) -> None:
    n_messages = 10_000
    sub = StreamSubscription(S, G, retention=DELETE, max_attempts=3, dead_letter=DEAD,
                             block=0.05, count=200)
    name = name_of(S, G)
    for start in range(0, n_messages, 1000):
        await client.pipeline([("XADD", S, "*", "n", str(i)) for i in range(start, start + 1000)])

    async def handle(d: Delivery) -> Outcome:
        n = int(d.fields[b"n"])
        if n % 100 == 1:
            return RETRY  # always: dead-lettered at attempt 3
        if n % 10 == 0 and d.attempt == 1:
            return RETRY  # once
        return ACK

    checks = 0
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, handle, concurrency=8)
        with trio.fail_after(90):
            while True:
                effects = consumer.stats()[name]["effects"]
                finished = effects.get("acked", 0) + effects.get("dead_lettered", 0)
                length = int(await client.execute("XLEN", S))
                # stats count what Redis confirmed, so Redis has finished at least as many
                assert length <= n_messages - finished, (length, finished)
                checks += 1
                if finished == n_messages:
                    break
                await trio.sleep(0.01)
        effects = consumer.stats()[name]["effects"]
    assert effects["dead_lettered"] == 100
    assert effects["copied"] == 1000 + 200  # one RETRY each of 1,000, two each of the 100 dead
    assert effects.get("failed", 0) == 0 and effects.get("lost_before_handling", 0) == 0
    assert int(await client.execute("XLEN", S)) == 0
    assert int((await client.execute("XPENDING", S, G))[0]) == 0
    assert int(await client.execute("XLEN", DEAD)) == 100
    assert checks > 1


async def test_delete_on_finalize_order_in_monitor(redis_url: str, client: Client,
                                                  server_caps: Capabilities) -> None:
    """What the server runs, in order: XACK then XDEL for ACK and DROP; inside
    the gated script XADD, XACK, XDEL for RETRY and the dead letter.  On Redis
    8.2 one XACKDEL instead of each XACK, XDEL."""
    if server_caps.xackdel:
        await _native_order_in_monitor(redis_url, client)
        return

    def all_finalized(consumer: Any) -> bool:
        return (consumer.stats()[name_of(S, G)]["effects"].get("acked") == 1
                and consumer.stats()[name_of(S, G)]["effects"].get("dead_lettered") == 2)

    seen = await _monitor_deletions(redis_url, client, all_finalized)
    # finalization writes (the producer's own XADDs, not from a script, aside)
    ops = [(lua, a[0].upper()) for lua, a in seen
           if a and a[0].upper() in ("XACK", "XDEL", "XADD") and a[1] in (S, DEAD)
           and (lua or a[0].upper() != "XADD")]
    assert ops[:2] == [(False, "XACK"), (False, "XDEL")]  # ack
    assert ops[2:4] == [(False, "XACK"), (False, "XDEL")]  # drop
    # retry at attempt 1 with max_attempts=1: dead letter, in the script
    assert (True, "XADD") in ops and ops.count((True, "XDEL")) == 2
    for i, op in enumerate(ops):
        if op == (True, "XDEL"):
            assert ops[i - 2:i] == [(True, "XADD"), (True, "XACK")]
    assert int(await client.execute("XLEN", S)) == 0


async def _monitor_deletions(
    url: str, client: Client, done: Callable[[Any], bool] | None = None
) -> list[Any]:
    """What MONITOR saw while a DELETE-retention consumer (max_attempts=1, a
    dead letter) finalized one entry each of ack, drop, retry and dead, each
    waited for until deleted (and then until ``done``, if given)."""
    from runtime.test_scripts import monitoring

    async def handle(d: Delivery) -> Outcome:
        n = d.fields[b"n"]
        if n == b"retry" and d.attempt == 1:
            return RETRY
        return {b"drop": DROP, b"dead": RETRY}.get(n, ACK)

    sub = StreamSubscription(S, G, retention=DELETE, max_attempts=1, dead_letter=DEAD, block=0.05)
    async with open_consumer(url, name="c1") as consumer:
        await consumer.mount(sub, handle)
        async with monitoring(client) as collect:
            for n in ("ack", "drop", "retry", "dead"):
                eid = (await client.execute("XADD", S, "*", "n", n)).decode()

                async def gone(eid: str = eid) -> bool:
                    return not await client.execute("XRANGE", S, eid, eid)

                await eventually(gone, what=f"{n} deleted")
            if done is not None:
                await eventually(lambda: done(consumer), what="all finalized")
            seen: list[Any] = await collect()
    return seen


async def _native_order_in_monitor(url: str, client: Client) -> None:
    seen = await _monitor_deletions(url, client)
    ops = [(lua, a[0].upper()) for lua, a in seen
           if a and a[0].upper() in ("XACK", "XDEL", "XACKDEL", "XADD") and a[1] in (S, DEAD)
           and (lua or a[0].upper() != "XADD")]
    assert ops[:2] == [(False, "XACKDEL"), (False, "XACKDEL")]  # ack, drop: one command each
    assert ("XACK" not in {op for _, op in ops}) and ("XDEL" not in {op for _, op in ops})
    assert ops.count((True, "XACKDEL")) == 2  # the dead letters, inside the gated script
    for i, op in enumerate(ops):
        if op == (True, "XACKDEL"):
            assert ops[i - 1] == (True, "XADD")  # the copy first
    assert int(await client.execute("XLEN", S)) == 0


# -- trim acked: real consumers -----------------------------------------------------------

async def test_three_groups_at_different_speeds_miss_nothing_and_the_stream_shrinks(
    redis_url: str, client: Client, quick_trim: None
) -> None:
    groups = {"fast": 0.0, "medium": 0.0005, "slow": 0.002}
    seen: dict[str, set[str]] = {g: set() for g in groups}

    def handler(group: str) -> Any:
        pause = groups[group]

        async def handle(d: Delivery) -> Outcome:
            if pause:
                await trio.sleep(pause)
            assert d.id is not None
            seen[group].add(d.id)
            return ACK

        return handle

    produced: list[str] = []
    async with open_consumer(redis_url, name="c1") as consumer:
        for g in groups:
            await consumer.mount(StreamSubscription(S, g, retention=TRIM, block=0.05, count=20),
                                 handler(g))
        for batch in range(8):
            replies = await client.pipeline([("XADD", S, "*", "b", str(batch), "i", str(i))
                                             for i in range(60)])
            produced += [r.decode() for r in replies]
            await trio.sleep(0.05)
            # never below what some group has not finished: the length first, then
            # what the groups have handled (which only grows meanwhile)
            length = int(await client.execute("XLEN", S))
            behind = len(produced) - min(len(s) for s in seen.values())
            assert length >= behind, (length, behind)
        await eventually(lambda: all(len(s) == len(produced) for s in seen.values()),
                         timeout=30, what="every group has seen every entry")

        async def shrunk() -> bool:
            return int(await client.execute("XLEN", S)) == 0

        await eventually(shrunk, what="the stream trimmed to nothing once every group passed")

        def trimmed() -> int:
            return sum(consumer.stats()[name_of(S, g)]["effects"].get("trimmed", 0)
                       for g in groups)

        # the last XTRIM's reply may still be on its way to the counter when
        # XLEN already answers 0 (seen once under load: 475 of 480)
        await eventually(lambda: trimmed() >= len(produced), what="every trim counted")
        stats = consumer.stats()
    for g in groups:
        assert seen[g] == set(produced), g
        effects = stats[name_of(S, g)]["effects"]
        assert effects.get("lost_before_handling", 0) == 0
    assert sum(stats[name_of(S, g)]["effects"].get("trimmed", 0) for g in groups) == len(produced)


async def test_with_no_group_lagging_the_length_stays_bounded(
    redis_url: str, client: Client, quick_trim: None
) -> None:
    batch = 100
    longest = 0
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, retention=TRIM, block=0.05), always(ACK),
                             concurrency=4)
        for _ in range(20):
            await client.pipeline([("XADD", S, "*", "n", "x")] * batch)
            longest = max(longest, int(await client.execute("XLEN", S)))

            async def trimmed() -> bool:
                return int(await client.execute("XLEN", S)) == 0

            await eventually(trimmed, what="the batch trimmed once handled")
    assert 0 < longest <= batch  # 2,000 written, never more than one batch kept


async def test_a_refused_trim_is_logged_and_tried_again(
    redis_url: str, client: Client, quick_trim: None, caplog: pytest.LogCaptureFixture
) -> None:
    """READONLY (the server became a replica): the trim fails, is logged, the
    reader lives on; once the server is a master again the stream is trimmed."""
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    got: list[str] = []

    async def handle(d: Delivery) -> Outcome:
        assert d.id is not None
        got.append(d.id)
        return ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, retention=TRIM, block=0.05), handle)
        await client.pipeline([("XADD", S, "*", "n", str(i)) for i in range(10)])
        await eventually(lambda: len(got) == 10, what="first entries handled")
        await client.execute("REPLICAOF", "127.0.0.1", "1")  # a master that never answers
        try:
            await eventually(lambda: any("retention trim" in r.getMessage() for r in caplog.records),
                             what="the refused trim logged")
        finally:
            await client.execute("REPLICAOF", "NO", "ONE")
        await client.pipeline([("XADD", S, "*", "n", str(i)) for i in range(10)])
        await eventually(lambda: len(got) == 20, what="the reader goes on")

        async def trimmed() -> bool:
            return int(await client.execute("XLEN", S)) == 0

        await eventually(trimmed, what="trimmed again")
        assert not consumer.mounts[0].done.is_set()


# -- Redis Cluster ------------------------------------------------------------------------

async def test_retention_on_redis_cluster(redis_cluster_url: str, quick_trim: None) -> None:
    """DELETE_ON_FINALIZE with a dead letter on another slot (copy, XACK, XDEL as
    three commands in that order), and TRIM_ACKED, through ``redis+cluster://``."""
    dead = "elsewhere-dead"
    work, log_ = "{work}.jobs", "{log}.events"

    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.fields[b"n"] == b"bad" else ACK

    async with open_client(redis_cluster_url) as cc, open_consumer(cc, name="c1") as consumer:
        await consumer.mount(StreamSubscription(work, G, retention=DELETE, max_attempts=1,
                                                dead_letter=dead, block=0.05), handle)
        await consumer.mount(StreamSubscription(log_, G, retention=TRIM, block=0.05), always(ACK))
        for n in (b"ok", b"bad", b"ok"):
            await cc.execute("XADD", work, "*", "n", n)
            await cc.execute("XADD", log_, "*", "n", n)

        async def both_empty() -> bool:
            lens = [int(await cc.execute("XLEN", k)) for k in (work, log_)]
            return lens == [0, 0]

        await eventually(both_empty, what="both streams emptied")
        assert int(await cc.execute("XLEN", dead)) == 1
        stats = consumer.stats()
    assert stats[name_of(work, G)]["effects"]["dead_lettered"] == 1
    assert stats[name_of(log_, G)]["effects"]["trimmed"] == 3


# -- inspect ------------------------------------------------------------------------------

def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trio_redis_finalize", *args],
                          capture_output=True, text=True, timeout=60)


async def test_inspect_shows_what_a_trim_would_remove(redis_url: str) -> None:
    async with open_client(redis_url) as client:
        written = [(await client.execute("XADD", S, "*", "n", str(i))).decode() for i in range(10)]
        await client.execute("XGROUP", "CREATE", S, "a", "0")
        await client.execute("XGROUP", "CREATE", S, "b", "0")
        await client.execute("XREADGROUP", "GROUP", "a", "c", "COUNT", 6, "STREAMS", S, ">")
        await client.execute("XACK", S, "a", *written[:4])  # a: 4, 5 pending; needs 4
        await client.execute("XREADGROUP", "GROUP", "b", "c", "COUNT", 8, "STREAMS", S, ">")
        await client.execute("XACK", S, "b", *written[:8])  # b: needs 8
    r = await trio.to_thread.run_sync(lambda: cli("inspect", S, "--url", redis_url, "--json"))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["length"] == 10
    needed = {g["name"]: g["oldest_needed_id"] for g in info["groups"]}
    assert needed == {"a": written[4], "b": next_id(written[7])}
    assert info["retention"] == {"oldest_needed_id": written[4], "trimmable": 4,
                                 "trimmable_capped": False}
    r = await trio.to_thread.run_sync(lambda: cli("inspect", S, "--url", redis_url))
    assert r.returncode == 0, r.stderr
    assert "oldest needed" in r.stdout and written[4] in r.stdout
    assert "trim would remove" in r.stdout


# -- Redis 8.2: the native path ---------------------------------------------------------

NATIVE = Capabilities(xackdel=True, acked_trim=True)


def native_target(**kw: Any) -> Any:
    return dataclasses.replace(target(**kw), caps=NATIVE)


def test_native_delete_on_finalize_plans_use_xackdel() -> None:
    t = native_target(retention=DELETE, max_attempts=3, dead_letter=DEAD, dead_letter_maxlen=50,
                      copy_maxlen=1000)
    d = delivery()
    xackdel = ("XACKDEL", S, G, "ACKED", "IDS", 1, d.id)
    assert t.xackdel and t.acked
    assert plan(t, d, ACK).commands == (xackdel,)
    assert plan(t, d, DROP).commands == (xackdel,)
    assert plan_lost(t, d).commands == (xackdel,)
    # another group's copy: XACKDEL ACKED deletes it only once no group references it
    assert plan_foreign(t, d).commands == (xackdel,)
    for kind, effect in plain_removals(t).items():
        assert plan(t, d, Outcome(kind)).effect is effect
    two = [d, delivery("1700000000000-8")]
    assert removal_commands(t, two) == [("XACKDEL", S, G, "ACKED", "IDS", 2, d.id, "1700000000000-8")]
    # RETRY: the gated script with XACKDEL inside (its cap a plain MAXLEN ~)
    (cmd,) = plan(t, d, RETRY).commands
    assert cmd[:2] == (b"EVALSHA", STREAM_COPY_ACK_EX.sha) and cmd[5:9] == (G, d.id, "x", 1000)
    (cmd,) = plan(t, delivery(attempt=3, retries=2), RETRY).commands
    assert cmd[4] == DEAD and cmd[7:9] == ("x", 50)
    td = native_target(retention=DELETE, delayed_retry=DelayedRetry.DURABLE_ZSET)
    (cmd,) = plan(td, d, retry_after(1.0)).commands
    assert cmd[:2] == (b"EVALSHA", STREAM_ZADD_ACKDEL.sha)
    p = plan(t, d, retry_after(1.0))
    assert runtime_removal(p) == (S, G, d.id, "x")
    assert runtime_copy(p) == (S, 1000)
    assert plan_dead(native_target(retention=DELETE, max_attempts=1, dead_letter=None),
                     d, "x").commands == (xackdel,)
    # Redis Cluster, dead letter on another slot: the capped copy, then the XACKDEL
    tc = dataclasses.replace(StreamSubscription(
        S, G, retention=DELETE, max_attempts=1, dead_letter="elsewhere", dead_letter_maxlen=7,
    ).target("c1", cluster=True), caps=NATIVE)
    p = plan(tc, d, RETRY)
    assert not p.gated
    assert cross_slot_copy(p) == ("elsewhere", 7)
    assert p.commands[1:] == (xackdel,)


def test_native_caps_stay_plain_and_without_retention_nothing_changes() -> None:
    """The ``*_maxlen`` caps are ``MAXLEN ~ n`` on Redis 8.2 too (its ``~ ...
    ACKED`` removes nothing, see ``_lua.HOW``); without DELETE_ON_FINALIZE the
    plans are the fallback's."""
    t = native_target(copy_maxlen=1000, max_attempts=3, dead_letter=DEAD, dead_letter_maxlen=50)
    d = delivery()
    assert not t.xackdel and t.acked
    fallback = target(copy_maxlen=1000, max_attempts=3, dead_letter=DEAD, dead_letter_maxlen=50)
    for outcome in (ACK, DROP, RETRY, retry_after(1.0)):
        assert without_receipts(plan(t, d, outcome).commands) == without_receipts(
            plan(fallback, d, outcome).commands)
    assert runtime_copy(plan(t, d, retry_after(1.0))) == runtime_copy(
        plan(fallback, d, retry_after(1.0)))
    dead = delivery(attempt=3, retries=2)
    assert plan(t, dead, RETRY).commands == plan(fallback, dead, RETRY).commands
    assert plan_foreign(t, d).commands == (("XACK", S, G, d.id),)


def test_copy_how_says_how_the_script_removes() -> None:
    x, a = Capabilities(xackdel=True), Capabilities(acked_trim=True)
    cases = [
        (target(), "0"), (target(retention=DELETE), "1"),
        (dataclasses.replace(target(retention=DELETE), caps=NATIVE), "x"),
        (dataclasses.replace(target(retention=DELETE), caps=x), "x"),
        (dataclasses.replace(target(retention=DELETE), caps=a), "1"),
        (dataclasses.replace(target(), caps=x), "0"),
        (dataclasses.replace(target(retention=TRIM), caps=NATIVE), "0"),
    ]
    for t, how in cases:
        assert copy_how(t) == how, (t.retention, t.caps)


async def native_pending(client: Client, n: int = 1, groups: Sequence[str] = (G,)) -> list[str]:
    """``n`` entries in ``S``, read by every group of ``groups`` (pending there)."""
    ids = [(await client.execute("XADD", S, "*", "n", str(i))).decode() for i in range(n)]
    for g in groups:
        await client.execute("XGROUP", "CREATE", S, g, "0")
        await client.execute("XREADGROUP", "GROUP", g, "c1", "COUNT", n, "STREAMS", S, ">")
    return ids


async def test_native_scripts_delete_only_what_no_group_references(redis82_url: str) -> None:
    """STREAM_COPY_ACK_EX ``x``: the copy written, the original acknowledged and
    -- once the other group acknowledged it too -- deleted; gated: once."""
    async with open_client(redis82_url) as client:
        [eid] = await native_pending(client, groups=(G, "audit"))
        cmd = STREAM_COPY_ACK_EX.command((S, S), (G, eid, "x", 0, "n", "copy"))
        first, second = await client.pipeline([cmd, cmd])
        assert first is not None and second is None  # the gate: one copy
        assert await client.execute("XRANGE", S, eid, eid)  # kept: audit has it pending
        assert int((await client.execute("XPENDING", S, G))[0]) == 0
        assert await client.execute("XACKDEL", S, "audit", "ACKED", "IDS", 1, eid) == [1]
        assert not await client.execute("XRANGE", S, eid, eid)
        # the durable delay's script, alone on its stream: deleted at once
        await client.execute("DEL", S)
        [eid] = await native_pending(client)
        await check_zadd_deletes_once(client, STREAM_ZADD_ACKDEL, eid)


async def test_native_batched_scripts_remove_with_one_xackdel(redis82_url: str) -> None:
    async with open_client(redis82_url) as client, node_max_entries(client, 2):
        ids = await native_pending(client, 4, groups=(G, "audit"))
        await client.execute("XACK", S, "audit", ids[0], ids[1])  # audit is done with two
        parts = [x for eid in ids[:3] for x in (eid, 2, "n", "copy")]
        cmd = STREAM_COPY_ACK_BATCH.command((S, DEAD), (G, "x", 10, ids[0], ids[2], 6, *parts))
        reply = await client.evalsha(STREAM_COPY_ACK_BATCH, (S, DEAD),
                                     (G, "x", 10, ids[0], ids[2], 6, *parts))
        assert reply == [3]  # every delivery copied and removed
        left = [r[0].decode() for r in await client.execute("XRANGE", S, "-", "+")]
        assert left == ids[2:]  # deleted where audit had finished, kept where not
        assert int((await client.execute("XPENDING", S, G))[0]) == 1  # only ids[3]
        assert await client.pipeline([cmd]) == [[3, 1, None, 2, None, 3, None]]  # gated: once
        zparts = [ids[3], 0, b"m"]
        z = await client.evalsha(STREAM_ZADD_ACK_BATCH, (S, "{orders}:d"),
                                 (G, "x", ids[3], ids[3], 2, *zparts))
        assert z == [1]  # (a batch of one, as the library never sends it)
        assert await client.execute("XRANGE", S, ids[3], ids[3])  # audit still has it
        assert int((await client.execute("XPENDING", S, G))[0]) == 0


@pytest.mark.parametrize("seed", range(6))
async def test_native_trim_removes_each_entry_every_group_acknowledged(redis82_url: str,
                                                                       seed: int) -> None:
    """Against the model of ACKED: an entry goes iff every group read it (at or
    below its last-delivered id) and has it no longer pending -- also above a
    stuck pending entry."""
    rng = random.Random(seed)
    async with open_client(redis82_url) as client, node_max_entries(client, rng.choice([3, 10, 100])):
        written = await random_groups(client, rng)
        n = len(written)
        groups = await needs(client)
        pending: set[str] = set()
        for g in groups:
            if g.pending:
                rows = await client.execute("XPENDING", S, g.name, "-", "+", n)
                pending |= {r[0].decode() for r in rows}
        bound = min((next_id(g.last_delivered) for g in groups), key=id_key)
        keep = [e for e in written if id_key(e) >= id_key(bound) or e in pending]
        await trim_all(client, TRIM_ACKED_NATIVE)
        left = [r[0].decode() for r in await client.execute("XRANGE", S, "-", "+")]
        assert left == keep
        r = parse_trim(await client.evalsha(TRIM_ACKED_NATIVE, (S,), (7,)))
        assert r.threshold == bound and r.removed == 0


async def test_native_trim_leaves_streams_without_groups_and_other_keys_alone(
        redis82_url: str) -> None:
    """ACKED alone would trim a stream without groups to nothing: the script's guard."""
    async with open_client(redis82_url) as client:
        await check_trim_leaves_alone(client, TRIM_ACKED_NATIVE)


async def test_native_two_groups_share_a_delete_on_finalize_stream(redis82_url: str) -> None:
    """Both groups see every entry; an entry is deleted only once both finalized
    it (whichever finishes last deletes it), and the mount is not refused."""
    n = 200
    seen: dict[str, set[str]] = {"billing": set(), "audit": set()}
    left_when: dict[str, int] = {}

    def handler(group: str, pause: float) -> Any:
        async def handle(d: Delivery) -> Outcome:
            assert d.id is not None
            if pause:
                await trio.sleep(pause)
            seen[group].add(d.id)
            return ACK

        return handle

    async with open_client(redis82_url) as client, open_consumer(redis82_url, name="c1") as consumer:
        await client.execute("XGROUP", "CREATE", S, "audit", "0", "MKSTREAM")  # not reading yet
        ids = [r.decode() for r in await client.pipeline([("XADD", S, "*", "n", str(i))
                                                          for i in range(n)])]
        await consumer.mount(StreamSubscription(S, "billing", retention=DELETE, block=0.05),
                             handler("billing", 0.0))
        await eventually(lambda: len(seen["billing"]) == n, what="billing finished")
        # billing is done, audit has not started: nothing may be gone
        left_when["billing done"] = int(await client.execute("XLEN", S))
        await consumer.mount(StreamSubscription(S, "audit", retention=DELETE, block=0.05),
                             handler("audit", 0.001))

        async def emptied() -> bool:
            return int(await client.execute("XLEN", S)) == 0

        await eventually(emptied, timeout=30, what="the stream emptied once both finished")

        def counted() -> bool:  # the last XACKDEL ran (the stream empty); its reply counts next
            return all(consumer.stats()[name_of(S, g)]["effects"].get("acked") == n
                       for g in ("billing", "audit"))

        await eventually(counted, timeout=10,
                         what=lambda: "every ACK counted: " + str(
                             [consumer.stats()[name_of(S, g)]["effects"] for g in ("billing", "audit")]))
        stats = consumer.stats()
    assert left_when["billing done"] == n
    assert seen["billing"] == seen["audit"] == set(ids)
    for g in ("billing", "audit"):
        effects = stats[name_of(S, g)]["effects"]
        assert effects["acked"] == n and effects.get("gate_closed", 0) == 0, (g, effects)


async def test_native_mount_allows_other_groups_and_the_fallback_refuses(redis82_url: str) -> None:
    """The same Redis 8.2 stream, read by another group: the native mount goes
    on, a forced fallback (``native=False``) refuses, naming the group."""
    async with open_client(redis82_url) as client:
        await client.execute("XGROUP", "CREATE", S, "audit", "0", "MKSTREAM")
    async with open_consumer(redis82_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, retention=DELETE, block=0.05), always(ACK))
        assert consumer.mounts[0].target.xackdel
    async with open_client(redis82_url, native=False) as fallback, \
            open_consumer(fallback, name="c1") as consumer:
        with pytest.raises(ValueError, match="'audit'"):
            await consumer.mount(StreamSubscription(S, G, retention=DELETE), always(ACK))


@pytest.mark.parametrize("forced_fallback", [False, True], ids=["native", "fallback"])
async def test_native_trim_acked_passes_a_stuck_entry(redis82_url: str, quick_trim: None,
                                                      forced_fallback: bool) -> None:
    """One entry read by a consumer that never finalizes it, 100 more handled:
    the native trim removes the 100 (acknowledged by every group); the
    fallback's threshold stops at the stuck one and keeps them all."""
    async with open_client(redis82_url, native=not forced_fallback) as client:
        await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
        stuck = (await client.execute("XADD", S, "*", "n", "stuck")).decode()
        await client.execute("XREADGROUP", "GROUP", G, "gone", "COUNT", 1, "STREAMS", S, ">")
        await client.pipeline([("XADD", S, "*", "n", str(i)) for i in range(100)])
        async with open_consumer(client, name="c1") as consumer:
            await consumer.mount(StreamSubscription(S, G, retention=TRIM, block=0.05), always(ACK))
            name = name_of(S, G)
            await eventually(lambda: consumer.stats()[name]["effects"].get("acked", 0) == 100,
                             what="100 handled")
            if not forced_fallback:
                async def only_stuck() -> bool:
                    return [r[0].decode() for r in await client.execute("XRANGE", S, "-", "+")] == [stuck]

                await eventually(only_stuck, what="everything but the stuck entry trimmed")
                await eventually(lambda: consumer.stats()[name]["effects"].get("trimmed", 0) == 100,
                                 what="the trim counted")
            else:
                await trio.sleep(0.3)  # many trim steps (every 20 ms)
                assert int(await client.execute("XLEN", S)) == 101
