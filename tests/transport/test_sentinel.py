"""Redis Sentinel (``redis+sentinel://``) and connections that notice silence.

Real processes on loopback: ``redis_sentinel`` is a master, a replica and
three sentinels (``down-after-milliseconds`` 1000), fresh per test.

* URL parsing and the constructor form (``sentinel_params``);
* a consumer from the sentinel URL consumes, reading and finalizing on the
  master; a new connection the sentinels sent to a replica is refused by the
  ``ROLE`` check and the sentinels are asked again; ``READONLY`` closes the
  connection and marks the master suspect;
* ``SENTINEL FAILOVER`` and SIGKILL of the master under one running consumer
  with a stream, a reliable list and a stream with durable delays: nothing
  lost, duplicates counted, nothing left pending, consumption resumes (the
  time is printed);
* a silent partition of an idle pooled connection: the next finalization is
  not held for its whole deadline (the pool checks a connection idle
  longer than ``health_check_interval`` with a short ``PING``), and TCP
  keepalive is on for every connection.
"""

from __future__ import annotations

import contextvars
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from urllib.parse import quote

import anyio
import pytest
import trio
from _procs import eventually
from anyio.abc import SocketAttribute
from faults.chaosproxy import ChaosProxy
from hypothesis import given, settings
from hypothesis import strategies as st
from redis import exceptions as rexc

from trio_redis_finalize import (
    ACK,
    DelayedRetry,
    Delivery,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._transport import Client, open_client, parse_url, sentinel_params
from trio_redis_finalize._transport._connection import open_connection
from trio_redis_finalize._transport._sentinel import MasterConnection, SentinelClient, not_master
from trio_redis_finalize.testing import RedisSentinel, RedisServer, free_port

RESUME_BOUND = 30.0  # test deadline; DESIGN: consumption resumes within 20 s


# -- URLs --------------------------------------------------------------------------------


def test_sentinel_url() -> None:
    p = parse_url("redis+sentinel://h1:26380,h2,[::1]:26381/mymaster/3")
    assert p.sentinels == (("h1", 26380), ("h2", 26379), ("::1", 26381))
    assert (p.service_name, p.db, p.tls, p.host, p.port) == ("mymaster", 3, False, "h1", 26380)
    assert (p.username, p.password, p.sentinel_username, p.sentinel_password) == (None,) * 4
    assert "mymaster" in p.address and "h2:26379" in p.address
    assert parse_url("redis+sentinel://h/m").db == 0
    assert parse_url("redis+sentinel://h/m?db=2").db == 2


def test_sentinel_url_credentials_tls_and_options() -> None:
    p = parse_url(
        "rediss+sentinel://app:s%40cret@h1:1,h2:2/svc?sentinel_password=sp&sentinel_username=su"
        "&sentinel_timeout=0.5&ssl_cert_reqs=none&health_check_interval=2&keepalive=0"
    )
    assert p.tls and not p.tls_verify
    assert (p.username, p.password) == ("app", "s@cret")  # the master's
    assert (p.sentinel_username, p.sentinel_password) == ("su", "sp")
    assert (p.sentinel_timeout, p.health_check_interval, p.keepalive) == (0.5, 2.0, 0.0)
    master = p.for_node("10.0.0.1", 6390)
    assert (master.host, master.port, master.password, master.db, master.sentinels) == (
        "10.0.0.1", 6390, "s@cret", 0, ())
    assert master.tls and master.address == "10.0.0.1:6390"
    s = p.for_sentinel("h2", 2)
    assert (s.username, s.password, s.db, s.tls, s.connect_timeout) == ("su", "sp", 0, True, 0.5)
    # no sentinel password given: the sentinels are asked without AUTH
    assert parse_url("redis+sentinel://:pw@h/m").for_sentinel("h", 1).password is None


_HOSTS = st.from_regex(r"[a-z][a-z0-9.-]{0,20}", fullmatch=True)
_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)


@given(
    sentinels=st.lists(st.tuples(_HOSTS, st.integers(1, 65535)), min_size=1, max_size=5),
    service=_TEXT, db=st.integers(0, 15), password=st.none() | _TEXT,
    sentinel_password=st.none() | _TEXT, tls=st.booleans(),
)
@settings(max_examples=100, deadline=None)
def test_sentinel_urls_round_trip(
    sentinels: list[tuple[str, int]], service: str, db: int, password: str | None,
    sentinel_password: str | None, tls: bool,
) -> None:
    auth = f":{quote(password, safe='')}@" if password is not None else ""
    query = f"?sentinel_password={quote(sentinel_password, safe='')}" if sentinel_password else ""
    nodes = ",".join(f"{h}:{p}" for h, p in sentinels)
    scheme = "rediss+sentinel" if tls else "redis+sentinel"
    p = parse_url(f"{scheme}://{auth}{nodes}/{quote(service, safe='')}/{db}{query}")
    assert p == sentinel_params(sentinels, service, db=db, password=password,
                                sentinel_password=sentinel_password or None, tls=tls)


@pytest.mark.parametrize("url, words", [
    ("redis+sentinel://h:1", "service name"),
    ("redis+sentinel://h:1/", "service name"),
    ("redis+sentinel://h:1/m/0/x", "path"),
    ("redis+sentinel://h:x/m", "sentinel"),
    ("redis+sentinel://h:1/m/x", "database"),
    ("redis+sentinel://h:1/m?sentinel_timeout=0", "sentinel_timeout"),
    ("redis+sentinel://h:1/m?health_check_interval=-1", "health_check_interval"),
])
def test_bad_sentinel_urls(url: str, words: str) -> None:
    with pytest.raises(ValueError, match="url") as err:
        parse_url(url)
    assert words in str(err.value)


def test_sentinel_params_constructor() -> None:
    p = sentinel_params(["h1:1", ("h2", 2), "h3"], "svc", db=1, password="pw",
                        sentinel_password="sp", connect_timeout=2.0)
    assert p.sentinels == (("h1", 1), ("h2", 2), ("h3", 26379))
    assert (p.service_name, p.db, p.password, p.sentinel_password, p.connect_timeout) == (
        "svc", 1, "pw", "sp", 2.0)
    for kwargs, name in [({"sentinels": [], "service_name": "s"}, "sentinels"),
                         ({"sentinels": ["h:x"], "service_name": "s"}, "sentinels"),
                         ({"sentinels": ["h:1"], "service_name": ""}, "service_name"),
                         ({"sentinels": ["h:1"], "service_name": "s", "db": -1}, "db")]:
        with pytest.raises(ValueError, match=name):
            sentinel_params(**kwargs)  # type: ignore[arg-type]
    # one string: its addresses, not its characters (now that the name is public)
    assert sentinel_params("h1:1, h2", "svc").sentinels == (("h1", 1), ("h2", 26379))
    with pytest.raises(ValueError, match="params"):
        SentinelClient(parse_url("redis://h:1"))


def test_not_master_matches_prefixes_bare_and_wrapped() -> None:
    assert not_master(rexc.ReadOnlyError("You can't write against a read only replica."))
    assert not_master(rexc.ResponseError("MASTERDOWN Link with MASTER is down"))
    assert not_master(rexc.ResponseError(
        "ERR Error running script (call to f_x): @user_script:1: -READONLY You can't write"))
    assert not not_master(rexc.ResponseError("ERR unknown command 'READONLYX'"))
    assert not not_master(rexc.ConnectionError("READONLY"))
    assert not not_master(b"READONLY")


async def test_unreachable_sentinels_raise_naming_each() -> None:
    ports = [free_port(), free_port()]
    url = f"redis+sentinel://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/svc"
    with trio.fail_after(10), pytest.raises(rexc.ConnectionError) as err:
        async with open_client(url):
            pass
    assert "no sentinel named the master 'svc'" in str(err.value)
    assert all(str(p) in str(err.value) for p in ports)


# -- one topology: consume, ROLE, READONLY -----------------------------------------------------


async def test_consumer_from_a_sentinel_url_consumes_on_the_master(
    redis_sentinel: RedisSentinel,
) -> None:
    top = redis_sentinel
    master = top.master_port()
    replica = top.replicas[0].port
    async with open_client(top.url) as producer:
        assert isinstance(producer, SentinelClient)
        assert producer.master == ("127.0.0.1", master)
        assert producer.server_params.port == master
        for n in range(20):
            await producer.execute("XADD", "s", "*", "n", n)
        seen: list[bytes] = []

        async def handle(d: Delivery) -> Outcome:
            seen.append(d.fields[b"n"])
            return ACK

        with trio.fail_after(15):
            async with open_consumer(top.url, name="c1", shutdown_grace=1.0) as consumer:
                await consumer.mount(StreamSubscription("s", group="g", block=0.2), handle)
                while len(seen) < 20:
                    await trio.sleep(0.02)
                # the reader and the pool talk to the master, none to the replica
                names = top.command(master, "CLIENT", "LIST").decode()
                assert "name=trf:c1:reader" in names and "name=trf:c1 " in names
                assert "name=trf:c1" not in top.command(replica, "CLIENT", "LIST").decode()
                for _ in range(100):
                    if consumer.stats()["stream 's' group 'g'"]["effects"].get("acked") == 20:
                        break
                    await trio.sleep(0.02)
        assert sorted(seen, key=int) == [str(n).encode() for n in range(20)]
        assert (await producer.execute("XPENDING", "s", "g"))[0] == 0

        # a stale answer naming the replica: ROLE refuses it, the sentinels are asked again
        client = SentinelClient(parse_url(top.url), name="checks")
        await client._switch_to(("127.0.0.1", replica), "a stale answer (test)")
        async with await client.connect(name="role-check") as conn:
            assert conn.params.port == master
            assert (await conn.execute("ROLE"))[0] == b"master"
        assert client.refused == 1 and client.master == ("127.0.0.1", master)

        # READONLY (the server is a replica now): the connection is closed, the master suspect
        direct = await open_connection(
            client.params.for_node("127.0.0.1", replica),
            factory=lambda stream, p: MasterConnection(stream, p, client),
        )
        await client._switch_to(("127.0.0.1", replica), "as if it were the master (test)")
        with pytest.raises(rexc.ReadOnlyError):
            await direct.execute("SET", "k", "v")
        assert direct.broken and client._stale
        with pytest.raises(rexc.ConnectionError, match="closed"):
            await direct.execute("PING")
        async with await client.connect() as again:  # the sentinels asked again: the master
            assert again.params.port == master
        await client.aclose()

        # no sentinel answers (here: none listens): the last known master still serves
        lonely = SentinelClient(sentinel_params([f"127.0.0.1:{free_port()}"], top.service_name))
        await lonely._switch_to(("127.0.0.1", master), "known before the sentinels went away")
        lonely.suspect(("127.0.0.1", master), "a lost connection (test)")
        async with await lonely.connect() as conn:
            assert conn.params.port == master and await conn.execute("PING") == b"PONG"
        await lonely.aclose()

        # the sentinel the producer follows +switch-master on dies: the next one takes over
        followed = producer.subscribed_to
        assert followed is not None
        top.sentinels[top.sentinel_ports.index(followed[1])].kill()
        new = await trio.to_thread.run_sync(top.failover)
        await eventually(lambda: producer.master == ("127.0.0.1", new), 10,
                         "following the switch through another sentinel")
        assert producer.subscribed_to not in (None, followed)
        assert await producer.execute("SET", "k", "v") == b"OK"
        assert top.role(new) == "master"


async def test_sentinel_and_master_credentials_come_from_the_url() -> None:
    with RedisSentinel(password="master-pw", sentinel_password="sentinel:pw") as top:
        assert "sentinel_password=sentinel%3Apw" in top.url
        handled: list[bytes] = []

        async def handle(d: Delivery) -> Outcome:
            assert d.data is not None
            handled.append(d.data)
            return ACK

        with trio.fail_after(15):
            async with open_client(top.url) as producer:
                await producer.execute("LPUSH", "auth-q", b"x")
                async with open_consumer(top.url, name="a1", shutdown_grace=1.0) as consumer:
                    await consumer.mount(ReliableListSubscription("auth-q", block=0.2), handle)
                    await eventually(lambda: handled == [b"x"], 5, "consuming with credentials")
        # the master's password is not the sentinels' (and the other way round)
        wrong = top.url.replace("sentinel%3Apw", "nope")
        with trio.fail_after(10), pytest.raises(rexc.ConnectionError) as err:
            async with open_client(wrong):
                pass
        assert "no sentinel named the master" in str(err.value) and "nope" not in str(err.value)
        no_master_pw = top.url.replace(":master-pw@", "")
        with trio.fail_after(10), pytest.raises(rexc.ConnectionError):
            async with open_client(no_master_pw) as client:
                await client.execute("PING")


def test_the_command_line_takes_a_sentinel_url(redis_sentinel: RedisSentinel) -> None:
    top = redis_sentinel
    # a dead letter as the library writes it (requeue refuses other streams)
    top.command(top.master_port(), "XADD", "dead", "*", "a", "1", "trf-dead-reason", "max_attempts")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "trio_redis_finalize", *args, "--url", top.url],
                              capture_output=True, text=True, timeout=60)

    inspect = cli("inspect", "dead", "--json")
    assert inspect.returncode == 0 and '"length": 1' in inspect.stdout, inspect.stderr
    requeue = cli("requeue", "dead", "--to", "again")
    assert requeue.returncode == 0 and "requeued 1" in requeue.stdout, requeue.stderr
    assert top.command(top.master_port(), "XLEN", "again") == 1
    demo = cli("demo")  # MONITOR on the master the sentinels name, not on a sentinel
    assert demo.returncode == 0 and demo.stdout.rstrip().endswith("lost: 0"), demo.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "trio_redis_finalize", "inspect", "k", "--url",
         f"redis+sentinel://127.0.0.1:{top.sentinel_ports[0]}/no-such-master"],
        capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode == 2 and "no-such-master" in bad.stderr and "Traceback" not in bad.stderr


# -- failover under a running consumer ---------------------------------------------------------

STREAM, QUEUE, DELAYED = "orders", "jobs", "later"
SUBS = {
    "stream": StreamSubscription(STREAM, group="g", block=0.2),
    "list": ReliableListSubscription(QUEUE, block=0.2),
    "delay": StreamSubscription(DELAYED, group="g", block=0.2,
                                delayed_retry=DelayedRetry.DURABLE_ZSET),
}
BEFORE, AFTER = 150, 30  # per form: produced before the fault, and after it


class Ledger:
    """What each form's handler was given, and when."""

    def __init__(self) -> None:
        self.calls: dict[str, Counter[int]] = {form: Counter() for form in SUBS}
        self.done: dict[str, Counter[int]] = {form: Counter() for form in SUBS}
        self.first_after: float | None = None

    def handler(self, form: str) -> Callable[[Delivery], Awaitable[Outcome]]:
        async def handle(d: Delivery) -> Outcome:
            n = int(d.fields[b"n"] if d.data is None else d.data)
            self.calls[form][n] += 1
            await trio.sleep(0.02)  # slow enough that the fault lands mid-consumption
            if form == "delay" and d.attempt == 1:
                return retry_after(0.2)  # through the durable delay set
            self.done[form][n] += 1
            if n >= BEFORE and self.first_after is None:
                self.first_after = time.monotonic()
            return ACK
        return handle

    def missing(self, produced: int) -> dict[str, list[int]]:
        return {form: sorted(set(range(produced)) - set(done))[:20]
                for form, done in self.done.items()}

    def handled(self, produced: int) -> bool:
        return all(len(done) == produced for done in self.done.values())


async def produce(client: Client, numbers: range) -> None:
    """Write like a producer that retries on errors (through the sentinel URL)."""
    for n in numbers:
        for cmd in (("XADD", STREAM, "*", "n", n), ("LPUSH", QUEUE, n),
                    ("XADD", DELAYED, "*", "n", n)):
            for _ in range(200):
                try:
                    await client.execute(*cmd, timeout=2.0)
                    break
                except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError):
                    await trio.sleep(0.05)
            else:
                raise AssertionError(f"could not write {cmd}")


LEFT: list[object] = []


async def nothing_pending(client: Client) -> bool:
    counts = [
        (await client.execute("XPENDING", STREAM, "g", timeout=2.0))[0],
        (await client.execute("XPENDING", DELAYED, "g", timeout=2.0))[0],
        await client.execute("ZCARD", "{later}:delayed", timeout=2.0),
        await client.execute("LLEN", QUEUE, timeout=2.0),
    ]
    LEFT[:] = counts
    return not any(counts)


@pytest.mark.parametrize("fault", ["SENTINEL FAILOVER", "SIGKILL"])
async def test_failover_under_a_running_consumer_loses_nothing(
    redis_sentinel: RedisSentinel, fault: str
) -> None:
    top = redis_sentinel
    ledger = Ledger()
    async with open_client(top.url) as producer:
        assert isinstance(producer, SentinelClient)
        old = producer.master
        assert old is not None
        await produce(producer, range(BEFORE))
        # every entry on the replica before the fault: what the new master has is exact
        assert await producer.execute("WAIT", 1, 2000) == 1
        async with open_consumer(top.url, name="c1", shutdown_grace=2.0) as consumer:
            for form, sub in SUBS.items():
                await consumer.mount(sub, ledger.handler(form), concurrency=2)
            await eventually(lambda: all(len(c) >= BEFORE // 4 for c in ledger.calls.values()),
                             10, "consumption before the fault")
            start = time.monotonic()
            in_flight = {form: BEFORE - len(done) for form, done in ledger.done.items()}
            if fault == "SIGKILL":
                killed = top.kill_master()
                new = await trio.to_thread.run_sync(
                    lambda: top.wait_master(other_than=killed.port))
            else:
                new = await trio.to_thread.run_sync(top.failover)
            elected = time.monotonic() - start
            assert new != old[1]
            # the producer follows the switch too; then it writes to the new master only
            await eventually(lambda: producer.master == ("127.0.0.1", new), 10,
                             "the producer following the switch")
            await produce(producer, range(BEFORE, BEFORE + AFTER))
            await eventually(lambda: ledger.handled(BEFORE + AFTER), RESUME_BOUND,
                             lambda: f"handling every entry (missing: {ledger.missing(BEFORE + AFTER)})")
            assert ledger.first_after is not None
            resumed = ledger.first_after - start
            await eventually(lambda: nothing_pending(producer), 10,
                             lambda: f"nothing pending (pending, pending, delayed, queue: {LEFT})")
            # Elements whose LREM the old master took after its replica was
            # promoted (lost with it) are found by the rescan after the
            # reconnection and delivered again: the processing list empties.
            async def processing_empty() -> bool:
                return await producer.execute("LLEN", "{jobs}:processing:c1") == 0

            await eventually(processing_empty, 10, "the processing list emptied")
            stats = consumer.stats()
        duplicates = {form: sum(c.values()) - len(c) for form, c in ledger.done.items()}
        print(f"\n{fault} ({top.version}): new master after {elected:.2f} s, consumption of "
              f"new entries resumed {resumed:.2f} s after the fault; not yet handled at the "
              f"fault {in_flight}; duplicates {duplicates}")
        everything = set(range(BEFORE + AFTER))
        for form, done in ledger.done.items():
            assert set(done) == everything, (form, sorted(everything - set(done))[:10])
        assert all(s["effects"].get("acked", 0) >= BEFORE + AFTER for s in stats.values()), stats
        assert producer.switches == 1 and producer.master == ("127.0.0.1", new)


# -- connections that notice silence -------------------------------------------------------------

_GENERATION: contextvars.ContextVar[int] = contextvars.ContextVar("generation", default=0)


class SilencingProxy(ChaosProxy):
    """A :class:`ChaosProxy` whose :meth:`silence` holds the bytes of the
    connections open now, for good, while later connections flow: a NAT or
    firewall that forgot one idle connection (no RST, no FIN)."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self._generation = 1
        self._cutoff = 0

    def silence(self) -> None:
        self._cutoff = self._generation
        self._generation += 1

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        _GENERATION.set(self._generation)  # inherited by this connection's pumps
        await super()._handle(client)

    async def _wait_flowing(self) -> None:
        await super()._wait_flowing()
        if _GENERATION.get() <= self._cutoff:
            await anyio.sleep_forever()


@asynccontextmanager
async def silencing(server: RedisServer) -> AsyncIterator[SilencingProxy]:
    async with trio.open_nursery() as n:
        proxy = SilencingProxy(server.port)
        await n.start(proxy.serve)
        try:
            yield proxy
        finally:
            n.cancel_scope.cancel()


async def test_an_idle_pooled_connection_cut_silently_costs_a_short_check(
    redis_server: RedisServer,
) -> None:
    async with silencing(redis_server) as proxy, open_client(
        proxy.url + "?health_check_interval=0.2"
    ) as client:
        await client.execute("SET", "trf-k", "1")  # the pool keeps this connection idle
        opened = client.connections_opened
        await trio.sleep(0.3)  # quiet longer than health_check_interval
        proxy.silence()
        start = trio.current_time()
        # without the check the GET is sent on the silent connection: no answer
        # for its whole deadline, then TimeoutError
        assert await client.execute("GET", "trf-k", timeout=5.0) == b"1"
        print(f"\na silently cut idle connection cost {trio.current_time() - start:.2f} s "
              f"(health check deadline {client.health_check_timeout} s)")
        assert (client.health_checks, client.health_check_failures) == (1, 1)
        assert client.connections_opened == opened + 1
        # a connection used within the interval is not checked
        assert await client.execute("GET", "trf-k") == b"1"
        assert client.health_checks == 1


async def test_the_next_finalization_after_a_silent_partition_does_not_stall(
    redis_server: RedisServer, redis_url: str,
) -> None:
    handled: list[str] = []

    async def handle(d: Delivery) -> Outcome:
        assert d.id is not None
        handled.append(d.id)
        return ACK

    name = "stream 'quiet' group 'g'"
    async with open_client(redis_url) as admin, silencing(redis_server) as proxy:
        await admin.execute("XGROUP", "CREATE", "quiet", "g", "0", "MKSTREAM")
        async with open_consumer(proxy.url + "?health_check_interval=0.5", name="q1",
                                 shutdown_grace=1.0) as consumer:
            await consumer.mount(StreamSubscription("quiet", group="g", block=0.2), handle)
            await admin.execute("XADD", "quiet", "*", "n", 1)
            await eventually(lambda: consumer.stats()[name]["effects"].get("acked") == 1, 5,
                             "the first entry acknowledged")
            await trio.sleep(0.6)  # the pooled connection is quiet, the reader blocks
            proxy.silence()  # both go silent; new connections work
            start = trio.current_time()
            await admin.execute("XADD", "quiet", "*", "n", 2)
            await eventually(lambda: len(handled) == 2, 10, "the reader reconnecting")
            await eventually(lambda: consumer.stats()[name]["effects"].get("acked") == 2, 10,
                             "the second entry acknowledged")
            stats = consumer.stats()[name]
            pool = consumer.client
            print(f"\nan entry written during a silent partition was acknowledged after "
                  f"{trio.current_time() - start:.2f} s (the reader's read deadline included); "
                  f"health checks {pool.health_checks}, failed {pool.health_check_failures}")
        # without the pool's check the XACK waits for its 5 s deadline, fails, is re-sent
        assert stats["finalize_errors"] == 0, stats
        assert (await admin.execute("XPENDING", "quiet", "g"))[0] == 0


async def test_every_tcp_connection_has_keepalive(redis_server: RedisServer) -> None:
    async with open_client(redis_server.url) as client, await client.connect() as conn:
        sock: socket.socket = conn._stream.extra(SocketAttribute.raw_socket)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 15
        if hasattr(socket, "TCP_KEEPCNT"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
    async with open_client(redis_server.url + "?keepalive=0") as client:
        conn = await client.connect()
        async with conn:
            sock = conn._stream.extra(SocketAttribute.raw_socket)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
