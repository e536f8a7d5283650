"""classify(): what each server (6.2, 7.0, Valkey 9.1) actually answers, sorted into
FINAL / NOT_RUN / UNKNOWN (DESIGN §4 "Error replies")."""

from __future__ import annotations

import pytest
from _procs import pel_count
from faults.server_faults import OomSwitch, busy_server
from redis import exceptions as rexc

from trio_redis_finalize._core.stream import scripts as stream_scripts
from trio_redis_finalize._transport import (
    FINAL,
    NOT_RUN,
    NOT_RUN_ERRORS,
    UNKNOWN,
    Client,
    classify,
)
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(60)


async def test_classify_real_replies(client: Client, oom: OomSwitch, redis_server: RedisServer) -> None:
    await client.execute("XGROUP", "CREATE", "s", "g", "0", "MKSTREAM")
    await client.execute("XADD", "s", "*", "a", "1")
    await client.execute("XREADGROUP", "GROUP", "g", "c", "STREAMS", "s", ">")
    eid = (await client.execute("XRANGE", "s", "-", "+"))[0][0]
    await client.execute("SET", "str", "x")
    copy = stream_scripts.STREAM_COPY_ACK.command(("s", "d"), ("g", eid, "a", "1"))
    await client.execute("SCRIPT", "LOAD", stream_scripts.STREAM_COPY_ACK.source)
    final = await client.pipeline(
        [("XADD", "str", "*", "a", "1"), ("XADD", "s"), ("NOSUCHCOMMAND",),
         ("EVAL", "return redis.error_reply('MYERR refused')", 0),
         ("EVAL", "return redis.call('INCR', KEYS[1])", 1, "str"),
         ("XGROUP", "CREATE", "s", "g", "0")],
        raise_on_error=False,
    )
    assert all(isinstance(r, rexc.ResponseError) for r in final), final
    assert [classify(r) for r in final] == [FINAL] * len(final)
    assert not any(isinstance(r, NOT_RUN_ERRORS) for r in final)

    oom.on()
    try:
        replies = await client.pipeline(
            [("XADD", "s", "*", "a", "1"), copy, ("EVAL", "return redis.call('SET', 'x', '1')", 0)],
            raise_on_error=False,
        )
    finally:
        oom.off()
    # bare OOM; the gated copy script and a plain script fail at their write
    # (6.2: "Error running script ... -OOM ..."; 7 and Valkey: "OOM ... script: ...")
    assert all(isinstance(r, rexc.ResponseError) for r in replies), replies
    assert [classify(r) for r in replies] == [NOT_RUN] * 3, [str(r) for r in replies]
    assert all(isinstance(r, NOT_RUN_ERRORS) for r in replies)
    assert await pel_count(client, "s", "g") == 1  # the script wrote nothing

    # NOREPLICAS
    await client.execute("CONFIG", "SET", "min-replicas-to-write", "1")
    try:
        replies = await client.pipeline([("XADD", "s", "*", "a", "1"), copy], raise_on_error=False)
    finally:
        await client.execute("CONFIG", "SET", "min-replicas-to-write", "0")
    assert [classify(r) for r in replies] == [NOT_RUN] * 2, [str(r) for r in replies]

    # READONLY: a replica (of a dead port)
    await client.execute("REPLICAOF", "127.0.0.1", "1")
    try:
        replies = await client.pipeline(
            [("XADD", "s", "*", "a", "1"), copy, ("XACK", "s", "g", eid)], raise_on_error=False
        )
    finally:
        await client.execute("REPLICAOF", "NO", "ONE")
    assert [classify(r) for r in replies] == [NOT_RUN] * 3, [str(r) for r in replies]

    # connection lost / timeout: outcome unknown
    assert classify(rexc.ConnectionError("lost")) is UNKNOWN
    assert classify(rexc.TimeoutError("no reply")) is UNKNOWN
    # a reply that is not RESP: the connection is closed, the command may have run
    assert classify(rexc.InvalidResponse(
        "127.0.0.1:1 did not answer as a Redis server (Protocol error)")) is UNKNOWN


async def test_classify_busy_script(client: Client, redis_server: RedisServer) -> None:
    async with busy_server(redis_server):
        with pytest.raises(rexc.ResponseError) as info:
            await client.execute("XADD", "s", "*", "a", "1")
    assert classify(info.value) is NOT_RUN, str(info.value)
    assert isinstance(info.value, NOT_RUN_ERRORS)


