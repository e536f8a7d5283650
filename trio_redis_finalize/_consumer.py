"""``open_consumer`` and the :class:`Consumer` that mounts subscriptions."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus
from redis import exceptions as rexc

from ._core._types import Target
from ._core._writes import plan_outcome
from ._deadlines import log, sole
from ._delivery import Delivery
from ._forms import FORMS
from ._forms._port import BatchHandler, Handler
from ._identity import LIVE, new_token
from ._mount import Mount
from ._outcome import Backoff, Outcome
from ._scheduler import Scheduler
from ._shutdown import CLOSE_MARGIN, Budget, cleanup_until
from ._subscription import DelayedRetry, Subscription
from ._transport import Client, ClusterClient, open_client

__all__ = ["Consumer", "Mounted", "check_async", "evicting_policy", "open_consumer"]


MOUNT_TIMEOUT = 15.0
"""Seconds within which a ``mount()`` whose set-up gets no answer fails (the
bound the per-command deadlines keep; see ``Consumer.mount``)."""


DEFAULT_BACKOFF = Backoff()
"""``Consumer.mount``'s default ``on_error``: ``Backoff(base=0.1, cap=30.0, window=30.0)``."""


_POLICY_TIMEOUT = 2.0
"""Seconds the ``CONFIG GET maxmemory-policy`` of the first mount may take."""


def evicting_policy(reply: object) -> str | None:
    """The ``maxmemory-policy`` a ``CONFIG GET maxmemory-policy`` reply names
    when it evicts keys (anything but ``noeviction``), else None (``noeviction``,
    an empty or unexpected reply)."""
    if isinstance(reply, dict):  # RESP3
        reply = [x for kv in reply.items() for x in kv]
    if not isinstance(reply, (list, tuple)) or len(reply) < 2:
        return None
    value = reply[1]
    policy = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return None if policy.lower() == "noeviction" else policy


def _default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def check_async(handler: object) -> None:
    """Refuse a handler that is a plain ``def`` function or a lambda (not a
    coroutine function): awaiting what it returns fails every delivery.

    Raises:
        TypeError: naming the handler.
    """
    fn = handler
    while isinstance(fn, functools.partial):
        fn = fn.func
    if (inspect.isfunction(fn) or inspect.ismethod(fn)) and not (
            inspect.iscoroutinefunction(fn) or getattr(handler, "trf_bind", None) is not None):
        what = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"handler {what!r} is a plain function (def or lambda), not 'async def': every "
            "delivery would fail awaiting its result; write 'async def handler(delivery): ...' "
            "(blocking code inside it: 'await anyio.to_thread.run_sync(work, delivery)')")


class Mounted:
    """A mounted subscription, as :meth:`Consumer.mount` returns it.

    ``name``: the subscription's name, its key in :meth:`Consumer.stats`;
    ``subscription``: what was mounted; :meth:`stats`: its counters.
    """

    __slots__ = ("_consumer", "_mount", "name", "subscription")

    def __init__(self, consumer: Consumer, mount: Mount, subscription: Subscription) -> None:
        self._consumer = consumer
        self._mount = mount
        self.name = mount.name
        self.subscription = subscription

    def stats(self) -> dict[str, Any]:
        """This subscription's counters (see :meth:`Consumer.stats`)."""
        return self._consumer._stats_of(self._mount)

    def __repr__(self) -> str:
        return f"<Mounted {self.name}>"


def _check_delay_key(target: Target, mounts: list[Mount]) -> None:
    """Refuse a durable delay set already named by a mount of another source.

    A delay-set member names no destination: each reader moves every due
    copy of its ``delay_key`` to its own source, so two sources sharing one
    would take each other's copies (a stream copy addressed to a group the
    other stream has not: acknowledged unhandled, lost)."""
    if target.delayed_retry is not DelayedRetry.DURABLE_ZSET:
        return
    for m in mounts:
        t = m.target
        if (t.delayed_retry is DelayedRetry.DURABLE_ZSET and t.delay_key == target.delay_key
                and t.source != target.source):
            raise ValueError(
                f"delay_key: {target.delay_key!r} is the durable delay set of {t.source!r} "
                f"({m.name}) already; {target.source!r} ({target.name}) needs its own (each "
                f"reader moves every due copy of its delay set to its own source)")


class Consumer:
    """Runs mounted subscriptions under a nursery; created by :func:`open_consumer`."""

    def __init__(
        self, client: Client, name: str, tg: TaskGroup, shutdown_grace: float,
        *, max_held_copies: int = 10_000, takeover: bool = False,
    ) -> None:
        self.client = client
        self.name = name
        self.shutdown_grace = shutdown_grace
        self.takeover = takeover
        self.token = new_token()
        """What this consumer's heartbeats hold: one live process per consumer
        name (``_core._identity``)."""
        self.scheduler = Scheduler(client, max_held_copies)
        self._tg = tg
        self._mounts: list[Mount] = []
        self._closing = False
        self._policy_checked = False  # maxmemory-policy, once per consumer (at its first mount)

    async def mount(
        self,
        subscription: Subscription,
        handler: Handler | BatchHandler,
        *,
        concurrency: int = 1,
        on_error: Outcome | Backoff = DEFAULT_BACKOFF,
        batch: bool = False,
        takeover: bool | None = None,
    ) -> Mounted:
        """Start reading ``subscription``; returns once it is reading, with a
        :class:`Mounted` handle (``.name``: its key in :meth:`stats`, ``.stats()``).

        Args:
            subscription: a ``StreamSubscription``, ``ReliableListSubscription``,
                ``ListSubscription``, ``ChannelSubscription`` or ``PatternSubscription``.
            handler: ``async def handler(delivery) -> Outcome``; with
                ``batch=True``, ``async def handler(deliveries) ->
                Outcome | Sequence[Outcome]``.
            concurrency: how many handler calls may run at once.
            batch: hand the handler every delivery of one read at once (a
                list of up to the subscription's ``count``; Pub/Sub: the
                messages waiting) instead of one at a time.  It returns one
                outcome for all of them, or a list or tuple of one outcome per
                delivery, in order; the finalization, its guarantees and
                ``on_error`` are per delivery, exactly as for a handler of
                one.  A handler that raises, or returns anything else, fails
                every delivery of the call (``on_error`` applies to each, one
                log line names them).  One outcome carrying writes
                (``Outcome.with_writes``) for more than one delivery is such
                a failure: it would commit its writes once per delivery.
            on_error: what is done when the handler raises or returns
                something that is not an :class:`Outcome`: a
                :class:`Backoff` (the default, ``Backoff(base=0.1,
                cap=30.0, window=30.0)``) or an outcome (``RETRY``, ``DROP``,
                ``ACK``, ``retry_after(d)``).  With a ``Backoff`` the delivery
                stays pending -- in the group's PEL (streams, every mode) or
                in the processing list (reliable lists) -- and this consumer
                delivers it again after a floor plus a random part of at
                most ``min(cap, base * 2 ** (attempt - 1))`` seconds (full
                jitter): no copy is written, a crash loses nothing, and a
                message that always fails never loops hot.  With
                ``max_attempts = m`` the floor after failed attempt ``a`` is
                ``window * 2 ** (a - 1) / (2 ** (m - 1) - 1)``, so the last
                attempt comes at least ``window`` (30 s) after the first
                (``m = 3``: 10 s, then 20 s); without ``max_attempts`` there
                is no floor.  ``max_attempts`` and ``dead_letter`` apply as
                to a ``RETRY`` (at the last attempt: the dead letter, or
                dropped with a warning).  On simple lists and Pub/Sub, which have
                nothing to leave pending, a ``Backoff`` logs the error and
                drops the message.
            takeover: streams and reliable lists: mount even when another
                live process holds this consumer name's heartbeat (it
                handles the same pending entries: stop it).  Default: the
                consumer's (``open_consumer(takeover=...)``, False).

        One live process per consumer name: a stream or reliable-list mount
        claims the name's heartbeat key (one script: two processes mounting
        at once cannot both win) and is refused with
        :class:`ConsumerNameInUse` while another process's heartbeat is
        alive.  A process killed without a clean stop leaves its heartbeat
        for at most the subscription's ``heartbeat`` (30 s by default); then
        its name mounts again.

        The set-up (type checks, group creation, first reads) honours the
        caller's cancellation, and fails within ``MOUNT_TIMEOUT`` (15 s)
        when the server does not answer.

        Raises:
            ValueError: bad ``concurrency`` / ``on_error`` / ``handler`` /
                ``takeover``; the same subscription mounted already on this
                consumer; a durable ``delay_key`` that a mount of another
                source on this consumer names already.
            TypeError: ``handler`` is a plain ``def`` function or a lambda
                (not ``async def``): each delivery would fail; the message
                names it.
            ConsumerNameInUse: another live process holds this consumer
                name's heartbeat (streams and reliable lists; the message
                names the key, the process and the heartbeat's age).
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
        if not isinstance(batch, bool):
            raise ValueError(f"batch must be True or False, got {batch!r}")
        if takeover is not None and not isinstance(takeover, bool):
            raise ValueError(f"takeover must be True, False or None, got {takeover!r}")
        check_async(handler)
        if batch and getattr(handler, "trf_bind", None) is not None:
            raise ValueError("handler: otel.instrument_handler wraps a handler of one delivery; "
                             "it cannot be mounted with batch=True")
        if not isinstance(subscription, Subscription):
            raise ValueError(f"subscription must be a subscription object, got {subscription!r}")
        target = subscription.target(  # type: ignore[attr-defined]
            self.name, cluster=isinstance(self.client, ClusterClient)
        )
        if any(m.name == target.name for m in self._mounts):
            raise ValueError(f"subscription: {target.name} is already mounted on consumer "
                             f"{self.name!r} (a second mount would handle everything twice)")
        _check_delay_key(target, self._mounts)
        spec = FORMS[target.form]
        if spec.uses_caps:
            # what the stream's server can do beyond Redis 6.2: the plans choose
            # native commands or the fallback from it (``_core._caps``), once
            caps = await self.client.capabilities_for(target.source)
            target = dataclasses.replace(target, caps=caps)
            if target.retention is not None and (target.xackdel or target.acked):
                log.info("%s: %s with the server's own commands (%s)", target.name,
                         target.retention, caps, extra={"subscription": target.name})
        reader = spec.reader(subscription)
        mount = Mount(self, self.client, self.scheduler, subscription, handler, reader, target,
                      concurrency=concurrency, on_error=on_error, batch=batch,
                      takeover=self.takeover if takeover is None else takeover)
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
            raise sole(eg) from None
        self._mounts.append(mount)
        if not self._policy_checked and spec.keyed:
            # once the mount is reading: the check can neither fail nor hold up its set-up
            self._policy_checked = True
            await self._check_eviction(target.name)
        return Mounted(self, mount, subscription)

    async def _check_eviction(self, name: str) -> None:
        """Warn when the server may evict keys (``maxmemory-policy`` other than
        ``noeviction``): a queue, its PEL or a dead letter could vanish.  A
        server that refuses ``CONFIG`` (managed services, ACLs, a renamed
        command) or does not answer in time is left alone (logged at DEBUG)."""
        try:
            reply = await self.client.execute("CONFIG", "GET", "maxmemory-policy",
                                              timeout=_POLICY_TIMEOUT)
        except (rexc.RedisError, OSError) as e:
            log.debug("%s: CONFIG GET maxmemory-policy refused (%s); eviction not checked",
                      name, e, extra={"subscription": name})
            return
        policy = evicting_policy(reply)
        if policy is not None:
            log.warning(
                "%s: the server's maxmemory-policy is %r: under memory pressure Redis evicts "
                "keys, and a queue, a stream with its pending entries, a delay set or a dead "
                "letter can vanish with everything in it; set maxmemory-policy noeviction "
                "(writes are then refused with OOM, which this library sends again)",
                name, policy, extra={"subscription": name, "maxmemory_policy": policy})

    async def finalize(self, delivery: Delivery, outcome: Outcome) -> None:
        """Finalize ``delivery`` now with ``outcome`` (outside a handler's return).

        Raises:
            AckUnsupported: the subscription's form cannot carry out ``outcome``.
            ValueError: ``outcome`` carries writes the subscription cannot
                commit with it (see ``Outcome.with_writes``).
            ValueError: no mounted subscription delivered ``delivery``.
        """
        for m in self._mounts:
            if m.name == delivery.mount:
                p = plan_outcome(m.target, delivery, outcome)  # raises what it refuses
                # an outcome with writes goes as itself: the finalizer counts its writes
                await m.finalizer.finalize([(delivery, outcome if outcome.writes else p)])
                return
        raise ValueError(f"delivery: no mounted subscription named {delivery.mount!r}")

    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters per subscription: ``{subscription name: counters}``, plain dicts.

        The key is the subscription's ``name`` (``stream 'orders' group
        'billing'``, ``reliable list 'jobs'``, ``list 'inbox'``, ``channels
        'a', 'b'`` ...), which :meth:`mount`'s handle carries too:
        ``handle = await consumer.mount(...)``; ``handle.stats()`` is
        ``consumer.stats()[handle.name]``.

        Each subscription's counters: ``received`` (deliveries read, before
        any handler call; each once: one a reliable list dropped unstarted
        at a late heartbeat counts when read again), ``handler_errors``, ``refused`` (outcomes the
        form cannot carry out), ``finalize_errors`` (error replies or failed
        round trips of finalization; those that did not run, or whose
        outcome is unknown, are sent again), ``read_errors``,
        ``group_recreated``, ``in_flight`` (handler calls running now),
        ``held`` (runtime ``retry_after`` copies in memory), ``delay_lag``
        (how overdue the durable delay set's oldest copy was at the last
        read; ``None`` without one), ``outcomes`` (what handlers returned:
        ``ack``, ``retry``, ``drop``, ``retry_after``, ``backoff``) and
        ``effects`` (what finalization did, as Redis answered: ``acked``,
        ``copied``, ``delayed``, ``held``, ``left_pending``, ``backed_off``,
        ``dead_lettered``, ``exhausted``, ``lost_before_handling``,
        ``foreign_copy``, ...; ``gate_closed`` when a gated step found the
        original no longer pending -- finalized already -- or a removal
        removed nothing; ``failed`` when a step got a final error reply: the
        original stays pending, the error is logged with command and key;
        ``released`` when a runtime delayed copy was written).  Both are
        ``collections.Counter`` s: an outcome or effect not counted yet
        reads 0 (``stats()[name]["effects"]["acked"]`` before the first
        ACK is settled), as Prometheus shows every series from 0.
        """
        return {m.name: self._stats_of(m) for m in self._mounts}

    def _stats_of(self, m: Mount) -> dict[str, Any]:
        snap = m.stats.snapshot()
        snap["held"] = self.scheduler.held_by(m)
        return snap

    @property
    def mounts(self) -> list[Mount]:
        return list(self._mounts)

    async def aclose(self) -> None:
        """Graceful shutdown (what leaving ``async with`` does)."""
        if self._closing:
            return
        self._closing = True
        budget = Budget.from_now(self.shutdown_grace)
        running = [(m.name, m.stats.in_flight) for m in self._mounts if m.stats.in_flight]
        if running:
            total = sum(n for _, n in running)
            log.info("consumer %s shutting down: waiting for %d handler%s to finish "
                     "(shutdown_grace=%g s): %s", self.name, total, "" if total == 1 else "s",
                     self.shutdown_grace, "; ".join(f"{name}: {n}" for name, n in running),
                     extra={"consumer": self.name, "handlers": total})
        with cleanup_until(budget.flush + CLOSE_MARGIN):
            async with anyio.create_task_group() as tg:  # phases 1-4, every mount at once
                for m in self._mounts:
                    tg.start_soon(m.stop, budget)
            await self.scheduler.flush(budget.flush)  # phase 5
            async with anyio.create_task_group() as tg:  # phase 6, every mount at once
                for m in self._mounts:
                    tg.start_soon(m.deregister)


@asynccontextmanager
async def open_consumer(
    url_or_client: str | Client,
    *,
    name: str | None = None,
    shutdown_grace: float = 10.0,
    max_held_copies: int = 10_000,
    takeover: bool = False,
) -> AsyncIterator[Consumer]:
    """A consumer whose subscriptions run while the ``async with`` block runs.

    Args:
        url_or_client: ``redis://[user:password@]host:port/db``, ``rediss://``
            (TLS), ``unix://path``, ``redis+cluster://host:port[,...]`` or
            ``redis+sentinel://host:port[,...]/service_name``; or a
            :class:`Client` of :func:`open_client` to share.
        name: the consumer name in stream groups and processing-list keys;
            give a stable one so a restart recovers this consumer's pending
            work.  Default: unique per process.  One live process per name:
            a second one is refused at mount (``ConsumerNameInUse``).
        shutdown_grace: seconds in-flight handlers get to finish on exit.
        max_held_copies: how many runtime ``retry_after`` copies may wait in
            process memory at once (all subscriptions together; shown per
            subscription as ``stats()[name]["held"]``).  When that many are
            held, a new delayed retry is written at once, with a warning,
            instead of growing memory.  ``0`` writes every runtime delayed
            retry at once.
        takeover: mount streams and reliable lists even when another live
            process holds this consumer name (``Consumer.mount``).

    Leaving the block (normally, by an exception or by cancellation) stops
    reading, lets in-flight handlers finish within ``shutdown_grace``,
    finalizes every outcome they returned, sends held delayed copies at once
    (early rather than lost) and closes connections.  What is unfinished
    stays pending for recovery.  A runtime delayed copy is lost only if the
    process dies while it waits (use ``DelayedRetry.DURABLE_ZSET`` to keep
    delayed copies in Redis).

    Raises:
        ValueError: bad URL or argument (the message names it).
        redis.exceptions.ConnectionError: the server cannot be reached.

    An exception raised inside the ``async with`` block comes out as itself
    (``except ValueError:`` catches it), not wrapped in an ``ExceptionGroup``.
    """
    if isinstance(shutdown_grace, bool) or not isinstance(shutdown_grace, (int, float)) or shutdown_grace < 0:
        raise ValueError(f"shutdown_grace must be a number of seconds >= 0, got {shutdown_grace!r}")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if isinstance(max_held_copies, bool) or not isinstance(max_held_copies, int) or max_held_copies < 0:
        raise ValueError(f"max_held_copies must be an int >= 0, got {max_held_copies!r}")
    if not isinstance(takeover, bool):
        raise ValueError(f"takeover must be True or False, got {takeover!r}")
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
        sched: Scheduler | None = None
        raised: BaseException | None = None  # the block's own exception, raised as itself
        try:
            async with anyio.create_task_group() as tg:
                consumer = Consumer(
                    client, consumer_name, tg, float(shutdown_grace), max_held_copies=max_held_copies,
                    takeover=takeover,
                )
                sched = consumer.scheduler
                sched_scope = anyio.CancelScope(shield=True)

                async def scheduler(
                    *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                ) -> None:
                    with sched_scope:
                        await consumer.scheduler.run(task_status=task_status)

                await tg.start(scheduler)
                try:
                    yield consumer
                except BaseException as e:  # re-raised below, outside the task group
                    raised = e
                finally:
                    try:
                        await consumer.aclose()  # shielded and bounded inside (_shutdown)
                    finally:  # even if shutdown failed: the shielded task must end
                        sched_scope.cancel()
        finally:  # the scheduler has stopped: what it still holds is counted and logged
            if sched is not None:
                sched.abandon()
                LIVE.discard(consumer.token)  # closed: a restart in this process may take it
        if raised is not None:
            # what the block raised comes out as it is, not in an ExceptionGroup
            # (the task group would wrap it), on trio and asyncio alike
            raise raised

