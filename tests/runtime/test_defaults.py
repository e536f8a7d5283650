"""Defaults that end, and an outcome that dead-letters now (issue 34, section 3).

* A poison message under the defaults (``max_attempts`` 10, dead letter
  ``{source}:dead``) ends in the default dead letter at its 10th attempt, on a
  stream and a reliable list; its traceback is logged at the first and the
  last attempt only, one line in between.
* ``reject(reason)`` / ``REJECT`` / ``raise Rejected(...)`` dead-letter at
  once on every stream mode and on reliable lists, with writes committed once;
  refused (``refused`` counted) on a simple list and without a dead letter.
* A runtime ``retry_after`` logs once per subscription that its copy is in
  process memory.
* ``maxmemory-policy``: a warning under ``allkeys-lru``, none when ``CONFIG``
  is refused.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import anyio
import pytest
import trio
from _procs import Recorder, always, eventually

from trio_redis_finalize import (
    ACK,
    REJECT,
    Backoff,
    Delivery,
    ListSubscription,
    Mode,
    Outcome,
    Rejected,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
    reject,
    retry_after,
)
from trio_redis_finalize._envelope import unwrap
from trio_redis_finalize._transport import open_client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(90)

LOGGER = "trio_redis_finalize"
FAST = Backoff(base=0.001, cap=0.005, window=0)  # the default attempts, without the waits


def _raised_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "handler raised on" in r.getMessage()]


@pytest.mark.parametrize("form", ["stream", "reliable list"])
async def test_poison_message_ends_in_the_default_dead_letter(
        redis_url: str, form: str, caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    async def handler(d: Delivery) -> Outcome:
        calls.append(d.attempt)
        raise ValueError(f"cannot parse order (attempt {d.attempt})")

    sub: StreamSubscription | ReliableListSubscription = (
        StreamSubscription("orders", "billing") if form == "stream"
        else ReliableListSubscription("orders"))
    assert sub.max_attempts == 10 and sub.dead_letter == "{orders}:dead"
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with open_client(redis_url) as client:
        if form == "stream":
            await client.execute("XADD", "orders", "*", "n", "1")
        else:
            await client.execute("LPUSH", "orders", b"order-1")
        with anyio.fail_after(60):
            async with open_consumer(client, name="c1") as consumer:
                handle = await consumer.mount(sub, handler, on_error=FAST)
                assert handle.name == sub.name and sub.name in consumer.stats()
                await eventually(lambda: handle.stats()["effects"].get("dead_lettered") == 1,
                                 timeout=50, what="the poison message dead-lettered")
        assert calls == list(range(1, 11))  # the handler never called past max_attempts
        if form == "stream":
            (dead,) = await client.execute("XRANGE", "{orders}:dead", "-", "+")
            fields = dict(zip(dead[1][::2], dead[1][1::2], strict=True))
            assert fields[b"n"] == b"1"
            assert b"max_attempts=10" in fields[b"trf-dead-reason"]
            assert fields[b"trf-dead-attempt"] == b"10"
            assert int((await client.execute("XPENDING", "orders", "billing"))[0]) == 0
        else:
            (element,) = await client.execute("LRANGE", "{orders}:dead", 0, -1)
            assert unwrap(element)[0] == b"order-1"  # as read (its retry counter in its envelope)
            (record,) = (await client.execute("HGETALL", "{orders}:dead:why"))[1::2]
            assert b"max_attempts=10" in record
            assert await client.execute("LLEN", "orders") == 0
    raised = _raised_records(caplog)
    assert [r.exc_info is not None for r in raised] == [True] + [False] * 8 + [True]
    assert all("ValueError: cannot parse order" in r.getMessage() for r in raised[1:-1])
    assert "dead-lettered to '{orders}:dead'" in raised[-1].getMessage()


async def test_max_attempts_none_opts_out(redis_url: str) -> None:
    sub = StreamSubscription("orders", "billing", max_attempts=None)
    assert sub.dead_letter is None
    calls: list[int] = []

    async def handler(d: Delivery) -> Outcome:
        calls.append(d.attempt)
        raise ValueError("poison")

    async with open_client(redis_url) as client:
        await client.execute("XADD", "orders", "*", "n", "1")
        with anyio.fail_after(60):
            async with open_consumer(client, name="c1") as consumer:
                await consumer.mount(sub, handler, on_error=FAST)
                await eventually(lambda: len(calls) >= 12, timeout=50, what="12 attempts")
        assert await client.execute("EXISTS", "{orders}:dead") == 0


# -- REJECT ----------------------------------------------------------------------

STREAMS = [
    StreamSubscription("s", "g"),
    StreamSubscription("s", "g", mode=Mode.RECLAIM, min_idle=5.0),
    StreamSubscription("s", "g", mode=Mode.CLAIMING, min_idle=5.0),
]


def _how(kind: str, reason: str) -> Any:
    async def handler(d: Delivery) -> Outcome:
        if kind == "raise":
            raise Rejected(reason)
        if kind == "writes":
            return reject(reason).with_writes(("HINCRBY", "{s}:totals", "rejected", 1))
        return reject(reason)
    return handler


@pytest.mark.parametrize("sub", STREAMS, ids=lambda s: s.mode.name)
@pytest.mark.parametrize("kind", ["return", "raise", "writes"])
async def test_reject_dead_letters_a_stream_entry_at_once(
        redis_url: str, sub: StreamSubscription, kind: str) -> None:
    async with open_client(redis_url) as client:
        await client.execute("XADD", "s", "*", "order", "malformed")
        with anyio.fail_after(30):
            async with open_consumer(client, name="c1") as consumer:
                handle = await consumer.mount(sub, _how(kind, "malformed order"))
                await eventually(lambda: handle.stats()["effects"].get("dead_lettered") == 1,
                                 timeout=20, what="rejected entry dead-lettered")
                stats = handle.stats()
        assert stats["outcomes"] == {"reject": 1} and stats["handler_errors"] == 0
        (dead,) = await client.execute("XRANGE", "{s}:dead", "-", "+")
        fields = dict(zip(dead[1][::2], dead[1][1::2], strict=True))
        assert fields[b"order"] == b"malformed"
        assert fields[b"trf-dead-reason"] == b"rejected: malformed order"
        assert fields[b"trf-dead-attempt"] == b"1"
        assert int((await client.execute("XPENDING", "s", "g"))[0]) == 0
        if kind == "writes":
            assert await client.execute("HGET", "{s}:totals", "rejected") == b"1"
            assert stats["effects"].get("writes") == 1


@pytest.mark.parametrize("kind", ["return", "raise", "writes"])
async def test_reject_dead_letters_a_reliable_list_element_at_once(
        redis_url: str, kind: str) -> None:
    sub = ReliableListSubscription("s")
    async with open_client(redis_url) as client:
        await client.execute("LPUSH", "s", b"malformed")
        with anyio.fail_after(30):
            async with open_consumer(client, name="c1") as consumer:
                handle = await consumer.mount(sub, _how(kind, "malformed order"))
                await eventually(lambda: handle.stats()["effects"].get("dead_lettered") == 1,
                                 timeout=20, what="rejected element dead-lettered")
        assert await client.execute("LRANGE", "{s}:dead", 0, -1) == [b"malformed"]
        (record,) = (await client.execute("HGETALL", "{s}:dead:why"))[1::2]
        assert b"rejected: malformed order" in record
        assert await client.execute("LLEN", "{s}:processing:c1") == 0
        if kind == "writes":
            assert await client.execute("HGET", "{s}:totals", "rejected") == b"1"


async def test_reject_refused_where_there_is_no_dead_letter(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger=LOGGER)
    handler = Recorder(lambda d: REJECT)
    async with open_client(redis_url) as client:
        await client.execute("LPUSH", "inbox", b"x")
        await client.execute("XADD", "s", "*", "n", "1")
        with anyio.fail_after(30):
            async with open_consumer(client, name="c1") as consumer:
                simple = await consumer.mount(ListSubscription("inbox"), handler)
                nodl = await consumer.mount(StreamSubscription("s", "g", dead_letter=None), handler)
                await eventually(lambda: simple.stats()["refused"] == 1 == nodl.stats()["refused"],
                                 timeout=20, what="both refused")
        # refused: the stream entry stays pending, nothing written anywhere
        assert int((await client.execute("XPENDING", "s", "g"))[0]) == 1
        assert await client.execute("EXISTS", "{s}:dead", "{inbox}:dead") == 0
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "a list has no dead letter" in text and "dead_letter=None" in text


# -- retry_after in memory -------------------------------------------------------

@pytest.mark.parametrize("form", ["stream", "reliable list"])
async def test_runtime_retry_after_is_logged_once(
        redis_url: str, form: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    sub = StreamSubscription("s", "g") if form == "stream" else ReliableListSubscription("s")

    async def handler(d: Delivery) -> Outcome:
        return retry_after(0.01) if d.attempt < 3 else ACK

    async with open_client(redis_url) as client:
        for n in range(3):
            if form == "stream":
                await client.execute("XADD", "s", "*", "n", str(n))
            else:
                await client.execute("LPUSH", "s", str(n))
        with anyio.fail_after(30):
            async with open_consumer(client, name="c1") as consumer:
                handle = await consumer.mount(sub, handler)
                await eventually(lambda: handle.stats()["outcomes"].get("ack") == 3, timeout=20,
                                 what="every message acknowledged at its 3rd attempt")
    lines = [r.getMessage() for r in caplog.records if "keeps its copy in process memory" in
             r.getMessage()]
    assert len(lines) == 1, lines
    if form == "stream":  # (the original is removed now, its copy written when due)
        assert "a crash before the delay ends loses it" in lines[0]
    else:  # (the original stays in the processing list until the copy is written)
        assert "leaves the original in the processing list" in lines[0]
        assert "loses" not in lines[0]
    assert "delayed_retry=DelayedRetry.DURABLE_ZSET" in lines[0]


# -- maxmemory-policy ------------------------------------------------------------

async def _mount_once(url: str) -> None:
    with anyio.fail_after(30):
        async with open_consumer(url, name="c1") as consumer:
            await consumer.mount(ReliableListSubscription("q"), always(ACK))


async def test_an_evicting_policy_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with RedisServer(extra_args=("--maxmemory-policy", "allkeys-lru")) as server:
        await _mount_once(server.url)
    lines = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "'allkeys-lru'" in lines[0] and "noeviction" in lines[0]


async def test_noeviction_and_a_refused_config_say_nothing(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    await _mount_once(redis_url)  # the test servers run noeviction (the default)
    with RedisServer(extra_args=("--rename-command", "CONFIG", "")) as server:
        await _mount_once(server.url)  # CONFIG refused: the mount goes on
    assert not [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]


# -- the default dead letter, known to inspect and requeue -----------------------

async def test_requeue_knows_the_default_dead_letters_source(redis_url: str) -> None:
    cli = [sys.executable, "-m", "trio_redis_finalize"]
    async with open_client(redis_url) as client:
        await client.execute("XADD", "s", "*", "order", "1")
        with anyio.fail_after(30):
            async with open_consumer(client, name="c1") as consumer:
                h = await consumer.mount(StreamSubscription("s", "g"), _how("return", "later"))
                await eventually(lambda: h.stats()["effects"].get("dead_lettered") == 1,
                                 timeout=20, what="dead-lettered")
            shown = await trio.run_process([*cli, "inspect", "s", "--url", redis_url],
                                           capture_stdout=True, capture_stderr=True, check=False)
            assert b"{s}:dead: 1" in shown.stdout, shown.stdout + shown.stderr
            moved = await trio.run_process([*cli, "requeue", "{s}:dead", "--url", redis_url],
                                           capture_stdout=True, capture_stderr=True, check=False)
            assert moved.returncode == 0, moved.stderr
            assert b"requeued 1 message from {s}:dead to s" in moved.stdout
            refused = await trio.run_process([*cli, "requeue", "elsewhere", "--url", redis_url],
                                             capture_stdout=True, capture_stderr=True, check=False)
            assert refused.returncode == 2 and b"--to KEY is needed" in refused.stderr
        assert await client.execute("XLEN", "{s}:dead") == 0
        entries = await client.execute("XRANGE", "s", "-", "+")
        assert len(entries) == 2 and entries[-1][1][:2] == [b"order", b"1"]


async def test_a_batch_handler_raising_rejected_dead_letters_its_batch(redis_url: str) -> None:
    async def handler(ds: list[Delivery]) -> Outcome:
        raise Rejected("bad batch")

    async with open_client(redis_url) as client:
        for n in range(3):
            await client.execute("XADD", "s", "*", "n", str(n))
        with anyio.fail_after(30):
            async with open_consumer(client, name="c1") as consumer:
                h = await consumer.mount(StreamSubscription("s", "g"), handler, batch=True)
                await eventually(lambda: h.stats()["effects"].get("dead_lettered") == 3,
                                 timeout=20, what="the batch dead-lettered")
                assert h.stats()["handler_errors"] == 0
        dead = await client.execute("XRANGE", "{s}:dead", "-", "+")
        assert [e[1][:2] for e in dead] == [[b"n", str(n).encode()] for n in range(3)]
        assert all(b"rejected: bad batch" in e[1] for e in dead)
