"""The mount's work queue, under trio's MockClock (no wall-clock waits).

``autojump_clock`` (pytest-trio) is ``MockClock(autojump_threshold=0)``: the
clock jumps to the next deadline as soon as every task is blocked, so a
handler that "takes 10 s" takes no real time and a start time shows which
deliveries ran side by side.  ``trio.testing.wait_all_tasks_blocked()`` lets
every task run until it blocks (it wins over the autojump).  Wake-ups are
counted with a trio instrument (``task_scheduled``): that is what "wakes
exactly one task" means, whatever the tasks do once awake.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_redis_finalize._hand_over import Lease, WorkQueue

TIMEOUT = 100.0  # mock seconds: a test that hangs fails at once (the clock jumps)


class Wakeups(trio.abc.Instrument):
    """Counts how often each watched task was made runnable."""

    def __init__(self, tasks: Iterable[trio.lowlevel.Task]) -> None:
        self.watched = set(tasks)
        self.count: Counter[trio.lowlevel.Task] = Counter()

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if task in self.watched:
            self.count[task] += 1

    def woken(self) -> int:
        """How many distinct watched tasks were woken."""
        return len(self.count)


@asynccontextmanager
async def bounded_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery, all of it within ``TIMEOUT``."""
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            yield nursery


async def start_idle_task(q: WorkQueue, nursery: trio.Nursery,
                          woken: list[str] | None = None) -> trio.CancelScope:
    """A task idle in ``q.wait()`` (once all tasks blocked), in the cancel scope
    returned; it appends "a" to ``woken`` if it ever gets past the wait."""
    scope = trio.CancelScope()

    async def task_a() -> None:
        with scope:
            await q.wait()
            if woken is not None:
                woken.append("a")

    nursery.start_soon(task_a)
    await trio.testing.wait_all_tasks_blocked()
    return scope


class Workers:
    """Handler tasks shaped like the mount's ``_handler_loop``: take, else wait.

    ``duration(item)``: mock seconds a delivery's handler takes (0: it never
    blocks).  ``done`` records (worker, item, start time) in start order.
    """

    def __init__(self, queue: Any, duration: Callable[[Any], float] = lambda item: 0.0) -> None:
        self.queue = queue
        self.duration = duration
        self.done: list[tuple[int, Any, float]] = []
        self.tasks: list[trio.lowlevel.Task] = []
        self.waiting: set[int] = set()  # workers blocked in queue.wait()
        self.ended: set[int] = set()

    async def run(self, n: int, nursery: trio.Nursery) -> None:
        for i in range(n):
            nursery.start_soon(self._loop, i)
        await trio.testing.wait_all_tasks_blocked()
        assert self.waiting == set(range(n))

    async def _loop(self, i: int) -> None:
        self.tasks.append(trio.lowlevel.current_task())
        queue = self.queue
        while True:
            d = queue.take()
            if d is None:
                self.waiting.add(i)
                try:
                    more = await queue.wait()
                finally:
                    self.waiting.discard(i)
                if not more:
                    self.ended.add(i)
                    return
                continue
            self.done.append((i, d, trio.current_time()))
            seconds = self.duration(d)
            if seconds:
                await trio.sleep(seconds)

    def by_worker(self) -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {}
        for i, d, _ in self.done:
            out.setdefault(i, []).append(d)
        return out


# -- put ---------------------------------------------------------------------


async def test_put_waits_until_the_queue_is_empty(autojump_clock: trio.abc.Clock) -> None:
    q = WorkQueue(Lease())
    with trio.fail_after(TIMEOUT):
        await q.put(["a", "b"])  # empty: at once
        put_done = trio.Event()

        async def producer() -> None:
            await q.put(["c"])
            put_done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer)
            await trio.sleep(5)  # whatever the time, it waits for room
            assert not put_done.is_set()
            assert list(q.items) == ["a", "b"]
            assert q.take() == "a"
            await trio.testing.wait_all_tasks_blocked()
            assert not put_done.is_set()  # not empty yet
            assert q.take() == "b"
            await put_done.wait()
        assert list(q.items) == ["c"]


async def test_a_cancelled_put_hands_over_nothing(autojump_clock: trio.abc.Clock) -> None:
    q = WorkQueue(Lease())
    with trio.fail_after(TIMEOUT):
        await q.put(["a"])
        with trio.move_on_after(3) as scope:
            await q.put(["b1", "b2", "b3"])
        assert scope.cancelled_caught
        assert list(q.items) == ["a"]  # none of the batch
        assert q.take() == "a"
        assert q.take() is None  # and it does not turn up later
        await trio.testing.wait_all_tasks_blocked()
        assert not q.items
        await q.put(["c"])  # the room event is not left stale
        assert list(q.items) == ["c"]


async def test_waiting_producers_take_turns_whole_batches(autojump_clock: trio.abc.Clock) -> None:
    """Two producers wait for room; one batch goes in whole, the other waits again."""
    q = WorkQueue(Lease())
    landed: list[str] = []
    with trio.fail_after(TIMEOUT):
        await q.put(["x"])

        async def producer(name: str, batch: list[str]) -> None:
            await q.put(batch)
            landed.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer, "p", ["p1", "p2"])
            nursery.start_soon(producer, "r", ["r1"])
            await trio.testing.wait_all_tasks_blocked()
            assert q.take() == "x"
            await trio.testing.wait_all_tasks_blocked()
            assert len(landed) == 1
            first = list(q.items)
            assert first in (["p1", "p2"], ["r1"])  # never mixed
            while q.take() is not None:
                pass
            await trio.testing.wait_all_tasks_blocked()
            assert len(landed) == 2
            second = list(q.items)
        assert sorted(first + second) == ["p1", "p2", "r1"]


async def test_cancelling_one_waiting_producer_leaves_the_other_waiting(
    autojump_clock: trio.abc.Clock,
) -> None:
    q = WorkQueue(Lease())
    with trio.fail_after(TIMEOUT):
        await q.put(["x"])
        async with trio.open_nursery() as nursery:
            cancelled = trio.CancelScope()

            async def doomed() -> None:
                with cancelled:
                    await q.put(["never"])

            nursery.start_soon(doomed)
            nursery.start_soon(q.put, ["kept"])
            await trio.testing.wait_all_tasks_blocked()
            cancelled.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert q.take() == "x"
        assert list(q.items) == ["kept"]


# -- take / wait: one wake-up at a time ---------------------------------------


async def test_put_wakes_exactly_one_idle_task(autojump_clock: trio.abc.Clock) -> None:
    q = WorkQueue(Lease())
    w = Workers(q)
    async with bounded_nursery() as nursery:
        await w.run(5, nursery)
        wakeups = Wakeups(w.tasks)
        trio.lowlevel.add_instrument(wakeups)
        try:
            await q.put(["a"])
            await trio.testing.wait_all_tasks_blocked()
        finally:
            trio.lowlevel.remove_instrument(wakeups)
        assert wakeups.woken() == 1  # not a thundering herd
        assert [d for _, d, _ in w.done] == ["a"]
        assert len(w.waiting) == 5  # back to waiting
        q.close()


async def test_a_handler_that_never_blocks_drains_the_batch_alone(autojump_clock: trio.abc.Clock) -> None:
    """It takes every delivery; one other task is woken (in vain), not all of them."""
    q = WorkQueue(Lease())
    w = Workers(q)  # handlers that never block
    async with bounded_nursery() as nursery:
        await w.run(5, nursery)
        wakeups = Wakeups(w.tasks)
        trio.lowlevel.add_instrument(wakeups)
        try:
            await q.put(list(range(10)))
            await trio.testing.wait_all_tasks_blocked()
        finally:
            trio.lowlevel.remove_instrument(wakeups)
        by_worker = w.by_worker()
        assert list(by_worker.values()) == [list(range(10))]
        assert wakeups.woken() == 2
        assert len(w.waiting) == 5
        q.close()


async def test_slow_deliveries_spread_over_the_tasks_one_by_one(autojump_clock: trio.abc.Clock) -> None:
    """Each slow delivery starts at once on a task of its own while tasks are idle;
    the rest wait for the first task to finish, none behind a busy task."""
    q = WorkQueue(Lease())
    w = Workers(q, duration=lambda item: 10.0)
    async with bounded_nursery() as nursery:
        await w.run(3, nursery)
        t0 = trio.current_time()
        await q.put(["a", "b", "c", "d", "e"])
        await trio.testing.wait_all_tasks_blocked()
        started = [(d, round(t - t0, 6)) for _, d, t in w.done]
        assert started == [("a", 0), ("b", 0), ("c", 0)]
        assert len({i for i, _, _ in w.done}) == 3  # three tasks, one each
        assert list(q.items) == ["d", "e"]
        while len(w.done) < 5:
            await trio.sleep(1)
        q.close()
    started = sorted((d, round(t - t0, 6)) for _, d, t in w.done)
    assert started == [("a", 0), ("b", 0), ("c", 0), ("d", 10), ("e", 10)]
    assert sorted(d for _, d, _ in w.done) == ["a", "b", "c", "d", "e"]


async def test_a_task_cancelled_after_being_woken_passes_the_wakeup_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The woken task is cancelled before it runs: the next idle task takes the work."""
    q = WorkQueue(Lease())
    woken_first: list[str] = []
    async with bounded_nursery() as nursery:
        scope_a = await start_idle_task(q, nursery, woken_first)  # a is the first idle task
        w = Workers(q)
        await w.run(2, nursery)
        # Cancel a while it waits (it is rescheduled with Cancelled but has
        # not run), then put: the put's wake-up goes to a's event.
        scope_a.cancel()
        await q.put(["x"])
        await trio.testing.wait_all_tasks_blocked()
        assert scope_a.cancelled_caught
        assert not woken_first
        assert [d for _, d, _ in w.done] == ["x"]  # passed on, not lost
        assert not q.items
        # and the counting is right afterwards: one more put, one more taker
        await q.put(["y"])
        await trio.testing.wait_all_tasks_blocked()
        assert [d for _, d, _ in w.done] == ["x", "y"]
        q.close()


async def test_a_cancelled_idle_task_leaves_the_idle_list(autojump_clock: trio.abc.Clock) -> None:
    q = WorkQueue(Lease())
    async with bounded_nursery() as nursery:
        scope_a = await start_idle_task(q, nursery)
        w = Workers(q)
        await w.run(1, nursery)
        scope_a.cancel()
        await trio.testing.wait_all_tasks_blocked()  # a is gone
        await q.put(["x"])  # its wake-up must not go to a's dead event
        await trio.testing.wait_all_tasks_blocked()
        assert [d for _, d, _ in w.done] == ["x"]
        q.close()


# -- close / drain --------------------------------------------------------------


async def test_close_wakes_every_waiter_and_they_end(autojump_clock: trio.abc.Clock) -> None:
    q = WorkQueue(Lease())
    w = Workers(q)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await w.run(4, nursery)
            q.close()
        assert q.closed
        assert w.ended == {0, 1, 2, 3}
        assert await q.wait() is False  # closed and empty: at once, every time
        assert await q.wait() is False


async def test_after_close_the_queued_deliveries_are_still_handled(autojump_clock: trio.abc.Clock) -> None:
    q = WorkQueue(Lease())
    w = Workers(q, duration=lambda item: 1.0)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await w.run(2, nursery)
            await q.put(["a", "b", "c"])
            q.close()
            assert await q.wait() is True  # closed but not empty
        assert sorted(d for _, d, _ in w.done) == ["a", "b", "c"]
        assert w.ended == {0, 1}
        assert await q.wait() is False


async def test_drain_returns_the_unstarted_deliveries_and_frees_a_waiting_put(
    autojump_clock: trio.abc.Clock,
) -> None:
    q = WorkQueue(Lease())
    with trio.fail_after(TIMEOUT):
        assert q.drain() == []
        await q.put(["a", "b", "c"])
        assert q.take() == "a"  # started
        async with trio.open_nursery() as nursery:
            nursery.start_soon(q.put, ["d"])
            await trio.testing.wait_all_tasks_blocked()
            assert q.drain() == ["b", "c"]
        assert list(q.items) == ["d"]
        assert q.drain() == ["d"]
        assert not q.items


# -- property: N tasks, random puts, takes and close ---------------------------


class WorkConserving(trio.abc.Instrument):
    """Checks, whenever every task is blocked, that no handler task waits idle
    while deliveries wait in the queue (a lost wake-up would show here)."""

    def __init__(self, queue: Any, workers: Workers) -> None:
        self.queue = queue
        self.workers = workers
        self.violations: list[tuple[float, list[Any], set[int]]] = []

    def before_io_wait(self, timeout: float) -> None:
        if trio.lowlevel.current_statistics().tasks_runnable:
            return
        if self.queue.items and self.workers.waiting:
            self.violations.append(
                (trio.current_time(), list(self.queue.items), set(self.workers.waiting)))


batches = st.lists(
    st.tuples(
        st.integers(0, 2),  # producer
        st.floats(0, 3, allow_nan=False),  # pause before the put
        st.lists(st.sampled_from([0.0, 0.0, 0.5, 2.0, 7.0]), min_size=1, max_size=6),  # durations
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None, report_multiple_bugs=False,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    n_workers=st.integers(1, 5),
    plan=batches,
    close_early=st.booleans(),
    cancel_at=st.none() | st.floats(0, 20, allow_nan=False),
)
def test_no_delivery_is_lost_or_duplicated(
    n_workers: int,
    plan: list[tuple[int, float, list[float]]],
    close_early: bool,
    cancel_at: float | None,
) -> None:
    """Producers put batches at random times, N tasks take with random handler
    durations, the queue is closed when the producers are done (or at once,
    from a producer's point of view, after its last put).  Optionally one extra
    idle-waiting task is cancelled at a random time.  Every delivery put is
    handled exactly once, the tasks all end, the queue never idles a task while
    work waits."""
    durations: dict[tuple[int, int], float] = {}
    for b, (_, _, ds) in enumerate(plan):
        for k, dur in enumerate(ds):
            durations[(b, k)] = dur

    async def main() -> None:
        q = WorkQueue(Lease())
        w = Workers(q, duration=lambda item: durations[item])
        check = WorkConserving(q, w)
        trio.lowlevel.add_instrument(check)
        # every delivery one after another, with every pause: a bound in mock time
        bound = sum(pause for _, pause, _ in plan) + sum(durations.values()) + 30
        with trio.fail_after(bound):
            async with trio.open_nursery() as nursery:
                await w.run(n_workers, nursery)

                async def stray() -> None:  # an extra waiter, cancelled while it waits
                    with trio.move_on_after(cancel_at or 0):
                        while await q.wait():
                            d = q.take()
                            if d is not None:
                                w.done.append((-1, d, trio.current_time()))
                                await trio.sleep(durations[d])

                if cancel_at is not None:
                    nursery.start_soon(stray)

                async def producer(p: int) -> None:
                    for b, (owner, pause, ds) in enumerate(plan):
                        if owner == p:
                            await trio.sleep(pause)
                            await q.put([(b, k) for k in range(len(ds))])

                async with trio.open_nursery() as producers:
                    for p in range(3):
                        producers.start_soon(producer, p)
                if not close_early:
                    while q.items:
                        await trio.sleep(1)
                q.close()
        trio.lowlevel.remove_instrument(check)
        handled = [d for _, d, _ in w.done]
        assert sorted(handled) == sorted(durations)  # none lost, none twice
        assert w.ended == set(range(n_workers))
        assert not q.items
        assert check.violations == []

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("n_workers", [1, 4])
async def test_a_long_run_of_batches_keeps_every_task_busy(
    autojump_clock: trio.abc.Clock, n_workers: int
) -> None:
    """Batches of equal slow deliveries, put back to back: with N tasks the
    whole run takes ceil(batch / N) handler durations per batch (mock time)."""
    q = WorkQueue(Lease())
    w = Workers(q, duration=lambda item: 1.0)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await w.run(n_workers, nursery)
            t0 = trio.current_time()
            for b in range(5):
                await q.put([(b, k) for k in range(4)])
            while len(w.done) < 20:
                await trio.sleep(0.5)
            q.close()
        elapsed = max(t for _, _, t in w.done) + 1.0 - t0
    # put waits for an empty queue, not for the handlers: the next batch
    # starts as tasks free up
    assert elapsed == pytest.approx(20 / n_workers)
    assert sorted(d for _, d, _ in w.done) == [(b, k) for b in range(5) for k in range(4)]
