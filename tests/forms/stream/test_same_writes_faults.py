"""Exactly once when a batched writes call carries ``SAME_WRITES``: a
handler returns one outcome object for every entry, so each delivery after
the first in a ``stream_writes_ack_batch`` call carries ``=`` in place of its
writes; the calls meet a fault (the reply lost, the connection silent, OOM,
READONLY) through the command proxy, and are sent again.  Every entry's
write is applied once and every entry is acknowledged: the resent call's
gates let nothing run twice.  Timeouts are bounds."""

from __future__ import annotations

import anyio
import pytest
import trio
from _procs import eventually, finalize_timers
from faults.cmdproxy import BLACKHOLE, LOST, CommandProxy, Fault, error

from trio_redis_finalize import ACK, Delivery, Outcome, StreamSubscription, open_consumer
from trio_redis_finalize._core._lua_writes import SAME_WRITES
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

S, G, COUNTER = "s", "g", "s:handled"
N = 20
DONE = ACK.with_writes(("INCR", COUNTER))
"""One outcome object for every entry."""

FAULTS: dict[str, Fault] = {"lost": LOST, "blackhole": BLACKHOLE, "oom": error("OOM"),
                            "readonly": error("READONLY")}
KIND = "EVALSHA:stream_writes_ack_batch"


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_fault_at_a_call_carrying_same_writes_applies_each_write_once(
    redis_server: RedisServer, client: Client, monkeypatch: pytest.MonkeyPatch, flavour: str,
    fault: str,
) -> None:
    finalize_timers(monkeypatch, grace=1.0, timeout=1.0)
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    for i in range(N):
        await client.execute("XADD", S, "*", "n", str(i))
    handled: list[str | None] = []

    async def handle(d: Delivery) -> Outcome:
        handled.append(d.id)
        return DONE

    async def done() -> bool:
        return (not await client.execute("XPENDING", S, G, "-", "+", 10)
                and len(set(handled)) == N)

    proxy = CommandProxy(redis_server.port, flavour=flavour)
    for k in range(4):  # the first calls, and their resends
        proxy.arm(KIND, FAULTS[fault], at=k)
    with trio.fail_after(60):  # a bound
        async with anyio.create_task_group() as tg:
            await tg.start(proxy.serve)
            async with open_consumer(proxy.url, name="a") as a:
                await a.mount(StreamSubscription(S, G, block=0.05, count=N), handle,
                              concurrency=1)
                await eventually(done, 30, lambda: f"every entry handled ({len(handled)})")
            await proxy.cut_all()
            tg.cancel_scope.cancel()
    fired = proxy.fired
    assert fired and all(f.kind == KIND for f in fired), fired
    # a faulted call carried the writes of the delivery before (not only full writes)
    assert any(SAME_WRITES.encode() in f.args for f in fired), [f.args for f in fired]
    assert int(await client.execute("GET", COUNTER)) == N
    assert await client.execute("XLEN", S) == N
