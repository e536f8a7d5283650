"""One live process per consumer name, and key names that are one-to-one
(issue 33, points 8 and 9), on real servers with real processes.

* a second process mounting a consumer name that a live process holds is
  refused (``ConsumerNameInUse``: the consumer, the heartbeat key, the
  holder, its age) and handles nothing; ``takeover=True`` takes the name
  deliberately, and the process it was taken from says so and stops
  renewing;
* two mounts of one name at the same moment: one wins;
* a holder that crashed elsewhere blocks until its heartbeat lapses, then
  the name mounts; one of this host that no longer runs (SIGKILL, restart)
  is taken at once;
* the names that shared keys before (group ``a`` + consumer ``b:c`` and group
  ``a:b`` + consumer ``c``; a reliable list ``{s}`` + consumer ``g:c`` and
  stream ``s``, group ``g``, consumer ``c``) no longer do: a SIGKILLed
  consumer is taken over while the other runs;
* the old naming is still read: a consumer of an earlier version that died
  is taken over, and its live heartbeat refuses its name.

Also a process: ``python tests/runtime/test_identity.py stream URL STREAM GROUP NAME HEARTBEAT``
or ``... list URL QUEUE NAME HEARTBEAT`` mounts one subscription whose handler
prints ``H <id or data>`` and hangs; ``R`` once mounted; the library's
warnings and errors go to stderr.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import trio

from trio_redis_finalize import (
    ACK,
    ConsumerNameInUse,
    Delivery,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._core._identity import (
    Claimed,
    gone,
    heartbeat_value,
    make_token,
    refusal,
)
from trio_redis_finalize._core.reliable_list import liveness as reliable
from trio_redis_finalize._core.stream import liveness as presence
from trio_redis_finalize._transport import Client

pytestmark = pytest.mark.timeout(90)

HERE = Path(__file__)


class Child:
    """This file run as a consumer process; its stdout lines, its stderr kept."""

    def __init__(self, proc: anyio.abc.Process) -> None:
        self.proc = proc
        self._buf = b""
        self._lines: list[str] = []  # read and not expected yet (its handler may print before "R")
        self.err = b""

    async def expect(self, prefix: str, timeout: float = 20.0) -> str:
        assert self.proc.stdout is not None
        with anyio.fail_after(timeout):
            while True:
                while b"\n" in self._buf:
                    line, self._buf = self._buf.split(b"\n", 1)
                    self._lines.append(line.decode())
                for i, line in enumerate(self._lines):
                    if line.startswith(prefix):
                        del self._lines[i]
                        return line
                self._buf += await self.proc.stdout.receive()

    async def stderr_until(self, text: str, timeout: float = 20.0) -> str:
        assert self.proc.stderr is not None
        with anyio.fail_after(timeout):
            while text.encode() not in self.err:
                self.err += await self.proc.stderr.receive()
        return self.err.decode()

    async def kill(self) -> None:
        self.proc.kill()  # SIGKILL
        with anyio.fail_after(10):
            await self.proc.wait()


async def child(*args: str) -> Child:
    proc = await anyio.open_process([sys.executable, str(HERE), *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    c = Child(proc)
    await c.expect("R")
    return c


class Seen:
    def __init__(self) -> None:
        self.seen: list[Delivery] = []

    async def __call__(self, d: Delivery) -> Outcome:
        self.seen.append(d)
        return ACK


def stream_sub(stream: str = "orders", group: str = "billing", heartbeat: float = 30.0,
               **kw: object) -> StreamSubscription:
    return StreamSubscription(stream, group, heartbeat=heartbeat, block=0.05, **kw)  # type: ignore[arg-type]


def list_sub(queue: str = "jobs", heartbeat: float = 30.0) -> ReliableListSubscription:
    return ReliableListSubscription(queue, heartbeat=heartbeat, block=0.05)


async def eventually(check: object, timeout: float = 20.0, what: str = "condition") -> None:
    with trio.move_on_after(timeout):
        while True:
            ok = check()  # type: ignore[operator]
            if hasattr(ok, "__await__"):
                ok = await ok
            if ok:
                return
            await trio.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout} s")


# -- point 8: a second live process with the name ------------------------------------

async def child_w1(form: str, redis_url: str, client: Client) -> tuple[
        Child, StreamSubscription | ReliableListSubscription, str]:
    """One delivery waiting and a process running consumer ``w1`` of ``form``
    (heartbeat 30 s); the process, the subscription to mount ``w1`` on here,
    and the heartbeat key."""
    if form == "stream":
        await client.execute("XGROUP", "CREATE", "orders", "billing", "0", "MKSTREAM")
        await client.execute("XADD", "orders", "*", "n", "1")
        p = await child("stream", redis_url, "orders", "billing", "w1", "30")
        sub: StreamSubscription | ReliableListSubscription = stream_sub()
        key = presence.heartbeat_key("orders", "billing", "w1")
    else:
        await client.execute("LPUSH", "jobs", b"job-1")
        p = await child("list", redis_url, "jobs", "w1", "30")
        sub = list_sub()
        key = reliable.heartbeat_key("jobs", "w1")
    return p, sub, key


@pytest.mark.parametrize("form", ["stream", "list"])
async def test_a_second_process_with_the_name_is_refused_then_takes_over_only_when_asked(
        form: str, redis_url: str, client: Client) -> None:
    """Process P holds consumer ``w1`` and one delivery in its handler; this
    process mounts ``w1`` too.  Refused, naming the consumer, the key, P and
    the heartbeat's age, and nothing of P's is handled here.  With
    ``takeover=True`` it mounts and handles P's delivery (deliberately); P
    logs that its name was taken over."""
    p, sub, key = await child_w1(form, redis_url, client)
    try:
        await p.expect("H")  # P is handling it
        h = Seen()
        async with open_consumer(redis_url, name="w1") as consumer:
            with pytest.raises(ConsumerNameInUse) as e:
                await consumer.mount(sub, h)
            msg = str(e.value)
            assert "consumer name 'w1' is in use" in msg, msg
            assert key in msg and f"process {p.proc.pid} on host" in msg, msg
            assert "renewed" in msg and "s ago" in msg and "lapses in" in msg, msg
            assert "takeover=True" in msg, msg
            assert consumer.mounts == []
            await trio.sleep(0.3)
            assert h.seen == []  # P's delivery was not handled a second time
        async with open_consumer(redis_url, name="w1", takeover=True) as consumer:
            await consumer.mount(sub, h)
            await eventually(lambda: len(h.seen) == 1, what="P's delivery taken over")
            holder = (await client.execute("GET", key)).decode()
            assert holder.startswith(consumer.token + " ")
            # P's next renewal (every 10 s) finds the name taken and says so
            err = await p.stderr_until("was taken over by", timeout=30)
            assert f"process {os.getpid()} on host" in err, err
            assert (await client.execute("GET", key)).decode() == holder  # P left it alone
    finally:
        await p.kill()


async def test_a_closed_superseded_consumer_leaves_the_new_holders_heartbeat(
        redis_url: str, client: Client, caplog: pytest.LogCaptureFixture) -> None:
    """A (this process) holds ``w1``; B takes it over; A's clean stop (nothing
    pending: it would deregister) deletes neither B's heartbeat nor its
    registration, and A logged the takeover as an error."""
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    await client.execute("XGROUP", "CREATE", "orders", "billing", "0", "MKSTREAM")
    key = presence.heartbeat_key("orders", "billing", "w1")
    registry = presence.registry_key("orders", "billing")
    # (heartbeats of seconds: a beat late by its whole heartbeat on a busy
    # machine would let A's key lapse, and B's first mount find it free)
    async with open_consumer(redis_url, name="w1") as b:
        async with open_consumer(redis_url, name="w1") as a:
            await a.mount(stream_sub(heartbeat=2.0), Seen())
            with pytest.raises(ConsumerNameInUse):
                await b.mount(stream_sub(heartbeat=2.0), Seen())
            await b.mount(stream_sub(heartbeat=1.0), Seen(), takeover=True)
            await eventually(lambda: any("was taken over by" in r.getMessage()
                                         for r in caplog.records), what="A logs the takeover")
        assert (await client.execute("GET", key)).decode().startswith(b.token + " ")
        assert await client.execute("HEXISTS", registry, "w1") == 1
        await trio.sleep(1.5)  # more than B's heartbeat: B still renews it
        assert (await client.execute("GET", key)).decode().startswith(b.token + " ")
    assert any("took consumer name 'w1' over" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("form", ["stream", "list"])
async def test_two_mounts_of_one_name_at_the_same_moment_one_wins(
        form: str, redis_url: str) -> None:
    """The check and the claim are one script: of two consumers mounting
    ``w1`` at once, exactly one mounts."""
    sub = stream_sub() if form == "stream" else list_sub()
    results: list[str] = []
    async with open_consumer(redis_url, name="w1") as c1, \
            open_consumer(redis_url, name="w1") as c2:
        async def mount(c: object) -> None:
            try:
                await c.mount(sub, Seen())  # type: ignore[attr-defined]
                results.append("mounted")
            except ConsumerNameInUse:
                results.append("refused")

        async with trio.open_nursery() as n:
            n.start_soon(mount, c1)
            n.start_soon(mount, c2)
        assert sorted(results) == ["mounted", "refused"]
        assert len(c1.mounts) + len(c2.mounts) == 1


# -- point 8: restarts ---------------------------------------------------------------

@pytest.mark.parametrize("form", ["stream", "list"])
async def test_a_crashed_holder_elsewhere_blocks_until_its_heartbeat_lapses(
        form: str, redis_url: str, client: Client) -> None:
    """The heartbeat a process of another host left when it was SIGKILLed
    (its value, with the TTL left): refused while it lives, naming that
    process; mounted as soon as it lapsed."""
    if form == "stream":
        sub: StreamSubscription | ReliableListSubscription = stream_sub()
        key = presence.heartbeat_key("orders", "billing", "w1")
    else:
        sub = list_sub()
        key = reliable.heartbeat_key("jobs", "w1")
    await client.execute("SET", key, "elsewhere/4242/0badc0de/4026531836/77 30000", "PX", 1500)
    async with open_consumer(redis_url, name="w1") as consumer:
        with pytest.raises(ConsumerNameInUse, match="process 4242 on host elsewhere"):
            await consumer.mount(sub, Seen())
        await eventually(lambda: _gone(client, key), timeout=10, what="the heartbeat lapsed")
        await consumer.mount(sub, Seen())
        assert (await client.execute("GET", key)).decode().startswith(consumer.token + " ")


async def _gone(client: Client, key: str) -> bool:
    return int(await client.execute("EXISTS", key)) == 0


@pytest.mark.parametrize("form", ["stream", "list"])
async def test_a_sigkilled_process_of_this_host_is_taken_over_at_once(
        form: str, redis_url: str, client: Client) -> None:
    """Its heartbeat (30 s) still lives, but its pid runs no more: the restart
    mounts at once and handles what it held (no 30 s wait)."""
    p, sub, key = await child_w1(form, redis_url, client)
    await p.expect("H")
    await p.kill()
    assert int(await client.execute("PTTL", key)) > 20_000  # alive for 20 s more
    h = Seen()
    with trio.fail_after(10):
        async with open_consumer(redis_url, name="w1") as consumer:
            await consumer.mount(sub, h)
            await eventually(lambda: len(h.seen) == 1, what="its delivery handled again")
            assert h.seen[0].attempt == 2


# -- point 9: names that shared keys -------------------------------------------------

async def test_groups_a_and_a_b_no_longer_share_a_heartbeat(redis_url: str, client: Client) -> None:
    """Group ``a`` + consumer ``b:c`` keeps running; group ``a:b`` + consumer
    ``c`` (another process, heartbeat 0.5 s) is SIGKILLed holding an entry:
    consumer ``z`` of group ``a:b`` takes it over (before: their heartbeat
    was one key, renewed by the live one, and ``c`` never died)."""
    for g in ("a", "a:b"):
        await client.execute("XGROUP", "CREATE", "s", g, "0", "MKSTREAM")
    async with open_consumer(redis_url, name="b:c") as live:
        await live.mount(stream_sub("s", "a", heartbeat=0.5), Seen())
        eid = (await client.execute("XADD", "s", "*", "n", "1")).decode()
        p = await child("stream", redis_url, "s", "a:b", "c", "0.5")
        try:
            assert (await p.expect("H")).split()[1] == eid
        finally:
            await p.kill()
        h = Seen()
        async with open_consumer(redis_url, name="z") as other:
            await other.mount(stream_sub("s", "a:b", heartbeat=0.5), h)
            await eventually(lambda: [d.id for d in h.seen] == [eid], timeout=15,
                             what="c's entry taken over by z")
            assert h.seen[0].attempt == 2
        assert live.mounts[0].stats.snapshot()["received"] == 1  # group a: its own copy


async def test_a_list_s_and_a_stream_s_no_longer_share_a_heartbeat(
        redis_url: str, client: Client) -> None:
    """Reliable list ``{s}`` + consumer ``g:c`` (another process, heartbeat
    0.5 s) is SIGKILLed holding an element while stream ``s`` + group ``g``
    + consumer ``c`` runs: consumer ``z`` of the list moves it back."""
    await client.execute("XGROUP", "CREATE", "s", "g", "0", "MKSTREAM")
    async with open_consumer(redis_url, name="c") as live:
        await live.mount(stream_sub("s", "g", heartbeat=0.5), Seen())
        await client.execute("LPUSH", "{s}", b"job")
        p = await child("list", redis_url, "{s}", "g:c", "0.5")
        try:
            await p.expect("H")
        finally:
            await p.kill()
        h = Seen()
        async with open_consumer(redis_url, name="z") as other:
            await other.mount(list_sub("{s}", heartbeat=0.5), h)
            await eventually(lambda: [d.data for d in h.seen] == [b"job"], timeout=15,
                             what="g:c's element moved back and handled by z")


# -- the old naming ------------------------------------------------------------------

async def test_a_dead_consumer_of_the_old_naming_is_taken_over(
        redis_url: str, client: Client) -> None:
    """An earlier version's consumer registered in ``{jobs}:consumers`` (and
    ``{orders}:consumers:billing``), its heartbeat lapsed, work left: taken
    over under the new naming, and its old registration removed."""
    await client.execute("RPUSH", "{jobs}:processing:old", b"left")
    await client.execute("HSET", "{jobs}:consumers", "old", "{jobs}:processing:old")
    await client.execute("XGROUP", "CREATE", "orders", "billing", "0", "MKSTREAM")
    eid = (await client.execute("XADD", "orders", "*", "n", "1")).decode()
    await client.execute("XREADGROUP", "GROUP", "billing", "old", "STREAMS", "orders", ">")
    await client.execute("HSET", "{orders}:consumers:billing", "old", "300 plain")
    lists, streams = Seen(), Seen()
    async with open_consumer(redis_url, name="new") as consumer:
        await consumer.mount(list_sub(heartbeat=0.3), lists)
        await consumer.mount(stream_sub(heartbeat=0.3), streams)
        await eventually(lambda: [d.data for d in lists.seen] == [b"left"], what="list taken over")
        await eventually(lambda: [d.id for d in streams.seen] == [eid], what="entry taken over")
        await eventually(lambda: _old_gone(client), what="old registrations removed")


async def _old_gone(client: Client) -> bool:
    return (await client.execute("HEXISTS", "{jobs}:consumers", "old") == 0
            and await client.execute("HEXISTS", "{orders}:consumers:billing", "old") == 0)


@pytest.mark.parametrize("form", ["stream", "list"])
async def test_a_live_heartbeat_of_the_old_naming_refuses_the_name(
        form: str, redis_url: str, client: Client) -> None:
    """A process of an earlier version still runs ``w1`` (its heartbeat key of
    the old naming is alive): refused, naming that key; once it lapses, the
    name mounts and its old registration is gone."""
    if form == "stream":
        sub: StreamSubscription | ReliableListSubscription = stream_sub()
        old_key, old_registry = "{orders}:heartbeat:billing:w1", "{orders}:consumers:billing"
        await client.execute("HSET", old_registry, "w1", "1000 plain")
    else:
        sub = list_sub()
        old_key, old_registry = "{jobs}:heartbeat:w1", "{jobs}:consumers"
        await client.execute("HSET", old_registry, "w1", "{jobs}:processing:w1")
    await client.execute("SET", old_key, "w1", "PX", 1000)
    async with open_consumer(redis_url, name="w1") as consumer:
        with pytest.raises(ConsumerNameInUse, match="old key naming") as e:
            await consumer.mount(sub, Seen())
        assert old_key in str(e.value)
        await eventually(lambda: _gone(client, old_key), timeout=10, what="the old heartbeat lapsed")
        await consumer.mount(sub, Seen())
        assert await client.execute("HEXISTS", old_registry, "w1") == 0


# -- the decisions, sans-IO ----------------------------------------------------------

def test_which_holder_is_known_gone() -> None:
    """Only a token of this host and pid namespace whose process no longer
    runs (or is a closed consumer of this process) is taken without waiting
    for the lapse; anything unknown is alive."""
    me = make_token("h", 10, "n0", "77", "500")
    starts = {10: "500", 20: "600", 30: "700"}
    start_of = starts.get

    def is_gone(token: str, live: set[str] = set(), pidns: str = "77") -> bool:  # noqa: B006
        return gone(heartbeat_value(token, 30.0), "h", pidns, 10, start_of, live)

    assert is_gone(make_token("h", 40, "n1", "77", "800"))  # no such pid: crashed
    assert is_gone(make_token("h", 20, "n1", "77", "599"))  # pid reused by another process
    assert not is_gone(make_token("h", 20, "n1", "77", "600"))  # runs: alive
    assert is_gone(make_token("h", 10, "n1", "77", "500"))  # this process, a closed consumer
    assert not is_gone(me, live={me})  # this process, an open consumer
    assert not is_gone(make_token("other", 40, "n1", "77", "800"))  # another host: unknown
    assert not is_gone(make_token("h", 40, "n1", "78", "800"))  # another pid namespace
    assert not is_gone(make_token("h", 40, "n1", "", ""), pidns="")  # no /proc: unknown
    assert not is_gone(make_token("h", 40, "n1", "77", "800"), pidns="")
    assert not is_gone("w1")  # the old naming's value, or anything unreadable
    assert not is_gone("h/x/n/77/800")
    assert make_token("a/b c", 1, "n", "2", "3") == "a_b_c/1/n/2/3"


def test_the_refusal_names_consumer_key_holder_and_age() -> None:
    got = Claimed(False, heartbeat_value(make_token("box", 4242, "n", "1", "2"), 30.0), 26.5)
    msg = str(refusal("stream 'orders' group 'billing'", "w1", "K", got, "OLD"))
    assert msg.startswith("stream 'orders' group 'billing': consumer name 'w1' is in use: ")
    assert "a live heartbeat 'K' held by process 4242 on host box, renewed 3.5 s ago " in msg
    assert "(it lapses in 26.5 s unless renewed)" in msg and "takeover=True" in msg
    old = str(refusal("x", "w1", "K", Claimed(False, "", 0.8, old_naming=True), "OLD"))
    assert "'OLD' of the old key naming" in old and "lapses in 0.8 s" in old


# -- the CLI -------------------------------------------------------------------------

SETUP = """
from trio_redis_finalize import ACK, StreamSubscription

async def setup(consumer):
    async def handle(d):
        return ACK
    await consumer.mount(StreamSubscription("orders", "billing", block=0.05), handle)
"""


async def test_run_refuses_a_name_in_use_and_takes_it_with_takeover(
        redis_url: str, client: Client, tmp_path: Path) -> None:
    await client.execute("XGROUP", "CREATE", "orders", "billing", "0", "MKSTREAM")
    (tmp_path / "idmod.py").write_text(SETUP)
    cli = [sys.executable, "-m", "trio_redis_finalize", "run", "idmod:setup", "--url", redis_url,
           "--name", "w1"]
    p = await child("stream", redis_url, "orders", "billing", "w1", "30")
    try:
        with trio.fail_after(60):
            r = await trio.run_process(cli, cwd=str(tmp_path), capture_stdout=True,
                                       capture_stderr=True, check=False)
        assert r.returncode != 0
        assert b"consumer name 'w1' is in use" in r.stderr, r.stderr
        run = await anyio.open_process([*cli, "--takeover"], cwd=str(tmp_path),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        took = Child(run)
        try:
            err = await took.stderr_until("running 1 subscription(s)", timeout=60)
            assert "took consumer name 'w1' over from process" in err, err
            await p.stderr_until("was taken over by", timeout=30)
        finally:
            await took.kill()
    finally:
        await p.kill()


# -- the consumer process ------------------------------------------------------------

async def _main(form: str, url: str, *args: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def out(line: str) -> None:
        os.write(1, (line + "\n").encode())

    async def hang(d: Delivery) -> Outcome:
        out(f"H {d.id if d.id is not None else (d.data or b'').decode()}")
        await trio.sleep_forever()
        return ACK  # pragma: no cover - killed before

    if form == "stream":
        stream, group, name, hb = args
        sub: StreamSubscription | ReliableListSubscription = stream_sub(stream, group, float(hb))
    else:
        queue, name, hb = args
        sub = list_sub(queue, float(hb))
    async with open_consumer(url, name=name, shutdown_grace=0.0) as consumer:
        await consumer.mount(sub, hang)
        out("R")
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(_main, *sys.argv[1:])
