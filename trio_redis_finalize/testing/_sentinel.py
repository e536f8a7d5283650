"""A Sentinel topology on loopback (``trio_redis_finalize.testing``): :class:`RedisSentinel`.

A master, its replicas and three sentinels (``redis-server <conf>
--sentinel``, generated config files), each a :class:`~._server.RedisServer`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from ._server import RedisServer, _info, _Topology, command

__all__ = ["RedisSentinel"]


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
