"""Runtime delayed copies: the consumer's one heap of ``retry_after`` copies."""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio
from anyio.abc import TaskStatus
from redis import exceptions as rexc

from ._core._commands import Command, describe
from ._core._recovery import SCHEDULE
from ._core._replies import FINAL, classify, describe_error
from ._core._types import FAILED, GATE_CLOSED, chain_stops
from ._core._writes import WRITES
from ._deadlines import FINALIZE_TIMEOUT, backoff, log
from ._shutdown import cleanup

if TYPE_CHECKING:
    from ._stats import MountStats
    from ._transport import Client

__all__ = ["DueTimes", "LaterGates", "Owner", "Scheduler"]


@runtime_checkable
class LaterGates(Protocol):
    """A mount's say on its delayed copies' commands (a reliable list's
    counted gates, ``_core.reliable_list.gates.ListGates``): each is numbered when
    it is sent (``send_later``) and settled from its final reply
    (``later_answered``: the effect and the writes to count, or None: the
    scheduler's own reading); ``due_of``: where a copy's due time is written
    once it is held (schedule key, member, attempt), or None."""

    def send_later(self, cmd: Command) -> Command: ...

    def due_of(self, cmd: Command) -> tuple[str, bytes, int] | None: ...

    def later_answered(self, cmd: Command, r: object) -> tuple[str, int] | None: ...


class Owner(Protocol):
    """Whose copies the scheduler holds (a mount): named in logs, counted in
    its stats; ``later_gates``: its say on the commands, or None."""

    @property
    def name(self) -> str: ...

    @property
    def stats(self) -> MountStats: ...

    @property
    def later_gates(self) -> LaterGates | None: ...


class Scheduler:
    """Runtime delayed copies: one heap and one task per consumer.

    A runtime ``retry_after(delay)`` (the default way for plain and reclaim
    streams, simple lists and Pub/Sub, and for reliable lists without
    ``DURABLE_ZSET``) hands the scheduler the commands that write the copy
    (``XADD``, ``LPUSH``, ``PUBLISH``; for a reliable list the gated
    copy-then-``LREM`` script, the original staying in the processing list
    meanwhile: the mount's ``later_gates`` number it when it is sent and give
    it a receipt, so a resend learns whether its first send committed, and
    settle it from its reply -- its writes are counted then, once committed;
    the copy's due time is written to Redis, see below).
    They wait in one heap, ordered by due time, served by one task (not a
    task per copy); due copies go out in pipelined batches.

    * At most ``max_held`` copies wait in memory (``open_consumer(...,
      max_held_copies=...)``).  Past that, a new delayed retry goes out at
      once (a warning is logged, at most every few seconds, with the count)
      rather than growing memory.
    * A copy whose send fails (connection lost, timeout, a reply that is not
      RESP, or an error reply saying the server did not run it: OOM,
      READONLY, BUSY ...) goes back
      into the heap and is sent again after a backoff: a copy is never
      dropped while the consumer runs.  A final error reply (WRONGTYPE ...)
      is logged with its key and command and counted, not "released".  A
      send whose reply was lost may be repeated: a stream's copy is written
      once (its receipt, ``stream.scripts.STREAM_COPY_ONCE``), other forms' may be
      duplicated by a fault, never lost.
    * A copy's commands run in order; a gated script answered nil ends them
      (``_plan.chain_stops``): the original was not removed by this
      finalization (a racing one did), nothing is copied (``gate_closed``).
    * :meth:`flush` (graceful shutdown) sends every held copy at once: early
      rather than lost.  Only a crash of the process, or a server that
      refuses or does not answer until the shutdown's deadline, loses held
      copies (a reliable list's original is still in its processing list
      then); the second kind is logged and counted ``held_lost``
      (:meth:`abandon`).

    * A reliable list's copy has its due time written beside the processing
      list (``later_gates.due_of``: the ``Backoff`` schedule, by the server's
      clock), by a second task beside the copies' (``DueTimes``), as
      soon as it is held: a crash of the process leaves the original in the
      processing list, and its recovery (a restart under the same name,
      another consumer's reaper) lets it wait out the rest of its delay
      instead of delivering it at once.  A write that fails is sent again
      (after a backoff, with the delay that is left) until the copy is due;
      one refused for good is logged (a restart before the due time then
      delivers the original at once: early, never lost).

    ``held_by(mount)`` is what ``consumer.stats()[name]["held"]`` shows: the
    copies of that mount in memory, waiting for their due time or being sent
    (from the batch taken out of the heap until what Redis answered settled
    it), so a copy the server keeps refusing stays counted throughout.
    """

    _WARN_EVERY = 5.0
    """Seconds between two "full" warnings (the ones between are counted)."""
    _BATCH = 500

    def __init__(self, client: Client, max_held: int = 10_000) -> None:
        self.client = client
        self._dues = DueTimes(client)  # of held reliable-list copies
        self.max_held = max_held
        self._heap: list[tuple[float, int, Owner, tuple[Command, ...]]] = []
        self._seq = itertools.count()
        self._wake = anyio.Event()
        self._now: list[tuple[Owner, tuple[Command, ...]]] = []  # over the limit: send at once
        self._held: dict[Owner, int] = {}  # in the heap
        self._in_flight: dict[Owner, int] = {}  # the batch being sent (one at a time)
        self._sending = anyio.Lock()
        self._failures = 0
        self._overflow = 0
        self._closing = False  # flush() has begun: run() sends nothing more
        self._warned_at = -float("inf")

    def __len__(self) -> int:
        return len(self._heap)

    def held_by(self, mount: Owner) -> int:
        """How many copies of ``mount`` are in memory now: waiting, or being sent."""
        return self._held.get(mount, 0) + self._in_flight.get(mount, 0)

    def _sending_now(self, batch: list[tuple[Owner, tuple[Command, ...]]]) -> None:
        """Count ``batch`` as being sent (it has left the heap, it is not settled)."""
        self._in_flight.clear()
        for mount, _ in batch:
            self._in_flight[mount] = self._in_flight.get(mount, 0) + 1

    def _push(self, due: float, mount: Owner, commands: tuple[Command, ...]) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), mount, commands))
        self._held[mount] = self._held.get(mount, 0) + 1

    def _pop(self) -> tuple[Owner, tuple[Command, ...]]:
        _, _, mount, commands = heapq.heappop(self._heap)
        left = self._held[mount] - 1
        if left:
            self._held[mount] = left
        else:
            del self._held[mount]
        return mount, commands

    def hold(self, mount: Owner, delay: float, commands: tuple[Command, ...]) -> None:
        """Send ``commands`` after ``delay`` seconds (at once when full)."""
        if len(self._heap) >= self.max_held:
            self._overflow += 1
            now = anyio.current_time()
            if now - self._warned_at >= self._WARN_EVERY:
                log.warning(
                    "%s: %d runtime delayed copies already held (max_held_copies=%d); "
                    "sending %d delayed retr%s now instead of after the delay",
                    mount.name, len(self._heap), self.max_held, self._overflow,
                    "y" if self._overflow == 1 else "ies",
                )
                self._warned_at = now
                self._overflow = 0
            self._now.append((mount, commands))
        else:
            due = anyio.current_time() + delay
            self._push(due, mount, commands)
            gates = mount.later_gates
            where = gates.due_of(commands[0]) if gates is not None and commands else None
            if where is not None:  # a reliable list's: its due time goes to Redis too
                self._dues.add(due, mount, where)
        self._wake.set()

    def _take_due(self, now: float) -> list[tuple[Owner, tuple[Command, ...]]]:
        if self._closing:  # flush() took over: nothing more goes out from run()
            return []
        batch = self._now[: self._BATCH]
        del self._now[: self._BATCH]
        while self._heap and self._heap[0][0] <= now and len(batch) < self._BATCH:
            batch.append(self._pop())
        return batch

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._dues.run)
            task_status.started()
            await self._send_due()

    async def _send_due(self) -> None:
        """The copies' task: send what is due (see the class docstring)."""
        while True:
            if self._closing:
                await anyio.sleep_forever()
            if not self._now:
                if not self._heap:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
                due = self._heap[0][0]
                now = anyio.current_time()
                if due > now:
                    self._wake = anyio.Event()
                    with anyio.move_on_after(due - now):
                        await self._wake.wait()
                    continue
            # taken out of the heap: must not be lost to a cancellation (each
            # of a copy's at most two steps is bounded by FINALIZE_TIMEOUT)
            with cleanup(3 * FINALIZE_TIMEOUT):
                async with self._sending:
                    batch = self._take_due(anyio.current_time())
                    if not batch:
                        continue
                    self._sending_now(batch)
                    left: list[tuple[Owner, tuple[Command, ...]]] = []
                    try:
                        await self._send(batch, left)
                    finally:
                        self._requeue(left)

    def _requeue(self, left: list[tuple[Owner, tuple[Command, ...]]]) -> None:
        """Put what must be sent again back into the heap, due after a backoff.

        Never dropped; a copy whose send ran out of time comes back too, a
        duplicate at worst.  Done in the same step that ends the batch's
        count as being sent, so :meth:`held_by` never misses a copy between.
        """
        self._in_flight.clear()
        if not left:
            self._failures = 0
            return
        due = anyio.current_time() + backoff(self._failures, cap=5.0)
        self._failures += 1
        for mount, commands in left:
            self._push(due, mount, commands)

    async def flush(self, deadline: float) -> None:
        """Send every held copy now (graceful shutdown), trying until ``deadline``.

        From here on ``run()`` sends nothing.  What could not be sent by
        ``deadline`` (or when a cancellation cut the flush, even while it
        waited for a batch that ``run()`` was sending) stays held, for
        :meth:`abandon` to count and report once the scheduler has stopped.
        """
        self._closing = True
        self._dues.closing = True  # the copies go out now: their due times no longer matter
        async with self._sending:  # a batch being sent by run() is settled first
            batch = list(self._now)
            self._now.clear()
            while self._heap:
                batch.append(self._pop())
            if not batch:
                return
            log.info("publishing %d held runtime delayed copies at shutdown", len(batch))
            attempt = 0
            try:
                while batch:
                    self._sending_now(batch)
                    left: list[tuple[Owner, tuple[Command, ...]]] = []
                    try:
                        await self._send(batch, left)
                    finally:
                        batch = left
                    pause = backoff(attempt)  # (one draw: the check bounds the sleep taken)
                    if batch and anyio.current_time() + pause > deadline:
                        break
                    if batch:
                        await anyio.sleep(pause)
                        attempt += 1
            finally:
                self._in_flight.clear()
                now = anyio.current_time()
                for mount, commands in batch:
                    self._push(now, mount, commands)

    def abandon(self) -> int:
        """Count and report the copies still held once the scheduler has stopped.

        Called after :meth:`flush` and the end of ``run()``: each copy left
        (the server refused or did not answer until the shutdown deadline)
        is counted ``held_lost`` on its mount and logged.  A stream's, a
        simple list's or Pub/Sub's copy is lost (its original was removed
        already); a reliable list's original is still in its processing list
        and is delivered again after a restart.  Returns how many.
        """
        left = [self._pop()[0] for _ in range(len(self._heap))] + [m for m, _ in self._now]
        self._now.clear()
        self._in_flight.clear()
        by_mount: dict[Owner, int] = {}
        for mount in left:
            mount.stats.effects["held_lost"] += 1
            by_mount[mount] = by_mount.get(mount, 0) + 1
        for mount, n in by_mount.items():
            log.error(
                "%s: could not publish %d held runtime delayed cop%s before shutting down: "
                "lost (a reliable list's originals stay in its processing list, delivered "
                "again after a restart; DelayedRetry.DURABLE_ZSET keeps delayed copies in Redis)",
                mount.name, n, "y" if n == 1 else "ies", extra={"subscription": mount.name},
            )
        return len(left)

    async def _send(
        self,
        batch: list[tuple[Owner, tuple[Command, ...]]],
        left: list[tuple[Owner, tuple[Command, ...]]],
    ) -> None:
        """Send the copies of ``batch``; what must be sent again goes into ``left``.

        On any exit: a cancellation (a deadline) adds the copies whose round
        trip it cut, from their unconfirmed command on (a duplicate at worst),
        and none that Redis had settled.

        Each entry's commands run in order, each only once the one before
        it succeeded (a reliable list's cross-slot ``LPUSH`` copy, then the
        ``LREM`` of the original).  A command the server did not run (OOM,
        READONLY ...) or whose outcome is unknown (connection lost) comes
        back, from that command on, to be sent again after a backoff; one
        that got a final error reply is logged with its key and counted
        (``finalize_errors``, effect ``failed``), never counted released.
        """
        chains = [(mount, list(cmds)) for mount, cmds in batch]
        live = [i for i, (_, cmds) in enumerate(chains) if cmds]
        for mount, cmds in chains:
            if not cmds:
                mount.stats.effects["released"] += 1
        try:
            await self._rounds(chains, live, left)
        finally:
            left.extend((chains[i][0], tuple(chains[i][1])) for i in live)

    async def _rounds(
        self,
        chains: list[tuple[Owner, list[Command]]],
        live: list[int],
        left: list[tuple[Owner, tuple[Command, ...]]],
    ) -> None:
        """The round trips of :meth:`_send`.  ``live`` (updated in place) is
        what is on its way: each entry's commands from its unconfirmed one on."""
        gate_closed: set[int] = set()  # reliable lists' delayed copies (later_gates)
        while live:
            commands: list[Command] = []
            for i in live:
                mount, cmds = chains[i]
                gates = mount.later_gates
                if gates is not None:  # numbered now (kept so: a resend is renumbered)
                    cmds[0] = gates.send_later(cmds[0])
                commands.append(cmds[0])
            try:
                replies: list[Any] = await self.client.pipeline(
                    commands, raise_on_error=False, timeout=FINALIZE_TIMEOUT
                )
            except (rexc.RedisError, OSError) as e:
                if classify(e) is not FINAL:
                    log.warning("sending %d delayed copies failed (%s); sending them again",
                                len(live), e)
                    return  # live: all of them, from this command on, to send again
                replies = [e] * len(commands)
            deferred: str | None = None
            step: list[int] = []
            for i, cmd, r in zip(live, commands, replies, strict=True):
                mount, cmds = chains[i]
                if isinstance(r, Exception):
                    mount.stats.finalize_errors += 1
                    if classify(r) is not FINAL:
                        deferred = deferred or describe_error(r, cmd)
                        left.append((mount, tuple(cmds)))
                        continue
                    mount.stats.effects[FAILED] += 1
                    if mount.later_gates is not None:
                        mount.later_gates.later_answered(cmd, r)
                    log.error("%s: delayed copy failed: %s; it is not written", mount.name,
                              describe_error(r, cmd), extra={"subscription": mount.name})
                    continue
                settled = (mount.later_gates.later_answered(cmd, r)
                           if mount.later_gates is not None else None)
                if settled is not None:  # counted as Redis answered: writes once committed
                    if settled[0] == GATE_CLOSED:
                        gate_closed.add(i)
                    elif settled[1]:
                        mount.stats.effects[WRITES] += settled[1]
                elif chain_stops(cmd, r):
                    # the original was not removed by this finalization (or its
                    # copy's receipt is gone): nothing copied, nothing more sent
                    mount.stats.effects[GATE_CLOSED] += 1
                    log.info("%s: a held delayed copy was not written: its gated step found "
                             "the original finalized by another finalization (or the copy "
                             "written by an earlier send): %s", mount.name,
                             describe(cmd), extra={"subscription": mount.name})
                    continue
                cmds.pop(0)
                if cmds:
                    step.append(i)
                else:
                    mount.stats.effects[GATE_CLOSED if i in gate_closed else "released"] += 1
            if deferred is not None:
                log.warning("sending delayed copies deferred by the server (%s); sending "
                            "them again", deferred)
            live[:] = step


_DUES_AT_ONCE = 1000
"""At most this many due times are written in one round trip."""


class DueTimes:
    """The due times of held reliable-list copies, written to Redis by one
    task (:meth:`run`, beside the scheduler's copies task; see
    :class:`Scheduler`).  ``closing``: the shutdown publishes the copies
    (``Scheduler.flush``), nothing more is written.

    Its resends are not the copies' (``Scheduler._requeue``), on purpose: a
    due time is worth writing only until its copy is due, so any doubt is
    sent again (only an error reply that is final ends it, not a client-side
    error), rebuilt with the delay left, after a backoff this task sleeps."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.closing = False
        # (due, mount, schedule key, member, attempt), in the order held
        self._dues: list[tuple[float, Owner, str, bytes, int]] = []
        self._wake = anyio.Event()

    def add(self, due: float, mount: Owner, where: tuple[str, bytes, int]) -> None:
        """A copy held until ``due`` (the scheduler's clock): its due time is to
        be written to ``where`` (``LaterGates.due_of``)."""
        self._dues.append((due, mount, *where))
        self._wake.set()

    async def run(self) -> None:
        """Write the due times of held reliable-list copies (see the class
        docstring): one ``SCHEDULE`` call per schedule key and round trip,
        each member due in what is left of its delay.  Sent again after a
        backoff while it did not run or its outcome is unknown (``ZADD GT``:
        a resend never moves a due time earlier), dropped once its copy is
        due, or the shutdown publishes the copies (``Scheduler.flush``)."""
        failures = 0
        while True:
            if not self._dues:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            now = anyio.current_time()
            dues = [x for x in self._dues[:_DUES_AT_ONCE] if x[0] > now] if not self.closing else []
            del self._dues[:_DUES_AT_ONCE]
            by_key: dict[str, list[tuple[float, Owner, str, bytes, int]]] = {}
            for x in dues:
                by_key.setdefault(x[2], []).append(x)
            keys = list(by_key)
            cmds = [SCHEDULE.command((k,), [a for due, _, _, member, attempt in by_key[k]
                                            for a in (member, max(1, round((due - now) * 1000)),
                                                      attempt)])
                    for k in keys]
            if not cmds:
                continue
            again: list[tuple[float, Owner, str, bytes, int]] = []
            try:
                replies: list[Any] = await self.client.pipeline(
                    cmds, raise_on_error=False, timeout=FINALIZE_TIMEOUT)
            except (rexc.RedisError, OSError) as e:
                replies = [e] * len(cmds)
            for k, r in zip(keys, replies, strict=True):
                if not isinstance(r, Exception):
                    continue
                mine = by_key[k]
                if isinstance(r, rexc.ResponseError) and classify(r) is FINAL:
                    log.warning("%s: writing the due times of %d runtime retry_after copies to %r "
                                "failed (%s); a restart before they are due delivers their "
                                "originals at once", mine[0][1].name, len(mine), k, r,
                                extra={"subscription": mine[0][1].name})
                    continue
                again += mine
            if again:
                self._dues[:0] = again  # before those held meanwhile: the oldest first
                await anyio.sleep(backoff(failures, cap=5.0))
                failures += 1
            else:
                failures = 0
