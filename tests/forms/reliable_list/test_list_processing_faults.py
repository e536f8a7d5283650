"""The refusal of a ``processing=`` list a live consumer registered, under faults.

``processing=`` names *this consumer's* processing list: a second consumer
name mounting the queue with the list another live consumer registered is
refused (``liveness.ListLiveness.register``: the registry read, then an
``EXISTS`` of each such consumer's heartbeat key), else its start's rescan
would hand the first one's elements to a second handler.  Here that
``EXISTS`` meets a fault (the command proxy): its reply lost (it ran), a
silent link, an error reply instead of running.  The mount must fail, with an
error, in time -- or look again and refuse -- never mount on the live one's
list: the second consumer handles nothing, registers nothing, and the first
one's elements are handled once, by it.  Timeouts are bounds.
"""

from __future__ import annotations

import pytest
import trio
from _procs import HoldFirst, Recorder, eventually
from _rlist import Q, lrange, sub
from faults.cmdproxy import BLACKHOLE, LOST, CommandProxy, Fault, error, serving
from redis import exceptions as rexc

from trio_redis_finalize import open_consumer
from trio_redis_finalize._core.reliable_list.liveness import registry_key
from trio_redis_finalize._forms.reliable_list import liveness as _list_liveness
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(90)

SHARED = "{jobs}:shared"
FAULTS: dict[str, Fault] = {"lost": LOST, "blackhole": BLACKHOLE, "OOM": error("OOM"),
                            "READONLY": error("READONLY")}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_fault_at_the_heartbeat_check_never_mounts_on_a_live_consumers_list(
    redis_server: RedisServer, flavour: str, client: Client, monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    """``c1`` (processing list ``SHARED``) holds three elements in hand.  ``c2``
    (through the proxy) mounts the same queue with ``processing=SHARED``; the
    ``EXISTS`` of ``c1``'s heartbeat key meets ``fault``.  ``c2``'s mount
    raises (the fault's error, or the refusal once it looked again); ``c2``
    handles nothing and is not registered; ``c1`` handles its three once."""
    monkeypatch.setattr(_list_liveness, "FINALIZE_TIMEOUT", 0.5)  # the silent link's end
    held = HoldFirst(n=3)
    other = Recorder()
    with trio.fail_after(60):  # a bound
        async with open_consumer(redis_server.url, name="c1", shutdown_grace=5.0) as c1:
            await c1.mount(sub(processing=SHARED), held, concurrency=3)
            await client.execute("LPUSH", Q, "m0", "m1", "m2")
            await eventually(lambda: len(held.seen) == 3, 10, "c1 holding three")
            async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy, \
                    open_consumer(proxy.url, name="c2", shutdown_grace=0.0) as c2:
                proxy.arm("EXISTS", FAULTS[fault])
                with pytest.raises(Exception) as info:  # the fault's, or the refusal
                    await c2.mount(sub(processing=SHARED), other)
                assert [f.fault for f in proxy.fired] == [FAULTS[fault]], proxy.fired
                await trio.sleep(0.5)  # a rescan of c2's would have delivered them by then
                assert other.seen == [], other.data
                registered = await client.execute("HGETALL", registry_key(Q))
            held.release.set()
            await eventually(lambda: _empty(client), 10, "c1's ACKs")
    # a lost reply or a silent link: the round trip's error (7.0: ConnectionError,
    # TimeoutError); an error reply: sent again, then the refusal
    if isinstance(info.value, ValueError):
        assert "live consumer 'c1'" in str(info.value), info.value
    else:
        assert isinstance(info.value, rexc.ConnectionError | rexc.TimeoutError), repr(info.value)
    assert b"c2" not in registered[::2], registered
    assert sorted((d.data, d.attempt) for d in held.seen) == [(b"m0", 1), (b"m1", 1), (b"m2", 1)]


async def _empty(client: Client) -> bool:
    return await lrange(client, SHARED) == [] and await lrange(client, Q) == []
