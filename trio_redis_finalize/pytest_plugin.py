"""pytest fixtures for code that consumes Redis (registered as a pytest plugin).

* ``redis_server``: a private :class:`~trio_redis_finalize.testing.RedisServer`
  for the whole session;
* ``redis_url``: its URL, with the database flushed before each test;
* ``fresh_redis_server``: a server of the test's own (for fault tests that
  kill, pause or restart it);
* ``run_consumer``: :func:`consume_until` bound to ``redis_url``: run a
  consumer with one subscription until a predicate holds;
* ``redis_cluster``: a local 3-master
  :class:`~trio_redis_finalize.testing.RedisCluster` for the whole session
  (skipped, with the reason, only when the binary cannot run a cluster);
  ``redis_cluster_url``: its ``redis+cluster://`` URL, every master flushed
  before each test;
* ``redis_sentinel``: a fresh
  :class:`~trio_redis_finalize.testing.RedisSentinel` topology per test (a
  master, a replica, three sentinels; ``.url`` is ``redis+sentinel://``).

:func:`consume_until` also works outside pytest (any trio or anyio code).

Example::

    from trio_redis_finalize import ACK, StreamSubscription

    async def test_orders_are_billed(redis_url, run_consumer):
        ...  # produce three orders to the stream "orders"
        billed = []

        async def handle(delivery):
            billed.append(delivery.fields[b"n"])
            return ACK

        stats = await run_consumer(
            StreamSubscription("orders", group="billing"), handle,
            lambda: len(billed) == 3, timeout=5,
        )
        assert stats["outcomes"] == {"ack": 3}
"""

from __future__ import annotations

import functools
import inspect
import socket
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeAlias

import anyio
import hiredis
import pytest

from ._consumer import DEFAULT_BACKOFF, open_consumer
from ._deadlines import sole
from ._outcome import Backoff, Outcome
from ._transport._connection import pack_command
from .testing import ClusterUnavailable, RedisCluster, RedisSentinel, RedisServer

if TYPE_CHECKING:
    from ._forms._port import BatchHandler, Handler
    from ._subscription import Subscription
    from ._transport import Client

__all__ = [
    "RunConsumer",
    "consume_until",
    "fresh_redis_server",
    "redis_cluster",
    "redis_cluster_url",
    "redis_server",
    "redis_url",
    "run_consumer",
    "sync_command",
]

Predicate = Callable[[], "bool | Awaitable[bool]"]


def sync_command(server: RedisServer, *args: str | bytes | int | float) -> object:
    """Run one command synchronously on ``server`` (for fixtures and set-up)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        reader = hiredis.Reader()
        payload = b""
        if server.password:
            payload += pack_command(("AUTH", server.password))
        payload += pack_command(args)
        s.sendall(payload)
        replies: list[object] = []
        want = 2 if server.password else 1
        while len(replies) < want:
            reply = reader.gets()
            if reply is False:
                data = s.recv(65536)
                if not data:
                    raise ConnectionError("redis-server closed the connection")
                reader.feed(data)
                continue
            replies.append(reply)
        return replies[-1]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    sync_command(redis_server, "FLUSHALL")
    sync_command(redis_server, "SCRIPT", "FLUSH")
    return redis_server.url


@pytest.fixture
def fresh_redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


async def consume_until(
    url_or_client: str | Client,
    subscription: Subscription,
    handler: Handler | BatchHandler,
    predicate: Predicate,
    *,
    timeout: float = 10.0,
    concurrency: int = 1,
    batch: bool = False,
    on_error: Outcome | Backoff = DEFAULT_BACKOFF,
    name: str | None = None,
    shutdown_grace: float = 5.0,
    poll: float = 0.02,
) -> dict[str, Any]:
    """Run a consumer with one subscription until ``predicate()`` holds.

    Opens a consumer on ``url_or_client``, mounts ``subscription`` with
    ``handler``, and checks ``predicate`` (a plain or async function of no
    arguments) after every handler call and every ``poll`` seconds.  Once it
    returns true the consumer shuts down gracefully, so every outcome
    returned so far is finalized in Redis when this returns.

    Args:
        url_or_client: a Redis URL (e.g. the ``redis_url`` fixture) or a client.
        subscription: the subscription to mount.
        handler: ``async def handler(delivery) -> Outcome``.
        predicate: ``() -> bool`` or ``async () -> bool``, e.g.
            ``lambda: len(seen) == 3``.
        timeout: seconds before giving up with :class:`TimeoutError`.
        concurrency: as in ``consumer.mount``.
        batch: as in ``consumer.mount`` (``handler`` then takes a list of deliveries).
        on_error: as in ``consumer.mount``.
        name: the consumer name (default: unique).
        shutdown_grace: as in ``open_consumer``.
        poll: seconds between two checks when no handler call ends.

    Returns:
        The subscription's final ``consumer.stats()`` entry (counters after
        the graceful shutdown).

    Raises:
        TimeoutError: ``predicate`` did not hold within ``timeout`` seconds
            (the message shows the subscription's counters); the consumer
            was shut down gracefully all the same.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not callable(predicate):
        raise ValueError(f"predicate must be a callable of no arguments, got {predicate!r}")
    changed = anyio.Event()

    async def observed(delivery: Any) -> Any:  # a delivery, or a list of them (batch=True)
        try:
            return await handler(delivery)
        finally:
            changed.set()

    async def holds() -> bool:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        return bool(result)

    held = False
    try:
        async with open_consumer(url_or_client, name=name, shutdown_grace=shutdown_grace) as consumer:
            await consumer.mount(subscription, functools.wraps(handler)(observed),
                                 concurrency=concurrency, on_error=on_error, batch=batch)
            with anyio.move_on_after(timeout):
                while not (held := await holds()):
                    with anyio.move_on_after(poll):
                        await changed.wait()
                    changed = anyio.Event()
    except BaseExceptionGroup as eg:
        # the consumer's task group wraps what the body raised (a failing
        # mount(), a predicate that raised): raise the error itself
        one = sole(eg)
        if isinstance(one, Exception):
            raise one from None
        raise
    stats = consumer.stats()[subscription.name]
    if not held:
        raise TimeoutError(
            f"consume_until: {getattr(predicate, '__qualname__', predicate)!s} did not hold within "
            f"{timeout:g} s on {subscription.name}; counters: {stats}"
        )
    return stats


RunConsumer: TypeAlias = "functools.partial[Coroutine[Any, Any, dict[str, Any]]]"
"""The type of the ``run_consumer`` fixture: :func:`consume_until` with the URL given."""


@pytest.fixture
def run_consumer(redis_url: str) -> RunConsumer:
    """:func:`consume_until` on the per-test ``redis_url``."""
    return functools.partial(consume_until, redis_url)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A local Redis Cluster of three masters for the whole session.

    Skipped (with the reason) only when the ``redis-server`` binary cannot
    run a cluster.
    """
    try:
        cluster = RedisCluster().start()
    except ClusterUnavailable as e:
        pytest.skip(f"cannot start a local Redis Cluster: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster: RedisCluster) -> str:
    """The cluster's ``redis+cluster://`` URL, every master flushed before the test."""
    redis_cluster.flushall()
    return redis_cluster.url


@pytest.fixture
def redis_sentinel() -> Iterator[RedisSentinel]:
    """A fresh Sentinel topology for one test: a master, a replica, three sentinels.

    Fresh per test, because failovers move the master (about 2 s to start:
    the sentinels must find each other).  ``redis_sentinel.url`` is the
    ``redis+sentinel://`` URL; ``failover()``, ``kill_master()`` and
    ``wait_master()`` move the master.  ``down-after-milliseconds`` is 1000.
    """
    with RedisSentinel() as topology:
        yield topology
