"""Error replies (DESIGN §4 "Error replies", issue 12 items 1, 8, 14).

Real faults only: ``CONFIG SET maxmemory 1`` (OOM), ``REPLICAOF`` a dead port
(READONLY), ``min-replicas-to-write`` (NOREPLICAS), another client's busy Lua
loop (BUSY), a closed gate made by acknowledging from outside, an ACL user
that may not run ``XACK`` (NOPERM inside the batched script, after its copies).  Run on Redis
6.2 (wraps inner errors in ``Error running script ... -OOM``), 7.0 and Valkey
9.1 (``TRF_REDIS_SERVER``).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from _procs import always, eventually, pel_count

from faults.server_faults import busy_server
from trio_redis_finalize import (
    ACK,
    ORIGIN_FIELD,
    RETRY,
    Delivery,
    ListSubscription,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(60)


# -- item 1: the finalizer sends again what did not run ------------------------------


async def oom_retried_then_off(consumer: Any, first_done: trio.Event, oom: Any) -> str:
    """Once the first RETRY is answered (OOM on): its finalization is tried
    again, with nothing copied; then OOM off.  The subscription's name."""
    await first_done.wait()
    name: str = consumer.mounts[0].name
    await eventually(lambda: consumer.stats()[name]["finalize_errors"] >= 2,
                     what="the OOM retried")
    assert consumer.stats()[name]["effects"].get("copied", 0) == 0
    oom.off()
    return name


async def test_retry_under_oom_is_sent_again_not_dropped(
    redis_url: str, client: Client, oom: Any
) -> None:
    """A gated RETRY answered OOM did not run: it is sent again once memory is back
    (before: logged as failed, the copy never written, the entry stranded)."""
    await client.execute("XADD", "s", "*", "n", "1")
    seen: list[int] = []
    first_done = trio.Event()

    async def handler(d: Delivery) -> Outcome:
        seen.append(d.attempt)
        if d.attempt == 1:
            oom.on()
            first_done.set()
            return RETRY
        return ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription("s", "g", block=0.1), handler)
        name = await oom_retried_then_off(consumer, first_done, oom)
        await eventually(lambda: seen == [1, 2] and consumer.stats()[name]["effects"].get("acked"),
                         what="the copy written and handled")
        effects = consumer.stats()[name]["effects"]
        assert effects["copied"] == 1 and effects.get("failed", 0) == 0, effects
    assert await pel_count(client, "s", "g") == 0
    assert await client.execute("XLEN", "s") == 2


async def test_runtime_delayed_copy_under_oom_is_requeued(
    redis_url: str, client: Client, oom: Any
) -> None:
    """retry_after (runtime): the XACK goes at once, the XADD copy at the timer.  An OOM
    on that XADD re-queues the copy (before: counted "released" and lost)."""
    await client.execute("XADD", "s", "*", "n", "1")
    seen: list[int] = []

    async def handler(d: Delivery) -> Outcome:
        seen.append(d.attempt)
        return retry_after(0.3) if d.attempt == 1 else ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription("s", "g", block=0.1), handler)
        name = consumer.mounts[0].name
        await eventually(lambda: consumer.stats()[name]["held"] == 1, what="copy held")
        oom.on()
        await eventually(lambda: consumer.stats()[name]["finalize_errors"] >= 1,
                         what="the copy refused")
        stats = consumer.stats()[name]
        assert stats["effects"].get("released", 0) == 0, stats
        assert stats["held"] == 1  # back in the heap, not lost
        oom.off()
        await eventually(lambda: seen == [1, 2], timeout=15, what="the copy handled")
        # the reader may see the copy before the scheduler has counted its reply
        await eventually(lambda: consumer.stats()[name]["effects"].get("released") == 1,
                         what="the copy counted released")
    assert await pel_count(client, "s", "g") == 0


@pytest.mark.parametrize("form", ["stream", "reliable-list"])
async def test_copies_refused_through_the_shutdown_are_counted_lost_and_logged(
    redis_url: str, client: Client, oom: Any, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, form: str,
) -> None:
    """A runtime copy the server refuses (OOM) until the flush's deadline is
    counted ``held_lost`` and logged with its subscription.  A stream's is
    lost (the original was acknowledged); a reliable list's original is
    still in its processing list."""
    from trio_redis_finalize import _shutdown
    monkeypatch.setattr(_shutdown, "FINALIZE_GRACE", 1.0)  # the flush ends 3.5 s after
    monkeypatch.setattr(_shutdown, "FLUSH_GRACE", 1.0)     # the shutdown began, not 21.5 s
    sub: StreamSubscription | ReliableListSubscription
    if form == "stream":
        await client.execute("XADD", "s", "*", "n", "1")
        sub = StreamSubscription("s", "g", block=0.1)
    else:
        await client.execute("LPUSH", "q", b"job")
        sub = ReliableListSubscription("q", block=0.1)

    async with open_consumer(redis_url, name="c1", shutdown_grace=0.5) as consumer:
        await consumer.mount(sub, always(retry_after(60)))
        await eventually(lambda: consumer.stats()[sub.name]["held"] == 1, what="copy held")
        oom.on()
    stats = consumer.stats()[sub.name]
    oom.off()
    assert stats["effects"].get("held_lost") == 1, stats
    assert stats["held"] == 0 and stats["effects"].get("released", 0) == 0
    [record] = [r for r in caplog.records if "before shutting down" in r.getMessage()]
    assert record.subscription == sub.name  # type: ignore[attr-defined]
    if form == "stream":
        assert await pel_count(client, "s", "g") == 0  # acknowledged: the copy was the message
        assert await client.execute("XLEN", "s") == 1
    else:
        assert await client.execute("LLEN", "{q}:processing:c1") == 1  # recovered on restart
        assert await client.execute("LLEN", "q") == 0


async def test_a_finalization_the_shutdown_cuts_is_logged_and_stays_pending(
    redis_url: str, client: Client, oom: Any, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A RETRY the server refuses (OOM) until the finalizer's shutdown deadline:
    the cut is logged with its subscription and count (before: nothing said),
    and the delivery stays pending, no copy written."""
    from trio_redis_finalize import _shutdown
    monkeypatch.setattr(_shutdown, "FINALIZE_GRACE", 1.0)
    monkeypatch.setattr(_shutdown, "FLUSH_GRACE", 1.0)
    await client.execute("XADD", "s", "*", "n", "1")
    refused = trio.Event()

    async def handler(d: Delivery) -> Outcome:
        oom.on()
        refused.set()
        return RETRY

    async with open_consumer(redis_url, name="c1", shutdown_grace=0.5) as consumer:
        sub = StreamSubscription("s", "g", block=0.1)
        await consumer.mount(sub, handler)
        await refused.wait()
        await eventually(lambda: consumer.stats()[sub.name]["finalize_errors"] >= 1,
                         what="the copy refused")
    oom.off()
    [record] = [r for r in caplog.records if "cut finalization" in r.getMessage()]
    assert record.subscription == sub.name  # type: ignore[attr-defined]
    assert "with 1 outcome not confirmed" in record.getMessage()
    assert await pel_count(client, "s", "g") == 1
    assert await client.execute("XLEN", "s") == 1
    assert "copied" not in consumer.stats()[sub.name]["effects"]


def test_the_shutdown_cuts_and_losses_are_reported_under_asyncio(
    redis_url: str, oom: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The two reports above under anyio's asyncio backend: a RETRY refused
    until the finalizer's deadline (the cut, logged; it stays pending) and a
    runtime copy refused until the flush's (counted held_lost, logged)."""
    import anyio

    from trio_redis_finalize import _shutdown
    from trio_redis_finalize._transport import open_client
    monkeypatch.setattr(_shutdown, "FINALIZE_GRACE", 1.0)
    monkeypatch.setattr(_shutdown, "FLUSH_GRACE", 1.0)
    retry, later = StreamSubscription("s", "g", block=0.05), StreamSubscription("t", "g", block=0.05)

    async def main() -> tuple[dict[str, Any], int, int]:
        async def handler(d: Delivery) -> Outcome:
            if d.source == "t":
                return retry_after(60)
            oom.on()  # from here the server refuses the copy (and the held one)
            return RETRY

        async with open_client(redis_url) as c:
            await c.execute("XADD", "t", "*", "n", "1")
            await c.execute("XADD", "s", "*", "n", "1")
            async with open_consumer(redis_url, name="aio", shutdown_grace=0.2) as consumer:
                await consumer.mount(later, handler)
                with anyio.fail_after(10):
                    while consumer.stats()[later.name]["held"] != 1:
                        await anyio.sleep(0.02)
                    await consumer.mount(retry, handler)
                    while consumer.stats()[retry.name]["finalize_errors"] < 1:
                        await anyio.sleep(0.02)
            oom.off()
            return (consumer.stats(), int((await c.execute("XPENDING", "s", "g"))[0]),
                    int(await c.execute("XLEN", "t")))

    stats, pending, t_len = anyio.run(main, backend="asyncio")
    assert stats[later.name]["effects"].get("held_lost") == 1 and t_len == 1
    texts = [r.getMessage() for r in caplog.records]
    assert any(t.startswith(f"{later.name}: could not publish 1 held") for t in texts), texts
    assert any(t.startswith(f"{retry.name}: the shutdown's deadline cut") for t in texts), texts
    assert pending == 1


async def test_final_error_on_delayed_copy_is_counted_not_released(
    redis_url: str, client: Client
) -> None:
    """A final error reply to a runtime copy is logged with key and command and
    counted as failed, never as released."""
    await client.execute("LPUSH", "l", "x")

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(ListSubscription("l", block=0.1), always(retry_after(0.3)))
        name = consumer.mounts[0].name
        await eventually(lambda: consumer.stats()[name]["held"] == 1, what="copy held")
        await client.execute("SET", "l", "not a list")
        await eventually(lambda: consumer.stats()[name]["effects"].get("failed") == 1,
                         what="the WRONGTYPE counted")
        assert consumer.stats()[name]["effects"].get("released", 0) == 0
        await client.execute("DEL", "l")


# -- item 8: transient replies never end a reader ------------------------------------


@pytest.mark.parametrize("form", ["stream", "reliable-list", "list"])
async def test_busy_server_does_not_end_a_reader(
    redis_url: str, redis_server: RedisServer, client: Client, form: str
) -> None:
    seen: list[bytes] = []

    async def handler(d: Delivery) -> Outcome:
        seen.append(d.fields[b"n"] if d.data is None else d.data)
        return ACK

    sub = {
        "stream": StreamSubscription("s", "g", block=0.05),
        "reliable-list": ReliableListSubscription("q", block=0.05),
        "list": ListSubscription("l", block=0.05),
    }[form]
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, handler)
        name = consumer.mounts[0].name
        async with busy_server(redis_server):
            # the blocked read times out, then every new request is answered BUSY
            await eventually(lambda: consumer.stats()[name]["read_errors"] >= 3, timeout=10,
                             what="BUSY reads")
        if form == "stream":
            await client.execute("XADD", "s", "*", "n", "after")
        else:
            await client.execute("LPUSH", "q" if form == "reliable-list" else "l", "after")
        await eventually(lambda: seen == [b"after"], timeout=10, what="reading again")


# -- item 14: a closed gate is its own effect -----------------------------------------


async def test_closed_gate_counts_gate_closed_not_copied(redis_url: str, client: Client) -> None:
    await client.execute("XADD", "s", "*", "n", "1")
    calls: list[int] = []

    async def handler(d: Delivery) -> Outcome:
        calls.append(d.attempt)
        # another finalizer got there first: the gate of the RETRY script is closed
        await client.execute("XACK", "s", "g", d.id or "")
        return RETRY

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription("s", "g", block=0.1), handler)
        name = consumer.mounts[0].name
        await eventually(lambda: consumer.stats()[name]["effects"], what="finalized")
        effects = consumer.stats()[name]["effects"]
        assert effects == {"gate_closed": 1}, effects
    assert await client.execute("XLEN", "s") == 1  # no copy was written
    assert calls == [1]


# -- issue 16 item 3: batched gated scripts, settled per delivery ----------------------


async def _batched_script_ran(client: Client) -> bool:
    from trio_redis_finalize._core.stream.scripts import STREAM_COPY_ACK_BATCH

    return (await client.execute("SCRIPT", "EXISTS", STREAM_COPY_ACK_BATCH.sha)) == [1]


async def test_batched_retry_under_oom_sends_each_delivery_again(
    redis_url: str, client: Client, oom: Any
) -> None:
    """Three RETRYs in one batch, one batched call: each delivery answered OOM
    (nothing of it written) is sent again, alone, until memory is back."""
    await client.execute("XGROUP", "CREATE", "s", "g", "0", "MKSTREAM")
    for i in range(3):
        await client.execute("XADD", "s", "*", "n", str(i))
    seen: list[tuple[str, int]] = []
    first_done = trio.Event()

    async def handler(d: Delivery) -> Outcome:
        seen.append((d.fields[b"n"].decode(), d.attempt))
        if d.attempt == 1:
            if len(seen) == 3:
                oom.on()
                first_done.set()
            return RETRY
        return ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription("s", "g", block=0.1, count=10), handler)
        name = await oom_retried_then_off(consumer, first_done, oom)
        await eventually(lambda: consumer.stats()[name]["effects"].get("acked", 0) == 3,
                         what="the copies written and handled")
        effects = consumer.stats()[name]["effects"]
        assert effects["copied"] == 3 and effects.get("failed", 0) == 0, effects
    assert sorted(seen) == [(str(i), a) for i in range(3) for a in (1, 2)]
    assert await pel_count(client, "s", "g") == 0
    assert await client.execute("XLEN", "s") == 6
    assert await _batched_script_ran(client)


async def test_batched_half_closed_gates_count_each_delivery(
    redis_url: str, client: Client
) -> None:
    """One of three was finalized by someone else: gate_closed for it, copied for the others."""
    await client.execute("XGROUP", "CREATE", "s", "g", "0", "MKSTREAM")
    for i in range(3):
        await client.execute("XADD", "s", "*", "n", str(i))

    async def handler(d: Delivery) -> Outcome:
        if d.fields[b"n"] == b"1":
            await client.execute("XACK", "s", "g", d.id or "")
        return RETRY if d.attempt == 1 else ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription("s", "g", block=0.1, count=10), handler)
        name = consumer.mounts[0].name
        await eventually(lambda: consumer.stats()[name]["effects"].get("acked", 0) == 2,
                         what="the copies handled")
        effects = consumer.stats()[name]["effects"]
        assert effects == {"copied": 2, "gate_closed": 1, "acked": 2}, effects
    assert await client.execute("XLEN", "s") == 5
    assert await _batched_script_ran(client)


async def test_batched_dead_letters_to_a_wrong_type_fail_each_and_name_it(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """The dead letter is a string: each delivery's element is WRONGTYPE (final):
    each fails, logged with its entry and the command and keys, and stays pending."""
    await client.execute("XGROUP", "CREATE", "s", "g", "0", "MKSTREAM")
    ids = [(await client.execute("XADD", "s", "*", "n", str(i))).decode() for i in range(2)]
    calls: list[str] = []
    both = trio.Event()

    async def handler(d: Delivery) -> Outcome:
        # Both return in the same step, so that their outcomes reach the
        # finalizer together (one batched call) however slow the machine:
        # the first sets the trap and waits for the second to have begun.
        calls.append(d.id or "")
        if len(calls) == 1:  # after the mount's own type check
            await client.execute("SET", "dl", "x")
            await eventually(lambda: len(calls) == 2, what="the second handler begun")
            both.set()
        await both.wait()
        return RETRY

    caplog.set_level("INFO", logger="trio_redis_finalize")
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription("s", "g", block=0.1, count=10, max_attempts=1,
                                                dead_letter="dl"), handler, concurrency=2)
        name = consumer.mounts[0].name
        await eventually(lambda: consumer.stats()[name]["effects"].get("failed", 0) >= 2,
                         what="both failed")
        stats = consumer.stats()[name]
        assert stats["finalize_errors"] >= 2 and "dead_lettered" not in stats["effects"]
    assert await pel_count(client, "s", "g") == 2
    text = caplog.text
    assert "WRONGTYPE" in text and "EVALSHA stream_copy_ack on key 's', 'dl'" in text
    for eid in ids:
        assert f"finalization of {eid} (attempt 1" in text
    assert await _batched_script_ran(client)


async def test_batched_retry_whose_xack_is_refused_leaves_copies_and_originals_pending(
    redis_server: RedisServer, redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """The batched script writes every copy, then one XACK of the originals; an
    ACL user that may not run XACK gets that XACK refused inside the script
    (NOPERM; Redis 7.0 words it "The user executing the script can't run this
    command"), a final error.  Every delivery of the call fails, logged; the copies stay
    written and the originals pending (duplicate, never loss).  Once XACK is
    allowed, the own PEL read again at the next start finishes them: each
    original delivered again (attempt 2), no copy written twice."""
    await client.execute("XGROUP", "CREATE", "s", "g", "0", "MKSTREAM")
    ids = [(await client.execute("XADD", "s", "*", "n", str(i))).decode() for i in range(3)]
    user, password = "trf-no-xack", "pw-no-xack"
    await client.execute("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all", "-xack")
    url = f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/0"
    seen: list[tuple[str, int]] = []

    async def handler(d: Delivery) -> Outcome:
        seen.append((d.origin_id, d.attempt))
        return RETRY if d.attempt == 1 and d.id == d.origin_id else ACK

    caplog.set_level("INFO", logger="trio_redis_finalize")
    try:
        async with open_consumer(url, name="c1") as consumer:
            await consumer.mount(StreamSubscription("s", "g", block=0.1, count=10), handler)
            name = consumer.mounts[0].name
            await eventually(lambda: consumer.stats()[name]["effects"].get("failed", 0) >= 3,
                             what="the three RETRYs failed")
            stats = consumer.stats()[name]
            assert "copied" not in stats["effects"] and stats["finalize_errors"] >= 1, stats
        entries = await client.execute("XRANGE", "s", "-", "+")
        copies = [e for e in entries if e[0].decode() not in ids]
        origins = sorted(dict(zip(f[::2], f[1::2], strict=True))[ORIGIN_FIELD].decode()
                         for _, f in copies)
        assert origins == sorted(ids)  # each copy written once, before the refused XACK
        pending = await client.execute("XPENDING", "s", "g", "-", "+", 10)
        assert set(ids) <= {p[0].decode() for p in pending}  # the originals: not lost
        assert await _batched_script_ran(client)
        text = caplog.text  # the refusal's text differs between servers; the command does not
        assert "finalization command failed" in text and "EVALSHA stream_copy_ack on key 's', 's'" in text
        for eid in ids:
            assert f"finalization of {eid} (attempt 1" in text

        await client.execute("ACL", "SETUSER", user, "+xack")
        async with open_consumer(url, name="c1") as consumer:
            await consumer.mount(StreamSubscription("s", "g", block=0.1, count=10), handler)
            name = consumer.mounts[0].name
            await eventually(lambda: consumer.stats()[name]["effects"].get("acked", 0) >= 6,
                             what="the originals and their copies acknowledged")
        assert await pel_count(client, "s", "g") == 0
    finally:
        await client.execute("ACL", "DELUSER", user)
    assert await client.execute("XLEN", "s") == 6  # no second copy
    for eid in ids:
        assert (eid, 1) in seen and (eid, 2) in seen  # delivered again: a duplicate


@pytest.mark.parametrize("form", ["stream", "list"])
async def test_batched_writes_under_oom_send_each_delivery_again_and_apply_once(
    redis_url: str, client: Client, oom: Any, form: str
) -> None:
    """ACKs carrying a write, memory refused once the last is handled: each
    delivery whose write was answered OOM (nothing of it written, not removed)
    is sent again, alone, until memory is back; each write applies once, with
    its finalization.  The stream's three go in one batched writes call (one
    read); the reliable list's reads grow from one element, so its batches
    vary (the fault matrix's ``list-writes-batched`` pins one batch)."""
    from trio_redis_finalize._core.stream.scripts import STREAM_WRITES_ACK_BATCH

    if form == "stream":
        n = 3
        await client.execute("XGROUP", "CREATE", "s", "g", "0", "MKSTREAM")
        for i in range(n):
            await client.execute("XADD", "s", "*", "n", str(i))
        sub: Any = StreamSubscription("s", "g", block=0.1, count=10)
    else:
        n = 10
        await client.execute("LPUSH", "q", *[b"job"] * 6, *[b"other%d" % i for i in range(4)])
        sub = ReliableListSubscription("q", block=0.1)
    seen: list[int] = []
    last_done = trio.Event()

    async def handler(d: Delivery) -> Outcome:
        seen.append(d.attempt)
        if len(seen) == n:
            oom.on()
            last_done.set()
        return ACK.with_writes(("HINCRBY", "totals", "n", 1))

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, handler)
        await last_done.wait()
        name = consumer.mounts[0].name
        await eventually(lambda: consumer.stats()[name]["finalize_errors"] >= 2,
                         what="the OOM retried")
        acked = consumer.stats()[name]["effects"].get("acked", 0)
        assert acked < n
        # committed only with a finalization
        assert int(await client.execute("HGET", "totals", "n") or 0) == acked
        oom.off()
        await eventually(lambda: consumer.stats()[name]["effects"].get("acked", 0) == n,
                         what="the writes committed")
        effects = consumer.stats()[name]["effects"]
        assert effects["writes"] == n and effects.get("failed", 0) == 0, effects
    assert seen == [1] * n  # no delivery handled twice
    assert await client.execute("HGET", "totals", "n") == str(n).encode()
    if form == "stream":
        assert (await client.execute("SCRIPT", "EXISTS", STREAM_WRITES_ACK_BATCH.sha)) == [1]


@pytest.mark.parametrize("script", ["reap", "stop"])
async def test_moving_a_processing_list_back_under_oom_loses_nothing(
    redis_url: str, client: Client, oom: Any, script: str
) -> None:
    """The reaper's move of a dead consumer's processing list (REAP) and a clean
    stop's hand-back (STOP) copy each element onto the queue before they remove
    it: refused for memory at the copy, the element stays where it was (before:
    removed, then the push refused -- lost)."""
    from redis import exceptions as rexc

    from trio_redis_finalize._core.reliable_list import liveness as _reliable

    proc = "{q}:processing:dead"
    await client.execute("LPUSH", proc, b"job")
    await client.execute("HSET", _reliable.registry_key("q"), "dead", proc)
    keys: tuple[str, ...] = (proc, "q", _reliable.heartbeat_key("q", "dead"),
                             _reliable.registry_key("q"))
    args: list[str | bytes] = ["dead"]
    if script == "stop":
        keys += (_reliable.receipts_key(proc),)
        args.append("")  # no heartbeat value held: the key is absent
    args += [b"job", b"job"]
    oom.on()
    with pytest.raises(rexc.ResponseError, match=r"OOM|maxmemory"):
        await client.evalsha(_reliable.REAP if script == "reap" else _reliable.STOP, keys, args)
    oom.off()
    assert await client.execute("LRANGE", proc, 0, -1) == [b"job"]
    assert await client.execute("LLEN", "q") == 0
    # once memory is back, the move goes through: the element on the queue, once
    await client.evalsha(_reliable.REAP if script == "reap" else _reliable.STOP, keys, args)
    assert await client.execute("LRANGE", "q", 0, -1) == [b"job"]
    assert await client.execute("LLEN", proc) == 0
