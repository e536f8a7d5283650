"""Reliable-list dead letters record why (issue 15, item 2), against a real server.

The dead letter keeps the element as it was read (consumable, requeueable);
its reason record (reason, the handler's exception, attempt, queue,
processing list, origin, server time) goes in the hash ``{dead}:why`` in the
same gated step, keyed by the SHA-1 of the element's bytes (identical
elements: one record each, oldest first).  ``inspect --entries`` shows them,
``requeue`` removes the record of what it moves and refuses a list whose
elements have no record unless ``--force``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from trio_redis_finalize import ACK, RETRY, Backoff, Delivery, ReliableListSubscription, open_consumer
from trio_redis_finalize._cli._queues import why_records
from trio_redis_finalize._core._plan import (
    dead_record,
    list_copies,
    list_counted,
    list_removal,
    plan_dead,
    why_key,
)
from trio_redis_finalize._core._types import Target
from trio_redis_finalize._core.reliable_list.scripts import LIST_COPY_REMOVE, LIST_DEAD_PUSH
from trio_redis_finalize._delivery import Delivery as _Delivery
from trio_redis_finalize._envelope import unwrap, wrap
from trio_redis_finalize._keys import same_slot
from trio_redis_finalize._subscription import Form
from trio_redis_finalize._transport import Client

CLI = [sys.executable, "-m", "trio_redis_finalize"]
DEAD = "jobs:dead"
WHY = why_key(DEAD)


async def acli(*args: str) -> Any:
    with trio.fail_after(60):
        return await trio.run_process([*CLI, *args], capture_stdout=True, capture_stderr=True,
                                      check=False)


async def wait_len(client: Client, key: str, n: int) -> None:
    with trio.fail_after(20):
        while int(await client.execute("LLEN", key)) < n:
            await trio.sleep(0.02)


async def boom(d: Delivery) -> Any:
    raise ValueError("boom")


@asynccontextmanager
async def failing_consumer(redis_url: str, handler: Any = boom, on_error: Any = RETRY) -> AsyncIterator[Any]:
    """Consumer ``c`` with ``handler`` (it raises) on ``jobs`` (max_attempts=2,
    dead letter ``DEAD``)."""
    sub = ReliableListSubscription("jobs", block=0.05, max_attempts=2, dead_letter=DEAD)
    async with open_consumer(redis_url, name="c") as consumer:
        await consumer.mount(sub, handler, on_error=on_error)
        yield consumer


async def push_until_dead(consumer: Any, *elements: str, dead: int) -> None:
    """``elements`` pushed onto ``jobs``; back once ``DEAD`` holds ``dead``."""
    await consumer.client.execute("LPUSH", "jobs", *elements)
    await wait_len(consumer.client, DEAD, dead)


async def records(client: Client, element: bytes) -> list[dict[str, Any]]:
    return why_records(await client.execute("HGET", WHY, hashlib.sha1(element).hexdigest()))


def test_why_key_shares_the_dead_letters_slot() -> None:
    assert WHY == "{jobs:dead}:why"
    for dead in ("d", "{app}.dead", "a}b", ""):
        assert same_slot(dead, why_key(dead))


async def test_handler_exception_is_recorded_beside_the_element(redis_url: str) -> None:
    async with failing_consumer(redis_url) as consumer:
        await push_until_dead(consumer, "job-1", dead=1)
        (element,) = await consumer.client.execute("LRANGE", DEAD, 0, -1)
        body, retries, origin = unwrap(element)
        assert body == b"job-1" and retries == 1  # the element as read at its last attempt
        (rec,) = await records(consumer.client, element)
        now_ms = int((await consumer.client.execute("TIME"))[0]) * 1000
    assert rec["error"] == "ValueError: boom"
    assert rec["attempt"] == 2
    assert rec["source"] == "jobs"
    assert rec["processing"] == "{jobs}:processing:c"
    assert rec["origin"] == origin
    assert "max_attempts=2" in rec["reason"]
    assert now_ms - 60_000 < rec["time_ms"] <= now_ms + 1000  # the server's clock


async def test_backoff_exhaustion_is_recorded_too(redis_url: str) -> None:
    async with failing_consumer(redis_url, on_error=Backoff(base=0.01, cap=0.01, window=0)) as consumer:
        await push_until_dead(consumer, "job-1", dead=1)
        (element,) = await consumer.client.execute("LRANGE", DEAD, 0, -1)
        (rec,) = await records(consumer.client, element)
    assert rec["error"] == "ValueError: boom" and rec["attempt"] == 2


async def test_identical_elements_dead_lettered_twice_have_a_record_each(redis_url: str) -> None:
    calls = 0

    async def handle(d: Delivery) -> Any:
        nonlocal calls
        calls += 1
        raise ValueError(f"boom {calls}")

    async with failing_consumer(redis_url, handle) as consumer:
        await push_until_dead(consumer, "same", "same", dead=2)
        elements = await consumer.client.execute("LRANGE", DEAD, 0, -1)
        assert elements[0] == elements[1]  # the same bytes: one field, two records
        recs = await records(consumer.client, elements[0])
        assert int(await consumer.client.execute("HLEN", WHY)) == 1
    assert len(recs) == 2
    assert all(r["attempt"] == 2 and r["error"].startswith("ValueError: boom ") for r in recs)
    assert recs[0]["time_ms"] <= recs[1]["time_ms"]

    # inspect shows both, oldest first, each with its own record
    r = await acli("inspect", DEAD, "--entries", "5", "--json", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    entries = json.loads(r.stdout)["entries"]
    assert [e["dead"]["error"] for e in entries] == [recs[0]["error"], recs[1]["error"]]

    # requeue one: one record left; requeue the other: the hash is gone
    r = await acli("requeue", DEAD, "--to", "back", "--limit", "1", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    async with open_consumer(redis_url, name="c") as consumer:
        left = await records(consumer.client, elements[0])
        assert left == recs[1:]
    r = await acli("requeue", DEAD, "--to", "back", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    async with open_consumer(redis_url, name="c") as consumer:
        assert int(await consumer.client.execute("EXISTS", DEAD, WHY)) == 0
        assert int(await consumer.client.execute("LLEN", "back")) == 2


async def test_inspect_entries_plain_and_json(redis_url: str) -> None:
    async with failing_consumer(redis_url) as consumer:
        await push_until_dead(consumer, "a", dead=1)
        await push_until_dead(consumer, "b", dead=2)
        await consumer.client.execute("LPUSH", DEAD, "foreign")  # no record: shown without one
    r = await acli("inspect", DEAD, "--entries", "5", "--json", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    a, b, foreign = json.loads(r.stdout)["entries"]
    assert (a["data"], b["data"], foreign["data"]) == ("a", "b", "foreign")
    for e in (a, b):
        assert e["dead"]["error"] == "ValueError: boom"
        assert e["dead"]["attempt"] == 2 and e["dead"]["source"] == "jobs"
        assert e["dead"]["origin"] == e["origin"]
        assert e["time"] is not None and e["time"].endswith("Z")
    assert foreign["dead"] is None and foreign["time"] is None

    r = await acli("inspect", DEAD, "--entries", "5", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert "dead-lettered at" in out and "reason" in out
    rows = [ln for ln in out.splitlines() if "ValueError: boom" in ln]
    assert len(rows) == 2 and all("jobs" in ln for ln in rows), out


async def test_requeue_moves_back_removes_the_record_and_is_consumed_as_the_original(
    redis_url: str,
) -> None:
    async with failing_consumer(redis_url) as consumer:
        await push_until_dead(consumer, "job-1", dead=1)
        (element,) = await consumer.client.execute("LRANGE", DEAD, 0, -1)
        origin = unwrap(element)[2]
        assert await records(consumer.client, element)
    r = await acli("requeue", DEAD, "--to", "jobs2", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().strip() == f"requeued 1 message from {DEAD} to jobs2"

    seen: list[Delivery] = []

    async def handle(d: Delivery) -> Any:
        seen.append(d)
        return ACK

    async with open_consumer(redis_url, name="c2") as consumer:
        assert int(await consumer.client.execute("EXISTS", DEAD, WHY)) == 0
        await consumer.mount(ReliableListSubscription("jobs2", block=0.05), handle)
        with trio.fail_after(10):
            while not seen:
                await trio.sleep(0.02)
    (d,) = seen
    assert d.data == b"job-1" and d.origin_id == origin and d.attempt == 1


async def test_requeue_refuses_a_list_without_reason_records_unless_forced(redis_url: str) -> None:
    async with open_consumer(redis_url, name="c") as consumer:
        await consumer.client.execute("LPUSH", "plain", "x")
    r = await acli("requeue", "plain", "--to", "elsewhere", "--url", redis_url)
    assert r.returncode == 2
    err = r.stderr.decode()
    assert "has no reason record in '{plain}:why'" in err and "nothing moved" in err, err
    r = await acli("requeue", "plain", "--to", "elsewhere", "--force", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().strip() == "requeued 1 message from plain to elsewhere"


# -- the scripts and the plan ---------------------------------------------------------------

P = "{q}:processing:c"
QD = "{q}:dead"


def _target(cluster: bool = False, dead: str = QD) -> Target:
    return Target(form=Form.RELIABLE_LIST, name="q", source="{q}", processing=P,
                  max_attempts=2, dead_letter=dead, cluster=cluster)


def _delivery(raw: bytes) -> _Delivery:
    body, retries, origin = unwrap(raw)
    return _Delivery("{q}", None, {}, body, retries + 1, origin or "o", raw=raw, retries=retries)


def test_the_dead_plan_is_one_gated_script_with_the_record() -> None:
    raw = wrap(b"x", 1, "o1")
    d = _delivery(raw)
    p = plan_dead(_target(), d, "max_attempts=2 reached at attempt 2")
    (cmd,) = p.commands
    assert p.gated and cmd[:7] == (b"EVALSHA", LIST_COPY_REMOVE.sha, 3, P, QD, why_key(QD), raw)
    assert cmd[7] == raw and json.loads(cmd[8]) == json.loads(
        dead_record(_target(), d, "max_attempts=2 reached at attempt 2"))
    # the counted gate parses this layout: element, n after the record
    assert list_removal(_target(), cmd) == raw and list_copies(cmd) == 1
    counted = list_counted(cmd, 3)
    assert counted == (*cmd, 3) and list_copies(counted) == 3
    assert list_removal(_target(), counted) == raw
    assert list_counted(counted, 2) == (*cmd, 2)


def test_the_cross_slot_dead_plan_pushes_with_the_record_then_removes() -> None:
    raw = b"x"
    t = _target(cluster=True, dead="elsewhere")
    p = plan_dead(t, _delivery(raw), "r")
    push, lrem = p.commands
    assert not p.gated
    assert push[:6] == (b"EVALSHA", LIST_DEAD_PUSH.sha, 2, "elsewhere", why_key("elsewhere"), raw)
    assert lrem == ("LREM", P, -1, raw)
    assert list_removal(t, push) is None and list_removal(t, lrem) == raw


async def test_copy_remove_with_record_is_gated_and_counted(client: Client) -> None:
    await client.execute("RPUSH", P, b"X", b"X")
    keys = (P, QD, why_key(QD))
    assert await client.evalsha(LIST_COPY_REMOVE, keys, (b"X", b"X", b'{"n":1}', 2)) == 1
    assert await client.evalsha(LIST_COPY_REMOVE, keys, (b"X", b"X", b'{"n":1}', 2)) is None
    assert await client.execute("LRANGE", P, 0, -1) == [b"X"]
    assert await client.evalsha(LIST_COPY_REMOVE, keys, (b"X", b"X", b'{"n":2}')) == 1  # n: 1
    assert await client.execute("LRANGE", P, 0, -1) == []
    assert await client.execute("LRANGE", QD, 0, -1) == [b"X", b"X"]
    value = await client.execute("HGET", why_key(QD), hashlib.sha1(b"X").hexdigest())
    recs = why_records(value)
    assert [r["n"] for r in recs] == [1, 2] and all(isinstance(r["time_ms"], int) for r in recs)


async def test_a_dead_letter_emptied_by_others_starts_a_fresh_reason_hash(client: Client) -> None:
    keys = (P, QD, why_key(QD))
    await client.execute("RPUSH", P, b"A", b"B")
    assert await client.evalsha(LIST_COPY_REMOVE, keys, (b"A", b"A", b'{"n":1}')) == 1
    await client.execute("LPOP", QD)  # consumed by someone else: A's record is an orphan
    assert await client.evalsha(LIST_COPY_REMOVE, keys, (b"B", b"B", b'{"n":2}')) == 1
    assert await client.execute("HKEYS", why_key(QD)) == [hashlib.sha1(b"B").hexdigest().encode()]


async def test_a_reason_hash_of_another_type_fails_before_any_write(client: Client) -> None:
    keys = (P, QD, why_key(QD))
    await client.execute("RPUSH", P, b"A")
    await client.execute("SET", why_key(QD), "not a hash")
    try:
        await client.evalsha(LIST_COPY_REMOVE, keys, (b"A", b"A", b'{"n":1}'))
    except Exception as e:
        assert "WRONGTYPE" in str(e)
    else:
        raise AssertionError("no error")
    assert await client.execute("LRANGE", P, 0, -1) == [b"A"]  # still pending, no copy
    assert int(await client.execute("EXISTS", QD)) == 0


async def test_dead_push_script(client: Client) -> None:
    assert await client.evalsha(LIST_DEAD_PUSH, ("d", why_key("d")), (b"E", b'{"n":1}')) == 1
    assert await client.execute("LRANGE", "d", 0, -1) == [b"E"]
    (rec,) = why_records(await client.execute("HGET", why_key("d"), hashlib.sha1(b"E").hexdigest()))
    assert rec["n"] == 1 and rec["time_ms"] > 0


async def test_split_requeue_removes_the_record_too(client: Client) -> None:
    """The Redis Cluster path (dead letter and destination on different slots):
    copy first, then remove the element and its record (one script on the dead
    letter's slot)."""
    from trio_redis_finalize._cli.requeue import _requeue_list

    keys = (P, QD, why_key(QD))
    element = wrap(b"x", 1, "o1")
    await client.execute("RPUSH", P, element)
    assert await client.evalsha(LIST_COPY_REMOVE, keys, (element, element, b'{"n":1}')) == 1
    assert await _requeue_list(client, QD, "back", None, True) == 1
    assert await client.execute("LRANGE", "back", 0, -1) == [wrap(b"x", 0, "o1")]
    assert int(await client.execute("EXISTS", QD, why_key(QD))) == 0
