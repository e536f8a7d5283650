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
    """A :class:`Client` for ``url``; checks the server answers, closes on exit.

    A ``redis+cluster://`` URL gives a :class:`~._cluster.ClusterClient` (the
    same interface, commands routed by hash slot); it reads the slot map
    from the first seed node that answers.  A ``redis+sentinel://`` URL (or
    ``sentinel_params``) gives a ``SentinelClient``:
    commands go to the master the sentinels name, and a background task
    follows ``+switch-master`` while the client is open.

    ``native``: detect and use what the server adds beyond Redis 6.2 (see
    ``_client``); ``False`` forces the fallback; ``None`` (default): yes
    unless ``TRF_FALLBACK`` is set.

    Raises:
        ValueError: the URL is not understood.
        redis.exceptions.ConnectionError: the server cannot be reached.
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
