"""A reply that is not RESP (``InvalidResponse``) to a runtime ``retry_after``'s steps.

The command proxy (``faults.cmdproxy``) answers one chosen request with an
HTTP status line: :data:`~faults.cmdproxy.GARBLED` after the server ran it,
:data:`~faults.cmdproxy.GARBLED_INSTEAD` without running it.  The client
cannot tell which: the outcome is unknown, like a lost reply, and the step
must be sent again (gated: a resend that finds its first send committed
writes nothing more).  Before, such a reply was a final error: a stream's
removal with its receipt (``stream_remove_receipt``) ran but was counted
failed and its copy never held (the message lost: the original was
acknowledged); the held copy (``stream_copy_once``) was counted failed and
never sent again (lost when it had not run; when it had, logged "not
written" although it was).

Real servers (``TRF_REDIS_SERVER``); timeouts are bounds, the pause after
the redelivery a bound for a second one to show.
"""

from __future__ import annotations

import pytest
import trio
from _procs import eventually, pel_count

from faults.cmdproxy import GARBLED, GARBLED_INSTEAD, CommandProxy, Fault, serving
from trio_redis_finalize import ACK, Delivery, Outcome, open_consumer, retry_after
from trio_redis_finalize import ChannelSubscription as Channel
from trio_redis_finalize import ListSubscription as SimpleList
from trio_redis_finalize import ReliableListSubscription as ReliableList
from trio_redis_finalize import StreamSubscription as Stream
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(60)

CASES: dict[str, tuple[str, Fault]] = {
    "remove-receipt-ran": ("EVALSHA:stream_remove_receipt", GARBLED),
    "copy-once-ran": ("EVALSHA:stream_copy_once", GARBLED),
    "copy-once-not-run": ("EVALSHA:stream_copy_once", GARBLED_INSTEAD),
}


class Attempts:
    """A handler: ``retry_after(0.3)`` on attempt 1, ACK after; records the attempts."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    async def __call__(self, d: Delivery) -> Outcome:
        self.seen.append(d.attempt)
        return retry_after(0.3) if d.attempt == 1 else ACK


@pytest.mark.parametrize("case", list(CASES))
async def test_a_garbled_reply_to_a_stream_s_runtime_copy_loses_nothing(
    redis_server: RedisServer, flavour: str, client: Client, case: str,
) -> None:
    """The message comes back once, as attempt 2; one copy in the stream;
    nothing counted failed, the copy counted released."""
    kind, fault = CASES[case]
    await client.execute("XADD", "s", "*", "n", "1")
    handler = Attempts()
    async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy:
        proxy.arm(kind, fault)
        async with open_consumer(proxy.url, name="c1", shutdown_grace=1.0) as consumer:
            await consumer.mount(Stream("s", "g", block=0.1), handler)
            name = consumer.mounts[0].name
            await eventually(lambda: proxy.fired, 15, f"{kind} met the fault")
            await eventually(lambda: handler.seen == [1, 2], 15,
                             lambda: f"attempt 2 delivered (seen {handler.seen})")
            await eventually(lambda: consumer.stats()[name]["effects"].get("released"), 15,
                             "the copy counted released")
            await trio.sleep(1.0)  # a second copy would be delivered by then
            effects = consumer.stats()[name]["effects"]
    assert handler.seen == [1, 2], handler.seen
    assert effects.get("failed", 0) == 0 and effects["released"] == 1, effects
    assert await client.execute("XLEN", "s") == 2  # the original and one copy
    assert await pel_count(client, "s", "g") == 0


@pytest.mark.parametrize("form", ["reliable-list", "list", "channel"])
async def test_a_garbled_reply_to_a_held_copy_that_did_not_run_sends_it_again(
    redis_server: RedisServer, flavour: str, client: Client, form: str,
) -> None:
    """A reliable list's gated copy-and-remove, a simple list's ``LPUSH``, a
    channel's ``PUBLISH``: answered with bytes that are not RESP instead of
    running, the copy is sent again (before: counted failed, never written --
    a simple list's or a channel's message lost, a reliable list's original
    stranded in its processing list until a restart)."""
    handler = Attempts()
    sub: ReliableList | SimpleList | Channel
    if form == "reliable-list":
        await client.execute("LPUSH", "q", b"job")
        sub, kind = ReliableList("q", block=0.1), "EVALSHA:reliable_list_delayed_copy"
    elif form == "list":
        await client.execute("LPUSH", "l", b"job")
        sub, kind = SimpleList("l", block=0.1), "LPUSH"
    else:
        sub, kind = Channel("ch"), "PUBLISH"
    async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy:
        proxy.arm(kind, GARBLED_INSTEAD)
        async with open_consumer(proxy.url, name="c1", shutdown_grace=1.0) as consumer:
            await consumer.mount(sub, handler)
            name = consumer.mounts[0].name
            if form == "channel":
                await client.execute("PUBLISH", "ch", b"m")
            await eventually(lambda: proxy.fired, 15, f"{kind} met the fault")
            await eventually(lambda: handler.seen == [1, 2], 15,
                             lambda: f"attempt 2 delivered (seen {handler.seen})")
            await trio.sleep(1.0)  # a second copy would be delivered by then
            effects = consumer.stats()[name]["effects"]
    assert handler.seen == [1, 2], handler.seen
    assert effects.get("failed", 0) == 0, effects
    for key in ("q", "{q}:processing:c1", "l"):
        assert await client.execute("LLEN", key) == 0, key

