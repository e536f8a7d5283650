"""The writes scripts read each key's type once per call (``_core/_lua_writes``'s
``wtype``): the cache's edge cases through the batched calls, on a real server.

A type remembered for a key says it holds that type or nothing: it is trusted
only for a write wanting that very type; any other want reads the type again.
A write that can change a key's type to another (SET, SETNX) forgets it.
Whatever the cache holds, a batched call must do what its single scripts sent
one after the other do (each single a fresh cache), and a type check that
passes on a stale type would let a later write of the outcome fail at run
time after the earlier ones were applied -- the guarantee these tests keep.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from _batch_writes import assert_batch_is_its_singles, pending_six, send
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import exceptions as rexc

from trio_redis_finalize import ACK, DROP, Delivery, ReliableListSubscription, StreamSubscription
from trio_redis_finalize._core._batch import batch_replies, first_round
from trio_redis_finalize._core._plan import list_counted
from trio_redis_finalize._core._types import Plan, Target
from trio_redis_finalize._core._writes import plan_writes
from trio_redis_finalize._core.reliable_list import scripts as list_scripts
from trio_redis_finalize._core.stream import scripts as stream_scripts
from trio_redis_finalize._transport import Client, open_client
from trio_redis_finalize._writes import checked_writes
from trio_redis_finalize.testing import RedisServer

S, G, Q = "{c}orders", "billing", "{c}jobs"
K, OTHER = "{c}k", "{c}other"


def _stream_target() -> Target:
    return StreamSubscription(S, G).target("c1")


def _list_target() -> Target:
    return ReliableListSubscription(Q).target("c1")


def _entry(eid: str) -> Delivery:
    return Delivery(source=S, id=eid, fields={b"f": b"v"}, data=None, attempt=1, origin_id=eid,
                    flat=(b"f", b"v"))


def _element(raw: bytes) -> Delivery:
    return Delivery(source=Q, id=None, fields={}, data=raw, attempt=1, origin_id="o", raw=raw)


async def _stream_call(c: Client, writes: list[tuple[Any, ...]]) -> tuple[list[Any], list[str]]:
    """One delivery per element of ``writes`` (its outcome's writes), all
    pending, finalized as ACKs in one STREAM_WRITES_ACK_BATCH call: the
    answers per delivery, and the ids still pending afterwards."""
    await c.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    for k in range(len(writes)):
        await c.execute("XADD", S, f"1-{k + 1}", "f", "v")
    await c.execute("XREADGROUP", "GROUP", G, "c1", "STREAMS", S, ">")
    t = _stream_target()
    plans = [plan_writes(t, _entry(f"1-{k + 1}"), ACK.with_writes(*ws))
             for k, ws in enumerate(writes)]
    commands, owners, _ = first_round((), plans)
    assert len(commands) == 1 and owners == [tuple(range(len(plans)))]
    assert commands[0][1] == stream_scripts.STREAM_WRITES_ACK_BATCH.sha
    (reply,) = await c.pipeline(commands, raise_on_error=False)
    answers = batch_replies(reply, len(plans))
    assert answers is not None, reply
    pending = await c.execute("XPENDING", S, G, "-", "+", len(writes) + 1)
    return answers, [p[0].decode() for p in pending]


def _refused_by_the_check(answer: Any, write: int = 1) -> bool:
    """An element refused by the type check before anything of it was written
    (not by the server at run time: its message is the check's own)."""
    return (isinstance(answer, rexc.ResponseError)
            and str(answer).startswith(f"WRONGTYPE write {write} of the outcome")
            and "nothing written" in str(answer))


async def test_a_key_deleted_by_an_earlier_delivery_takes_another_type(client: Client) -> None:
    """Delivery 1 HINCRBYs k (its type now known: hash), delivery 2 DELs it,
    delivery 3 writes it as a set: allowed (the type is read again: the key
    holds nothing), delivery 4 HINCRBYs it: refused by the check (a set now)."""
    answers, pending = await _stream_call(client, [
        [("HINCRBY", K, "n", 1)],
        [("DEL", K)],
        [("SADD", K, "m")],
        [("SADD", OTHER, "x"), ("HINCRBY", K, "n", 1)],
    ])
    assert answers[:3] == [1, 1, 1]
    assert _refused_by_the_check(answers[3], write=2)
    assert pending == ["1-4"]
    assert await client.execute("TYPE", K) == b"set"
    assert await client.execute("EXISTS", OTHER) == 0  # nothing of delivery 4 written


async def test_a_hash_emptied_by_its_last_field_takes_another_type(client: Client) -> None:
    """A typed write that empties its key (HDEL of the last field) leaves it
    holding nothing: a later delivery may write it with another type."""
    await client.execute("HSET", K, "f", "v")
    answers, pending = await _stream_call(client, [
        [("HDEL", K, "f")],
        [("RPUSH", K, "e")],
        [("LTRIM", K, 1, 0)],  # empties the list
        [("SADD", K, "m")],
    ])
    assert answers == [1, 1, 1, 1] and pending == []
    assert await client.execute("SMEMBERS", K) == [b"m"]


@pytest.mark.parametrize("change", [("SET", K, "text"), ("SETNX", K, "text")],
                         ids=["SET", "SETNX"])
async def test_a_key_made_a_string_is_refused_to_a_later_hash_write(
    client: Client, change: tuple[Any, ...]
) -> None:
    """Delivery 1 writes k as a hash, then empties it (HDEL: the cache says
    hash, the key holds nothing); delivery 2 makes it a string (SET, or SETNX
    on the key holding nothing); delivery 3's SADD + HINCRBY k is refused by
    the check, nothing of it written -- a type remembered from delivery 1
    would have let its SADD run and its HINCRBY fail at run time."""
    answers, pending = await _stream_call(client, [
        [("HSET", K, "f", "v"), ("HDEL", K, "f")],
        [change],
        [("SADD", OTHER, "x"), ("HINCRBY", K, "n", 1)],
    ])
    assert answers[:2] == [1, 1]
    assert _refused_by_the_check(answers[2], write=2), str(answers[2])
    assert pending == ["1-3"]
    assert await client.execute("GET", K) == b"text"
    assert await client.execute("EXISTS", OTHER) == 0


async def test_same_writes_that_make_a_key_a_string_are_checked_again(client: Client) -> None:
    """Deliveries 2 to 4 carry one outcome (SAME_WRITES: its writes sent once)
    that writes k as a hash, then SETs it; k's type known from delivery 1.
    Delivery 2 is written; 3 and 4 are refused by the check (k a string now),
    nothing of them written -- running the writes again unchecked would add
    to OTHER, then fail at run time on k."""
    same = [("SADD", OTHER, "x"), ("HSET", K, "f", "v"), ("SET", K, "text")]
    answers, pending = await _stream_call(client, [[("SADD", OTHER, "w"), ("HSET", K, "g", "v")],
                                                   same, same, same])
    assert answers[:2] == [1, 1]
    assert all(_refused_by_the_check(a, write=2) for a in answers[2:]), [str(a) for a in answers]
    assert pending == ["1-3", "1-4"]
    assert await client.execute("GET", K) == b"text"
    assert sorted(await client.execute("SMEMBERS", OTHER)) == [b"w", b"x"]


async def test_a_key_set_then_hincrbyed_in_one_call(client: Client) -> None:
    """Delivery 1 SETs k, delivery 2 HINCRBYs it: delivery 2 refused
    (WRONGTYPE) alone; delivery 1 written and removed."""
    answers, pending = await _stream_call(client, [
        [("SET", K, "v")],
        [("HINCRBY", K, "n", 1)],
    ])
    assert answers[0] == 1
    assert _refused_by_the_check(answers[1]), str(answers[1])
    assert pending == ["1-2"]
    assert await client.execute("GET", K) == b"v"


@pytest.mark.parametrize("removal", [("PEXPIREAT", K, 1), ("UNLINK", OTHER, K), ("DEL", K)],
                         ids=["expired", "unlink", "del"])
async def test_a_key_removed_keeps_only_what_holds_for_nothing(
    client: Client, removal: tuple[Any, ...]
) -> None:
    """A removal (an expiry in the past, UNLINK, DEL) leaves the key holding
    nothing: the same type is written again without a read, another type too
    (read: nothing), and a third write of the first type is refused (the key
    now holds the second)."""
    answers, pending = await _stream_call(client, [
        [("HINCRBY", K, "n", 1)],
        [removal],
        [("HINCRBY", K, "n", 5)],
        [removal],
        [("SADD", K, "m")],
        [("HSET", K, "f", "v")],
    ])
    assert answers[:5] == [1, 1, 1, 1, 1]
    assert _refused_by_the_check(answers[5]), str(answers[5])
    assert pending == ["1-6"]
    assert await client.execute("SMEMBERS", K) == [b"m"]


async def test_a_key_of_another_type_is_refused_to_every_delivery_writing_it(
    client: Client
) -> None:
    """A string k: every delivery that writes it as a hash is refused (each
    its own element, nothing of it written, still pending), whichever of its
    writes names k; the deliveries around them are written and removed."""
    await client.execute("SET", K, "text")
    writes: list[list[tuple[Any, ...]]] = []
    for k in range(12):
        if k % 3 == 0:
            writes.append([("HINCRBY", K, "n", 1)])
        elif k % 3 == 1:
            writes.append([("SADD", OTHER, str(k)), ("HSET", K, "f", str(k))])
        else:
            writes.append([("SADD", OTHER, str(k))])
    answers, pending = await _stream_call(client, writes)
    for k, a in enumerate(answers):
        if k % 3 == 2:
            assert a == 1
        else:
            assert _refused_by_the_check(a, write=1 if k % 3 == 0 else 2), (k, str(a))
    assert pending == [f"1-{k + 1}" for k in range(12) if k % 3 != 2]
    assert sorted(await client.execute("SMEMBERS", OTHER)) == sorted(
        str(k).encode() for k in range(12) if k % 3 == 2)
    assert await client.execute("GET", K) == b"text"


async def test_value_checks_judge_only_what_no_earlier_write_of_the_outcome_touched(
    client: Client
) -> None:
    """The value checks of writes after the first (an outcome's own, beside
    the type cache): a value Redis would refuse is refused before anything of
    the outcome is written, unless an earlier write of the same outcome names
    its key (which could change it: not judged, run as it comes)."""
    await client.execute("SET", "{c}text", "abc")
    await client.execute("HSET", "{c}h", "f", "text")
    answers, pending = await _stream_call(client, [
        [("SADD", OTHER, "1"), ("INCR", "{c}text")],  # refused: not an integer
        [("SADD", OTHER, "2"), ("INCRBY", "{c}n", "1.5")],  # refused: the increment
        [("SADD", OTHER, "3"), ("HINCRBY", "{c}h", "f", 1)],  # refused: the field
        [("SADD", OTHER, "4"), ("PFADD", "{c}text", "a")],  # refused: not a HyperLogLog
        [("HSET", "{c}h", "f", "5"), ("HINCRBY", "{c}h", "f", 1)],  # touched: 6
        [("DEL", OTHER, "{c}text"), ("INCR", "{c}text")],  # touched (DEL's 2nd key): 1
        [("SET", "{c}t2", "x"), ("SADD", OTHER, "7"), ("INCR", "{c}t2")],  # run, refused at
    ])                                                                    # run time
    whys = ["the value is not an integer", "the increment is not an integer",
            "the field f holds no integer", "not a HyperLogLog"]
    for k, why in enumerate(whys):
        a = answers[k]
        assert isinstance(a, rexc.ResponseError), (k, a)
        assert str(a).startswith("write 2 of the outcome") and why in str(a), str(a)
        assert "nothing written" in str(a)
    assert answers[4:6] == [1, 1]
    assert isinstance(answers[6], rexc.ResponseError) and "write" not in str(answers[6])
    assert pending == ["1-1", "1-2", "1-3", "1-4", "1-7"]
    assert await client.execute("HGET", "{c}h", "f") == b"6"
    assert await client.execute("GET", "{c}text") == b"1"
    # the 7th: its writes before the refused one applied (as its single script leaves them)
    assert await client.execute("GET", "{c}t2") == b"x"
    assert await client.execute("SMEMBERS", OTHER) == [b"7"]


async def _type_reads(c: Client) -> int:
    """TYPE calls the server counted (scripts' calls included)."""
    info = await c.execute("INFO", "commandstats")
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("cmdstat_type:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


def test_the_batched_pass_sends_every_value_checked_write_to_the_checks() -> None:
    """The names a batched call's pass over a delivery's writes sends to
    ``wcheck`` as later writes (``VALUE_CHECKED``) are those ``wchecks``
    judges: a name judged there but missing here would run unjudged."""
    import re

    from trio_redis_finalize._core._lua_writes import BATCH_WRITES_LUA, VALUE_CHECKED

    judged = set(re.findall(r"^    ([A-Z]+) = function\(i, fresh\)", BATCH_WRITES_LUA, re.M))
    judged |= set(re.findall(r"^  t\.([A-Z]+)", BATCH_WRITES_LUA, re.M))
    judged |= set(re.findall(r", t\.([A-Z]+) = ", BATCH_WRITES_LUA))
    assert judged == set(VALUE_CHECKED) == {"INCR", "INCRBY", "DECR", "DECRBY", "HINCRBY", "PFADD"}


async def test_identical_keys_across_a_hundred_deliveries_are_read_once(client: Client) -> None:
    """100 deliveries writing the same two keys, one of them given an expiry
    each time and deleted every tenth: each written once per delivery, all
    removed, and each key's type read once for the call (an expiry or a
    deletion leaves a key holding its type or nothing: no read again)."""
    ids = [f"1-{k + 1}" for k in range(100)]
    await client.execute("CONFIG", "RESETSTAT")
    answers, pending = await _stream_call(client, [
        [("HINCRBY", K, "n", 1), ("SADD", OTHER, eid), ("EXPIRE", OTHER, 1000)] if k % 2
        else [("HINCRBY", K, "n", 1)] if k % 10 else [("DEL", OTHER), ("HINCRBY", K, "n", 1)]
        for k, eid in enumerate(ids)])
    assert answers == [1] * 100 and pending == []
    assert await client.execute("HGET", K, "n") == b"100"
    assert await client.execute("SCARD", OTHER) == 5  # added since the last DEL (the 91st)
    assert await _type_reads(client) == 2


async def test_a_single_script_reads_a_key_its_writes_share_once(client: Client) -> None:
    """A single writes script (an outcome finalized alone) keeps the cache for
    its own writes: three writes on one hash and an expiry, one TYPE.  (A
    SET between two hash writes, which the script would let fail at run
    time with the writes before it applied, is refused when the outcome is
    made: ``_writes._left``.)"""
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    await client.execute("XADD", S, "1-1", "f", "v")
    await client.execute("XADD", S, "1-2", "f", "v")
    await client.execute("XREADGROUP", "GROUP", G, "c1", "STREAMS", S, ">")
    t = _stream_target()
    await client.execute("CONFIG", "RESETSTAT")
    (cmd,) = plan_writes(t, _entry("1-1"), ACK.with_writes(
        ("HSET", K, "f", "v"), ("HINCRBY", K, "n", 1), ("EXPIRE", K, 1000),
        ("HINCRBY", K, "n", 2))).commands
    (reply,) = await client.pipeline([cmd])
    assert reply == 1 and await client.execute("HGET", K, "n") == b"3"
    assert await _type_reads(client) == 1
    with pytest.raises(ValueError, match=r"writes\[2\]: HINCRBY .* is a string"):
        ACK.with_writes(("HINCRBY", K, "n", 1), ("SET", K, "text"), ("HINCRBY", K, "n", 1))


async def test_a_list_batch_shares_the_cache_across_its_elements(client: Client) -> None:
    """LIST_WRITES_REMOVE_BATCH: element 1 HINCRBYs k (a hash), element 2 SETs
    it, element 3's SADD + HINCRBY k is refused by the check (nothing of it
    written, still in the processing list), element 4 DELs k, element 5
    HINCRBYs it (allowed: nothing there)."""
    t = _list_target()
    raws = [b"a", b"b", b"c", b"d", b"e"]
    await client.execute("RPUSH", t.processing, *raws)
    writes: list[list[tuple[Any, ...]]] = [
        [("HINCRBY", K, "n", 1)], [("SET", K, "v")], [("SADD", OTHER, "x"), ("HINCRBY", K, "n", 1)],
        [("DEL", K)], [("HINCRBY", K, "n", 1)]]
    plans: list[Plan] = []
    for raw, ws in zip(raws, writes, strict=True):
        (single,) = plan_writes(t, _element(raw), ACK.with_writes(*ws)).commands
        plans.append(dataclasses.replace(plan_writes(t, _element(raw), ACK.with_writes(*ws)),
                                         commands=(list_counted(single, 1),)))
    commands, owners, _ = first_round((), plans)
    assert len(commands) == 1 and owners == [tuple(range(len(raws)))]
    assert commands[0][1] == list_scripts.LIST_WRITES_REMOVE_BATCH.sha
    (reply,) = await client.pipeline(commands, raise_on_error=False)
    answers = batch_replies(reply, len(raws))
    assert answers is not None
    assert [answers[k] for k in (0, 1, 3, 4)] == [1, 1, 1, 1]
    assert _refused_by_the_check(answers[2], write=2), str(answers[2])
    assert await client.execute("LRANGE", t.processing, 0, -1) == [b"c"]
    assert await client.execute("HGET", K, "n") == b"1"
    assert await client.execute("EXISTS", OTHER) == 0


# -- any writes, batched against their singles ----------------------------------------------

_KEYS = ("{c}a", "{c}b")
_WRITES = st.one_of(
    # (mostly the first key: the cases meet on one key)
    st.sampled_from((*[_KEYS[0]] * 3, _KEYS[1])).flatmap(lambda k: st.sampled_from([
        ("HINCRBY", k, "n", 1), ("HSET", k, "f", "v"), ("HDEL", k, "f"), ("HDEL", k, "n"),
        ("SADD", k, "m"), ("SREM", k, "m"), ("LPUSH", k, "e"), ("LTRIM", k, 1, 0),
        ("INCR", k), ("SET", k, "1"), ("SETNX", k, "x"), ("DEL", k), ("PEXPIREAT", k, 1),
        ("EXPIRE", k, 1000), ("PERSIST", k),
    ])),
    st.just(("DEL", *_KEYS)),
)


def _constructible(ws: list[tuple[Any, ...]]) -> bool:
    """An outcome may carry ``ws`` (none of its writes' keys made another type
    by an earlier one: ``checked_writes`` refuses that when it is made)."""
    try:
        checked_writes(ws)
    except ValueError:
        return False
    return True


_PICKS = st.lists(st.tuples(st.integers(0, 5), st.booleans(),
                            st.lists(_WRITES, min_size=1, max_size=2).filter(_constructible)),
                  min_size=2, max_size=12)
_PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


async def _keys_state(c: Client) -> list[Any]:
    out: list[Any] = []
    for k in _KEYS:
        kind = await c.execute("TYPE", k)
        kind = kind.decode() if isinstance(kind, bytes) else kind
        value = {"string": ("GET", k), "hash": ("HGETALL", k), "set": ("SMEMBERS", k),
                 "list": ("LRANGE", k, 0, -1)}.get(kind)
        got = await c.execute(*value) if value else None
        out += [kind, sorted(got) if kind == "set" else got, await c.execute("TTL", k) > 0]
    return out


def _six_pending(redis_server: RedisServer, plans: list[Any], closed: set[int]
                 ) -> Callable[[bool], Awaitable[tuple[list[Any], list[Any]]]]:
    """``plans`` sent, batched or one by one, to six pending stream entries
    (those of ``closed`` acknowledged first) with ``_KEYS[1]`` a hash holding
    text: their answers, then the keys' state and what is left pending."""
    async def go(batched: bool) -> tuple[list[Any], list[Any]]:
        with trio.fail_after(60):
            async with open_client(redis_server.url) as c:
                await pending_six(c, S, G, closed)
                await c.execute("HSET", _KEYS[1], "n", "text")
                answers = await send(c, plans, batched)
                pending = [p[0] for p in await c.execute("XPENDING", S, G, "-", "+", 10)]
                return answers, [*await _keys_state(c), pending]
    return go



@pytest.mark.timeout(300)
@_PROPERTY
@given(picks=_PICKS, closed=st.sets(st.integers(0, 5)))
def test_any_writes_in_a_stream_batch_do_what_their_singles_do(
    redis_server: RedisServer, picks: list[tuple[int, bool, list[tuple[Any, ...]]]],
    closed: set[int],
) -> None:
    """Writes that change, empty and remove keys (of every type the cache can
    hold) across the deliveries of one STREAM_WRITES_ACK_BATCH call leave
    Redis as their single scripts one after the other do, and answer alike."""
    t = _stream_target()
    plans = [plan_writes(t, _entry(f"1-{k}"), (ACK if ack else DROP).with_writes(*ws))
             for k, ack, ws in picks]

    assert_batch_is_its_singles(_six_pending(redis_server, plans, closed))


# runs of one outcome (SAME_WRITES), from a pool of two
_RUNS = st.tuples(
    st.lists(st.lists(_WRITES, min_size=1, max_size=3).filter(_constructible), min_size=2,
             max_size=2),
    st.lists(st.tuples(st.integers(0, 5), st.booleans(), st.integers(0, 1)), min_size=2,
             max_size=12))


@pytest.mark.timeout(300)
@_PROPERTY
@given(runs=_RUNS, closed=st.sets(st.integers(0, 5)))
def test_runs_of_one_outcome_in_a_stream_batch_do_what_their_singles_do(
    redis_server: RedisServer,
    runs: tuple[list[list[tuple[Any, ...]]], list[tuple[int, bool, int]]], closed: set[int],
) -> None:
    """The same with the deliveries' outcomes drawn from two (most of them
    the one of the delivery before: SAME_WRITES, run again from where they
    are)."""
    pool, picks = runs
    t = _stream_target()
    plans = [plan_writes(t, _entry(f"1-{k}"), (ACK if ack else DROP).with_writes(*pool[o]))
             for k, ack, o in picks]

    assert_batch_is_its_singles(_six_pending(redis_server, plans, closed))


@pytest.mark.timeout(300)
@_PROPERTY
@given(picks=_PICKS, present=st.lists(st.sampled_from([b"0", b"1", b"2"]), max_size=4),
       absent=st.lists(st.sampled_from([b"0", b"1", b"2"]), max_size=1))
def test_any_writes_in_a_list_batch_do_what_their_singles_do(
    redis_server: RedisServer, picks: list[tuple[int, bool, list[tuple[Any, ...]]]],
    present: list[bytes], absent: list[bytes],
) -> None:
    """The same through LIST_WRITES_REMOVE_BATCH (elements present once,
    more, or not)."""
    t = _list_target()
    plans: list[Plan] = []
    elements = [_element(str(k % 3).encode()) for k, _, _ in picks]
    for (_, ack, ws), d in zip(picks, elements, strict=True):
        (single,) = plan_writes(t, d, (ACK if ack else DROP).with_writes(*ws)).commands
        plans.append(dataclasses.replace(plan_writes(t, d, ACK.with_writes(*ws)),
                                         commands=(list_counted(single, 1),)))
    commands, owners, _ = first_round((), plans)
    assert len(commands) == 1 and owners == [tuple(range(len(plans)))]
    assert commands[0][1] == list_scripts.LIST_WRITES_REMOVE_BATCH.sha

    async def go(batched: bool) -> tuple[list[Any], list[Any]]:
        with trio.fail_after(60):
            async with open_client(redis_server.url) as c:
                await c.execute("FLUSHALL")
                # each element present once (open gates), some twice, some closed
                pushed = [*({d.raw for d in elements} - set(absent)), *present]
                if pushed:
                    await c.execute("RPUSH", t.processing, *pushed)
                await c.execute("HSET", _KEYS[1], "n", "text")
                answers = await send(c, plans, batched, commands)
                # (the processing list as a multiset: the batched call takes a copy
                # counted 1 out first once a write ran, and puts it back at the tail
                # when its writes are refused)
                return answers, [*await _keys_state(c),
                                 sorted(await c.execute("LRANGE", t.processing, 0, -1))]

    assert_batch_is_its_singles(go)
