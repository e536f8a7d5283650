"""The stream's give-back at a stop, against a real server.

What a stream consumer read and no handler started is given back at the
shutdown with its delivery count set one lower (``decode.give_back``: the
finalizer's plan in phase 3, sent once more by the reader's ``closed``
step), so it comes back at the attempt it had.  Here:

* a claiming peer (RECLAIM, CLAIMING, a process of its own) takes those
  entries while the stop is held up by a long handler (once the stop began,
  the lease keeps only what a handler started, ``Context.leased``): the
  give-back leaves them with the peer, at the peer's count, and each is
  handled once, by the peer; the long handler's own entry stays with it;
* the give-back's own request meets a fault (the command proxy): its reply
  lost, a silent link, an error reply instead of running.  The entries stay
  pending and a restart delivers them at the attempt they had (or one
  higher, where no give-back could run at all).

Timeouts are bounds, never expectations.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable

import anyio
import pytest
import trio
from _paths import TESTS
from _procs import Recorder, child_lines, eventually, finalize_timers
from faults.cmdproxy import BLACKHOLE, LOST, CommandProxy, Fault, error

from trio_redis_finalize import ACK, Delivery, Mode, Outcome, StreamSubscription, open_consumer
from trio_redis_finalize._core._recovery import LEASE
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(90)

S, G = "s", "g"
PROC = str(TESTS / "_stream_proc.py")
N = 5
"""Entries written: the first one's handler holds the stop up, the others wait unstarted."""


async def _pending(client: Client) -> dict[str, tuple[str, int]]:
    """Entry id -> (the consumer it is pending for, its delivery count)."""
    rows = await client.execute("XPENDING", S, G, "-", "+", 100)
    return {r[0].decode(): (r[1].decode(), int(r[3])) for r in rows}


async def _produce(client: Client) -> list[str]:
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    return [(await client.execute("XADD", S, "*", "n", str(i))).decode() for i in range(N)]


async def _all_read(client: Client) -> bool:
    """The N entries are pending (read)."""
    return len(await _pending(client)) == N


async def _consumer_a(
    url: str, sub: StreamSubscription, handler: Callable[[Delivery], Awaitable[Outcome]],
    stop: trio.Event, done: trio.Event,
    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Consumer A (shutdown grace 60 s) in a task of its own: started once
    mounted, its stop begun once ``stop`` is set; ``done`` is set when the stop ended."""
    async with open_consumer(url, name="a", shutdown_grace=60.0) as a:
        await a.mount(sub, handler)
        task_status.started()
        await stop.wait()
    done.set()


@pytest.mark.parametrize("mode", [Mode.RECLAIM, Mode.CLAIMING], ids=["reclaim", "claiming"])
async def test_the_give_back_leaves_an_entry_a_claiming_peer_took_during_the_stop(
    redis_url: str, client: Client, mode: Mode,
) -> None:
    """Consumer A (here) reads five entries; its one handler holds the first
    (concurrency 1), the other four wait unstarted.  A's stop begins: the
    lease of the four ends (none will start here); the handler holds on
    (keeping its own entry's lease by hand, with the library's owner-checked
    lease script: A is PLAIN, its lease renews every ``heartbeat / 3``, and
    B claims what is idle 1 s).  Peer B
    (a process, ``mode``, ``min_idle`` 1 s) claims the four (their count 2:
    a claim counts) and begins the first; B is then stopped (SIGSTOP) so
    nothing moves while A's handler lets go and A's give-back and hand-back
    run.  The four must still be B's at count 2 (before: A's plain ``XCLAIM
    ... 0 ... RETRYCOUNT 0`` took them back, count 0, and its stop made
    them idle for anyone).  B resumed handles each once, at attempt 2; A
    handled only the first."""
    ids = await _produce(client)
    holding, release, stop, a_done = trio.Event(), trio.Event(), trio.Event(), trio.Event()
    seen_a: list[tuple[str | None, int]] = []

    async def hold(d: Delivery) -> Outcome:
        seen_a.append((d.id, d.attempt))
        if d.id == ids[0]:
            holding.set()
            while not release.is_set():  # its lease, by hand: A (PLAIN) leases every 10 s,
                await client.evalsha(LEASE, (S,), (G, "a", ids[0]))  # B claims after 1 s
                with trio.move_on_after(0.1):
                    await release.wait()
        return ACK

    sub = StreamSubscription(S, G, block=0.05, count=10)
    with trio.fail_after(60):  # a bound
        async with trio.open_nursery() as nursery:
            await nursery.start(_consumer_a, redis_url, sub, hold, stop, a_done)
            await holding.wait()
            await eventually(lambda: _all_read(client), 10, "A read every entry")
            stop.set()  # A's stop begins: its reader (and the four's lease) ends
            async with child_lines(PROC, redis_url, S, G, "b", mode.value, "1.0", "1.0") as b:
                assert await b.read(lambda w: w == ["R"], 20), b.lines

                async def claimed() -> bool:
                    await b.read(lambda w: w[:1] == ["H"], 0.05)
                    owners = await _pending(client)
                    return (all(owners.get(i, ("",))[0] == "b" for i in ids[1:])
                            and bool(b.words("H")))

                await eventually(claimed, 20, lambda: f"B claimed the four ({b.lines})")
                os.kill(b.proc.pid, signal.SIGSTOP)
                release.set()  # A's handler returns: the give-back and the hand-back run
                with trio.fail_after(20):  # a bound
                    await a_done.wait()
                after_a = await _pending(client)
                os.kill(b.proc.pid, signal.SIGCONT)
                # each of the four is B's at count 2 (claimed once) and nothing else
                assert after_a == {i: ("b", 2) for i in ids[1:]}, after_a

                async def b_done() -> bool:
                    await b.read(None, 0.05)
                    return len(b.words("A")) >= N - 1 and not await _pending(client)

                await eventually(b_done, 30, lambda: f"B handled the four ({b.lines})")
                await b.read(None, 0.5)  # anything more B would do
    assert seen_a == [(ids[0], 1)], seen_a
    handled = sorted((w[1], w[2]) for w in b.words("H"))
    assert handled == sorted((i, "2") for i in ids[1:]), b.lines


async def test_a_handler_running_through_the_stop_keeps_its_entry_from_a_claiming_peer(
    redis_url: str, client: Client,
) -> None:
    """A (RECLAIM, ``min_idle`` 3 s: its lease renews every second) reads one
    entry; its handler runs on through A's stop (grace 60 s) for four times
    ``min_idle`` while peer B (a process, RECLAIM, ``min_idle`` 3 s) reads
    and claims.  The entry stays A's and B never starts it: A's lease
    (``Reader.holding``) runs until A's finalizer ends, past its reader.
    Before, the lease ended with the reader at the stop's first phase and B
    claimed the entry once idle 3 s, running its handler a second time beside
    A's."""
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    eid = (await client.execute("XADD", S, "*", "n", "0")).decode()
    holding, release, stop, a_done = trio.Event(), trio.Event(), trio.Event(), trio.Event()

    async def hold(d: Delivery) -> Outcome:
        holding.set()
        await release.wait()
        return ACK

    sub = StreamSubscription(S, G, mode=Mode.RECLAIM, min_idle=3.0, block=0.05)
    with trio.fail_after(60):  # a bound
        async with trio.open_nursery() as nursery:
            await nursery.start(_consumer_a, redis_url, sub, hold, stop, a_done)
            await holding.wait()
            stop.set()  # A's stop begins: its reader ends, its handler runs on
            async with child_lines(PROC, redis_url, S, G, "b", "reclaim", "3.0", "1.0") as b:
                assert await b.read(lambda w: w == ["R"], 20), b.lines
                end = trio.current_time() + 12.0  # B's claims look, four min_idles long
                while trio.current_time() < end:
                    await b.read(lambda w: w[:1] == ["H"], 0.2)
                    assert not b.words("H"), f"B started A's entry, its handler still running: {b.lines}"
                    assert (await _pending(client))[eid][0] == "a"
                release.set()
                with trio.fail_after(20):  # a bound
                    await a_done.wait()
                assert await _pending(client) == {}  # A's ACK
                await b.read(None, 0.5)
                assert not b.words("H"), b.lines


# -- faults at the give-back's own request ------------------------------------------------

FAULTS: dict[str, tuple[list[Fault], int]] = {
    # its reply lost (it ran: the counts are set back); the finalizer sends it
    # again, and the stop once more: both find the counts set back and leave them
    "lost": ([LOST], 1),
    # a silent link: the request never reaches the server; the finalizer's
    # deadline, then the stop's own give-back sets the counts back
    "blackhole": ([BLACKHOLE], 1),
    # refused (did not run): sent again, then it runs
    "oom": ([error("OOM")], 1),
    "readonly": ([error("READONLY")], 1),
    # every give-back refused, the finalizer's and the stop's: no count set
    # back, the entries stay pending, one attempt higher (the read counts);
    # the one case where a restart sees more than the attempt they had
    "oom-always": ([error("OOM")] * 40, 2),
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_fault_at_the_give_back_leaves_the_entries_pending_at_their_attempt(
    redis_server: RedisServer, redis_url: str, client: Client, monkeypatch: pytest.MonkeyPatch,
    flavour: str, fault: str,
) -> None:
    """A (through the command proxy) reads five entries, its one handler holds
    the first until the stop begins, the other four wait unstarted and are
    given back; the give-back's first request (``EVALSHA:stream_give_back``)
    meets ``fault``.  Nothing is lost: the four stay pending for A, and A
    started again (no fault) handles each once, at attempt 1 (2 where every
    give-back was refused, see FAULTS)."""
    finalize_timers(monkeypatch, grace=1.0, timeout=1.0)
    from trio_redis_finalize._core.stream.decode import GIVE_BACK

    faults, attempt = FAULTS[fault]
    ids = await _produce(client)
    await client.execute("SCRIPT", "LOAD", GIVE_BACK.source)  # the faulted request runs (no NOSCRIPT)
    holding, stopping = trio.Event(), trio.Event()
    seen: list[tuple[str | None, int]] = []

    async def hold(d: Delivery) -> Outcome:
        seen.append((d.id, d.attempt))
        if d.id == ids[0]:
            holding.set()
            await stopping.wait()
            await trio.sleep(0.05)  # the stop has begun: nothing new is started
        return ACK

    proxy = CommandProxy(redis_server.port, flavour=flavour)
    with trio.fail_after(60):  # a bound
        async with anyio.create_task_group() as tg:
            await tg.start(proxy.serve)
            async with open_consumer(proxy.url, name="a", shutdown_grace=5.0) as a:
                await a.mount(StreamSubscription(S, G, block=0.05, count=10), hold)
                await holding.wait()
                await eventually(lambda: _all_read(client), 10, "A read every entry")
                for k, f in enumerate(faults):
                    proxy.arm("EVALSHA:stream_give_back", f, at=k)
                stopping.set()
            fired = [(f.kind, f.fault.label) for f in proxy.fired]
            await proxy.cut_all()
            tg.cancel_scope.cancel()
        assert fired[:1] == [("EVALSHA:stream_give_back", faults[0].label)], fired
        left = await _pending(client)
        assert left == {i: ("a", attempt - 1) for i in ids[1:]}, (fired, left)

        # A started again, no fault: each of the four once, at its attempt
        rec = Recorder()
        async with open_consumer(redis_url, name="a") as a:
            await a.mount(StreamSubscription(S, G, block=0.05), rec)

            async def all_done() -> bool:
                return not await _pending(client)

            await eventually(all_done, 20, lambda: f"every entry handled ({rec.seen})")
    again = sorted((d.id, d.attempt) for d in rec.seen)
    assert seen == [(ids[0], 1)], seen
    assert again == [(i, attempt) for i in ids[1:]], (fired, again)


async def test_the_give_back_script_sets_back_only_what_is_still_as_handed(client: Client) -> None:
    """``GIVE_BACK`` on a real server: of four entries handed to ``me`` at count
    1, one is still so (set back to 0), one a peer claimed (left with it, its
    count as the claim set it), one was set back already (left: a resend),
    one was acknowledged (left: pending for nobody)."""
    from trio_redis_finalize._core.stream.decode import give_back

    ids = await _produce(client)
    await client.execute("XREADGROUP", "GROUP", G, "me", "COUNT", 4, "STREAMS", S, ">")
    await client.execute("XCLAIM", S, G, "peer", 0, ids[1], "JUSTID")  # count 1, the peer's
    await client.execute("XCLAIM", S, G, "me", 0, ids[2], "RETRYCOUNT", 0, "JUSTID")
    await client.execute("XACK", S, G, ids[3])
    p = give_back(S, G, "me", [(i, 1) for i in ids[:4]])
    assert p is not None
    replies = await client.pipeline(list(p.commands))
    assert replies == [[1, 0, 0, 0]], replies
    assert await _pending(client) == {ids[0]: ("me", 0), ids[1]: ("peer", 1), ids[2]: ("me", 0)}
    # sent again (a lost reply): nothing more changes
    assert await client.pipeline(list(p.commands)) == [[0, 0, 0, 0]]
    assert await _pending(client) == {ids[0]: ("me", 0), ids[1]: ("peer", 1), ids[2]: ("me", 0)}
