"""``open_client``: the client a URL names (single server, Cluster or Sentinel)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ._client import Client
from ._cluster import ClusterClient
from ._sentinel import SentinelClient
from ._url import ConnectionParams, parse_url

__all__ = ["open_client"]


@asynccontextmanager
async def open_client(
    url: str | ConnectionParams, *, name: str | None = None, max_connections: int = 32,
    native: bool | None = None,
) -> AsyncIterator[Client]:
    """A :class:`~trio_redis_finalize.Client` for ``url``; checks the server
    answers, closes on exit.

    Give it to ``open_consumer`` and ``open_publisher`` to share its
    connections.  ``url``: a URL as ``open_consumer`` takes, or the
    :class:`~trio_redis_finalize.ConnectionParams` of
    :func:`~trio_redis_finalize.sentinel_params`.  A ``redis+cluster://``
    URL gives a client of the same interface whose commands are routed by
    hash slot (one pool per master node, ``MOVED`` and ``ASK`` followed); it
    reads the slot map from the first seed node that answers.  A
    ``redis+sentinel://`` URL (or ``sentinel_params``) gives one whose
    commands go to the master the sentinels name; a background task
    follows ``+switch-master`` while the client is open.

    Args:
        url: where to connect.
        name: the connections' name (``CLIENT SETNAME``).
        max_connections: the pool's size.
        native: detect and use what the server adds beyond Redis 6.2 (see
            ``_client``); ``False`` forces the fallback; ``None`` (default):
            yes unless ``TRF_FALLBACK`` is set.

    Raises:
        ValueError: the URL is not understood.
        redis.exceptions.ConnectionError: the server cannot be reached, or
            is not a Redis server (the message names the address).
    """
    params = parse_url(url) if isinstance(url, str) else url
    client: Client
    if params.cluster_seeds:
        client = ClusterClient(params, name=name, max_connections=max_connections, native=native)
    elif params.sentinels:
        sentinel = SentinelClient(params, name=name, max_connections=max_connections,
                                  native=native)
        try:
            async with sentinel.following():
                await sentinel.check()
                yield sentinel
        finally:
            await sentinel.aclose()
        return
    else:
        client = Client(params, name=name, max_connections=max_connections, native=native)
    try:
        await client.check()
        yield client
    finally:
        await client.aclose()
