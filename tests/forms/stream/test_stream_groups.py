"""Stream groups and configuration (issue 12, items 3, 12, 15): a group
destroyed mid-run is recreated at the last id its reader delivered; the same
subscription cannot be mounted twice; bad configuration is a ValueError and a
key of the wrong type fails mount() naming key and type."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
from _procs import Recorder, assert_refused_naming, eventually
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import exceptions as rexc

from trio_redis_finalize import (
    DelayedRetry,
    Mode,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._transport import Client, open_client

S, G = "jobs", "workers"
NAME = f"stream {S!r} group {G!r}"


async def xadd(client: Client, n: str) -> str:
    return str((await client.execute("XADD", S, "*", "n", n)).decode())


# -- item 3: NOGROUP mid-run ------------------------------------------------------------

@pytest.mark.parametrize("start_id", ["0", "$"])
async def test_group_destroyed_mid_run_is_recreated_at_the_last_delivered_id(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture, start_id: str
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    h = Recorder()
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.1, start_id=start_id), h)
        first = await xadd(client, "first")
        await eventually(lambda: len(h.seen) == 1, what="first entry handled")
        await eventually(lambda: consumer.stats()[NAME]["effects"].get("acked") == 1, what="acked")
        # destroyed, and an entry written before the reader can notice
        replies = await client.pipeline([
            ("MULTI",), ("XGROUP", "DESTROY", S, G), ("XADD", S, "*", "n", "meanwhile"), ("EXEC",),
        ])
        meanwhile = replies[-1][1].decode()
        await eventually(lambda: consumer.stats()[NAME]["group_recreated"] >= 1, what="recreated")
        after = await xadd(client, "after")
        await eventually(lambda: len(h.seen) >= 3, what="entries after the destroy")
        await trio.sleep(0.3)
        assert consumer.stats()[NAME]["group_recreated"] == 1
    # nothing skipped ($), nothing handled twice (0)
    assert [d.id for d in h.seen] == [first, meanwhile, after]
    assert [d.attempt for d in h.seen] == [1, 1, 1]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("group is gone" in m and NAME in m and first in m for m in warnings), warnings
    assert int((await client.execute("XPENDING", S, G))[0]) == 0


# -- item 12: the same subscription mounted twice -----------------------------------------

async def test_the_same_subscription_cannot_be_mounted_twice(redis_url: str, client: Client) -> None:
    h = Recorder()
    sub = StreamSubscription(S, G, block=0.1)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, h)
        with pytest.raises(ValueError, match="mounted"):
            await consumer.mount(sub, h)
        with pytest.raises(ValueError, match="mounted"):  # an equal one
            await consumer.mount(StreamSubscription(S, G, block=0.5), Recorder())
        # another group of the same stream is another subscription
        other = Recorder()
        await consumer.mount(StreamSubscription(S, "other", block=0.1), other)
        eid = await xadd(client, "x")
        await eventually(lambda: len(h.seen) == 1 and len(other.seen) == 1, what="handled")
        await trio.sleep(0.3)
    assert [d.id for d in h.seen] == [eid]  # once, not twice
    assert len(consumer.stats()) == 2


# -- item 15: configuration ------------------------------------------------------------------

DZ = DelayedRetry.DURABLE_ZSET

BAD: list[tuple[str, Any, str]] = [
    ("start_id word", lambda: StreamSubscription(S, G, start_id="latest"), "start_id"),
    ("start_id >", lambda: StreamSubscription(S, G, start_id=">"), "start_id"),
    ("start_id half", lambda: StreamSubscription(S, G, start_id="1-"), "start_id"),
    ("start_id negative", lambda: StreamSubscription(S, G, start_id="-1"), "start_id"),
    ("start_id three parts", lambda: StreamSubscription(S, G, start_id="1-2-3"), "start_id"),
    ("start_id spaced", lambda: StreamSubscription(S, G, start_id=" 0"), "start_id"),
    ("start_id int", lambda: StreamSubscription(S, G, start_id=0), "start_id"),  # type: ignore[arg-type]
    ("dead_letter is the default delay_key",
     lambda: StreamSubscription(S, G, max_attempts=2, dead_letter="{jobs}:delayed"), "delay_key"),
    ("dead_letter is the default delay_key (durable)",
     lambda: StreamSubscription(S, G, delayed_retry=DZ, max_attempts=2,
                                dead_letter="{jobs}:delayed"), "delay_key"),
    ("dead_letter is the given delay_key",
     lambda: StreamSubscription(S, G, delayed_retry=DZ, delay_key="d", max_attempts=2,
                                dead_letter="d"), "delay_key"),
    ("min_idle too short, reclaim", lambda: StreamSubscription(S, G, mode=Mode.RECLAIM, min_idle=0.005),
     "min_idle"),
    ("min_idle zero, claiming", lambda: StreamSubscription(S, G, mode=Mode.CLAIMING, min_idle=0),
     "min_idle"),
]


@pytest.mark.parametrize(("what", "factory", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_stream_config_names_the_parameter(what: str, factory: Any, param: str) -> None:
    assert_refused_naming(param, factory, what)


@pytest.mark.parametrize("start_id", ["0", "$", "0-0", "1700000000000", "1700000000000-7"])
def test_good_start_ids(start_id: str) -> None:
    assert StreamSubscription(S, G, start_id=start_id).start_id == start_id


def test_min_idle_edges() -> None:
    StreamSubscription(S, G, mode=Mode.RECLAIM, min_idle=0.01)
    StreamSubscription(S, G, mode=Mode.CLAIMING, min_idle=0.01)
    StreamSubscription(S, G, min_idle=0)  # PLAIN does not claim: unused


@pytest.mark.parametrize(
    ("setup", "sub", "key", "kind"),
    [
        (("SET", "dead", "x"), StreamSubscription(S, G, max_attempts=1, dead_letter="dead"),
         "dead", "string"),
        (("LPUSH", "dead", "x"), StreamSubscription(S, G, max_attempts=1, dead_letter="dead"),
         "dead", "list"),
        (("SET", "{jobs}:delayed", "x"), StreamSubscription(S, G, delayed_retry=DZ),
         "{jobs}:delayed", "string"),
        (("XADD", "mine", "*", "a", "b"), StreamSubscription(S, G, delayed_retry=DZ, delay_key="mine"),
         "mine", "stream"),
    ],
)
async def test_mount_names_key_and_type_of_a_wrong_typed_key(
    redis_url: str, client: Client, setup: tuple[str, ...], sub: StreamSubscription, key: str,
    kind: str,
) -> None:
    await client.execute(*setup)
    async with open_consumer(redis_url, name="c1") as consumer:
        with trio.fail_after(10), pytest.raises(rexc.ResponseError) as info:
            await consumer.mount(sub, Recorder())
    msg = str(info.value)
    assert key in msg and kind in msg, msg


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(start_id=st.one_of(
    st.integers(0, 2**65).map(str),
    st.tuples(st.integers(0, 2**65), st.integers(0, 2**65)).map(lambda t: f"{t[0]}-{t[1]}"),
    st.sampled_from(["0", "$", "0-0", "-", "+", ">", "*", "1-*", "0x1", "1e3", "1.5", "-1", "1-", "1--2"]),
    st.text(alphabet="0123456789-$+ *x", max_size=8),
))
async def test_start_id_accepted_only_if_redis_accepts_it(redis_url: str, start_id: str) -> None:
    """Every start_id the subscription accepts, XGROUP CREATE accepts too."""
    try:
        StreamSubscription(S, G, start_id=start_id)
    except ValueError as e:
        assert "start_id" in str(e)
        return
    async with open_client(redis_url) as c:
        await c.execute("DEL", S)
        assert await c.execute("XGROUP", "CREATE", S, G, start_id, "MKSTREAM") in (b"OK", "OK")
