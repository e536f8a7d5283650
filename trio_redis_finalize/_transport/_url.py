"""Connection parameters from a Redis URL."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

__all__ = ["SENTINEL_PORT", "ConnectionParams", "parse_url", "sentinel_params"]

_SCHEMES = (
    "redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel",
)
SENTINEL_PORT = 26379


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectionParams:
    """Where and how to connect (immutable): what a URL says, or what
    :func:`~trio_redis_finalize.sentinel_params` builds; give it to
    :func:`~trio_redis_finalize.open_client`."""

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
    # Redis Sentinel (``redis+sentinel://``): the master named ``service_name``
    # is found through ``sentinels``; ``host``/``port`` are the first sentinel's.
    sentinels: tuple[tuple[str, int], ...] = ()
    service_name: str | None = None
    sentinel_username: str | None = None  # the sentinels' own credentials
    sentinel_password: str | None = None
    sentinel_timeout: float = 1.0  # deadline of each question to one sentinel
    # connections that notice silence
    health_check_interval: float = 30.0  # PING an idle pooled connection idle this long
    keepalive: float = 15.0  # TCP keepalive idle seconds (probes every 5 s, 3 lost: dead); 0: off

    @property
    def address(self) -> str:
        if self.sentinels:
            nodes = ",".join(f"{h}:{p}" for h, p in self.sentinels)
            return f"master {self.service_name!r} via sentinels {nodes}"
        return self.path if self.path else f"{self.host}:{self.port}"

    def for_node(self, host: str, port: int) -> ConnectionParams:
        """The same options for the one server at ``host:port`` (a cluster node, a master)."""
        return dataclasses.replace(
            self, host=host, port=port, path=None, cluster_seeds=(), sentinels=(),
            service_name=None,
        )

    def for_sentinel(self, host: str, port: int) -> ConnectionParams:
        """How to talk to the sentinel at ``host:port``: its own credentials, database 0."""
        return dataclasses.replace(
            self.for_node(host, port), username=self.sentinel_username,
            password=self.sentinel_password, db=0,
            connect_timeout=min(self.connect_timeout, self.sentinel_timeout),
        )


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


def _nodes(netloc: str, url: str, what: str, default_port: int) -> tuple[tuple[str, int], ...]:
    """``host:port[,host:port...]`` (the part after any ``user:password@``)."""
    nodes = []
    for item in netloc.rsplit("@", 1)[-1].split(","):
        host, _, port_text = item.rpartition(":")
        if not host or host.endswith(":"):  # no port, or a bare IPv6 address
            host, port_text = item, str(default_port)
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"url: bad {what} {item!r} in {_redact(url)!r}") from None
        if not host.strip("[]") or not 0 < port < 65536:
            raise ValueError(f"url: bad {what} {item!r} in {_redact(url)!r}")
        nodes.append((host.strip("[]"), port))
    return tuple(nodes)


_OPTIONS = frozenset((
    "db", "username", "password", "timeout", "health_check_interval", "keepalive",
    "ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile",
    "sentinel_username", "sentinel_password", "sentinel_timeout",
))
"""The query options a URL may give (anything else is refused, naming it)."""


def parse_url(url: str) -> ConnectionParams:
    """Parse ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://`` and
    ``redis+sentinel://`` URLs.

    ``redis://[[user]:password@]host[:port][/db][?timeout=seconds]``;
    ``unix://[[user]:password@]/path/to.sock[?db=n]``; the query may also give
    ``db``, ``username`` and ``password`` (as redis-py accepts them).  User name
    and password are percent-decoded.  TLS (``rediss://``) options, with
    redis-py's names: ``ssl_ca_certs=<CA file>``, ``ssl_cert_reqs=none`` (no
    verification: tests only), ``ssl_certfile`` / ``ssl_keyfile`` (client
    certificate).

    ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name[/db]``
    (``rediss+sentinel://``: TLS to sentinels and master): the master named
    ``service_name`` found through the listed sentinels (port 26379 when
    omitted).  User and password are the master's; the sentinels' own are
    ``?sentinel_username=`` / ``?sentinel_password=`` (none by default);
    ``?sentinel_timeout=`` is the deadline of each question to one sentinel
    (1 s).

    Every scheme: ``?health_check_interval=`` (seconds, 30): a pooled
    connection idle longer is checked with a ``PING`` before it is used;
    ``?keepalive=`` (seconds, 15; 0 turns it off): TCP keepalive idle time.

    Raises:
        ValueError: naming ``url`` when the scheme or a part is not understood,
            or a query option is unknown (named; the ``sentinel_*`` ones only
            on ``redis+sentinel://``); the password is never echoed.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(
            f"url: unknown scheme {parts.scheme!r} in {_redact(url)!r} "
            f"(expected one of {', '.join(s + '://' for s in _SCHEMES)})"
        )
    query = parse_qs(parts.query, keep_blank_values=True)
    for name in query:
        if name not in _OPTIONS or (name.startswith("sentinel_") and not scheme.endswith("+sentinel")):
            where = "" if name not in _OPTIONS else " (only for redis+sentinel:// URLs)"
            raise ValueError(
                f"url: unknown query option {name!r}{where} in {_redact(url)!r} (known: "
                f"{', '.join(sorted(_OPTIONS))})")

    def opt(name: str) -> str | None:
        return query[name][0] if name in query else None

    def seconds(name: str, default: float) -> float:
        text = opt(name)
        return default if text is None else float(_number(float, text, name, url))

    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    if "username" in query:
        username = query["username"][0] or None
    if "password" in query:
        password = query["password"][0]
    timeout = seconds("timeout", 5.0)
    common: dict[str, Any] = {
        "connect_timeout": timeout,
        "health_check_interval": seconds("health_check_interval", 30.0),
        "keepalive": seconds("keepalive", 15.0),
    }
    sentinel = scheme.endswith("+sentinel")
    segments = [unquote(x) for x in parts.path.strip("/").split("/")] if parts.path.strip("/") else []
    if sentinel:
        if not segments or not segments[0]:
            raise ValueError(
                f"url: no service name in {_redact(url)!r} "
                "(redis+sentinel://host:port[,host:port...]/service_name[/db])"
            )
        if len(segments) > 2:
            raise ValueError(f"url: bad path {parts.path!r} in {_redact(url)!r} (/service_name[/db])")
        db_text = segments[1] if len(segments) > 1 else ""
    else:
        db_text = parts.path.strip("/") if scheme != "unix" else ""
    if "db" in query:
        db_text = query["db"][0]
    db = int(_number(int, db_text, "database", url)) if db_text else 0
    if scheme == "unix":
        if not parts.path:
            raise ValueError(f"url: no socket path in {_redact(url)!r}")
        return ConnectionParams(
            path=unquote(parts.path), db=db, username=username, password=password, **common,
        )
    tls = scheme.startswith("rediss")
    reqs = query.get("ssl_cert_reqs", ["required"])[0].lower()
    if reqs not in ("none", "optional", "required"):
        raise ValueError(f"url: ssl_cert_reqs must be none, optional or required, not {reqs!r}")
    common.update(
        tls=tls, tls_ca_certs=opt("ssl_ca_certs"), tls_verify=reqs != "none",
        tls_certfile=opt("ssl_certfile"), tls_keyfile=opt("ssl_keyfile"),
        username=username, password=password,
    )
    if scheme.endswith("+cluster"):
        seeds = _nodes(parts.netloc, url, "cluster node", 6379)
        if db != 0:
            raise ValueError(f"url: Redis Cluster has only database 0, {_redact(url)!r} names {db}")
        return ConnectionParams(
            host=seeds[0][0], port=seeds[0][1], cluster_seeds=seeds, **common,
        )
    if sentinel:
        sentinels = _nodes(parts.netloc, url, "sentinel", SENTINEL_PORT)
        sentinel_timeout = seconds("sentinel_timeout", 1.0)
        if sentinel_timeout <= 0:
            raise ValueError(f"url: sentinel_timeout must be > 0 in {_redact(url)!r}")
        return ConnectionParams(
            host=sentinels[0][0], port=sentinels[0][1], db=db, sentinels=sentinels,
            service_name=segments[0], sentinel_username=opt("sentinel_username") or None,
            sentinel_password=opt("sentinel_password"), sentinel_timeout=sentinel_timeout,
            **common,
        )
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"url: bad port in {_redact(url)!r}") from None
    return ConnectionParams(host=parts.hostname or "127.0.0.1", port=port, db=db, **common)


def sentinel_params(
    sentinels: Sequence[tuple[str, int] | str] | str,
    service_name: str,
    *,
    db: int = 0,
    username: str | None = None,
    password: str | None = None,
    sentinel_username: str | None = None,
    sentinel_password: str | None = None,
    sentinel_timeout: float = 1.0,
    tls: bool = False,
    **options: Any,
) -> ConnectionParams:
    """Connection parameters for the master ``service_name`` found through ``sentinels``.

    The constructor form of a ``redis+sentinel://`` URL: ``sentinels`` are
    ``(host, port)`` pairs or ``"host:port"`` strings (or one string,
    ``"host:port,host:port"``); ``username`` /
    ``password`` are the master's, ``sentinel_*`` the sentinels' own;
    ``options`` are other :class:`~trio_redis_finalize.ConnectionParams`
    fields (``connect_timeout``, ``tls_ca_certs``, ``health_check_interval``
    ...).  Give the result to :func:`~trio_redis_finalize.open_client`, and
    the client to ``open_consumer`` or ``open_publisher``::

        params = sentinel_params(["10.0.0.1:26379", "10.0.0.2:26379"], "orders-master")
        async with open_client(params) as client, open_consumer(client) as consumer:
            ...

    Raises:
        ValueError: naming the parameter that is wrong.
    """
    if not isinstance(service_name, str) or not service_name:
        raise ValueError(f"service_name must be a non-empty string, got {service_name!r}")
    if isinstance(sentinels, str):  # not its characters, one by one
        sentinels = [part.strip() for part in sentinels.split(",") if part.strip()]
    nodes: list[tuple[str, int]] = []
    for item in sentinels:
        if isinstance(item, str):
            host, _, port_text = item.rpartition(":")
            if not host:
                host, port_text = item, str(SENTINEL_PORT)
            try:
                item = (host.strip("[]"), int(port_text))
            except ValueError:
                raise ValueError(f"sentinels: bad address {item!r}") from None
        host, port = item
        if not host or not 0 < int(port) < 65536:
            raise ValueError(f"sentinels: bad address {item!r}")
        nodes.append((host, int(port)))
    if not nodes:
        raise ValueError("sentinels: give at least one sentinel address")
    if isinstance(db, bool) or not isinstance(db, int) or db < 0:
        raise ValueError(f"db must be an int >= 0, got {db!r}")
    if not sentinel_timeout > 0:
        raise ValueError(f"sentinel_timeout must be > 0, got {sentinel_timeout!r}")
    return ConnectionParams(
        host=nodes[0][0], port=nodes[0][1], db=db, username=username, password=password,
        sentinels=tuple(nodes), service_name=service_name, sentinel_username=sentinel_username,
        sentinel_password=sentinel_password, sentinel_timeout=sentinel_timeout, tls=tls,
        **options,
    )
