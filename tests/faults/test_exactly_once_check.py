"""``testing.check_exactly_once``: a user's handler through every fault at every
finalization command, against a real server.

A handler whose effect rides with its finalization (``with_writes``) passes on
every form; one that writes with its own client before returning ACK (the
mistake the helper exists to catch) fails with the key, the happy path's value
and the case's; so does a handler that writes with the outcome but also
directly.  The report counts per message the handler calls and the committed
writes.
"""

from __future__ import annotations

import anyio
import pytest

from trio_redis_finalize import (
    ACK,
    RETRY,
    DelayedRetry,
    Delivery,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    retry_after,
)
from trio_redis_finalize._transport import open_client
from trio_redis_finalize.testing import ExactlyOnceError, check_exactly_once

pytestmark = pytest.mark.timeout(240)

STREAM = StreamSubscription("orders", "billing")
LIST = ReliableListSubscription("jobs")
ORDERS = [{"order": "1", "eur": "5"}, {"order": "2", "eur": "7"}]


async def bill(d: Delivery) -> Outcome:
    return ACK.with_writes(("HINCRBY", "totals", "eur", int(d.fields[b"eur"])))


async def test_a_handler_whose_write_rides_with_its_ack_passes_on_a_stream(redis_url: str) -> None:
    with anyio.fail_after(200):
        report = await check_exactly_once(bill, ORDERS, subscription=STREAM, url=redis_url)
    assert report.ok
    happy, *faulted = report.cases
    assert happy.state == {"totals": ("hash", {b"eur": b"12"})}
    assert [(m.index, m.calls, m.committed) for m in happy.messages] == [(0, 1, 1), (1, 1, 1)]
    # every fault at every finalization command the happy path sent (one batched call at least)
    assert len(faulted) >= 4 and len(faulted) % 4 == 0
    assert all(c.state == happy.state and not c.problems for c in faulted)
    # a crash made some message be handled again, and its write still committed once
    assert any(m.calls == 2 and m.committed == 1 for c in faulted for m in c.messages)


async def test_a_retry_then_ack_with_writes_passes_on_a_reliable_list(redis_url: str) -> None:
    async with open_client(redis_url) as own:

        async def job(d: Delivery) -> Outcome:
            # first try: RETRY, noting the try with the finalization; then ACK.  It decides
            # on what Redis holds, not on the attempt (a crash costs an attempt)
            data = d.data or b""
            if not await own.execute("SISMEMBER", "tried", data):
                return RETRY.with_writes(("SADD", "tried", data))
            return ACK.with_writes(("SADD", "done", data))

        with anyio.fail_after(200):
            report = await check_exactly_once(job, [b"a", b"b"], subscription=LIST, url=redis_url,
                                              faults=("after", "crash-after"))
    assert report.ok
    happy = report.cases[0]
    assert happy.state == {"tried": ("set", [b"a", b"b"]), "done": ("set", [b"a", b"b"])}
    assert [(m.calls, m.committed) for m in happy.messages] == [(2, 2), (2, 2)]


async def test_a_handler_that_writes_outside_with_writes_is_caught(redis_url: str) -> None:
    async with open_client(redis_url) as own:

        async def broken(d: Delivery) -> Outcome:
            # the mistake: the effect is applied before, and apart from, the finalization
            await own.execute("HINCRBY", "totals", "eur", int(d.fields[b"eur"]))
            return ACK

        with anyio.fail_after(200), pytest.raises(ExactlyOnceError) as caught:
            await check_exactly_once(broken, ORDERS, subscription=STREAM, url=redis_url,
                                     faults=("crash-before",))
    text = str(caught.value)
    assert "key 'totals': happy path hash {b'eur': b'12'}, here hash {b'eur':" in text
    assert "crash-before finalization command #0" in text
    assert "handler calls 2 (happy path 1)" in text
    failed = caught.value.report.failed
    assert failed and all(c.state["totals"] != caught.value.report.cases[0].state["totals"]
                          for c in failed)


async def later(d: Delivery) -> Outcome:
    if d.id == d.origin_id:  # the original: later; its copy: done
        return retry_after(0.05)
    return ACK.with_writes(("INCR", "handled"))


async def test_a_durable_delayed_retry_with_writes_passes(redis_url: str) -> None:
    durable = StreamSubscription("orders", "billing", delayed_retry=DelayedRetry.DURABLE_ZSET)
    with anyio.fail_after(200):
        report = await check_exactly_once(later, [{"n": "1"}], subscription=durable, url=redis_url,
                                          faults=("after", "crash-after"))
    assert report.ok
    assert report.cases[0].state == {"handled": ("string", b"1")}


async def test_a_runtime_delayed_retry_lost_in_a_crash_is_reported_with_the_setting_that_keeps_it(
        redis_url: str) -> None:
    with anyio.fail_after(200), pytest.raises(ExactlyOnceError) as caught:
        await check_exactly_once(later, [{"n": "1"}], subscription=STREAM, url=redis_url,
                                 faults=("crash-after",))
    text = str(caught.value)
    assert "key 'handled': happy path string b'1', here absent" in text
    assert "DelayedRetry.DURABLE_ZSET" in text


async def test_refusals_name_what_is_wrong() -> None:
    from trio_redis_finalize import ListSubscription

    with pytest.raises(ValueError, match="finalizes nothing to prove"):
        await check_exactly_once(bill, ORDERS, subscription=ListSubscription("q"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown"):
        await check_exactly_once(bill, ORDERS, subscription=STREAM, faults=("sideways",))
    with pytest.raises(ValueError, match="messages"):
        await check_exactly_once(bill, [], subscription=STREAM)


async def test_without_a_url_it_starts_and_stops_its_own_server() -> None:
    with anyio.fail_after(200):
        report = await check_exactly_once(bill, ORDERS[:1], subscription=STREAM, faults=("after",))
    assert report.ok and report.cases[0].state == {"totals": ("hash", {b"eur": b"5"})}
