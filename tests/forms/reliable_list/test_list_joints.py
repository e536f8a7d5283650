"""A reliable list's joints against a real server: where two finalizations of
identical bytes meet, or a finalization meets the reader's rescan.

* an element of a batched removal-with-writes call refused (OOM inside the
  script) is sent again alone; its counted gate is settled by that resend
  only, so an identical copy another handler still holds stays held and the
  periodic rescan does not hand it to a second handler (stop 40's fix, which
  had only its sans-IO test);
* an element waiting out its ``Backoff`` in the processing list of a
  consumer that stopped (gracefully, or died) is moved back onto the queue
  by a live consumer's reaper only once it is due: the schedule outlives the
  process, as a stream's claim of a stopped consumer's entry honours it;
  so for a consumer stalled past its heartbeat (SIGSTOP) while it waits;
* a consumer started again under its name with another processing list takes
  back what its previous process left in the old one;
* a consumer stalled past its heartbeat (SIGSTOP) does not start, once
  resumed, what a live consumer's reaper moved back meanwhile.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import trio
from _paths import TESTS
from _procs import Hang, Recorder, child_lines, eventually
from _rlist import Q, as_a_crash, b_starts_all, done_counts, effects, lrange, proc, sub, text
from faults.cmdproxy import BLACKHOLE, LOST, CommandProxy, error, serving

from trio_redis_finalize import ACK, Backoff, Delivery, Outcome, _shutdown, open_consumer
from trio_redis_finalize._core.reliable_list.liveness import ADOPT, registry_key
from trio_redis_finalize._forms.reliable_list import liveness as _list_liveness
from trio_redis_finalize._forms.reliable_list import reader as _reader
from trio_redis_finalize._forms.reliable_list.recovery import ListRecovery
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(90)


def count_rescans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the processing list's rescans that went through (``[n]``); the
    rescan itself is the package's."""
    done = [0]
    real = ListRecovery.rescan

    async def rescan(self: ListRecovery, *a: Any, **kw: Any) -> None:
        await real(self, *a, **kw)
        done[0] += 1

    monkeypatch.setattr(ListRecovery, "rescan", rescan)
    return done


async def test_an_identical_copy_in_hand_is_not_rescanned_after_a_refused_batched_write(
    redis_url: str, client: Client, oom: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four copies of ``job``; the first one's handler holds it; the fourth's
    ACK with a write is refused (OOM inside ``LIST_WRITES_REMOVE_BATCH``) and
    sent again alone until memory is back.  The held copy stays held: the
    periodic rescan (0.3 s here) does not deliver it again while its handler
    runs, and each copy is handled and written once.

    Before stop 40's fix (``ListGates.settle`` settled such an element from the
    batched reply *and* from its resend) one held copy was forgotten twice and
    a false leftover recorded: the rescan handed the held copy to a second
    handler (attempt 2), five handler calls for four copies."""
    monkeypatch.setattr(_reader, "_RESCAN_EVERY", 0.3)
    rescans = count_rescans(monkeypatch)
    await client.execute("LPUSH", Q, *[b"job"] * 4)
    calls: list[int] = []
    release, refused = trio.Event(), trio.Event()

    async def handler(d: Delivery) -> Outcome:
        calls.append(d.attempt)
        if len(calls) == 1:
            await release.wait()  # this copy stays in hand meanwhile
        elif len(calls) == 4:
            oom.on()
            refused.set()
        return ACK.with_writes(("HINCRBY", "totals", "n", 1))

    async with open_consumer(redis_url, name="c1", shutdown_grace=2.0) as consumer:
        await consumer.mount(sub(block=0.1), handler, concurrency=2)
        await refused.wait()
        name = consumer.mounts[0].name
        await eventually(lambda: consumer.stats()[name]["finalize_errors"] >= 2,
                         what="the refused write sent again")
        oom.off()
        await eventually(lambda: effects(consumer).get("acked") == 3, what="three copies acked")
        assert await lrange(client, proc("c1")) == [b"job"]  # the held one
        # two rescans that started after the three were settled
        seen = rescans[0]
        await eventually(lambda: rescans[0] >= seen + 2, what="two more rescans")
        assert calls == [1, 1, 1, 1], f"the copy in hand was delivered again: {calls}"
        release.set()
        await eventually(lambda: effects(consumer).get("acked") == 4, what="the held copy acked")
        e = effects(consumer)
        assert e.get("gate_closed", 0) == 0 and e.get("writes") == 4, e
    assert calls == [1, 1, 1, 1]
    assert await client.execute("HGET", "totals", "n") == b"4"
    assert await lrange(client, proc("c1")) == [] and await lrange(client, Q) == []


WINDOW = 5.0


@pytest.mark.parametrize("stop", ["graceful", "lapsed"])
async def test_a_stopped_consumers_waiting_element_is_reaped_only_once_due(
    redis_url: str, client: Client, monkeypatch: pytest.MonkeyPatch, stop: str,
) -> None:
    """Consumer ``a`` fails ``job`` (``Backoff`` with a floor of 5 s:
    ``window`` 5, ``max_attempts`` 2) and stops while it waits: gracefully
    (the element stays in its processing list with its schedule, its last
    heartbeat lapses about 2.5 s later), or without a hand-back (a crash: its
    heartbeat lapses).  Consumer ``b``'s reaper moves it back onto the queue
    once ``a``'s heartbeat lapsed -- and, the schedule outliving the process,
    not before it is due: attempt 2 comes no sooner than 5 s after attempt 1
    failed.  Before, the reaper moved it at once and ``b`` handled attempt 2
    about 2.5 s after the failure."""
    monkeypatch.setattr(_shutdown, "FINALIZE_GRACE", 1.0)  # a's last heartbeat: 0.5 + 1 + 1 s
    failed: list[float] = []
    seen: list[tuple[float, int]] = []

    async def fail(d: Delivery) -> Outcome:
        failed.append(trio.current_time())
        raise RuntimeError("fails once")

    async def record(d: Delivery) -> Outcome:
        seen.append((trio.current_time(), d.attempt))
        return ACK

    backoff = Backoff(base=0.01, cap=0.01, window=WINDOW)
    schedule = proc("a") + ":backoff"
    with trio.fail_after(40):  # a bound
        async with open_consumer(redis_url, name="a", shutdown_grace=0.5) as a:
            await a.mount(sub(heartbeat=1.0, max_attempts=2), fail, on_error=backoff)
            await client.execute("LPUSH", Q, b"job")
            await eventually(lambda: client.execute("ZCARD", schedule), 10,
                             "the due time written")
            if stop == "lapsed":  # no hand-back, no deregistration: as a crash leaves it
                as_a_crash(monkeypatch, a)
        assert await lrange(client, proc("a")) == [b"job"]  # left waiting, with its schedule
        assert await client.execute("HEXISTS", registry_key(Q), "a") == 1
        async with open_consumer(redis_url, name="b") as b:
            await b.mount(sub(heartbeat=1.0, max_attempts=2), record, on_error=backoff)
            await eventually(lambda: seen, 20, "attempt 2 handled by b")
            await eventually(lambda: effects(b).get("acked") == 1, 10, "acked")
    assert [at for _, at in seen] == [2], seen
    early = failed[0] + WINDOW - seen[0][0]
    assert early <= 0.05, f"attempt 2 came {early:.2f} s before its Backoff was due"
    assert await lrange(client, proc("a")) == [] and await lrange(client, Q) == []


@pytest.mark.parametrize("left", ["in-hand", "waiting"])
async def test_a_restart_with_another_processing_list_takes_the_old_ones_elements(
    redis_url: str, client: Client, monkeypatch: pytest.MonkeyPatch, left: str,
) -> None:
    """Consumer ``a`` (processing list ``p1``) dies while its handler holds
    ``job`` (``in-hand``), or while ``job`` waits out its ``Backoff`` after a
    failed attempt 1 (``waiting``: due 5 s later); no hand-back, as a crash
    leaves it.  It is started again under its name with changed settings,
    ``processing="p2"``: it takes ``p1`` over as its own, and ``job`` is
    delivered again as attempt 2 (counted, as after any crash), a waiting one
    no sooner than due (its schedule moves along).  Consumer ``b`` runs
    beside it.  Before, the restart's claim re-registered ``a`` with ``p2``
    and ``job`` stayed in ``p1``, held by nobody, for good."""
    started = trio.Event()
    failed: list[float] = []
    seen: list[tuple[str, int, float]] = []

    async def first(d: Delivery) -> Outcome:
        failed.append(trio.current_time())
        started.set()
        if left == "waiting":
            raise RuntimeError("fails once")
        await trio.sleep_forever()
        raise AssertionError("not reached")

    def record(who: str) -> Any:
        async def handler(d: Delivery) -> Outcome:
            seen.append((who, d.attempt, trio.current_time()))
            return ACK
        return handler

    backoff = Backoff(base=0.01, cap=0.01, window=WINDOW)
    with trio.fail_after(40):  # a bound
        async with open_consumer(redis_url, name="a", shutdown_grace=0.0) as a:
            await a.mount(sub(heartbeat=0.5, processing="{jobs}:p1", max_attempts=2), first,
                          on_error=backoff)
            await client.execute("LPUSH", Q, b"job")
            await started.wait()
            if left == "waiting":
                await eventually(lambda: client.execute("ZCARD", "{jobs}:p1:backoff"), 10,
                                 "the due time written")
            as_a_crash(monkeypatch, a)
        assert len(await lrange(client, "{jobs}:p1")) == 1
        async with open_consumer(redis_url, name="a", takeover=True) as a2, \
                open_consumer(redis_url, name="b") as b:
            await a2.mount(sub(heartbeat=0.5, processing="{jobs}:p2", max_attempts=2),
                           record("a"), on_error=backoff)
            await b.mount(sub(heartbeat=0.5, max_attempts=2), record("b"), on_error=backoff)
            await eventually(lambda: seen, 15, "the element left in p1 delivered again")
            await eventually(lambda: effects(a2).get("acked", 0) + effects(b).get("acked", 0)
                             == 1, 10, "acked")
    assert [at for _, at, _ in seen] == [2], seen
    if left == "waiting":
        early = failed[0] + WINDOW - seen[0][2]
        assert early <= 0.05, f"attempt 2 came {early:.2f} s before its Backoff was due"
    assert await lrange(client, "{jobs}:p1") == [] and await lrange(client, Q) == []
    assert await lrange(client, "{jobs}:p2") == []


# -- a consumer stalled past its heartbeat (SIGSTOP) ---------------------------------------

LIST_PROC = str(TESTS / "_list_proc.py")


async def test_a_stalled_consumer_does_not_start_what_was_moved_back_meanwhile(
    redis_url: str, client: Client,
) -> None:
    """Consumer A (a process, concurrency 1, 1 s per element, heartbeat 1 s)
    reads its first elements and starts one; it is stopped (SIGSTOP) 3.5 s,
    longer than its heartbeat, and consumer B's reaper moves A's processing
    list back onto the queue: B handles all six.  Resumed, A finishes the one
    it had begun (its finalization finds its gate closed: no second write)
    and starts none of those it had read and not begun -- they are B's now
    (at most one: the handler task may take the next one before A learns
    its list was moved), as a stalled stream consumer leaves what another
    claimed meanwhile."""
    names = [f"e{i}" for i in range(6)]
    await client.execute("LPUSH", Q, *names)
    async with child_lines(LIST_PROC, redis_url, Q, "a", "1.0", "1.0") as a:
        assert await a.read(lambda w: w[:1] == ["H"], 20), a.lines
        os.kill(a.proc.pid, signal.SIGSTOP)
        async with b_starts_all(redis_url, names, a.proc.pid, trio.current_time()) as started_by_b:
            await a.read(None, 2.5)  # A runs 2.5 s: at 1 s per element, time to start 2 more
            started_by_a = [w[1] for w in a.words("H")]
            assert sorted(set(started_by_b)) == names
            assert len(started_by_a) <= 2, (started_by_a, a.lines)  # at most one after the resume
    await done_counts(client)  # each element's write once


@pytest.mark.parametrize("resume", ["before-due", "after-due"])
async def test_a_waiting_element_of_a_stalled_consumer_comes_back_once_when_due(
    redis_url: str, client: Client, resume: str,
) -> None:
    """Consumer A (a process, heartbeat 1 s) fails ``job``'s attempt 1;
    attempt 2 is due 4 s later (``Backoff`` window, ``max_attempts=2``), its
    due time written beside A's processing list.  A is stopped (SIGSTOP) at
    once; its heartbeat lapses and consumer B's reaper finds the element
    waiting: not moved before it is due.  A is resumed before that (its own
    redelivery then comes when due) or after (B moved it back when due; A's
    redelivery finds it gone).  Either way attempt 2 is handled once, no
    sooner than due, and its write committed once."""
    window = WINDOW - 1
    await client.execute("LPUSH", Q, b"job")
    seen: list[tuple[int, float]] = []

    async def record(d: Delivery) -> Outcome:
        seen.append((d.attempt, time.monotonic()))
        return ACK.with_writes(("HINCRBY", "done", text(d), 1))

    async with child_lines(LIST_PROC, redis_url, Q, "a", "1.0", "0", str(window)) as a:
        assert await a.read(lambda w: w[:1] == ["H"], 20), a.lines
        failed_at = float(a.lines[-1][3])
        with trio.fail_after(10):  # a bound: the due time written, then A stopped
            while not await client.execute("ZCARD", proc("a") + ":backoff"):
                await trio.sleep(0.01)
        os.kill(a.proc.pid, signal.SIGSTOP)
        stopped = trio.current_time()
        backoff = Backoff(base=0.01, cap=0.01, window=window)
        async with open_consumer(redis_url, name="b", shutdown_grace=0.0) as consumer:
            await consumer.mount(sub(heartbeat=1.0, max_attempts=2), record, on_error=backoff)
            await trio.sleep(max(0.0, (2.0 if resume == "before-due" else 5.0)
                                 - (trio.current_time() - stopped)))
            os.kill(a.proc.pid, signal.SIGCONT)
            with trio.fail_after(20):  # a bound
                while not seen and len(a.words("H")) < 2:
                    await a.read(lambda w: w[:1] == ["H"], 0.1)
            await a.read(None, 1.5)  # both run on
        handled = [*seen, *((int(w[2]), float(w[3])) for w in a.words("H")[1:])]
    assert [at for at, _ in handled] == [2], (seen, a.lines)
    assert handled[0][1] >= failed_at + window - 0.05, (handled, failed_at)
    assert await client.execute("HGET", "done", "job") == b"1"
    assert await lrange(client, Q) == [] and await lrange(client, proc("a")) == []


@pytest.mark.parametrize("fault", ["lost", "blackhole", "OOM", "READONLY"])
async def test_a_fault_at_the_take_over_of_the_old_processing_list_leaves_it_to_the_next_mount(
    redis_server: RedisServer, flavour: str, client: Client, monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    """As above (``in-hand``), but the restart's ``reliable_list_adopt`` meets a
    lost reply, a silent link or a refusal: that ``mount()`` may fail (in time,
    with an error); mounted again, with no fault, the consumer still takes
    ``p1`` over and ``job`` is delivered once more, as attempt 2.  The old
    list must not be forgotten because the claim re-registered the name with
    ``p2`` before the take-over failed."""
    first, record = Hang(), Recorder()
    faults = {"lost": LOST, "blackhole": BLACKHOLE}
    with trio.fail_after(60):  # a bound
        async with open_consumer(redis_server.url, name="a", shutdown_grace=0.0) as a:
            await a.mount(sub(heartbeat=0.5, processing="{jobs}:p1"), first)
            await client.execute("LPUSH", Q, b"job")
            await first.started.wait()
            as_a_crash(monkeypatch, a)
        monkeypatch.setattr(_list_liveness, "FINALIZE_TIMEOUT", 0.5)
        async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy:
            proxy.arm(f"EVALSHA:{ADOPT.name}", faults.get(fault) or error(fault))
            try:
                async with open_consumer(proxy.url, name="a", takeover=True) as a2:
                    await a2.mount(sub(heartbeat=0.5, processing="{jobs}:p2"), record)
                    await eventually(lambda: record.seen, 10, "job delivered again")
            except Exception:
                pass
            assert proxy.fired, proxy
        if not record.seen:
            async with open_consumer(redis_server.url, name="a", takeover=True) as a3:
                await a3.mount(sub(heartbeat=0.5, processing="{jobs}:p2"), record)
                await eventually(lambda: record.seen, 15, "the element left in p1 delivered again")
                await eventually(lambda: effects(a3).get("acked", 0) == 1, 10, "acked")
    assert [d.attempt for d in record.seen] == [2], record.seen
    assert await lrange(client, "{jobs}:p1") == [] and await lrange(client, Q) == []
