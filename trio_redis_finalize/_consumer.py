"""``open_consumer`` and the :class:`Consumer` that mounts subscriptions."""

from __future__ import annotations

import heapq
import itertools
import logging
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
from ._mount import FINALIZE_TIMEOUT, Handler, Mount, Reader, backoff, log
from ._outcome import RETRY, Outcome
from ._plan import plan
from ._subscription import Form, Subscription
from ._transport import Client, Command, open_client

__all__ = ["Consumer", "open_consumer"]


def _default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Scheduler:
    """Runtime delayed copies: one heap and one task per consumer.

    At most ``max_held`` copies wait in memory; past that a new delayed retry
    goes out at once (with a warning) rather than growing memory.  On
    shutdown every held copy is sent at once: early rather than lost.
    """

    def __init__(self, client: Client, max_held: int = 10_000) -> None:
        self.client = client
        self.max_held = max_held
        self._heap: list[tuple[float, int, Mount, tuple[Command, ...]]] = []
        self._seq = itertools.count()
        self._wake = anyio.Event()
        self._now: list[tuple[Mount, tuple[Command, ...]]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def held_by(self, mount: Mount) -> int:
        return sum(1 for e in self._heap if e[2] is mount)

    def hold(self, mount: Mount, delay: float, commands: tuple[Command, ...]) -> None:
        if len(self._heap) >= self.max_held:
            log.warning(
                "%s: %d runtime delayed copies already held; sending this one now",
                mount.name, len(self._heap),
            )
            delay = 0.0
        heapq.heappush(self._heap, (anyio.current_time() + delay, next(self._seq), mount, commands))
        self._wake.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
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
            batch: list[tuple[float, int, Mount, tuple[Command, ...]]] = []
            while self._heap and self._heap[0][0] <= now and len(batch) < 500:
                batch.append(heapq.heappop(self._heap))
            with anyio.CancelScope(shield=True):  # popped: must not be lost to a cancel
                await self._send([(e[2], e[3]) for e in batch], deadline=anyio.current_time() + 30)

    async def flush(self, deadline: float) -> None:
        """Send every held copy now (shutdown)."""
        batch = [(e[2], e[3]) for e in sorted(self._heap)]
        self._heap.clear()
        if batch:
            log.info("publishing %d held runtime delayed copies at shutdown", len(batch))
            await self._send(batch, deadline=deadline)

    async def _send(self, batch: list[tuple[Mount, tuple[Command, ...]]], deadline: float | None) -> None:
        commands = [c for _, cmds in batch for c in cmds]
        attempt = 0
        while True:
            try:
                replies = await self.client.pipeline(commands, raise_on_error=False, timeout=FINALIZE_TIMEOUT)
                break
            except (rexc.ConnectionError, rexc.TimeoutError, OSError) as e:
                if deadline is not None and anyio.current_time() > deadline:
                    log.error("could not send %d delayed copies before the deadline: %s", len(batch), e)
                    return
                log.warning("sending %d delayed copies failed (%s); trying again", len(batch), e)
                await anyio.sleep(backoff(attempt))
                attempt += 1
        for r in replies:
            if isinstance(r, rexc.RedisError):
                log.error("delayed copy failed: %s", r)
        for mount, _ in batch:
            mount.stats.effects["released"] += 1


class Consumer:
    """Runs mounted subscriptions under a nursery; created by :func:`open_consumer`."""

    def __init__(self, client: Client, name: str, tg: TaskGroup, shutdown_grace: float) -> None:
        self.client = client
        self.name = name
        self.shutdown_grace = shutdown_grace
        self.scheduler = Scheduler(client)
        self._tg = tg
        self._mounts: list[Mount] = []
        self._closing = False

    async def mount(
        self,
        subscription: Subscription,
        handler: Handler,
        *,
        concurrency: int = 1,
        on_error: Outcome = RETRY,
    ) -> None:
        """Start reading ``subscription``; returns once it is reading.

        Args:
            subscription: a ``StreamSubscription``, ``ReliableListSubscription``,
                ``ListSubscription``, ``ChannelSubscription`` or ``PatternSubscription``.
            handler: ``async def handler(delivery) -> Outcome``.
            concurrency: how many handler calls may run at once.
            on_error: the outcome used when the handler raises or returns
                something that is not an :class:`Outcome`.

        Raises:
            ValueError: bad ``concurrency`` / ``on_error`` / ``handler``.
            redis.exceptions.ResponseError: the key holds another type (the
                message names key and type).
        """
        if self._closing:
            raise RuntimeError("consumer is shutting down")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
        if not isinstance(on_error, Outcome):
            raise ValueError(f"on_error must be an Outcome (ACK, RETRY, DROP, retry_after), got {on_error!r}")
        if not callable(handler):
            raise ValueError(f"handler must be an async callable, got {handler!r}")
        if not isinstance(subscription, Subscription):
            raise ValueError(f"subscription must be a subscription object, got {subscription!r}")
        target = subscription.target(self.name)  # type: ignore[attr-defined]
        reader = _reader_for(subscription)
        mount = Mount(self, subscription, handler, reader, target, concurrency=concurrency, on_error=on_error)
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


def _sole(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception inside nested one-member groups, else the group itself."""
    exc: BaseException = eg
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


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
    url_or_client: str | Client, *, name: str | None = None, shutdown_grace: float = 10.0
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

    Leaving the block (normally, by an exception or by cancellation) stops
    reading, lets in-flight handlers finish within ``shutdown_grace``,
    finalizes every outcome they returned, sends held delayed copies at once
    and closes connections.  What is unfinished stays pending for recovery.

    Raises:
        ValueError: bad URL or argument (the message names it).
        redis.exceptions.ConnectionError: the server cannot be reached.
    """
    if isinstance(shutdown_grace, bool) or not isinstance(shutdown_grace, (int, float)) or shutdown_grace < 0:
        raise ValueError(f"shutdown_grace must be a number of seconds >= 0, got {shutdown_grace!r}")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty string, got {name!r}")
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
            consumer = Consumer(client, consumer_name, tg, float(shutdown_grace))
            sched_scope = anyio.CancelScope(shield=True)

            async def scheduler(*, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
                with sched_scope:
                    await consumer.scheduler.run(task_status=task_status)

            await tg.start(scheduler)
            try:
                yield consumer
            finally:
                with anyio.CancelScope(shield=True):
                    await consumer.aclose()
                sched_scope.cancel()

