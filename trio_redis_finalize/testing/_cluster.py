"""A local Redis Cluster (``trio_redis_finalize.testing``): :class:`RedisCluster`.

Three masters (by default) formed by hand with ``CLUSTER MEET`` and
``CLUSTER ADDSLOTS``, no ``redis-cli``; each node a :class:`~._server.RedisServer`.
"""

from __future__ import annotations

import signal
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._server import RedisServer, _info, _Topology, command, free_port

__all__ = ["ClusterUnavailable", "RedisCluster", "free_cluster_port"]

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
