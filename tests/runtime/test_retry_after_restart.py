"""A ``retry_after(delay)`` whose message waits in Redis through a crash
(SIGKILL) of its consumer, then a restart.

* A reliable list's runtime ``retry_after`` keeps its original in the
  processing list while the copy waits in memory; the copy's due time is
  written beside the list (its ``Backoff`` schedule).  A restart under the
  same name (whatever its ``on_error``), or another consumer's reaper, lets
  the original wait out the rest: it comes back once, as attempt 2, not
  before its due time -- also when the due time's write met a lost reply, a
  silent link or a refusal (it is sent again); and a second finalization of
  the same delivery racing it settles it once.  (Before, the restart's rescan
  delivered it at once.)
* A CLAIMING stream's ``retry_after`` leaves the entry in the PEL, claimed
  back once idle ``min_idle`` (a longer delay is cut to ``min_idle``, the
  contract): a restart keeps that, never sooner.

Consumer A is ``tests/_delay_proc.py`` in its own process (it stamps the
server's clock just before its handler returns ``retry_after``); the restart
runs here and stamps the server's clock when its handler runs.  Timeouts are
bounds, never expectations; a wait that proves an absence is a bound too.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

import _delay_proc
import pytest
import trio
from _procs import eventually
from faults.cmdproxy import BLACKHOLE, LOST, CommandProxy, Fault, error, serving, wrapped

from trio_redis_finalize import ACK, DROP, Backoff, Delivery, Outcome, open_consumer, retry_after
from trio_redis_finalize._core._recovery import SCHEDULE
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(120)

DELAY = 6.0
"""The delay A's handler asks for: longer than a restart takes."""
SCHEDULE_OF_A = "{q}:processing:a:backoff"
"""The Backoff schedule beside A's processing list, where the due time goes."""
FAULTS: dict[str, Fault] = {"lost": LOST, "blackhole": BLACKHOLE, "OOM": error("OOM"),
                            "READONLY": wrapped("READONLY")}


def consumer_a(url: str, way: str, delay: float,
               **options: object) -> AbstractAsyncContextManager[trio.Process]:
    """``_delay_proc.py`` as consumer ``a``, stamping (``stamp=1``)."""
    return _delay_proc.started(url, way, delay, stamp=1, **options)


async def returned_at(client: Client) -> int:
    """When A's handler returned ``retry_after`` (the server's clock, ms), once it did."""
    await eventually(lambda: client.execute("LLEN", "stamps"), 20, "A's retry_after")
    return int(await client.execute("LINDEX", "stamps", 0))


class Stamped:
    """A handler that records each delivery's attempt with the server's clock (ms), and ACKs."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.seen: list[tuple[int, int]] = []  # (server ms, attempt)

    async def __call__(self, d: Delivery) -> Outcome:
        self.seen.append((await _delay_proc.server_ms(self.client), d.attempt))
        return ACK


def assert_not_early(seen: list[tuple[int, int]], due_ms: float) -> None:
    early = due_ms - seen[0][0]
    assert early <= 50, f"attempt 2 came {early / 1000:.2f} s before its retry_after was due"


async def assert_list_left_empty(client: Client, *consumers: str) -> None:
    for key in ("q", *(f"{{q}}:processing:{name}" for name in consumers)):
        assert await client.execute("LLEN", key) == 0, key


# -- the reliable list: the due time outlives the process -------------------------------------

@pytest.mark.parametrize("restart", ["same-name", "same-name-on-error-drop", "another-consumer"])
async def test_a_reliable_list_retry_after_waits_out_its_delay_through_a_crash(
    redis_url: str, client: Client, restart: str,
) -> None:
    """A returns ``retry_after(6)`` for ``job`` and is SIGKILLed once the
    copy's due time is written (the original in A's processing list, the copy
    in A's memory).  Started again under its name (``on_error`` the default
    Backoff, or DROP), the consumer lets the original wait out the rest of
    the delay; another consumer's reaper, once A's heartbeat lapsed, moves it
    back only once due.  Either way ``job`` comes back once, as attempt 2, no
    sooner than 6 s after A's handler returned.  (Before: at once, about
    3 s early.)"""
    await client.execute("LPUSH", "q", b"job")
    async with consumer_a(redis_url, "reliable", DELAY, heartbeat=1.0) as a:
        returned = await returned_at(client)
        with trio.move_on_after(DELAY / 2):  # a bound (the code before wrote none: killed then)
            await eventually(lambda: client.execute("ZCARD", SCHEDULE_OF_A), 20,
                             "the due time written")
        a.kill()
    rec = Stamped(client)
    name = "b" if restart == "another-consumer" else "a"
    on_error = DROP if restart.endswith("drop") else Backoff()
    async with open_consumer(redis_url, name=name, shutdown_grace=0.0) as again:
        await again.mount(_delay_proc.subscription("reliable", heartbeat="1.0"), rec,
                          on_error=on_error)
        await eventually(lambda: rec.seen, DELAY + 20, "the message after the restart")
        await trio.sleep(1.0)  # a second delivery would come by then
    assert [at for _, at in rec.seen] == [2], rec.seen
    assert_not_early(rec.seen, returned + DELAY * 1000)
    await assert_list_left_empty(client, "a", "b")


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_fault_at_the_due_time_s_write_still_leaves_it_written(
    redis_server: RedisServer, flavour: str, client: Client, fault: str,
) -> None:
    """A (through the command proxy, its scheduler's requests bounded to 0.5 s)
    writes the due time of its ``retry_after(6)``; that write meets the fault
    (it ran and its reply was lost, a silent link, an OOM or READONLY refusal
    instead of running).  It is sent again (the delay that is left: a resend
    never moves the due time earlier), so the due time is in Redis when A is
    SIGKILLed, and the restart lets ``job`` wait out the rest: once, attempt 2,
    not early."""
    await client.execute("LPUSH", "q", b"job")
    kind = f"EVALSHA:{SCHEDULE.name}"
    async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy:
        proxy.arm(kind, FAULTS[fault])
        async with consumer_a(proxy.url, "reliable", DELAY, timeout=0.5) as a:
            returned = await returned_at(client)
            await eventually(lambda: proxy.fired, 10, "the due time's write met the fault")
            await eventually(lambda: proxy.seen[kind] >= 2, 10, "the due time's write sent again")
            await eventually(lambda: client.execute("ZCARD", SCHEDULE_OF_A), 10,
                             "the due time written after all")
            a.kill()
    rec = Stamped(client)
    async with open_consumer(redis_server.url, name="a", shutdown_grace=0.0) as again:
        await again.mount(_delay_proc.subscription("reliable"), rec)
        await eventually(lambda: rec.seen, DELAY + 20, "the message after the restart")
        await trio.sleep(1.0)  # a second delivery would come by then
    assert [at for _, at in rec.seen] == [2], rec.seen
    assert_not_early(rec.seen, returned + DELAY * 1000)
    await assert_list_left_empty(client, "a")


@pytest.mark.parametrize("first", ["retry_after", "ack"])
async def test_a_second_finalization_racing_a_written_due_time_settles_it_once(
    redis_url: str, client: Client, first: str,
) -> None:
    """The handler's outcome and ``consumer.finalize`` of the same delivery
    meet: ``retry_after(1.5)`` (its due time written) then a late ACK, or an
    ACK then a stale ``retry_after(1.5)``.  The ACK removes the original; the
    held copy's gated step then finds it gone and writes nothing.  Nothing
    comes back (past the due time), nothing is left in the lists; the stale
    due time only names bytes no longer there."""
    await client.execute("LPUSH", "q", b"job")
    seen: list[Delivery] = []
    later = retry_after(1.5)

    async def handle(d: Delivery) -> Outcome:
        seen.append(d)
        return later if first == "retry_after" else ACK

    async with open_consumer(redis_url, name="a", shutdown_grace=0.0) as consumer:
        await consumer.mount(_delay_proc.subscription("reliable"), handle)
        await eventually(lambda: seen, 20, "job delivered")
        name = consumer.mounts[0].name
        if first == "retry_after":
            await eventually(lambda: client.execute("ZCARD", SCHEDULE_OF_A), 20,
                             "the due time written")
            await consumer.finalize(seen[0], ACK)
        else:
            await eventually(lambda: consumer.stats()[name]["effects"].get("acked"), 20, "acked")
            await consumer.finalize(seen[0], later)
            await eventually(lambda: client.execute("ZCARD", SCHEDULE_OF_A), 20,
                             "the due time written")
        await eventually(lambda: consumer.stats()[name]["effects"].get("gate_closed"), 20,
                         "the held copy's gate found closed")
        await trio.sleep(1.0)  # a second delivery would come by then
        effects = consumer.stats()[name]["effects"]
    assert len(seen) == 1, [(d.attempt, d.data) for d in seen]
    assert effects.get("acked") == 1 and effects.get("released", 0) == 0, effects
    await assert_list_left_empty(client, "a")


# -- CLAIMING: the PEL is the delay ----------------------------------------------------------

MIN_IDLE = 2.5


async def test_a_claiming_retry_after_comes_back_after_min_idle_through_a_crash(
    redis_url: str, client: Client,
) -> None:
    """A (CLAIMING, ``min_idle`` 2.5 s) returns ``retry_after(6)``: the entry
    stays in the PEL, claimed back once idle ``min_idle`` (the delay is cut
    to it, the documented contract).  A is SIGKILLed at once; the restart
    under its name claims the entry only once idle ``min_idle``: attempt 2,
    no sooner than 2.5 s after A's handler returned, once."""
    first = (await client.execute("XADD", "s", "*", "k", "v")).decode()
    async with consumer_a(redis_url, "claiming", DELAY, min_idle=MIN_IDLE) as a:
        returned = await returned_at(client)
        a.kill()
    seen: list[tuple[int, int]] = []
    ids: list[str | None] = []

    async def record(d: Delivery) -> Outcome:
        seen.append((await _delay_proc.server_ms(client), d.attempt))
        ids.append(d.id)
        return ACK

    async with open_consumer(redis_url, name="a", shutdown_grace=0.0) as again:
        await again.mount(_delay_proc.subscription("claiming", min_idle=str(MIN_IDLE)), record)
        await eventually(lambda: seen, MIN_IDLE + 20, "the entry after the restart")
        await trio.sleep(1.0)  # a second delivery would come by then
    assert [at for _, at in seen] == [2] and ids == [first], (seen, ids)
    assert_not_early(seen, returned + MIN_IDLE * 1000)
    assert int((await client.execute("XPENDING", "s", "g"))[0]) == 0
