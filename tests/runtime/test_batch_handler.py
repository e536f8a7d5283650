"""The batch handler: ``consumer.mount(..., batch=True)`` hands the handler the
deliveries of one read at once and takes one outcome for all, or one per
delivery; finalization, ``on_error`` and the counters stay per delivery.

The crash-point enumeration (``test_crash_points.py``, ``BATCH_PATHS``) and
the fault matrix (``test_fault_matrix.py``, the ``*-batch-handler``
workloads) run the same guarantees under faults; this file checks the
contract itself against a real server.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import anyio
import anyio.lowlevel
import pytest
import trio
from _paths import ROOT
from _procs import eventually

from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    ChannelSubscription,
    Delivery,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._transport import Client
from trio_redis_finalize.otel import instrument_handler
from trio_redis_finalize.pytest_plugin import consume_until

pytestmark = pytest.mark.timeout(60)

S, G = "s", "g"
NAME = f"stream {S!r} group {G!r}"


async def _add(client: Client, n: int) -> list[str]:
    return [(await client.execute("XADD", S, "*", "n", str(i))).decode() for i in range(n)]


async def _pending(client: Client) -> int:
    return int((await client.execute("XPENDING", S, G))[0])


async def test_one_call_per_read_one_outcome_for_all(redis_url: str, client: Client) -> None:
    ids = await _add(client, 25)
    calls: list[list[str]] = []

    async def handler(ds: list[Delivery]) -> Outcome:
        assert isinstance(ds, list) and all(isinstance(d, Delivery) for d in ds)
        calls.append([d.id or "" for d in ds])
        return ACK

    stats = await consume_until(redis_url, StreamSubscription(S, G, count=10, block=0.05),
                                handler, lambda: sum(map(len, calls)) == 25, batch=True)
    assert [i for c in calls for i in c] == ids  # in order, each once
    assert max(map(len, calls)) == 10 and len(calls) == 3  # one call per read of 10
    assert stats["received"] == 25
    assert stats["outcomes"] == {"ack": 25} and stats["effects"] == {"acked": 25}
    assert await _pending(client) == 0
    assert int(await client.execute("XLEN", S)) == 25  # ACK leaves the entries (no retention)


async def test_one_outcome_per_delivery(redis_url: str, client: Client) -> None:
    await _add(client, 6)
    seen: list[tuple[bytes, int]] = []

    async def handler(ds: list[Delivery]) -> tuple[Outcome, ...]:
        seen.extend((d.fields[b"n"], d.attempt) for d in ds)
        # 0, 3: ACK; 1, 4: RETRY the first time; 2, 5: DROP
        return tuple(
            ACK if int(d.fields[b"n"]) % 3 == 0 or d.attempt > 1
            else RETRY if int(d.fields[b"n"]) % 3 == 1 else DROP
            for d in ds)

    stats = await consume_until(redis_url, StreamSubscription(S, G, block=0.05), handler,
                                lambda: len(seen) == 8, batch=True)
    assert sorted(seen) == sorted([(str(i).encode(), 1) for i in range(6)]
                                  + [(b"1", 2), (b"4", 2)])
    assert stats["outcomes"] == {"ack": 4, "retry": 2, "drop": 2}, stats
    assert stats["effects"] == {"acked": 4, "copied": 2, "dropped": 2}, stats
    assert await _pending(client) == 0


async def test_a_raise_fails_every_delivery_of_the_call(
        redis_url: str, client: Client, caplog: pytest.LogCaptureFixture) -> None:
    ids = await _add(client, 3)
    calls: list[list[int]] = []

    async def handler(ds: list[Delivery]) -> Outcome:
        calls.append([d.attempt for d in ds])
        if len(calls) == 1:
            raise RuntimeError("the batch failed")
        return ACK

    caplog.set_level(logging.ERROR, "trio_redis_finalize")
    stats = await consume_until(
        redis_url, StreamSubscription(S, G, block=0.05, max_attempts=5), handler,
        lambda: sum(map(len, calls)) == 6, batch=True, on_error=RETRY)
    assert calls[0] == [1, 1, 1] and sorted(a for c in calls[1:] for a in c) == [2, 2, 2]
    assert stats["handler_errors"] == 3
    assert stats["effects"] == {"copied": 3, "acked": 3}, stats
    # one log line names every delivery of the call, its attempt and its fate
    [record] = [r for r in caplog.records if "batch handler raised" in r.getMessage()]
    text = record.getMessage()
    assert "on 3 deliveries" in text and all(f"{i} (attempt 1)" in text for i in ids), text
    assert "RETRY" in text and record.exc_info is not None
    assert record.__dict__["entry_ids"] == ids and record.__dict__["attempts"] == [1, 1, 1]
    assert await _pending(client) == 0


async def test_the_raise_is_recorded_on_each_dead_letter(redis_url: str, client: Client) -> None:
    await _add(client, 2)

    async def handler(ds: list[Delivery]) -> Outcome:
        raise ValueError("bad batch")

    async def dead() -> bool:
        return int(await client.execute("XLEN", "dead")) == 2

    got = await consume_until(
        redis_url, StreamSubscription(S, G, block=0.05, max_attempts=1, dead_letter="dead"),
        handler, dead, batch=True)
    assert got["effects"] == {"dead_lettered": 2}, got
    for _, fields in await client.execute("XRANGE", "dead", "-", "+"):
        flat = dict(zip(fields[::2], fields[1::2], strict=True))
        assert flat[b"trf-dead-error"] == b"ValueError: bad batch", flat



@pytest.mark.parametrize("result", [
    pytest.param([ACK], id="too-few"),
    pytest.param("ACK", id="a-string"),
    pytest.param(None, id="none"),
])
async def test_a_wrong_return_fails_every_delivery(
        redis_url: str, client: Client, caplog: pytest.LogCaptureFixture, result: object) -> None:
    await _add(client, 2)
    calls: list[int] = []

    async def handler(ds: list[Delivery]) -> object:
        calls.append(len(ds))
        return result if len(calls) == 1 else ACK

    caplog.set_level(logging.ERROR, "trio_redis_finalize")
    stats = await consume_until(redis_url, StreamSubscription(S, G, block=0.05), handler,
                                lambda: sum(calls) == 4, batch=True, on_error=RETRY)
    assert calls == [2, 2], calls
    assert stats["handler_errors"] == 2 and stats["effects"] == {"copied": 2, "acked": 2}, stats
    [record] = [r for r in caplog.records if "batch handler returned" in r.getMessage()]
    assert "one Outcome, or a list or tuple of 2" in str(record.exc_info and record.exc_info[1])


async def test_writes_one_per_delivery_and_not_one_for_many(
        redis_url: str, client: Client, caplog: pytest.LogCaptureFixture) -> None:
    await _add(client, 3)
    calls: list[int] = []

    async def handler(ds: list[Delivery]) -> Sequence[Outcome] | Outcome:
        calls.append(len(ds))
        if len(calls) == 1:  # one outcome with writes for three: refused
            return ACK.with_writes(("HINCRBY", "{s}:totals", "n", 1))
        return [ACK.with_writes(("HINCRBY", "{s}:totals", "n", 1)) for _ in ds]

    caplog.set_level(logging.ERROR, "trio_redis_finalize")
    stats = await consume_until(redis_url, StreamSubscription(S, G, block=0.05), handler,
                                lambda: sum(calls) == 6, batch=True, on_error=RETRY)
    assert await client.execute("HGET", "{s}:totals", "n") == b"3"  # once per delivery
    assert stats["effects"] == {"copied": 3, "acked": 3, "writes": 3}, stats
    text = " ".join(r.getMessage() + str(r.exc_info and r.exc_info[1]) for r in caplog.records)
    assert "would commit its writes 3 times" in text, text


async def test_reliable_list(redis_url: str, client: Client) -> None:
    await client.execute("LPUSH", "jobs", *[f"j{i}" for i in range(7)])
    calls: list[list[bytes]] = []

    async def handler(ds: list[Delivery]) -> list[Outcome]:
        calls.append([d.data for d in ds])
        return [ACK] * len(ds)

    stats = await consume_until(redis_url, ReliableListSubscription("jobs", block=0.05), handler,
                                lambda: sum(map(len, calls)) == 7, batch=True)
    assert sorted(b for c in calls for b in c) == sorted(f"j{i}".encode() for i in range(7))
    assert stats["effects"] == {"acked": 7}, stats
    assert await client.execute("LLEN", "jobs") == 0
    assert [k for k in await client.execute("KEYS", "{jobs}:processing:*")
            if await client.execute("LLEN", k)] == []


async def test_pubsub(redis_url: str, client: Client) -> None:
    got: list[bytes] = []

    async def handler(ds: list[Delivery]) -> Outcome:
        got.extend(d.data for d in ds)
        return ACK

    with trio.fail_after(20):
        async with open_consumer(redis_url) as consumer:
            await consumer.mount(ChannelSubscription("news"), handler, batch=True)
            for i in range(5):
                await client.execute("PUBLISH", "news", f"m{i}")
            await eventually(lambda: len(got) == 5, what="every message handled")
    assert got == [f"m{i}".encode() for i in range(5)]


async def test_shutdown_cuts_the_whole_call_and_its_deliveries_stay_pending(
        redis_url: str, client: Client, caplog: pytest.LogCaptureFixture) -> None:
    ids = await _add(client, 3)
    started = trio.Event()

    async def handler(ds: list[Delivery]) -> Outcome:
        started.set()
        await trio.sleep_forever()
        raise AssertionError("not reached")

    caplog.set_level(logging.INFO, "trio_redis_finalize")
    with trio.fail_after(15):
        async with open_consumer(redis_url, name="c1", shutdown_grace=0.2) as consumer:
            await consumer.mount(StreamSubscription(S, G, block=0.05), handler, batch=True)
            await started.wait()
    assert consumer.stats()[NAME]["handler_errors"] == 0
    assert await _pending(client) == 3
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "waiting for 1 handler" in text and all(i in text for i in ids), text


async def test_bad_arguments(redis_url: str) -> None:
    async def handler(ds: list[Delivery]) -> Outcome:
        return ACK

    async with open_consumer(redis_url) as consumer:
        with pytest.raises(ValueError, match=r"^batch must be True or False, got 'yes'$"):
            await consumer.mount(StreamSubscription(S, G), handler, batch="yes")  # type: ignore[arg-type]
        traced = instrument_handler(handler)  # type: ignore[arg-type]
        if getattr(traced, "trf_bind", None) is not None:  # opentelemetry-api installed
            with pytest.raises(ValueError, match="batch=True"):
                await consumer.mount(StreamSubscription(S, G), traced, batch=True)


def test_asyncio_backend(redis_url: str) -> None:
    async def main() -> None:
        from trio_redis_finalize._transport import open_client

        async with open_client(redis_url) as c:
            await _add(c, 4)
            calls: list[int] = []

            async def handler(ds: list[Delivery]) -> Outcome:
                calls.append(len(ds))
                await anyio.lowlevel.checkpoint()
                return ACK

            with anyio.fail_after(20):
                stats = await consume_until(redis_url, StreamSubscription(S, G, block=0.05),
                                            handler, lambda: sum(calls) == 4, batch=True)
            assert stats["effects"] == {"acked": 4}
            assert await _pending(c) == 0

    anyio.run(main, backend="asyncio")


GUIDE_TEXT = (ROOT / "docs" / "guide.rst").read_text()


async def test_the_guides_example_runs_as_written(redis_url: str, client: Client) -> None:
    import trio_redis_finalize as trf

    text = GUIDE_TEXT
    section = text.split("Batch handlers\n--------------\n", 1)[1]
    m = re.search(r"\.\. code-block:: python\n\n((?:    .*\n|\n)+)", section)
    assert m is not None
    code = "\n".join(line[4:] for line in m.group(1).splitlines())
    stored: list[bytes] = []

    async def store_many(rows: list[dict[bytes, bytes]]) -> set[int]:
        stored.extend(r[b"n"] for r in rows)
        return {i for i, r in enumerate(rows) if r[b"n"] == b"1" and stored.count(b"1") == 1}

    scope: dict[str, object] = {"ACK": trf.ACK, "RETRY": trf.RETRY, "store_many": store_many}
    exec(code, scope)
    await _add(client, 3)
    stats = await consume_until(redis_url, StreamSubscription(S, G, block=0.05),
                                scope["handle"], lambda: len(stored) == 4,  # type: ignore[arg-type]
                                batch=True)
    assert sorted(stored) == [b"0", b"1", b"1", b"2"]
    assert stats["effects"] == {"acked": 3, "copied": 1}, stats
