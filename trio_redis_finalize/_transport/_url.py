"""Connection parameters from a Redis URL."""

from __future__ import annotations

import dataclasses
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

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
    tls_ca_certs: str | None = None  # CA bundle to verify the server with
    tls_verify: bool = True  # False: no certificate or host name check
    tls_certfile: str | None = None  # client certificate (mutual TLS)
    tls_keyfile: str | None = None

    @property
    def address(self) -> str:
        return self.path if self.path else f"{self.host}:{self.port}"

    def for_node(self, host: str, port: int) -> ConnectionParams:
        return dataclasses.replace(self, host=host, port=port, path=None, cluster_seeds=())


def _redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.netloc.rsplit("@", 1)[0].split(":", 1)[0]
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _number(kind: type[int] | type[float], text: str, what: str, url: str) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"url: {what} {text!r} in {_redact(url)!r} is not a number") from None
    if value < 0:
        raise ValueError(f"url: {what} {text!r} in {_redact(url)!r} is negative")
    return value


def parse_url(url: str) -> ConnectionParams:
    """Parse ``redis://``, ``rediss://``, ``unix://`` and ``redis+cluster://`` URLs.

    ``redis://[[user]:password@]host[:port][/db][?timeout=seconds]``;
    ``unix://[[user]:password@]/path/to.sock[?db=n]``; the query may also give
    ``db``, ``username`` and ``password`` (as redis-py accepts them).  User name
    and password are percent-decoded.  TLS (``rediss://``) options, with
    redis-py's names: ``ssl_ca_certs=<CA file>``, ``ssl_cert_reqs=none`` (no
    verification: tests only), ``ssl_certfile`` / ``ssl_keyfile`` (client
    certificate).

    Raises:
        ValueError: naming ``url`` when the scheme or a part is not understood
            (the password is never echoed).
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(
            f"url: unknown scheme {parts.scheme!r} in {_redact(url)!r} "
            f"(expected one of {', '.join(s + '://' for s in _SCHEMES)})"
        )
    query = parse_qs(parts.query)
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    if "username" in query:
        username = query["username"][0] or None
    if "password" in query:
        password = query["password"][0]
    timeout = float(_number(float, query["timeout"][0], "timeout", url)) if "timeout" in query else 5.0
    db_text = parts.path.strip("/") if scheme != "unix" else ""
    if "db" in query:
        db_text = query["db"][0]
    db = int(_number(int, db_text, "database", url)) if db_text else 0
    if scheme == "unix":
        if not parts.path:
            raise ValueError(f"url: no socket path in {_redact(url)!r}")
        return ConnectionParams(
            path=unquote(parts.path), db=db, username=username, password=password,
            connect_timeout=timeout,
        )
    tls = scheme.startswith("rediss")
    reqs = query.get("ssl_cert_reqs", ["required"])[0].lower()
    if reqs not in ("none", "optional", "required"):
        raise ValueError(f"url: ssl_cert_reqs must be none, optional or required, not {reqs!r}")
    def opt(name: str) -> str | None:
        return query[name][0] if name in query else None

    ca, certfile, keyfile, verify = (
        opt("ssl_ca_certs"), opt("ssl_certfile"), opt("ssl_keyfile"), reqs != "none"
    )
    if scheme.endswith("+cluster"):
        netloc = parts.netloc.rsplit("@", 1)[-1]
        seeds = []
        for item in netloc.split(","):
            host, _, port_text = item.rpartition(":")
            if not host or host.endswith(":"):  # no port, or a bare IPv6 address
                host, port_text = item, "6379"
            try:
                port = int(port_text)
            except ValueError:
                raise ValueError(f"url: bad cluster node {item!r} in {_redact(url)!r}") from None
            if not host.strip("[]") or not 0 < port < 65536:
                raise ValueError(f"url: bad cluster node {item!r} in {_redact(url)!r}")
            seeds.append((host.strip("[]"), port))
        if db != 0:
            raise ValueError(f"url: Redis Cluster has only database 0, {_redact(url)!r} names {db}")
        return ConnectionParams(
            host=seeds[0][0], port=seeds[0][1], username=username, password=password,
            tls=tls, cluster_seeds=tuple(seeds), connect_timeout=timeout,
            tls_ca_certs=ca, tls_verify=verify, tls_certfile=certfile, tls_keyfile=keyfile,
        )
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"url: bad port in {_redact(url)!r}") from None
    return ConnectionParams(
        host=parts.hostname or "127.0.0.1", port=port, db=db, username=username,
        password=password, tls=tls, connect_timeout=timeout,
        tls_ca_certs=ca, tls_verify=verify, tls_certfile=certfile, tls_keyfile=keyfile,
    )
