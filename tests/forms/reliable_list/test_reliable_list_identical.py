"""Reliable lists with identical elements and lost replies (issue 12, items 2, 5, 15).

Faults are real: :class:`LosingClient` is the package's transport client
that, once armed, lets one chosen command run on the server and then loses
its reply (``ConnectionError`` to the caller, the connection closed), on the
pool (finalizations) or on the reader's dedicated connection (``BLMOVE``).

* a resent finalization never removes another in-flight copy of the same
  bytes (``LPUSH q X X``, concurrency 2, the first ACK's reply lost);
* a copy stranded by a lost read is delivered again even when an identical
  element was handled before;
* a lost read is not an attempt (``max_attempts=1``); an element in the
  processing list at start still is (a previous process may have handled it);
* elements read but never started go back to the queue at shutdown, whatever
  the concurrency: none is left to be counted as a crash;
* bad input: a ``delay_key`` holding another type fails ``mount()`` naming key
  and type; a heartbeat too short to renew a lease is a ValueError.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from typing import Any

import pytest
import trio
from _procs import Hang, HoldFirst, Recorder, addr_of, eventually, mount_refused
from _rlist import NAME, Q, effects, lrange, proc, sub
from redis import exceptions as rexc

from trio_redis_finalize import (
    ACK,
    RETRY,
    Consumer,
    DelayedRetry,
    Delivery,
    ReliableListSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core.reliable_list.gates import ListGates
from trio_redis_finalize._core.reliable_list.liveness import bumped
from trio_redis_finalize._envelope import unwrap, wrap
from trio_redis_finalize._transport import Client, Command, Connection, parse_url


def _name(cmd: Command) -> bytes:
    head = cmd[0]
    return (head if isinstance(head, bytes) else str(head).encode()).upper()


Match = Callable[[Command], bool]


def removes_from(key: str) -> Match:
    """A command that removes an element from list ``key`` (LREM or a gated script)."""
    k = key.encode()

    def match(cmd: Command) -> bool:
        name = _name(cmd)
        if name == b"LREM":
            return str(cmd[1]).encode() == k or cmd[1] == k
        if name == b"EVALSHA":
            keys = [c if isinstance(c, bytes) else str(c).encode() for c in cmd[3 : 3 + int(cmd[2])]]
            return bool(keys) and keys[0] == k
        return False

    return match


class _LosingConnection:
    """A reader's connection whose next ``BLMOVE`` that moves an element loses its reply."""

    def __init__(self, owner: LosingClient, inner: Connection) -> None:
        self._owner = owner
        self._inner = inner

    @property
    def broken(self) -> bool:
        return self._inner.broken

    async def pipeline(self, commands: Sequence[Command], *, timeout: float | None = None) -> list[Any]:
        replies = await self._inner.pipeline(commands, timeout=timeout)
        owner = self._owner
        if owner.lose_reads and _name(commands[0]) == b"BLMOVE" and any(r is not None for r in replies):
            owner.lose_reads -= 1
            owner.lost_reads.append([r for r in replies if r is not None])
            await self._inner.aclose()
            raise rexc.ConnectionError("injected: BLMOVE ran, its reply was lost")
        if owner.lose_empty_reads and _name(commands[0]) == b"BLMOVE" and not any(replies):
            owner.lose_empty_reads -= 1  # nothing moved: nothing stranded, a reconnect
            await self._inner.aclose()
            raise rexc.ConnectionError("injected: an empty BLMOVE ran, its reply was lost")
        return replies

    async def execute(self, *args: Any, timeout: float | None = None) -> Any:
        reply = await self._inner.execute(*args, timeout=timeout)
        hold = self._owner.hold_lrange
        if hold is not None and _name(args) == b"LRANGE":
            self._owner.hold_lrange = None
            await hold()  # the LRANGE ran; its reply is read only now
        return reply

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _LosingConnection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class LosingClient(Client):
    """A transport client that loses the reply of chosen commands after they ran."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lose_reads = 0
        self.lost_reads: list[list[bytes]] = []
        self.lose_empty_reads = 0
        self.hold_lrange: Callable[[], Awaitable[None]] | None = None
        """Awaited once, after the reader's next ``LRANGE`` ran, before its reply is read."""
        self._match: Match | None = None
        self._times = 0
        self._every = 1
        self._hits = 0
        self.lost: list[tuple[Command, Any]] = []
        """(command, the reply Redis gave) for every reply lost on the pool."""

    def lose(self, match: Match, times: int = 1, every: int = 1) -> None:
        """Lose the reply of ``times`` pool commands that ``match``: of every
        ``every``-th one from now on (1: the next ``times``)."""
        self._match = match
        self._times = times
        self._every = every
        self._hits = 0

    async def pipeline(self, commands: Sequence[Command], *, raise_on_error: bool = True,
                       timeout: float | None = None) -> list[Any]:
        match = self._match
        hit = next((i for i, c in enumerate(commands) if match is not None and match(c)), None)
        if hit is not None and self._times:
            self._hits += 1
            if self._hits % self._every:
                hit = None
        if hit is None or not self._times:
            return await super().pipeline(commands, raise_on_error=raise_on_error, timeout=timeout)
        self._times -= 1
        replies = await super().pipeline(commands[: hit + 1], raise_on_error=False, timeout=timeout)
        self.lost.append((commands[hit], replies[hit]))
        raise rexc.ConnectionError(f"injected: {_name(commands[hit])!r} ran, its reply was lost")

    async def connect(self, **kwargs: Any) -> Any:
        return _LosingConnection(self, await super().connect(**kwargs))


def losing_client(url: str) -> AbstractAsyncContextManager[LosingClient]:
    return aclosing(LosingClient(parse_url(url), max_connections=32))


@asynccontextmanager
async def losing_consumer(url: str) -> AsyncIterator[tuple[LosingClient, Consumer]]:
    """Consumer ``c1`` over a :class:`LosingClient` (not armed yet)."""
    async with losing_client(url) as lc, open_consumer(lc, name="c1") as consumer:
        yield lc, consumer


async def left_behind(client: Client) -> tuple[list[bytes], list[bytes]]:
    """What ``c1``'s processing list and the queue still hold."""
    return await lrange(client, proc("c1")), await lrange(client, Q)


class TwoCopies:
    """``LPUSH q X X`` handled by two handlers at once: ``arrive`` records a
    delivery and returns its rank (1, 2, ...), the second one sets ``both``;
    ``consumer`` is set once the consumer is open."""

    def __init__(self) -> None:
        self.seen: list[Delivery] = []
        self.both = trio.Event()
        self.consumer: Consumer | None = None

    async def push(self, client: Client) -> None:
        await client.execute("LPUSH", Q, b"X", b"X")

    def arrive(self, d: Delivery) -> int:
        self.seen.append(d)
        if len(self.seen) == 2:
            self.both.set()
        return len(self.seen)

    def effects(self) -> dict[str, int]:
        assert self.consumer is not None
        return effects(self.consumer)

    def handler(self, first: Any, counted: str, what: str, second: Any) -> Callable[[Delivery], Any]:
        """The first X waits for the second and answers ``first``; the second
        waits until effect ``counted`` is 1 and answers ``second``; later ones ACK."""

        async def h(d: Delivery) -> Any:
            n = self.arrive(d)
            if n == 1:
                await self.both.wait()
                return first
            if n == 2:
                await eventually(lambda: self.effects().get(counted) == 1, what=what)
                return second
            return ACK

        return h

    @asynccontextmanager
    async def losing_removals(
        self, url: str, h: Callable[[Delivery], Any], subscription: ReliableListSubscription
    ) -> AsyncIterator[tuple[LosingClient, Consumer]]:
        """Consumer ``c1`` whose next removal from its processing list loses its
        reply, ``h`` mounted on ``subscription`` with two handlers."""
        async with losing_consumer(url) as (lc, consumer):
            self.consumer = consumer
            lc.lose(removes_from(proc("c1")))
            await consumer.mount(subscription, h, concurrency=2)
            yield lc, consumer


# -- item 2: identical elements ----------------------------------------------------------

async def test_resent_ack_never_removes_another_in_flight_copy(redis_url: str, client: Client) -> None:
    """``LPUSH q X X``, concurrency 2: the first ACK's reply is lost and it is sent
    again while the second X is still being handled; that one's RETRY then still
    makes its copy, which comes back at attempt 2."""
    two = TwoCopies()
    await two.push(client)

    h = two.handler(ACK, "acked", "first ACK, resent", RETRY)

    async with two.losing_removals(redis_url, h, sub()) as (lc, consumer):
        await eventually(lambda: len(two.seen) >= 3 and effects(consumer).get("acked") == 2,
                         what="the retried X handled again")
        assert lc.lost, "the fault must have fired"
    assert [(d.data, d.attempt) for d in two.seen] == [(b"X", 1), (b"X", 1), (b"X", 2)]
    assert await left_behind(client) == ([], [])


async def test_resent_retry_of_one_copy_keeps_the_other(redis_url: str, client: Client) -> None:
    """The same with the copy script: the first X's RETRY reply is lost and resent
    while the second X is being handled; each X makes exactly one copy."""
    two = TwoCopies()
    await two.push(client)

    h = two.handler(RETRY, "copied", "first RETRY", RETRY)

    async with two.losing_removals(redis_url, h, sub()) as (lc, consumer):
        await eventually(lambda: effects(consumer).get("acked") == 2, what="both copies acked")
        await trio.sleep(0.2)
        assert lc.lost
    assert sorted((d.data, d.attempt) for d in two.seen) == [(b"X", 1), (b"X", 1), (b"X", 2), (b"X", 2)]
    assert await left_behind(client) == ([], [])


async def test_resent_dead_letter_keeps_the_other_copy(redis_url: str, client: Client) -> None:
    """max_attempts=1: the first X's RETRY goes to the dead letter; that reply is
    lost and resent while the second X is handled: two dead letters, no loss."""
    two = TwoCopies()
    await two.push(client)

    async def h(d: Delivery) -> Any:
        if two.arrive(d) == 2:
            await eventually(lambda: two.effects().get("dead_lettered") == 1, what="first dead")
        else:
            await two.both.wait()
        return RETRY

    async with two.losing_removals(redis_url, h, sub(max_attempts=1, dead_letter="dead")) as (lc, consumer):
        await eventually(lambda: effects(consumer).get("dead_lettered") == 2, what="two dead letters")
        await eventually(lambda: _llen(client, "dead", 2), what="two elements in the dead letter")
        assert lc.lost
    assert [d.attempt for d in two.seen] == [1, 1]
    assert await left_behind(client) == ([], [])


async def _llen(client: Client, key: str, n: int) -> bool:
    return int(await client.execute("LLEN", key)) == n


async def test_a_rescan_racing_a_removal_does_not_deliver_the_element_again(
    redis_url: str, client: Client
) -> None:
    """A rescan's ``LRANGE`` runs while X is being handled, and X's ACK is answered
    before the ``LRANGE``'s reply is read: X is in the reply but no longer held.
    It was finalized, not stranded: it is not delivered again (it was, under
    load: the flaky test above handled a copy twice), nor by the recheck later."""
    await client.execute("LPUSH", Q, b"X")
    seen: list[Delivery] = []
    handling, lrange_ran = trio.Event(), trio.Event()
    box: list[Consumer] = []

    async def h(d: Delivery) -> Any:
        seen.append(d)
        handling.set()
        await lrange_ran.wait()
        return ACK

    async def hold() -> None:
        lrange_ran.set()
        await eventually(lambda: effects(box[0]).get("acked") == 1, what="X acked meanwhile")

    async with losing_consumer(redis_url) as (lc, consumer):
        box.append(consumer)
        await consumer.mount(sub(), h)
        await handling.wait()
        lc.hold_lrange = hold
        lc.lose_empty_reads = 1  # the reader reconnects: a rescan, X still in hand
        await eventually(lambda: lc.hold_lrange is None and lrange_ran.is_set(), what="the rescan")
        await trio.sleep(1.5)  # past the recheck (_RECHECK)
        assert effects(consumer).get("acked") == 1
    assert [(d.data, d.attempt) for d in seen] == [(b"X", 1)]
    assert await left_behind(client) == ([], [])


async def test_copy_stranded_after_an_identical_one_was_handled_is_delivered(
    redis_url: str, client: Client
) -> None:
    """X is handled and acknowledged; a second X's BLMOVE reply is lost: that X,
    stranded in the processing list, is delivered after the read error (not
    mistaken for the first one)."""
    h = Recorder(lambda d: ACK)
    async with losing_consumer(redis_url) as (lc, consumer):
        await consumer.mount(sub(), h)
        await client.execute("LPUSH", Q, b"X")
        await eventually(lambda: effects(consumer).get("acked") == 1, what="first X acked")
        lc.lose_reads = 1
        await client.execute("LPUSH", Q, b"X")
        await eventually(lambda: lc.lost_reads, what="the read reply lost")
        await eventually(lambda: effects(consumer).get("acked") == 2, what="stranded X acked")
    assert [(d.data, d.attempt) for d in h.seen] == [(b"X", 1), (b"X", 1)]
    assert await left_behind(client) == ([], [])


async def test_stranded_copy_beside_one_in_flight_is_delivered(redis_url: str, client: Client) -> None:
    """One X is being handled when a second X's read reply is lost: the second is
    delivered too (once), the first is not delivered a second time."""
    h = HoldFirst()
    seen = h.seen
    async with losing_consumer(redis_url) as (lc, consumer):
        await consumer.mount(sub(), h, concurrency=2)
        await client.execute("LPUSH", Q, b"X")
        await eventually(lambda: len(seen) == 1, what="first X in its handler")
        lc.lose_reads = 1
        await client.execute("LPUSH", Q, b"X")
        await eventually(lambda: len(seen) == 2, what="stranded X delivered")
        h.release.set()
        await eventually(lambda: effects(consumer).get("acked") == 2, what="both acked")
        await trio.sleep(0.3)
    assert [(d.data, d.attempt) for d in seen] == [(b"X", 1), (b"X", 1)]
    assert await left_behind(client) == ([], [])


# -- item 5: attempts are handler calls --------------------------------------------------

async def test_a_lost_read_is_not_an_attempt(redis_url: str, client: Client) -> None:
    """max_attempts=1 and one lost BLMOVE reply: the element is still handled
    (attempt 1), not dead-lettered unhandled."""
    h = Recorder(lambda d: ACK)
    async with losing_consumer(redis_url) as (lc, consumer):
        lc.lose_reads = 1
        await consumer.mount(sub(max_attempts=1, dead_letter="dead"), h)
        await client.execute("LPUSH", Q, b"once")
        await eventually(lambda: effects(consumer).get("acked") == 1
                         or effects(consumer).get("dead_lettered") == 1, what="finalized")
        assert lc.lost_reads == [[b"once"]]
    assert [(d.data, d.attempt) for d in h.seen] == [(b"once", 1)]
    assert await lrange(client, "dead") == []
    assert await lrange(client, proc("c1")) == []


async def test_lost_read_of_a_retried_copy_keeps_its_attempt(redis_url: str, client: Client) -> None:
    """A copy at attempt 2 whose read reply is lost arrives at attempt 2."""
    h = Recorder(lambda d: ACK)
    async with losing_consumer(redis_url) as (lc, consumer):
        lc.lose_reads = 1
        await consumer.mount(sub(max_attempts=2), h)
        await client.execute("LPUSH", Q, wrap(b"copy", 1, "o-1"))
        await eventually(lambda: effects(consumer).get("acked") == 1, what="acked")
    assert [(d.data, d.attempt, d.origin_id) for d in h.seen] == [(b"copy", 2, "o-1")]


async def test_in_the_processing_list_at_start_still_counts(redis_url: str, client: Client) -> None:
    """What the processing list holds at start may have been handled by the
    previous process: it is an attempt (max_attempts=1: dead-lettered unhandled)."""
    await client.execute("LPUSH", proc("c1"), b"was-handled")
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(max_attempts=1, dead_letter="dead"), h)
        await eventually(lambda: effects(consumer).get("dead_lettered") == 1, what="dead letter")
    assert h.seen == []
    (dead,) = await lrange(client, "dead")
    assert unwrap(dead)[:2] == (b"was-handled", 1)


async def test_read_errors_during_a_handler_are_not_attempts_a_crash_is(
    redis_url: str, client: Client
) -> None:
    """Three read errors (rescans) while X is being handled bump nothing; X left
    unfinished at shutdown (as after a crash) arrives at attempt 2 on restart."""
    await client.execute("LPUSH", Q, b"X")
    hang = Hang()
    async with open_consumer(redis_url, name="c1", shutdown_grace=0.1) as consumer:
        await consumer.mount(sub(), hang)
        await hang.started.wait()
        for i in range(3):
            await client.execute("CLIENT", "KILL", "ADDR", await addr_of(client, "trf:c1:reader"))
            await eventually(lambda i=i: consumer.stats()[NAME]["read_errors"] > i, what="read error")
            await eventually(lambda: _reader_back(client), what="reader reconnected")
        assert await lrange(client, proc("c1")) == [b"X"]  # not rewritten by a bump
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(max_attempts=2), h)
        await eventually(lambda: effects(consumer).get("acked") == 1, what="recovered and acked")
    assert [(d.data, d.attempt) for d in h.seen] == [(b"X", 2)]


async def _reader_back(client: Client) -> bool:
    try:
        await addr_of(client, "trf:c1:reader")
    except AssertionError:
        return False
    return True


async def test_unstarted_elements_go_back_at_shutdown_with_concurrency(
    redis_url: str, client: Client
) -> None:
    """Two handlers hang past shutdown_grace while the reader waits to hand over
    its next batch: every element no handler started goes back to the queue
    uncounted (none stays in the processing list to be counted as a crash);
    the two cut ones go back at the stop, counted."""
    elements = [f"e{i}".encode() for i in range(10)]
    await client.execute("LPUSH", Q, *elements)
    started: list[bytes] = []

    async def hang(d: Delivery) -> Any:
        assert d.data is not None
        started.append(d.data)
        await trio.sleep_forever()

    async with open_consumer(redis_url, name="c1", shutdown_grace=0.2) as consumer:
        await consumer.mount(sub(), hang, concurrency=2)
        await eventually(lambda: len(started) == 2, what="two handlers busy")
        await trio.sleep(0.3)  # the reader reads on and waits to hand over
    # the two cut ones are handed back at the stop too, counted (bumped)
    assert await lrange(client, proc("c1")) == []
    back = await lrange(client, Q)
    assert sorted(back) == sorted((set(elements) - set(started)) | {bumped(e) for e in started})
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), h)
        await eventually(lambda: effects(consumer).get("acked") == 10, what="all acked")
    attempts = {d.data: d.attempt for d in h.seen}
    assert all(attempts[e] == (2 if e in started else 1) for e in elements)


# -- item 15: bad input --------------------------------------------------------------------

async def test_delay_key_of_the_wrong_type_fails_mount_naming_key_and_type(
    redis_url: str, client: Client
) -> None:
    await client.execute("SET", f"{{{Q}}}:delayed", "x")
    async with open_consumer(redis_url, name="c1") as consumer:
        message = await mount_refused(consumer, sub(delayed_retry=DelayedRetry.DURABLE_ZSET))
    assert repr(f"{{{Q}}}:delayed") in message and "string" in message


async def test_dead_letter_of_the_wrong_type_fails_mount_naming_key_and_type(
    redis_url: str, client: Client
) -> None:
    await client.execute("HSET", "dead", "f", "v")
    async with open_consumer(redis_url, name="c1") as consumer:
        message = await mount_refused(consumer, sub(max_attempts=2, dead_letter="dead"))
    assert repr("dead") in message and "hash" in message


@pytest.mark.parametrize("heartbeat", [0.009, 0.001, 1e-9])
def test_heartbeat_too_short_for_a_lease_names_the_parameter(heartbeat: float) -> None:
    with pytest.raises(ValueError, match="heartbeat"):
        ReliableListSubscription(Q, heartbeat=heartbeat)


def test_smallest_heartbeat_is_accepted() -> None:
    assert ReliableListSubscription(Q, heartbeat=0.01).heartbeat == 0.01


def test_dead_letter_equal_to_the_delay_key_names_the_parameter() -> None:
    with pytest.raises(ValueError, match="dead_letter"):
        ReliableListSubscription(Q, delayed_retry=DelayedRetry.DURABLE_ZSET, max_attempts=2,
                                 dead_letter=f"{{{Q}}}:delayed")
    with pytest.raises(ValueError, match="dead_letter"):
        ReliableListSubscription(Q, delayed_retry=DelayedRetry.DURABLE_ZSET, delay_key="d",
                                 max_attempts=2, dead_letter="d")


# -- held runtime delays beside identical copies -------------------------------------------

async def test_runtime_retry_after_beside_an_identical_copy(redis_url: str, client: Client) -> None:
    """One X waits in memory (runtime retry_after), the other is acknowledged
    with its reply lost and resent: the waiting X still makes its copy."""
    two = TwoCopies()
    await two.push(client)

    h = two.handler(retry_after(0.5), "held", "first held", ACK)

    async with losing_consumer(redis_url) as (lc, consumer):
        two.consumer = consumer
        await consumer.mount(sub(), h, concurrency=2)
        lc.lose(lambda c: _name(c) == b"LREM" or removes_from(proc("c1"))(c))
        await eventually(lambda: effects(consumer).get("acked") == 2, what="ack + delayed copy acked")
        assert lc.lost
    assert [(d.data, d.attempt) for d in two.seen] == [(b"X", 1), (b"X", 1), (b"X", 2)]
    assert await left_behind(client) == ([], [])


async def test_identical_element_after_a_runtime_retry_after_is_acked(
    redis_url: str, client: Client
) -> None:
    """X waits in memory (runtime retry_after), its copy comes back and is acked;
    then a new X arrives: its ACK removes it (the waiting X is no longer
    counted as held once its copy was sent)."""
    await client.execute("LPUSH", Q, b"X")
    h = Recorder(lambda d: retry_after(0.1) if d.attempt == 1 and len(h.seen) == 1 else ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), h)
        await eventually(lambda: effects(consumer).get("acked") == 1, what="delayed copy acked")
        await trio.sleep(0.7)
        await client.execute("LPUSH", Q, b"X")
        await eventually(lambda: effects(consumer).get("acked") == 2, what="second X acked")
        await eventually(lambda: _llen(client, proc("c1"), 0), what="processing list empty")
    assert [(d.data, d.attempt) for d in h.seen] == [(b"X", 1), (b"X", 2), (b"X", 1)]


async def test_many_identical_elements_with_lost_finalization_replies(
    redis_url: str, client: Client
) -> None:
    """20 identical elements, 4 handlers, RETRY or ACK, every second removal's
    reply lost (and resent): each of the 20 is acknowledged exactly once in
    the end, nothing is left behind, nothing is delivered more than needed."""
    n = 20
    await client.execute("LPUSH", Q, *([b"X"] * n))
    outcomes: list[tuple[int, str]] = []
    flip = [False]

    async def h(d: Delivery) -> Any:
        await trio.sleep(0.01)
        flip[0] = not flip[0]
        if d.attempt == 1 and flip[0]:
            outcomes.append((d.attempt, "retry"))
            return RETRY
        outcomes.append((d.attempt, "ack"))
        return ACK

    async with losing_consumer(redis_url) as (lc, consumer):
        lc.lose(removes_from(proc("c1")), times=20, every=2)
        await consumer.mount(sub(), h, concurrency=4)
        await eventually(lambda: sum(1 for _, o in outcomes if o == "ack") >= n, timeout=20,
                         what="all acknowledged")
        await trio.sleep(0.5)
        assert lc.lost
    retries = sum(1 for _, o in outcomes if o == "retry")
    assert sum(1 for _, o in outcomes if o == "ack") == n
    assert len(outcomes) == n + retries  # every RETRY came back once, nothing else twice
    assert await left_behind(client) == ([], [])


# -- the hot path's counted gates, taken in C (issue 25) -----------------------------------------


def _gates_with(held: dict[bytes, int]) -> ListGates:
    """A consumer's gates holding ``held`` (none of their removals sent yet)."""
    g = ListGates()
    g.target = sub().target("c1")
    g.unsent.update(held)
    g.in_hand.update(held)
    return g


def _lrems(*elements: bytes) -> list[Command]:
    return [("LREM", proc("c1"), -1, e) for e in elements]


@pytest.mark.parametrize("batch", [
    [b"a", b"b", b"c"],  # unique: the commands as they are
    [b"a", b"X", b"b", b"X", b"X"],  # three copies of X in one batch
    [b"X", b"a"],  # one of three copies of X held
    [b"gone", b"a"],  # an element not held (n 0)
])
def test_prepare_and_settle_in_c_number_as_one_by_one(batch: list[bytes]) -> None:
    """The hot path's removals taken out of the counts at once (``fast``,
    ``hot``) leave the same commands and counts as one by one (``fast=0``,
    ``hot=False``): identical elements are put back and numbered."""
    held = {b"a": 1, b"b": 1, b"c": 1, b"X": 3}
    one, fast = _gates_with(held), _gates_with(held)
    slow_cmds = one.prepare(_lrems(*batch))
    fast_cmds = fast.prepare(_lrems(*batch), len(batch))
    assert fast_cmds == slow_cmds and fast.unsent == one.unsent
    if batch.count(b"X") == 3:  # gated on 3, 2, 1 copies, in order
        counted = [c for c in fast_cmds if c[0] == b"EVALSHA"]
        assert [c[-1] for c in counted] == [3, 2] and fast_cmds[-1][0] == "LREM"
    replies = [1] * len(batch)
    one.settle([], slow_cmds, replies)
    fast.settle([], fast_cmds, replies, True)
    assert fast.in_hand == one.in_hand and fast.leftover == one.leftover


def test_settle_in_c_with_a_removal_that_removed_nothing_settles_one_by_one() -> None:
    """A hot batch whose replies are not all 1 (a closed gate, an error
    reply) is settled one by one: the error leaves a copy to look for."""
    held = {b"a": 1, b"b": 1}
    one, fast = _gates_with(held), _gates_with(held)
    cmds = fast.prepare(_lrems(b"a", b"b"), 2)
    one.prepare(_lrems(b"a", b"b"))
    replies: list[object] = [rexc.ResponseError("OOM"), 1]
    one.settle([], cmds, replies)
    fast.settle([], cmds, replies, True)
    assert fast.in_hand == one.in_hand == {}
    assert fast.leftover == one.leftover == {b"a": 1}


async def test_identical_elements_among_unique_ones_in_fast_batches(
    redis_url: str, client: Client
) -> None:
    """Copies of X among unique elements, no-op handlers (big batches: the
    hot path's removals counted in C), every third removal's reply lost and
    resent: each element is delivered and removed once, nothing left.

    A resent removal of X while the reader's read of another X is on its way
    removes that X (counting cannot tell it from the one its first send
    removed, see ``ReliableListReader``): the read X is handled all the same
    and its own removal is counted ``gate_closed``, at most once per lost
    removal of X (seen in CI with two burners)."""
    elements = [b"X" if i % 7 == 0 else f"u{i}".encode() for i in range(200)]
    await client.execute("LPUSH", Q, *elements)
    seen: list[bytes] = []

    async def h(d: Delivery) -> Any:
        assert d.data is not None
        seen.append(d.data)
        return ACK

    async with losing_consumer(redis_url) as (lc, consumer):
        lc.lose(removes_from(proc("c1")), times=10, every=3)
        await consumer.mount(sub(), h, concurrency=2)
        def done() -> int:
            e = effects(consumer)
            return int(e.get("acked", 0) + e.get("gate_closed", 0))

        await eventually(lambda: done() >= len(elements), timeout=20, what="all removed")
        await trio.sleep(0.3)
        assert lc.lost
        assert done() == len(elements)
        lost_x = sum(1 for cmd, _ in lc.lost if b"X" in cmd)
        assert effects(consumer).get("gate_closed", 0) <= lost_x, (effects(consumer), lc.lost)
    assert sorted(seen) == sorted(elements)  # each delivered (and handled) once
    assert await left_behind(client) == ([], [])
