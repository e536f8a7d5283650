"""``open_consumer`` and the :class:`Consumer` that mounts subscriptions."""

from __future__ import annotations

import heapq
import itertools
import os
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus
from redis import exceptions as rexc

from ._delivery import Delivery
from ._mount import FINALIZE_TIMEOUT, Handler, Mount, Reader, _sole, backoff, describe_error, log
from ._outcome import Backoff, Outcome
from ._plan import FAILED, GATE_CLOSED, plan
from ._subscription import Form, Subscription
from ._transport import FINAL, Client, ClusterClient, Command, classify, open_client

__all__ = ["Consumer", "open_consumer"]


MOUNT_TIMEOUT = 15.0
"""Seconds within which a ``mount()`` whose set-up gets no answer fails (the
bound the per-command deadlines keep; see ``Consumer.mount``)."""


DEFAULT_BACKOFF = Backoff()
"""``Consumer.mount``'s default ``on_error``: ``Backoff(base=0.1, cap=30.0)``."""


def _default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Scheduler:
    """Runtime delayed copies: one heap and one task per consumer.

    A runtime ``retry_after(delay)`` (the default way for plain and reclaim
    streams, simple lists and Pub/Sub, and for reliable lists without
    ``DURABLE_ZSET``) hands the scheduler the commands that write the copy
    (``XADD``, ``LPUSH``, ``PUBLISH``; for a reliable list the gated
    copy-then-``LREM`` script, the original staying in the processing list
    meanwhile).  They wait in one heap, ordered by due time, served by one
    task (not a task per copy); due copies go out in pipelined batches.

    * At most ``max_held`` copies wait in memory (``open_consumer(...,
      max_held_copies=...)``).  Past that, a new delayed retry goes out at
      once (a warning is logged, at most every few seconds, with the count)
      rather than growing memory.
    * A copy whose send fails (connection lost, timeout, or an error reply
      saying the server did not run it: OOM, READONLY, BUSY ...) goes back
      into the heap and is sent again after a backoff: a copy is never
      dropped while the consumer runs.  A final error reply (WRONGTYPE ...)
      is logged with its key and command and counted, not "released".  A
      send whose reply was lost may be repeated, so a fault can duplicate a
      copy, never lose it.
    * :meth:`flush` (graceful shutdown) sends every held copy at once: early
      rather than lost.  Only a crash of the process loses held copies (a
      reliable list's original is still in its processing list then).

    ``held_by(mount)`` is what ``consumer.stats()[name]["held"]`` shows.
    """

    _WARN_EVERY = 5.0
    """Seconds between two "full" warnings (the ones between are counted)."""
    _BATCH = 500

    def __init__(self, client: Client, max_held: int = 10_000) -> None:
        self.client = client
        self.max_held = max_held
        self._heap: list[tuple[float, int, Mount, tuple[Command, ...]]] = []
        self._seq = itertools.count()
        self._wake = anyio.Event()
        self._now: list[tuple[Mount, tuple[Command, ...]]] = []  # over the limit: send at once
        self._held: dict[Mount, int] = {}
        self._sending = anyio.Lock()
        self._failures = 0
        self._overflow = 0
        self._warned_at = -float("inf")

    def __len__(self) -> int:
        return len(self._heap)

    def held_by(self, mount: Mount) -> int:
        """How many copies of ``mount`` wait in memory now."""
        return self._held.get(mount, 0)

    def _push(self, due: float, mount: Mount, commands: tuple[Command, ...]) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), mount, commands))
        self._held[mount] = self._held.get(mount, 0) + 1

    def _pop(self) -> tuple[Mount, tuple[Command, ...]]:
        _, _, mount, commands = heapq.heappop(self._heap)
        left = self._held[mount] - 1
        if left:
            self._held[mount] = left
        else:
            del self._held[mount]
        return mount, commands

    def hold(self, mount: Mount, delay: float, commands: tuple[Command, ...]) -> None:
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
            self._push(anyio.current_time() + delay, mount, commands)
        self._wake.set()

    def _take_due(self, now: float) -> list[tuple[Mount, tuple[Command, ...]]]:
        batch = self._now[: self._BATCH]
        del self._now[: self._BATCH]
        while self._heap and self._heap[0][0] <= now and len(batch) < self._BATCH:
            batch.append(self._pop())
        return batch

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
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
            # taken out of the heap: must not be lost to a cancellation
            with anyio.CancelScope(shield=True):
                async with self._sending:
                    batch = self._take_due(anyio.current_time())
                    if not batch:
                        continue
                    left = await self._send(batch)
                    if not left:
                        self._failures = 0
                        continue
                    # back into the heap, due after a backoff (never dropped)
                    due = anyio.current_time() + backoff(self._failures, cap=5.0)
                    self._failures += 1
                    for mount, commands in left:
                        self._push(due, mount, commands)

    async def flush(self, deadline: float) -> None:
        """Send every held copy now (graceful shutdown), trying until ``deadline``."""
        async with self._sending:  # a batch being sent by run() is settled first
            batch = list(self._now)
            self._now.clear()
            while self._heap:
                batch.append(self._pop())
            if not batch:
                return
            log.info("publishing %d held runtime delayed copies at shutdown", len(batch))
            attempt = 0
            while batch := await self._send(batch):
                if anyio.current_time() + backoff(attempt) > deadline:
                    log.error(
                        "could not publish %d held runtime delayed copies before shutting "
                        "down: they are lost (use DelayedRetry.DURABLE_ZSET to keep them in Redis)",
                        len(batch),
                    )
                    for mount, _ in batch:
                        mount.stats.effects["held_lost"] += 1
                    return
                await anyio.sleep(backoff(attempt))
                attempt += 1

    async def _send(
        self, batch: list[tuple[Mount, tuple[Command, ...]]]
    ) -> list[tuple[Mount, tuple[Command, ...]]]:
        """Send the copies of ``batch``; returns what must be sent again.

        Each entry's commands run in order, each only once the one before
        it succeeded (a reliable list's cross-slot ``LPUSH`` copy, then the
        ``LREM`` of the original).  A command the server did not run (OOM,
        READONLY ...) or whose outcome is unknown (connection lost) comes
        back, from that command on, to be sent again after a backoff; one
        that got a final error reply is logged with its key and counted
        (``finalize_errors``, effect ``failed``), never counted released.
        """
        chains = [(mount, list(cmds)) for mount, cmds in batch]
        left: list[tuple[Mount, tuple[Command, ...]]] = []
        live = [i for i, (_, cmds) in enumerate(chains) if cmds]
        for mount, cmds in chains:
            if not cmds:
                mount.stats.effects["released"] += 1
        gate_closed: set[int] = set()
        while live:
            commands = [chains[i][1][0] for i in live]
            try:
                replies: list[Any] = await self.client.pipeline(
                    commands, raise_on_error=False, timeout=FINALIZE_TIMEOUT
                )
            except (rexc.RedisError, OSError) as e:
                if classify(e) is not FINAL:
                    log.warning("sending %d delayed copies failed (%s); sending them again",
                                len(live), e)
                    left.extend((chains[i][0], tuple(chains[i][1])) for i in live)
                    return left
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
                    log.error("%s: delayed copy failed: %s; it is not written", mount.name,
                              describe_error(r, cmd), extra={"subscription": mount.name})
                    continue
                if r is None and cmd[0] == b"EVALSHA":
                    gate_closed.add(i)  # the original is gone: nothing copied
                cmds.pop(0)
                if cmds:
                    step.append(i)
                else:
                    mount.stats.effects[GATE_CLOSED if i in gate_closed else "released"] += 1
            if deferred is not None:
                log.warning("sending delayed copies deferred by the server (%s); sending "
                            "them again", deferred)
            live = step
        return left


class Consumer:
    """Runs mounted subscriptions under a nursery; created by :func:`open_consumer`."""

    def __init__(
        self, client: Client, name: str, tg: TaskGroup, shutdown_grace: float,
        *, max_held_copies: int = 10_000,
    ) -> None:
        self.client = client
        self.name = name
        self.shutdown_grace = shutdown_grace
        self.scheduler = Scheduler(client, max_held_copies)
        self._tg = tg
        self._mounts: list[Mount] = []
        self._closing = False

    async def mount(
        self,
        subscription: Subscription,
        handler: Handler,
        *,
        concurrency: int = 1,
        on_error: Outcome | Backoff = DEFAULT_BACKOFF,
    ) -> None:
        """Start reading ``subscription``; returns once it is reading.

        Args:
            subscription: a ``StreamSubscription``, ``ReliableListSubscription``,
                ``ListSubscription``, ``ChannelSubscription`` or ``PatternSubscription``.
            handler: ``async def handler(delivery) -> Outcome``.
            concurrency: how many handler calls may run at once.
            on_error: what is done when the handler raises or returns
                something that is not an :class:`Outcome`: a
                :class:`Backoff` (the default, ``Backoff(base=0.1,
                cap=30.0)``) or an outcome (``RETRY``, ``DROP``, ``ACK``,
                ``retry_after(d)``).  With a ``Backoff`` the delivery stays
                pending -- in the group's PEL (streams, every mode) or in the
                processing list (reliable lists) -- and this consumer
                delivers it again after ``min(cap, base * 2 ** (attempt -
                1))`` seconds at most (full jitter): no copy is written, a
                crash loses nothing, and a message that always fails never
                loops hot.  ``max_attempts`` and ``dead_letter`` apply as to
                a ``RETRY`` (at the last attempt: the dead letter, or dropped
                with a warning).  On simple lists and Pub/Sub, which have
                nothing to leave pending, a ``Backoff`` logs the error and
                drops the message.

        The set-up (type checks, group creation, first reads) honours the
        caller's cancellation, and fails within ``MOUNT_TIMEOUT`` (15 s)
        when the server does not answer.

        Raises:
            ValueError: bad ``concurrency`` / ``on_error`` / ``handler``; the
                same subscription mounted already on this consumer.
            redis.exceptions.ResponseError: the key holds another type (the
                message names key and type).
            redis.exceptions.TimeoutError: a set-up command got no answer
                (the message names command and key).
        """
        if self._closing:
            raise RuntimeError("consumer is shutting down")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
        if not isinstance(on_error, (Outcome, Backoff)):
            raise ValueError(f"on_error must be a Backoff or an Outcome (ACK, RETRY, DROP, "
                             f"retry_after), got {on_error!r}")
        if not callable(handler):
            raise ValueError(f"handler must be an async callable, got {handler!r}")
        if not isinstance(subscription, Subscription):
            raise ValueError(f"subscription must be a subscription object, got {subscription!r}")
        target = subscription.target(  # type: ignore[attr-defined]
            self.name, cluster=isinstance(self.client, ClusterClient)
        )
        if any(m.name == target.name for m in self._mounts):
            raise ValueError(f"subscription: {target.name} is already mounted on consumer "
                             f"{self.name!r} (a second mount would handle everything twice)")
        reader = _reader_for(subscription)
        mount = Mount(self, subscription, handler, reader, target, concurrency=concurrency, on_error=on_error)
        # Set-up runs in the caller's cancel scope (a move_on_after around
        # mount() is honoured).  No overall deadline (re-reading a long PEL
        # may take long, at the handlers' pace); every set-up command has its
        # own (the pool's 5 s, a read's block + margin, the connect timeout),
        # so a silent server fails the mount within MOUNT_TIMEOUT, naming the
        # command and key.
        try:
            await self._tg.start(mount.run)
        except BaseExceptionGroup as eg:
            # the mount's task groups wrap a set-up failure (WRONGTYPE, ...):
            # raise the error itself, as documented
            raise _sole(eg) from None
        self._mounts.append(mount)

    async def finalize(self, delivery: Delivery, outcome: Outcome) -> None:
        """Finalize ``delivery`` now with ``outcome`` (outside a handler's return).

        Raises:
            AckUnsupported: the subscription's form cannot carry out ``outcome``.
            ValueError: no mounted subscription delivered ``delivery``.
        """
        for m in self._mounts:
            if m.name == delivery.mount:
                p = plan(m.target, delivery, outcome)
                await m._finalize([(delivery, p)])
                return
        raise ValueError(f"delivery: no mounted subscription named {delivery.mount!r}")

    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters per subscription (see :class:`~trio_redis_finalize._stats.MountStats`)."""
        out = {}
        for m in self._mounts:
            snap = m.stats.snapshot()
            snap["held"] = self.scheduler.held_by(m)
            out[m.name] = snap
        return out

    @property
    def mounts(self) -> list[Mount]:
        return list(self._mounts)

    async def aclose(self) -> None:
        """Graceful shutdown (what leaving ``async with`` does)."""
        if self._closing:
            return
        self._closing = True
        grace = self.shutdown_grace
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for m in self._mounts:
                    tg.start_soon(m.stop, grace)
            await self.scheduler.flush(anyio.current_time() + 10.0)


def _reader_for(subscription: Subscription) -> Reader:
    form = subscription.form
    if form is Form.STREAM:
        from ._stream import StreamReader

        return StreamReader(subscription)  # type: ignore[arg-type]
    if form is Form.RELIABLE_LIST:
        from ._reliable_list import ReliableListReader

        return ReliableListReader(subscription)  # type: ignore[arg-type]
    if form is Form.LIST:
        from ._list import ListReader

        return ListReader(subscription)  # type: ignore[arg-type]
    from ._channel import PubSubReader

    return PubSubReader(subscription)  # type: ignore[arg-type]


@asynccontextmanager
async def open_consumer(
    url_or_client: str | Client,
    *,
    name: str | None = None,
    shutdown_grace: float = 10.0,
    max_held_copies: int = 10_000,
) -> AsyncIterator[Consumer]:
    """A consumer whose subscriptions run while the ``async with`` block runs.

    Args:
        url_or_client: ``redis://[user:password@]host:port/db``, ``rediss://``
            (TLS), ``unix://path`` or ``redis+cluster://host:port[,...]``; or
            a transport client to share.
        name: the consumer name in stream groups and processing-list keys;
            give a stable one so a restart recovers this consumer's pending
            work.  Default: unique per process.
        shutdown_grace: seconds in-flight handlers get to finish on exit.
        max_held_copies: how many runtime ``retry_after`` copies may wait in
            process memory at once (all subscriptions together; shown per
            subscription as ``stats()[name]["held"]``).  When that many are
            held, a new delayed retry is written at once, with a warning,
            instead of growing memory.  ``0`` writes every runtime delayed
            retry at once.

    Leaving the block (normally, by an exception or by cancellation) stops
    reading, lets in-flight handlers finish within ``shutdown_grace``,
    finalizes every outcome they returned, sends held delayed copies at once
    (early rather than lost) and closes connections.  What is unfinished
    stays pending for recovery.  A runtime delayed copy is lost only if the
    process dies while it waits (see :class:`~trio_redis_finalize._consumer.Scheduler`; use
    ``DelayedRetry.DURABLE_ZSET`` to keep delayed copies in Redis).

    Raises:
        ValueError: bad URL or argument (the message names it).
        redis.exceptions.ConnectionError: the server cannot be reached.
    """
    if isinstance(shutdown_grace, bool) or not isinstance(shutdown_grace, (int, float)) or shutdown_grace < 0:
        raise ValueError(f"shutdown_grace must be a number of seconds >= 0, got {shutdown_grace!r}")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if isinstance(max_held_copies, bool) or not isinstance(max_held_copies, int) or max_held_copies < 0:
        raise ValueError(f"max_held_copies must be an int >= 0, got {max_held_copies!r}")
    consumer_name = name or _default_name()
    async with AsyncExitStack() as stack:
        if isinstance(url_or_client, Client):
            client = url_or_client
        elif isinstance(url_or_client, str):
            client = await stack.enter_async_context(
                open_client(url_or_client, name=f"trf:{consumer_name}", max_connections=64)
            )
        else:
            raise ValueError(f"url_or_client must be a URL string or a client, got {url_or_client!r}")
        async with anyio.create_task_group() as tg:
            consumer = Consumer(
                client, consumer_name, tg, float(shutdown_grace), max_held_copies=max_held_copies
            )
            sched_scope = anyio.CancelScope(shield=True)

            async def scheduler(*, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
                with sched_scope:
                    await consumer.scheduler.run(task_status=task_status)

            await tg.start(scheduler)
            try:
                yield consumer
            finally:
                try:
                    with anyio.CancelScope(shield=True):
                        await consumer.aclose()
                finally:  # even if shutdown failed: the shielded task must end
                    sched_scope.cancel()

