"""Redis Cluster: commands routed by hash slot over one pool per node.

:class:`ClusterClient` has the interface of :class:`~._client.Client`
(``execute``, ``pipeline``, ``transaction``, ``evalsha``, ``connect``,
``pubsub``, ``aclose``), so the consumer does not know which one it holds.
:func:`~._open.open_client` builds one for a ``redis+cluster://`` URL.

* **Slot map** from ``CLUSTER SLOTS`` (Redis 6.2 and 7) of the first node
  that answers: the nodes already known, then the seeds of the URL.  A
  command goes to the master of the slot of its first key
  (``_core._commands.command_keys``, ``redis.crc.key_slot``: hash tags
  honoured); a command without keys (``PING``, ``SCRIPT LOAD``, ``PUBLISH``:
  classic Pub/Sub is broadcast to the whole cluster) to any node, except
  ``SCAN ... MATCH {tag}...``, which goes to the node of the tag's slot.
* **Redirections** (a ``MOVED``, ``ASK`` or ``TRYAGAIN`` reply means that the
  command did not run, so sending it again is always safe):

  - ``MOVED slot host:port``: the slot's new owner is learnt at once, the
    whole map is read again before the next command, and the command is sent
    to the new owner;
  - ``ASK slot host:port`` (a slot being migrated, the key already gone):
    ``ASKING`` and the command, once, to the given node;
  - ``TRYAGAIN`` (a multi-key command whose keys are split by a migration):
    sent again after a short pause;

  at most :data:`MAX_REDIRECTS` times per command; after that the last
  redirection error is the command's reply.
* **No retries on ambiguous failures.**  A connection error, a timeout or a
  reply that is not RESP (``InvalidResponse``) is raised to the caller (the
  map is read again before the next command, in case a node went away);
  whether to send again is the caller's decision.
* **Pipelines** are split into runs of consecutive commands of one hash
  slot, sent run after run, in order.  A run is redirected as a whole (a
  ``MOVED`` names a slot), and a run is finished (its redirections
  followed) before the next is sent, so steps on different slots keep their
  order even during a migration: a cross-slot copy-then-remove (dead letter
  on another slot) never removes before its copy is written.  Commands of
  one slot in one pipeline must not depend on each other's order (the
  consumer's are single XACKs and gated scripts).
* **Transactions** must name keys of one slot only.
* **Dedicated connections** (:meth:`ClusterClient.connect`) go to the node
  of the ``key`` they will serve and follow redirections themselves: a
  ``MOVED`` moves the connection to the new owner (in place), an ``ASK`` is
  followed on a second connection to the importing node.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
from redis import exceptions as rexc
from redis.crc import key_slot

from .._core._caps import NO_CAPABILITIES, Capabilities
from .._core._commands import Arg, Command
from .._core._replies import with_context
from ._client import Client, _is_evalsha, transaction_result
from ._connection import _CLOSE_TIMEOUT, DEFAULT_TIMEOUT, Connection, open_connection, pack_command
from ._slots import (
    MAX_REDIRECTS,
    MAX_TRYAGAIN,
    REDIRECTS,
    SLOTS,
    Address,
    key_bytes,
    one_slot,
    redirect_address,
    slot_map,
    slot_of,
    slot_runs,
    tryagain_pause,
)
from ._url import ConnectionParams

__all__ = ["ClusterClient", "RoutedConnection"]

class ClusterClient(Client):
    """A Redis Cluster client: one :class:`Client` pool per master node.

    Each node's pool holds at most ``max_connections`` connections.  See the
    module docstring for routing and redirections.  Counters:
    :attr:`moved`, :attr:`asked`, :attr:`refreshes`.
    """

    def __init__(
        self, params: ConnectionParams, *, name: str | None = None, max_connections: int = 32,
        native: bool | None = None,
    ) -> None:
        if not params.cluster_seeds:
            raise ValueError("params: a cluster client needs seed nodes (a redis+cluster:// URL)")
        super().__init__(params, name=name, max_connections=max_connections, native=native)
        self._nodes: dict[Address, Client] = {}
        self._owner: list[Address | None] = [None] * SLOTS
        self._epoch = 0
        self._stale = True
        self._refresh_lock = anyio.Lock()
        self.moved = 0
        self.asked = 0
        self.refreshes = 0

    # -- nodes and the slot map --------------------------------------------------
    def node(self, addr: Address) -> Client:
        """The pool of the node at ``addr`` (made on first use)."""
        pool = self._nodes.get(addr)
        if pool is None:
            if self._closed:
                raise rexc.ConnectionError("client is closed")
            pool = self._nodes[addr] = Client(
                self.params.for_node(*addr), name=self.name, max_connections=self.max_connections,
                native=self.native,
            )
        return pool

    @property
    def nodes(self) -> list[Address]:
        """The masters that serve slots, as the map knows them now."""
        return sorted({a for a in self._owner if a is not None})

    def owner(self, slot: int) -> Address | None:
        """The node that serves ``slot`` as the map knows it now."""
        return self._owner[slot]

    @property
    def idle_connections(self) -> int:
        return sum(p.idle_connections for p in self._nodes.values())

    @property
    def free_slots(self) -> int:
        return sum(p.free_slots for p in self._nodes.values())

    def _learn(self, slot: int, addr: Address) -> None:
        self._owner[slot] = addr
        self._stale = True  # read the whole map again before the next command

    async def refresh(self, seen_epoch: int | None = None) -> None:
        """Read the slot map again (``CLUSTER SLOTS``).

        ``seen_epoch``: the :attr:`epoch` the caller saw; when the map was
        read since, nothing is done (many callers, one refresh).

        Raises:
            redis.exceptions.ConnectionError: no node answered.
            redis.exceptions.ResponseError: a node refused (not a cluster node).
        """
        if seen_epoch is None:
            seen_epoch = self._epoch
        async with self._refresh_lock:
            if self._epoch != seen_epoch:
                return
            candidates: list[Address] = []
            for a in [*self.nodes, *self.params.cluster_seeds]:
                if a not in candidates:
                    candidates.append(a)
            errors: list[str] = []
            for addr in candidates:
                try:
                    reply = await self.node(addr).execute(
                        "CLUSTER", "SLOTS", timeout=self.params.connect_timeout
                    )
                except (rexc.ConnectionError, rexc.TimeoutError, rexc.InvalidResponse,
                        OSError) as e:
                    errors.append(f"{addr[0]}:{addr[1]}: {e}")
                    continue
                except rexc.ResponseError as e:
                    raise type(e)(
                        f"{addr[0]}:{addr[1]} is not a Redis Cluster node ({e}); "
                        "use a redis:// URL for a single server"
                    ) from None
                self._owner = slot_map(reply, addr)
                self._epoch += 1
                self._stale = False
                self.refreshes += 1
                return
            raise rexc.ConnectionError(
                "no node of the Redis Cluster answered CLUSTER SLOTS: " + "; ".join(errors)
            )

    @property
    def epoch(self) -> int:
        """How many times the slot map was read."""
        return self._epoch

    async def _route(self, slot: int | None) -> Address:
        if self._stale:
            await self.refresh(self._epoch)
        if slot is None:
            for a in self._owner:
                if a is not None:
                    return a
            return self.params.cluster_seeds[0]
        addr = self._owner[slot]
        if addr is None:
            await self.refresh(self._epoch)
            addr = self._owner[slot]
            if addr is None:
                raise rexc.ClusterDownError(f"hash slot {slot} is served by no node of the cluster")
        return addr

    async def _on_node(
        self, addr: Address, commands: Sequence[Command], timeout: float | None
    ) -> list[Any]:
        try:
            return await self.node(addr).pipeline(commands, raise_on_error=False, timeout=timeout)
        except (rexc.ConnectionError, rexc.InvalidResponse):
            self._stale = True  # the node may be gone: read the map before the next command
            raise

    async def _asking(self, addr: Address, command: Command, timeout: float | None) -> Any:
        """``ASKING`` + ``command`` on one connection of ``addr``; the command's reply."""
        node = self.node(addr)
        try:
            async with node.lease() as conn:
                replies = await conn.pipeline([("ASKING",), command], timeout=timeout)
                if isinstance(replies[1], rexc.NoScriptError) and _is_evalsha(command):
                    await node._load_scripts(conn, [command], timeout)
                    replies = await conn.pipeline([("ASKING",), command], timeout=timeout)
        except (rexc.ConnectionError, rexc.InvalidResponse):
            self._stale = True
            raise
        return replies[1]

    async def _follow(
        self, command: Command, reply: Any, source: Address, timeout: float | None
    ) -> Any:
        """Follow the redirections of ``command`` (answered ``reply`` by ``source``)."""
        redirects = waits = 0
        while redirects < MAX_REDIRECTS and waits < MAX_TRYAGAIN:
            if isinstance(reply, rexc.MovedError):
                redirects += 1
                self.moved += 1
                source = redirect_address(reply, source)
                self._learn(int(reply.slot_id), source)
                (reply,) = await self._on_node(source, [command], timeout)
            elif isinstance(reply, rexc.AskError):
                redirects += 1
                self.asked += 1
                source = redirect_address(reply, source)
                reply = await self._asking(source, command, timeout)
            elif isinstance(reply, rexc.TryAgainError):
                await anyio.sleep(tryagain_pause(waits))
                waits += 1
                source = await self._route(slot_of(command))
                (reply,) = await self._on_node(source, [command], timeout)
            else:
                break
        return reply

    async def _run(
        self, slot: int | None, commands: Sequence[Command], timeout: float | None
    ) -> list[Any]:
        """One run (commands of one slot) with its redirections followed, in order."""
        addr = await self._route(slot)
        replies = await self._on_node(addr, commands, timeout)
        for i, r in enumerate(replies):
            if isinstance(r, REDIRECTS):
                replies[i] = await self._follow(commands[i], r, addr, timeout)
        return replies

    # -- capabilities (each node's pool keeps its own, see Client) ---------------------
    @property
    def capabilities(self) -> Capabilities | None:
        """What every node answered so far has in common (None: none answered)."""
        if not self.native:
            return NO_CAPABILITIES
        known = [c for p in self._nodes.values() if (c := p.capabilities) is not None]
        if not known:
            return None
        out = known[0]
        for c in known[1:]:
            out = out.common(c)
        return out

    async def capabilities_for(self, key: Arg | None = None) -> Capabilities:
        """What the node that serves ``key``'s slot can do (its pool's, see
        :meth:`Client.capabilities_for`)."""
        slot = None if key is None else int(key_slot(key_bytes(key)))
        return await self.node(await self._route(slot)).capabilities_for()

    # -- the Client interface ----------------------------------------------------------
    async def check(self) -> None:
        """Read the slot map (raises when no seed answers or the map is empty)."""
        await self.refresh(self._epoch)
        if not self.nodes:
            raise rexc.ClusterDownError("the cluster serves no hash slot (CLUSTER ADDSLOTS missing?)")

    async def execute(self, *args: Arg, timeout: float | None = None) -> Any:
        """Run one command on the node of its key; error replies raise.

        ``timeout`` bounds each round trip (``None``: ``DEFAULT_TIMEOUT``).
        """
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        (reply,) = await self._run(slot_of(args), [args], timeout)
        if isinstance(reply, rexc.RedisError):
            raise with_context(reply, args)
        return reply

    async def _send(self, commands: Sequence[Command], timeout: float) -> list[Any]:
        """What :meth:`pipeline` sends: ``commands``, one run of consecutive
        same-slot commands at a time, each run's redirections followed.

        Replies in order, error replies as values.  See the module docstring
        for the order kept across slots.
        """
        replies: list[Any] = []
        for s, run in slot_runs(commands):
            replies.extend(await self._run(s, run, timeout))
        return replies

    async def transaction(
        self, commands: Sequence[Command], *, timeout: float | None = None
    ) -> list[Any]:
        """``MULTI`` … ``EXEC`` on the node of the commands' slot (one slot only).

        Raises:
            redis.exceptions.CrossSlotTransactionError: keys of several slots.
        """
        slot = one_slot(commands)
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        block: list[Command] = [("MULTI",), *commands, ("EXEC",)]
        addr = await self._route(slot)
        replies = await self._on_node(addr, block, timeout)
        redirects = waits = 0
        while redirects < MAX_REDIRECTS and waits < MAX_TRYAGAIN:
            redirect = next((r for r in replies[1:-1] if isinstance(r, REDIRECTS)), None)
            if redirect is None:
                break
            # a redirection at queueing time aborts the transaction: nothing ran
            if isinstance(redirect, rexc.MovedError):
                redirects += 1
                self.moved += 1
                addr = redirect_address(redirect, addr)
                self._learn(int(redirect.slot_id), addr)
                replies = await self._on_node(addr, block, timeout)
            elif isinstance(redirect, rexc.AskError):
                redirects += 1
                self.asked += 1
                addr = redirect_address(redirect, addr)
                replies = (await self._on_node(addr, [("ASKING",), *block], timeout))[1:]
            else:
                await anyio.sleep(tryagain_pause(waits))
                waits += 1
                addr = await self._route(slot)
                replies = await self._on_node(addr, block, timeout)
        return transaction_result(commands, replies)

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[Connection]:
        """Hold one pooled connection of any node (for commands without keys)."""
        async with self.node(await self._route(None)).lease() as conn:
            yield conn

    async def connect(self, *, name: str | None = None, key: Arg | None = None) -> Connection:
        """A dedicated connection to the node of ``key`` (any node without one).

        It follows redirections itself (:class:`RoutedConnection`), so a
        blocking read keeps working while its slot moves to another node.
        """
        conn_name = name or self.name
        factory = functools.partial(RoutedConnection, cluster=self, name=conn_name)
        return await self._dial_node(key, conn_name, factory)

    async def _subscriber(self, name: str | None, key: Arg | None) -> Connection:
        """To the node of ``key`` (any node: classic Pub/Sub messages reach
        every node of the cluster)."""
        return await self._dial_node(key, name)

    async def _dial_node(
        self, key: Arg | None, name: str | None,
        factory: Callable[[anyio.abc.ByteStream, ConnectionParams], Connection] = Connection,
    ) -> Connection:
        """A new connection to the node of ``key``'s slot (any node without one)."""
        slot = None if key is None else int(key_slot(key_bytes(key)))
        addr = await self._route(slot)
        try:
            conn = await open_connection(self.params.for_node(*addr), name=name, factory=factory,
                                         detect=self.native)
        except rexc.ConnectionError:
            self._stale = True
            raise
        self.node(addr)._found(conn)
        return conn

    async def aclose(self) -> None:
        """Close every node's idle connections; leased ones close when given back."""
        await super().aclose()
        for pool in list(self._nodes.values()):
            await pool.aclose()


class RoutedConnection(Connection):
    """A dedicated cluster connection that follows ``MOVED``, ``ASK`` and ``TRYAGAIN``.

    ``MOVED``: a connection to the new owner replaces this one's socket (the
    old socket is closed), and the command is sent there.  ``ASK``: the
    command goes, after ``ASKING``, over a second connection to the
    importing node, kept for the next ``ASK`` and closed with this one.
    Connection errors and timeouts are raised as on any connection.
    """

    __slots__ = ("_aside", "_cluster", "_name")

    def __init__(
        self, stream: anyio.abc.ByteStream, params: ConnectionParams, *,
        cluster: ClusterClient, name: str | None,
    ) -> None:
        super().__init__(stream, params)
        self._cluster = cluster
        self._name = name
        self._aside: Connection | None = None

    @property
    def address(self) -> Address:
        """The node this connection talks to now."""
        return (self.params.host, self.params.port)

    async def aclose(self) -> None:
        aside, self._aside = self._aside, None
        if aside is not None:
            await aside.aclose()
        await super().aclose()

    def close_now(self) -> None:
        if self._aside is not None:
            self._aside.close_now()
        super().close_now()

    async def pipeline(
        self, commands: Sequence[Command], *, timeout: float | None = None
    ) -> list[Any]:
        replies = await super().pipeline(commands, timeout=timeout)
        for i, r in enumerate(replies):
            if isinstance(r, REDIRECTS):
                replies[i] = await self._answer(commands[i], r, timeout)
        return replies

    async def _answer(self, command: Command, reply: Any, timeout: float | None) -> Any:
        """Follow the redirections of ``command``, answered ``reply``; the final reply."""
        cluster = self._cluster
        redirects = waits = 0
        while redirects < MAX_REDIRECTS and waits < MAX_TRYAGAIN:
            if isinstance(reply, rexc.MovedError):
                redirects += 1
                cluster.moved += 1
                addr = redirect_address(reply, self.address)
                cluster._learn(int(reply.slot_id), addr)
                await self._move_to(addr)
                (reply,) = await self.roundtrip(pack_command(tuple(command)), 1, timeout)
            elif isinstance(reply, rexc.AskError):
                redirects += 1
                cluster.asked += 1
                reply = await self._ask(redirect_address(reply, self.address), command, timeout)
            elif isinstance(reply, rexc.TryAgainError):
                await anyio.sleep(tryagain_pause(waits))
                waits += 1
                (reply,) = await self.roundtrip(pack_command(tuple(command)), 1, timeout)
            else:
                break
        return reply

    async def _move_to(self, addr: Address) -> None:
        """Talk to ``addr`` from now on (a new socket; the old one is closed)."""
        cluster = self._cluster
        try:
            new = await open_connection(cluster.params.for_node(*addr), name=self._name,
                                        detect=cluster.native)
        except rexc.ConnectionError:
            cluster._stale = True
            raise
        cluster.node(addr)._found(new)
        old = self._stream
        # a parser of its own (_protocol_error marks this one lost); new's holds nothing
        self._stream, self._reader, self.params = new._stream, self._new_reader(), new.params
        self.capabilities = new.capabilities
        with anyio.move_on_after(_CLOSE_TIMEOUT, shield=True):
            try:
                await old.aclose()
            except Exception:
                pass

    async def _ask(self, addr: Address, command: Command, timeout: float | None) -> Any:
        aside = self._aside
        if aside is None or aside.broken or (aside.params.host, aside.params.port) != addr:
            if aside is not None:
                await aside.aclose()
            self._aside = None
            aside = self._aside = await open_connection(
                self._cluster.params.for_node(*addr), name=self._name
            )
        replies = await aside.pipeline([("ASKING",), command], timeout=timeout)
        return replies[1]
