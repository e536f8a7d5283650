"""Stream subscriptions under real faults: SIGKILL of a consumer process
mid-handler, long handlers next to a reclaiming consumer, FLUSHALL, a destroyed
group whose recreation fails, entries deleted while pending, and a read reply
lost to CLIENT KILL."""

from __future__ import annotations

import logging
import subprocess
import sys

import anyio
import anyio.abc
import pytest
import trio
from _paths import TESTS
from _procs import connection, effects, eventually, stats
from _stream import NAME, G, S, pending, pending_of, xadd

from trio_redis_finalize import ACK, Delivery, Mode, Outcome, StreamSubscription, open_consumer
from trio_redis_finalize._transport import Client, open_client
from trio_redis_finalize.testing import RedisServer

PROC = TESTS / "_stream_proc.py"


# -- helpers ------------------------------------------------------------------


class Recorder:
    def __init__(self, sleep: float = 0.0) -> None:
        self.sleep = sleep
        self.seen: list[Delivery] = []
        self.finished: list[str | None] = []

    async def __call__(self, d: Delivery) -> Outcome:
        self.seen.append(d)
        if self.sleep:
            await trio.sleep(self.sleep)
        self.finished.append(d.id)
        return ACK


class ConsumerProcess:
    """``tests/_stream_proc.py`` as a child process; lines of its stdout."""

    def __init__(self, proc: anyio.abc.Process) -> None:
        self.proc = proc
        self._buf = b""

    async def line(self, timeout: float = 15.0) -> str:
        assert self.proc.stdout is not None
        with anyio.fail_after(timeout):
            while b"\n" not in self._buf:
                self._buf += await self.proc.stdout.receive()
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    async def expect(self, prefix: str) -> list[str]:
        while True:
            words = (await self.line()).split()
            if words and words[0] == prefix:
                return words

    async def kill(self) -> None:
        self.proc.kill()  # SIGKILL
        with anyio.fail_after(5):
            await self.proc.wait()


async def start_proc(url: str, name: str, mode: Mode, min_idle: float) -> ConsumerProcess:
    proc = await anyio.open_process(
        [sys.executable, str(PROC), url, S, G, name, mode.value, str(min_idle)],
        stdout=subprocess.PIPE, stderr=None,
    )
    return ConsumerProcess(proc)


# -- SIGKILL mid-handler -----------------------------------------------------------

async def _kill_mid_handler(url: str, client: Client, name: str, mode: Mode, min_idle: float) -> str:
    eid = await xadd(client, job="1")
    p = await start_proc(url, name, mode, min_idle)
    try:
        words = await p.expect("H")
        assert words[1:] == [eid, "1"]
    finally:
        await p.kill()
    assert await pending_of(client) == {name: 1}  # stranded in the dead consumer's PEL
    return eid


async def test_sigkill_mid_handler_then_restart_with_the_same_name(redis_url: str, client: Client) -> None:
    eid = await _kill_mid_handler(redis_url, client, "victim", Mode.PLAIN, 0.3)
    h = Recorder()
    async with open_consumer(redis_url, name="victim") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.1), h)
        # mount() returns once the own PEL was re-read: the entry is in hand
        await eventually(lambda: effects(consumer).get("acked") == 1, what="re-read entry acked")
        await trio.sleep(0.2)
    assert [(d.id, d.attempt) for d in h.seen] == [(eid, 2)]  # server count: read twice
    assert await pending(client) == 0


async def test_sigkill_mid_handler_then_another_consumer_reclaims(redis_url: str, client: Client) -> None:
    min_idle = 0.3
    eid = await _kill_mid_handler(redis_url, client, "victim", Mode.RECLAIM, min_idle)
    h = Recorder()
    async with open_consumer(redis_url, name="rescuer") as consumer:
        await consumer.mount(StreamSubscription(S, G, mode=Mode.RECLAIM, min_idle=min_idle, block=0.05), h)
        await eventually(lambda: effects(consumer).get("acked") == 1, what="reclaimed entry acked")
        await trio.sleep(0.2)
    assert [(d.id, d.attempt) for d in h.seen] == [(eid, 2)]
    assert await pending(client) == 0
    consumers = await client.execute("XINFO", "CONSUMERS", S, G)
    by_name = {dict(zip(c[::2], c[1::2], strict=False))[b"name"]: c for c in consumers}
    # the victim's heartbeat has not lapsed yet; the rescuer, its PEL empty,
    # deregistered as it stopped
    assert b"victim" in by_name and b"rescuer" not in by_name


# -- long handlers keep their lease ------------------------------------------------------

async def test_long_handler_is_not_claimed_by_another_reclaiming_consumer(
    redis_url: str, client: Client
) -> None:
    min_idle = 0.3
    slow = Recorder(sleep=3 * min_idle)
    other = Recorder()
    sub = StreamSubscription(S, G, mode=Mode.RECLAIM, min_idle=min_idle, block=0.05)
    async with open_consumer(redis_url, name="slow") as a, open_consumer(redis_url, name="other") as b:
        await a.mount(sub, slow)
        eid = await xadd(client, job="long")
        await eventually(lambda: len(slow.seen) == 1, what="slow handler started")
        await b.mount(sub, other)
        with trio.fail_after(5):
            while not slow.finished:
                # while the handler runs, its entry stays with its consumer
                assert await pending_of(client) in ({"slow": 1}, {})
                await trio.sleep(0.05)
        await eventually(lambda: effects(a).get("acked") == 1, what="acked by its handler")
        await trio.sleep(min_idle + 0.2)
        assert effects(b) == {}
    assert [d.id for d in slow.seen] == [eid]
    assert other.seen == []
    assert await pending(client) == 0


# -- FLUSHALL under a running consumer --------------------------------------------------

async def test_flushall_recreates_the_group_and_goes_on(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")  # whatever earlier tests set
    h = Recorder()
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.1), h)
        await xadd(client, n="before")
        await eventually(lambda: effects(consumer).get("acked") == 1, what="first entry")
        await client.execute("FLUSHALL")
        await eventually(lambda: stats(consumer)["group_recreated"] >= 1, what="group recreated")
        after = await xadd(client, n="after")
        await eventually(lambda: effects(consumer).get("acked") == 2, what="entry after the flush")
        # and once more, with the reader blocked on the key right now
        await client.execute("FLUSHALL")
        again = await xadd(client, n="again")
        await eventually(lambda: effects(consumer).get("acked") == 3, what="entry after the 2nd flush")
    assert [d.fields[b"n"] for d in h.seen] == [b"before", b"after", b"again"]
    assert [d.id for d in h.seen][1:] == [after, again]
    assert any(r.levelname == "WARNING" and "group is gone" in r.getMessage() and NAME in r.getMessage()
               for r in caplog.records)
    assert await pending(client) == 0


# -- a destroyed group whose recreation fails ---------------------------------------------

@pytest.mark.parametrize("fault", ["OOM", "READONLY", "BUSY", "lost", "blackhole"])
async def test_group_recreation_refused_or_unanswered_is_sent_again_nothing_lost(
    redis_server: RedisServer, client: Client, fault: str
) -> None:
    """The group destroyed, and the reader's ``XGROUP CREATE`` refused (did not
    run: sent again after a backoff), its reply lost (it ran: the next one
    answers BUSYGROUP) or unanswered (a silent link: its deadline, then again).
    Entries written while the group is gone, before and after the failed
    recreation, are each handled once; nothing read before is handled again."""
    from faults.cmdproxy import BLACKHOLE, LOST, CommandProxy, error

    info = await client.execute("INFO", "server")
    proxy = CommandProxy(redis_server.port, flavour="valkey" if b"valkey" in info.lower() else "redis")
    h = Recorder()
    async with anyio.create_task_group() as tg:
        await tg.start(proxy.serve)
        async with open_consumer(proxy.url, name="c1") as consumer:
            await consumer.mount(StreamSubscription(S, G, block=0.1), h)
            first = await xadd(client, n="first")
            await eventually(lambda: effects(consumer).get("acked") == 1, what="first entry")
            proxy.arm("XGROUP CREATE", {"lost": LOST, "blackhole": BLACKHOLE}.get(fault) or error(fault))
            if fault not in ("lost", "blackhole"):
                proxy.arm("XGROUP CREATE", error(fault), at=1)  # refused twice
            replies = await client.pipeline([
                ("MULTI",), ("XGROUP", "DESTROY", S, G), ("XADD", S, "*", "n", "meanwhile"), ("EXEC",),
            ])
            meanwhile = replies[-1][1].decode()
            await eventually(lambda: len(proxy.fired) >= 1, what="the recreation failed")
            later = await xadd(client, n="later")  # refused: the group most likely still gone
            await eventually(lambda: effects(consumer).get("acked") == 3, timeout=15,
                             what="the entries written while the group was gone")
            await trio.sleep(0.3)
            assert stats(consumer)["group_recreated"] == 1
        await proxy.cut_all()
        tg.cancel_scope.cancel()
    assert [f.kind for f in proxy.fired] == ["XGROUP CREATE"] * (1 if fault in ("lost", "blackhole") else 2)
    assert [(d.id, d.attempt) for d in h.seen] == [(first, 1), (meanwhile, 1), (later, 1)]
    assert await pending(client) == 0


# -- entries deleted while pending -------------------------------------------------------

async def _strand(client: Client, owner: str) -> tuple[str, str]:
    """Two entries read by ``owner`` (never acknowledged); the first then deleted."""
    gone, live = await xadd(client, n="gone"), await xadd(client, n="live")
    await client.execute("XGROUP", "CREATE", S, G, "0")
    await client.execute("XREADGROUP", "GROUP", G, owner, "COUNT", 10, "STREAMS", S, ">")
    assert await client.execute("XDEL", S, gone) == 1
    assert await pending_of(client) == {owner: 2}
    return gone, live


async def test_entry_deleted_while_pending_on_pel_reread(redis_url: str, client: Client) -> None:
    _gone, live = await _strand(client, "c1")
    h = Recorder()
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05), h)
        await eventually(lambda: effects(consumer) == {"acked": 1, "lost_before_handling": 1},
                         what="live acked, deleted reported")
        await trio.sleep(0.3)
        assert effects(consumer) == {"acked": 1, "lost_before_handling": 1}  # not looped on
    assert [d.id for d in h.seen] == [live]
    assert await pending(client) == 0


@pytest.mark.parametrize("mode", [Mode.RECLAIM, Mode.CLAIMING])
async def test_entry_deleted_while_pending_on_xautoclaim(
    redis_url: str, client: Client, mode: Mode
) -> None:
    _gone, live = await _strand(client, "dead")
    h = Recorder()
    sub = StreamSubscription(S, G, mode=mode, min_idle=0.2, block=0.05)
    async with open_consumer(redis_url, name="c2") as consumer:
        await consumer.mount(sub, h)
        await eventually(lambda: effects(consumer) == {"acked": 1, "lost_before_handling": 1},
                         what="live acked, deleted reported")
        await trio.sleep(0.5)  # several more XAUTOCLAIM rounds
        assert effects(consumer) == {"acked": 1, "lost_before_handling": 1}
    assert [d.id for d in h.seen] == [live]
    assert await pending(client) == 0


# -- a read reply lost on the wire ---------------------------------------------------------

async def _reader_client(client: Client, consumer: str) -> dict[str, str]:
    kv, text = await connection(client, f"trf:{consumer}:reader")
    if not kv:
        raise AssertionError(f"no reader connection for {consumer} in {text}")
    return kv


async def test_lost_read_reply_is_recovered_from_the_pel_once(redis_url: str, client: Client) -> None:
    h = Recorder()
    async with open_consumer(redis_url, name="lr") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.5), h)
        with trio.fail_after(5):
            while True:
                reader = await _reader_client(client, "lr")
                if "b" in reader["flags"] and reader["cmd"] == "xreadgroup":
                    break
                await trio.sleep(0.01)
        # the entry is delivered to the blocked reader (and enters its PEL), then
        # its connection dies before the reply is written
        eid, _ = await client.pipeline([("XADD", S, "*", "n", "1"), ("CLIENT", "KILL", "ID", reader["id"])])
        eid = eid.decode()
        await eventually(lambda: effects(consumer).get("acked") == 1, what="recovered entry acked")
        await trio.sleep(0.3)
        assert stats(consumer)["read_errors"] >= 1
    # from the PEL; the lost read was no handler call, so no attempt (DESIGN §4 "Attempts")
    assert [(d.id, d.attempt) for d in h.seen] == [(eid, 1)]
    assert await pending(client) == 0


# -- attempt counters that crashes cannot fool ---------------------------------------------

async def test_pel_reread_counts_header_retries_and_delivery_count(
    redis_url: str, client: Client
) -> None:
    copy = str((await client.execute("XADD", S, "*", "n", "copy", "trf-retries", "2",
                                      "trf-origin", "1-1")).decode())
    crashy = await xadd(client, n="crashy")
    await client.execute("XGROUP", "CREATE", S, G, "0")
    # both read by "c1", which crashed; "crashy" was re-read (and crashed) twice more
    await client.execute("XREADGROUP", "GROUP", G, "c1", "COUNT", 10, "STREAMS", S, ">")
    for _ in range(2):
        await client.execute("XCLAIM", S, G, "c1", 0, crashy)
    h = Recorder()
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05), h)
        await eventually(lambda: effects(consumer).get("acked") == 2, what="both acked")
    by_id = {d.id: d for d in h.seen}
    # header retries 2 + count 2 (its read, and the crash the restart counts): the copy's
    # crash counts as an original's does
    assert by_id[copy].attempt == 4 and by_id[copy].origin_id == "1-1"
    assert by_id[crashy].attempt == 4  # server count: 1 read + 2 claims + the re-read


async def test_crash_loop_reaches_max_attempts_through_the_delivery_count(
    redis_url: str, client: Client
) -> None:
    """A poison entry that kills its consumer on every try is dead-lettered once
    the server's delivery count passes max_attempts, without a handler call."""
    eid = await xadd(client, n="poison")
    await client.execute("XGROUP", "CREATE", S, G, "0")
    await client.execute("XREADGROUP", "GROUP", G, "c1", "COUNT", 1, "STREAMS", S, ">")
    await client.execute("XCLAIM", S, G, "c1", 0, eid)  # count 2: crashed twice
    h = Recorder()
    sub = StreamSubscription(S, G, block=0.05, max_attempts=2, dead_letter="dead")
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, h)  # re-read: count 3 > 2
        await eventually(lambda: effects(consumer).get("dead_lettered") == 1, what="dead-lettered")
    assert h.seen == []
    assert await pending(client) == 0
    dead = await client.execute("XRANGE", "dead", "-", "+")
    fields = dict(zip(dead[0][1][::2], dead[0][1][1::2], strict=True))
    assert fields[b"trf-dead-id"] == eid.encode() and fields[b"trf-dead-attempt"] == b"3"


# -- the server restarts under a running consumer -----------------------------------------

async def test_server_restart_reconnects_recreates_the_group_and_goes_on(
    fresh_redis_server: RedisServer,
) -> None:
    server = fresh_redis_server
    h = Recorder()
    async with open_consumer(server.url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.1), h)
        async with open_client(server.url) as client:
            await xadd(client, n="before")
            await eventually(lambda: effects(consumer).get("acked") == 1, what="first entry")
        server.restart()  # SIGKILL, no persistence: stream and group are gone
        async with open_client(server.url) as client:
            await eventually(lambda: stats(consumer)["read_errors"] >= 1, what="read error seen")
            after = await xadd(client, n="after")
            await eventually(lambda: effects(consumer).get("acked") == 2, timeout=10,
                             what="entry after the restart")
            assert await pending(client) == 0
    assert [d.fields[b"n"] for d in h.seen] == [b"before", b"after"]
    assert h.seen[1].id == after
    assert stats(consumer)["group_recreated"] >= 1
