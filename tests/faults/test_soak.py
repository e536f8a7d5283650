"""Process faults: SIGKILLed consumers, a SIGKILLed and a frozen redis-server.

* The consumer soak (stream, then reliable list): N messages (ACK, RETRY,
  ``retry_after`` through the durable delay set, poison with
  ``max_attempts=3``), the consumer subprocess (``_soak_proc.py``, handler
  concurrency 4) SIGKILLed at random moments and restarted under the same
  name.  Then: every message handled at least once and finalized exactly
  once, nothing pending or stranded, duplicate handler executions (per
  message, beyond what its kind needs) at most 2 x kills x concurrency (see
  :func:`check`; the figures are printed), every poison message dead-lettered
  exactly once.
  Handler executions are counted from the subprocess's unbuffered log.
* redis-server with ``appendonly yes`` SIGKILLed and restarted under load:
  no acknowledged write lost, the consumer resumes by itself.
* redis-server frozen (SIGSTOP) longer than the read deadline, then SIGCONT:
  the consumer resumes.

CI runs short versions; ``TRF_LONG=1`` runs 10,000 messages and 20 kills
(and 5 server kills).  Each test prints its figures (run with ``-s``).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import _soak_proc as proc
import pytest
import trio
from _paths import TESTS
from _procs import eventually
from redis import exceptions as rexc

from faults.checks import ListState, StreamState, list_state, stream_state
from trio_redis_finalize import (
    ACK,
    RETRY,
    Delivery,
    Outcome,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._core._types import content_origin
from trio_redis_finalize._transport import Client, open_client
from trio_redis_finalize.testing import RedisServer

LONG = os.environ.get("TRF_LONG") == "1"
MESSAGES = 10_000 if LONG else 2_000
KILLS = 20 if LONG else 5
SERVER_KILLS = 5 if LONG else 3
CONCURRENCY = 4
EXPECTED = {"ack": 1, "retry": 2, "later": 2, "poison": proc.MAX_ATTEMPTS}
SOAK_PROC = TESTS / "_soak_proc.py"
NAME = "w1"


def kind_for(i: int) -> str:
    if i % 50 == 7:
        return "poison"
    return {1: "retry", 2: "retry", 3: "later"}.get(i % 10, "ack")


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[Client]:
    async with open_client(redis_url) as c:
        yield c


# -- the consumer soak ------------------------------------------------------------

class Form:
    """What the soak needs to know of a form: produce, and what Redis holds."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def produce(self, client: Client, n: int) -> dict[str, str]:
        """Messages 0..n-1; returns origin -> kind."""
        kinds: dict[str, str] = {}
        for start in range(0, n, 500):
            idx = range(start, min(n, start + 500))
            if self.name == "stream":
                replies = await client.pipeline(
                    [("XADD", proc.S, "*", "kind", kind_for(i), "n", i) for i in idx])
                kinds.update({r.decode(): kind_for(i) for r, i in zip(replies, idx, strict=True)})
            else:
                elements = [f"{kind_for(i)}:{i}".encode() for i in idx]
                await client.execute("LPUSH", proc.Q, *elements)
                kinds.update({content_origin(e): kind_for(i) for e, i in zip(elements, idx, strict=True)})
        return kinds

    async def setup(self, client: Client) -> None:
        if self.name == "stream":
            await client.execute("XGROUP", "CREATE", proc.S, proc.G, "0", "MKSTREAM")

    async def state(self, client: Client) -> StreamState | ListState:
        if self.name == "stream":
            return await stream_state(client, proc.S, proc.G, delay_key="{soak}:delayed",
                                      dead_letter=proc.S_DEAD)
        return await list_state(client, proc.Q, [f"{{{proc.Q}}}:processing:{NAME}"],
                                delay_key="{soakq}:delayed", dead_letter=proc.Q_DEAD)


class Process:
    """One life of the consumer subprocess."""

    def __init__(self, url: str, form: str, log: Path) -> None:
        self.log = log
        self.ready_before = self._count(b"READY")
        self.p = subprocess.Popen(
            [sys.executable, "-u", str(SOAK_PROC), url, form, NAME, str(log), str(CONCURRENCY)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(SOAK_PROC.parent.parent)},
        )

    def _count(self, word: bytes) -> int:
        if not self.log.exists():
            return 0
        return self.log.read_bytes().count(word + b"\n")

    async def ready(self) -> None:
        with trio.move_on_after(20):
            while self._count(b"READY") <= self.ready_before:
                assert self.p.poll() is None, "the consumer process died on its own"
                await trio.sleep(0.02)
            return
        raise AssertionError("the consumer process did not get ready")

    def kill(self) -> None:
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()

    async def stop(self) -> None:
        self.p.send_signal(signal.SIGTERM)
        await trio.to_thread.run_sync(self.p.wait, 15)


def read_log(log: Path) -> list[tuple[str, str, int, str]]:
    rows = []
    for line in log.read_text().splitlines():
        if line.startswith("H "):
            _, token, origin, attempt, kind = line.split(" ")
            rows.append((token, origin, int(attempt), kind))
    return rows


async def soak(form: Form, url: str, admin: Client, tmp_path: Path) -> dict[str, Any]:
    started = time.monotonic()
    await form.setup(admin)
    kinds = await form.produce(admin, MESSAGES)
    log = tmp_path / f"{form.name}.log"
    rng = random.Random(1234 if form.name == "stream" else 4321)
    for _ in range(KILLS):
        life = Process(url, form.name, log)
        await life.ready()
        await trio.sleep(rng.uniform(0.05, 0.35))
        life.kill()
    final = Process(url, form.name, log)
    await final.ready()

    async def settled() -> bool:
        return not (await form.state(admin)).present()

    await eventually(settled, 120 if LONG else 60, "the last consumer finishing the work")
    await final.stop()
    state = await form.state(admin)
    stranded = state.stranded()
    # a clean consumer drains whatever might be left (nothing, if all is well)
    drained: Counter[str] = Counter()

    async def ack(d: Delivery) -> Outcome:
        drained[d.origin_id] += 1
        return ACK

    async with open_consumer(url, name=NAME, shutdown_grace=1.0) as consumer:
        await consumer.mount(proc.subscription(form.name), ack)
        await trio.sleep(0.3)
    rows = read_log(log)
    lives = [seg.count("\nH ") + seg.startswith("H ") for seg in log.read_text().split("READY\n")[1:]]
    execs = Counter(origin for _, origin, _, _ in rows)
    per_token = Counter(token for token, _, _, _ in rows)
    dup_by_kind = sum(max(0, execs[o] - EXPECTED[k]) for o, k in kinds.items())
    return {
        "form": form.name, "messages": MESSAGES, "kills": KILLS, "concurrency": CONCURRENCY,
        "executions": len(rows), "duplicates": dup_by_kind,
        "same_delivery_twice": sum(n - 1 for n in per_token.values()),
        "seconds": round(time.monotonic() - started, 1), "executions_per_life": lives,
        "kinds": kinds, "execs": execs, "rows": rows, "state": state, "stranded": stranded,
        "drained": drained, "log": log.read_text(),
    }


def check(result: dict[str, Any]) -> None:
    kinds: dict[str, str] = result["kinds"]
    execs: Counter[str] = result["execs"]
    state = result["state"]
    dead = state.dead_letters()
    assert not result["stranded"], f"stranded after the last consumer stopped: {result['stranded']}"
    assert not result["drained"], f"the clean consumer still found work: {result['drained']}"
    assert not state.present()
    never = [o for o, k in kinds.items() if execs[o] == 0]
    assert not never, f"{len(never)} never handled, e.g. {[(o, kinds[o]) for o in never[:5]]}"
    # a message that is no poison is dead-lettered only when kills alone spent
    # its attempts (crash_counted; printed by report), and then once, with at
    # most the one copy of its RETRY or delay that committed
    calls = _calls(result)  # the log read once
    crashed = {o for o, k in kinds.items()
               if k != "poison" and dead[o] == 1 and crash_counted(calls, o)}
    result["crash_counted"] = sorted(crashed)
    wrong_dead = {o: dead[o] for o, k in kinds.items()
                  if dead[o] != (1 if k == "poison" or o in crashed else 0)}
    assert not wrong_dead, (f"dead letters (poison exactly once, others never but after kills "
                            f"alone spent their attempts): {wrong_dead}; {_story(result, wrong_dead)}")
    assert set(dead) <= set(kinds)
    if result["form"] == "stream":  # finalized exactly once: one copy per retry, per delay
        copies = state.copies()
        want = {o: {"ack": 0, "retry": 1, "later": 1}.get(k, copies[o]) for o, k in kinds.items()}
        wrong = {o: copies[o] for o in kinds
                 if not (copies[o] <= want[o] if o in crashed else copies[o] == want[o])}
        assert not wrong, f"copies per message: {wrong}"
    limit = proc.MAX_ATTEMPTS
    over = [r for r in result["rows"] if r[2] > limit]
    assert not over, f"handler calls past max_attempts: {over[:5]}"
    assert set(execs) <= set(kinds), f"handled messages nobody produced: {set(execs) - set(kinds)}"
    # A kill re-runs what the handlers were running (<= concurrency) and the
    # outcomes still waiting behind the finalizer's round trip (the handlers
    # moved on meanwhile, so <= concurrency more while a round trip is shorter
    # than a handler call): kills x concurrency is what an inline-ack consumer
    # gets; this pipelined finalizer measured up to 8 for one kill.
    bound = result["kills"] * result["concurrency"] * 2
    assert result["duplicates"] <= bound, (
        f"{result['duplicates']} duplicate executions > 2 x kills x concurrency = {bound}")


def _calls(result: dict[str, Any]) -> dict[str, list[tuple[str, int, int]]]:
    """Each message's handler calls from the log: (delivery, attempt, life),
    the life counted in START lines (a process writes one as it begins: its
    handlers may run before its READY, the restart's own-PEL reading)."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    life = 0
    for line in result["log"].splitlines():
        if line == "START":
            life += 1
        elif line.startswith("H "):
            _, token, origin, attempt, _kind = line.split(" ")
            out.setdefault(origin, []).append((token, int(attempt), life))
    return out


def crash_counted(calls: dict[str, list[tuple[str, int, int]]], origin: str) -> bool:
    """Whether a message that is no poison may rightly have reached
    ``max_attempts``: every handler call of it ran in a life of its own (a
    kill ended each life before its outcome was finalized, or before a
    handler started what was read: the restart read it again, one attempt
    more, as DESIGN's "counters crashes cannot fool" asks).  Kills in a row
    that catch one read before its outcomes are sent make it; two calls in
    one life do not."""
    lives = [life for _, _, life in calls.get(origin, [])]
    return len(lives) == len(set(lives))


def _story(result: dict[str, Any], origins: Iterable[str], most: int = 3) -> str:
    """What the log and Redis say of a few ``origins``: each handler call
    (delivery, attempt, life) and each dead letter's fields (its reason), so
    that a failure seen once on a loaded machine can be read."""
    calls = _calls(result)
    dead = list(getattr(result["state"], "dead", []))
    out = []
    for o in list(origins)[:most]:
        letters = [{k.decode(): v[:200] for k, v in e.fields.items()}
                   for e in dead if getattr(e, "origin", None) == o]
        out.append(f"{o}: handler calls {calls.get(o, [])}, dead letters {letters}")
    return "; ".join(out)


def report(result: dict[str, Any]) -> None:
    keys = ("form", "messages", "kills", "concurrency", "executions", "duplicates",
            "same_delivery_twice", "seconds", "executions_per_life", "crash_counted")
    print("\nsoak:", ", ".join(f"{k}={result.get(k)}" for k in keys))


@pytest.mark.timeout(1800 if LONG else 120)
async def test_stream_consumer_sigkill_soak(redis_url: str, admin: Client, tmp_path: Path) -> None:
    result = await soak(Form("stream"), redis_url, admin, tmp_path)
    try:
        check(result)
    finally:
        report(result)


@pytest.mark.timeout(1800 if LONG else 120)
async def test_reliable_list_consumer_sigkill_soak(redis_url: str, admin: Client, tmp_path: Path) -> None:
    result = await soak(Form("list"), redis_url, admin, tmp_path)
    try:
        check(result)
    finally:
        report(result)


# -- the server -------------------------------------------------------------------------

S, G = "orders", "billing"


def _policy(d: Delivery) -> Outcome:
    return RETRY if int(d.fields[b"n"]) % 5 == 1 and d.origin_id == d.id else ACK


@pytest.mark.timeout(600 if LONG else 120)
async def test_redis_server_sigkill_with_aof_loses_nothing_acknowledged(tmp_path: Path) -> None:
    server = RedisServer(appendonly=True).start()
    started = time.monotonic()
    try:
        acked: dict[int, str] = {}  # XADD replied: the write is acknowledged
        attempted = 0
        handled: Counter[int] = Counter()
        calls: Counter[str] = Counter()

        async def handle(d: Delivery) -> Outcome:
            assert d.id is not None
            handled[int(d.fields[b"n"])] += 1
            calls[d.id] += 1
            return _policy(d)

        async def produce(stop: trio.Event) -> None:
            nonlocal attempted
            while not stop.is_set():
                try:
                    async with open_client(server.url + "?timeout=0.5") as c:
                        while not stop.is_set():
                            n = attempted
                            attempted += 1
                            acked[n] = (await c.execute("XADD", S, "*", "n", n, timeout=0.5)).decode()
                            await trio.sleep(0.002)
                except (rexc.ConnectionError, rexc.TimeoutError, OSError):
                    await trio.sleep(0.05)  # the server is down: that write's outcome is unknown

        async with open_client(server.url) as c:
            await c.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
        rng = random.Random(99)
        async with open_consumer(server.url + "?timeout=0.5", name=NAME, shutdown_grace=2.0) as consumer:
            await consumer.mount(StreamSubscription(S, G, block=0.1, count=20), handle, concurrency=4)
            stop = trio.Event()
            async with trio.open_nursery() as n:
                n.start_soon(produce, stop)
                for _ in range(SERVER_KILLS):
                    await trio.sleep(rng.uniform(0.3, 0.8))
                    await trio.to_thread.run_sync(server.restart)  # SIGKILL, same port and dir
                await trio.sleep(0.3)
                stop.set()
            async with open_client(server.url) as admin:
                async def settled() -> bool:
                    state = await stream_state(admin, S, G)
                    return not state.present() and all(n in handled for n in acked)

                await eventually(settled, 30, "the consumer resuming by itself and finishing")
                state = await stream_state(admin, S, G)
        lost = [n for n in acked if n not in handled]
        assert not lost, f"{len(lost)} acknowledged writes never handled: {lost[:10]}"
        assert set(handled) <= set(range(attempted))
        copies = state.copies()
        for n, eid in acked.items():
            assert copies[eid] == (1 if n % 5 == 1 else 0), f"message {n}: {copies[eid]} copies"
        assert not state.pending
        dups = sum(c - 1 for c in calls.values())
        print(f"\nserver kills: {SERVER_KILLS}, acked writes {len(acked)} of {attempted} attempted, "
              f"handled {sum(handled.values())}, same delivery twice {dups}, "
              f"{time.monotonic() - started:.1f} s")
    finally:
        server.stop()


async def test_frozen_server_longer_than_the_read_deadline_then_the_consumer_resumes(
    fresh_redis_server: RedisServer,
) -> None:
    server = fresh_redis_server
    handled: Counter[str] = Counter()

    async def handle(d: Delivery) -> Outcome:
        assert d.id is not None
        handled[d.id] += 1
        return ACK

    async with open_client(server.url) as admin:
        await admin.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
        async with open_consumer(server.url + "?timeout=0.5", name=NAME, shutdown_grace=1.0) as consumer:
            await consumer.mount(StreamSubscription(S, G, block=0.2), handle)
            before = [(await admin.execute("XADD", S, "*", "n", i)).decode() for i in range(3)]

            async def all_handled(ids: list[str]) -> bool:
                return all(handled[i] for i in ids)

            await eventually(lambda: all_handled(before), 5, "handling before the freeze")
            server.pause()  # SIGSTOP: connections still accepted by the kernel
            try:
                await trio.sleep(2.0)  # > block + read margin (1.2 s)
            finally:
                server.resume()
            after = [(await admin.execute("XADD", S, "*", "n", i)).decode() for i in range(3, 6)]
            await eventually(lambda: all_handled(after), 8, "consuming again after SIGCONT")

            async def settled() -> bool:
                return not (await stream_state(admin, S, G)).present()

            await eventually(settled, 5, "nothing pending")
            assert consumer.stats()[f"stream {S!r} group {G!r}"]["read_errors"] >= 1
    assert set(handled.values()) == {1}
