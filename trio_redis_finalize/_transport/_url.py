"""Connection parameters from a Redis URL."""

from __future__ import annotations

import dataclasses
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["ConnectionParams", "parse_url"]

_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectionParams:
    """Where and how to connect; built by :func:`parse_url`."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None  # unix socket
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    cluster_seeds: tuple[tuple[str, int], ...] = ()
    connect_timeout: float = 5.0

    @property
    def address(self) -> str:
        return self.path if self.path else f"{self.host}:{self.port}"

    def for_node(self, host: str, port: int) -> ConnectionParams:
        return dataclasses.replace(self, host=host, port=port, path=None, cluster_seeds=())


def parse_url(url: str) -> ConnectionParams:
    """Parse ``redis://``, ``rediss://``, ``unix://`` and ``redis+cluster://`` URLs.

    Raises:
        ValueError: naming ``url`` when the scheme or a part is not understood.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(
            f"url: unknown scheme {parts.scheme!r} in {url!r} "
            f"(expected one of {', '.join(s + '://' for s in _SCHEMES)})"
        )
    query = parse_qs(parts.query)
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    timeout = float(query["timeout"][0]) if "timeout" in query else 5.0
    db_text = parts.path.strip("/") if scheme != "unix" else query.get("db", ["0"])[0]
    try:
        db = int(db_text) if db_text else 0
    except ValueError:
        raise ValueError(f"url: database {db_text!r} in {url!r} is not a number") from None
    if "db" in query:
        db = int(query["db"][0])
    if scheme == "unix":
        if not parts.path:
            raise ValueError(f"url: no socket path in {url!r}")
        return ConnectionParams(
            path=parts.path, db=db, username=username, password=password, connect_timeout=timeout
        )
    tls = scheme.startswith("rediss")
    if scheme.endswith("+cluster"):
        netloc = parts.netloc.rsplit("@", 1)[-1]
        seeds = []
        for item in netloc.split(","):
            host, _, port_text = item.rpartition(":")
            if not host:
                host, port_text = item, "6379"
            try:
                seeds.append((host.strip("[]"), int(port_text)))
            except ValueError:
                raise ValueError(f"url: bad cluster node {item!r} in {url!r}") from None
        if db != 0:
            raise ValueError(f"url: Redis Cluster has only database 0, {url!r} names {db}")
        return ConnectionParams(
            host=seeds[0][0], port=seeds[0][1], username=username, password=password,
            tls=tls, cluster_seeds=tuple(seeds), connect_timeout=timeout,
        )
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"url: bad port in {url!r}") from None
    return ConnectionParams(
        host=parts.hostname or "127.0.0.1", port=port, db=db, username=username,
        password=password, tls=tls, connect_timeout=timeout,
    )
