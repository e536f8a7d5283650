"""Redis Sentinel: the master found through the sentinels, and followed on failover.

:class:`SentinelClient` has the interface of :class:`~._client.Client`; its
connections (pooled, dedicated, Pub/Sub) all go to the master the sentinels
name for ``params.service_name``.  :func:`~._open.open_client` builds one
for a ``redis+sentinel://`` URL (or :func:`~._url.sentinel_params`).

* **Discovery:** ``SENTINEL get-master-addr-by-name`` to each sentinel in
  turn (each question with the deadline ``params.sentinel_timeout``); the
  first that names the master answers, and is asked first next time.
* **Every new connection is checked with ``ROLE``**: a server that is not a
  master (a stale answer during a failover), or answers ``ROLE`` with bytes
  that are not RESP, is refused; the client asks the sentinels again once,
  and raises ``ConnectionError`` if that does not give a master either (the
  caller backs off and tries again).
* **Sentinels down:** the last known master is used while it answers
  ``ROLE`` master (no sentinel is needed to keep consuming).
* **Rediscovery:** a connection to the master that is lost, answers bytes
  that are not RESP (something else at its address now), or answers
  ``READONLY`` / ``MASTERDOWN`` (the server is a replica now), makes the next
  new connection ask the sentinels again; a connection that got ``READONLY``
  is closed at once, so a reader's next ``connect()`` reaches the new master.
* **``+switch-master``:** while the client is open (:meth:`following`, which
  ``open_client`` enters) one task subscribes to ``+switch-master`` on one
  sentinel (the next one when it fails), asks the sentinels again after every
  (re)subscription, and on a switch closes every connection to the old
  master: idle pooled ones, leased ones and readers' dedicated ones alike
  (their requests end with ``ConnectionError``: outcome unknown, which the
  finalizer re-sends; a dedicated connection fails on its owner's next
  request even if it was idle, so a reader reconnects and re-reads its PEL
  or processing list, as after any lost connection).  The old master
  may keep accepting writes for a while after the sentinels promoted its
  replica (they reconfigure it some seconds later): what a client writes
  there is lost, so nothing is left talking to it.

No command is ever sent twice here: whether to re-send is the caller's
decision, as everywhere in the transport.
"""

from __future__ import annotations

import logging
import random
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
from redis import exceptions as rexc

from ._client import Client
from ._connection import _CLOSE_TIMEOUT, Connection, open_connection
from ._pubsub import PubSub
from ._url import ConnectionParams

__all__ = ["SWITCH_CHANNEL", "MasterConnection", "SentinelClient", "not_master"]

log = logging.getLogger("trio_redis_finalize.sentinel")

SWITCH_CHANNEL = "+switch-master"
_PING_EVERY = 5.0  # seconds between PINGs on the quiet +switch-master subscription
Address = tuple[str, int]


def not_master(reply: object) -> bool:
    """Whether an error reply says the server is not (or no longer) a usable master.

    ``READONLY`` (a replica) and ``MASTERDOWN`` (a replica that lost its
    master), bare or wrapped in a script error as Redis 6.2 wraps them;
    prefixes only (Valkey words the rest differently).
    """
    if isinstance(reply, rexc.ReadOnlyError):
        return True
    if not isinstance(reply, rexc.ResponseError):
        return False
    text = str(reply)
    for word in ("READONLY", "MASTERDOWN"):
        if text.startswith(word) or f"-{word}" in text or f": {word} " in text:
            return True
    return False


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class MasterConnection(Connection):
    """A connection to the server the sentinels named master.

    Loss or a ``READONLY`` / ``MASTERDOWN`` reply tells its client to ask the
    sentinels again; after ``READONLY`` the connection is closed (never reused).
    """

    def __init__(
        self, stream: anyio.abc.ByteStream, params: ConnectionParams, client: SentinelClient
    ) -> None:
        super().__init__(stream, params)
        self._client = client
        self.pooled = False

    async def sever(self) -> None:
        """Close the socket, but let the owner find out on its next request.

        The request (or the one in flight) fails with ``ConnectionError`` as if
        the server had closed the connection, so a reader takes its usual path
        after a lost connection: reconnect, and re-read what it may have missed
        (its PEL, its processing list).  Closing it quietly would let a reader
        that was busy elsewhere just reconnect, and never re-read what the old
        master took but did not pass on.
        """
        with anyio.move_on_after(_CLOSE_TIMEOUT, shield=True):
            try:
                await self._stream.aclose()
            except Exception:
                pass

    @property
    def address(self) -> Address:
        return (self.params.host, self.params.port)

    async def roundtrip(self, payload: bytes, n: int, *args: Any, **kwargs: Any) -> list[Any]:
        try:
            replies = await super().roundtrip(payload, n, *args, **kwargs)
        except rexc.ConnectionError:
            if self.lost:
                self._client.suspect(self.address, "connection lost")
            raise
        except rexc.InvalidResponse:  # closed, as a lost connection
            self._client.suspect(self.address, "did not answer as a Redis server")
            raise
        for reply in replies:
            if not_master(reply):
                self._client.suspect(self.address, str(reply).split(" ", 1)[0])
                await self.aclose()
                break
        return replies


class SentinelClient(Client):
    """A client of the master named ``params.service_name`` by ``params.sentinels``.

    See the module docstring.  Counters: :attr:`discoveries` (questions
    answered by a sentinel), :attr:`switches` (master changes seen),
    :attr:`refused` (new connections refused by the ``ROLE`` check).
    """

    def __init__(
        self, params: ConnectionParams, *, name: str | None = None, max_connections: int = 32,
        **options: Any,
    ) -> None:
        if not params.sentinels or not params.service_name:
            raise ValueError(
                "params: a Sentinel client needs sentinels and a service name "
                "(a redis+sentinel:// URL or sentinel_params())"
            )
        super().__init__(params, name=name, max_connections=max_connections, **options)
        self.service_name: str = params.service_name
        self._sentinels: list[Address] = list(params.sentinels)
        self._master: Address | None = None
        self._master_params: ConnectionParams | None = None
        self._stale = True
        self._epoch = 0
        self._lock = anyio.Lock()
        self._conns: weakref.WeakSet[MasterConnection] = weakref.WeakSet()
        self.discoveries = 0
        self.switches = 0
        self.refused = 0
        self.subscribed_to: Address | None = None
        """The sentinel whose ``+switch-master`` this client follows now."""

    # -- where the master is ----------------------------------------------------------
    @property
    def master(self) -> Address | None:
        """The master's address as this client knows it now (``None`` before discovery)."""
        return self._master

    @property
    def server_params(self) -> ConnectionParams:
        return self._master_params or self.params

    @property
    def sentinels(self) -> list[Address]:
        """The sentinels, in the order they are asked (the last that answered first)."""
        return list(self._sentinels)

    def suspect(self, addr: Address, why: str) -> None:
        """``addr`` failed as master: ask the sentinels before the next new connection."""
        if addr == self._master and not self._stale:
            log.info("master %r at %s:%d: %s; asking the sentinels again",
                     self.service_name, addr[0], addr[1], why)
            self._stale = True

    async def _ask(self, addr: Address) -> Address:
        params = self.params.for_sentinel(*addr)
        with anyio.fail_after(self.params.sentinel_timeout):
            conn = await open_connection(params, name=self.name)
            async with conn:
                reply = await conn.execute(
                    "SENTINEL", "get-master-addr-by-name", self.service_name,
                    timeout=self.params.sentinel_timeout,
                )
        if not reply:
            raise LookupError(f"does not know master {self.service_name!r}")
        return (_text(reply[0]), int(reply[1]))

    async def discover(self, seen_epoch: int | None = None) -> Address:
        """Ask the sentinels where the master is (one question at a time).

        ``seen_epoch``: the :attr:`epoch` the caller saw; when the sentinels were
        asked since and the answer is not suspect, that answer is returned.

        Raises:
            redis.exceptions.ConnectionError: no sentinel named the master
                (each one's reason in the message).
        """
        async with self._lock:
            if (seen_epoch is not None and seen_epoch != self._epoch and not self._stale
                    and self._master is not None):
                return self._master
            reasons = []
            for addr in list(self._sentinels):
                try:
                    master = await self._ask(addr)
                except (rexc.RedisError, OSError, TimeoutError, LookupError) as e:
                    reasons.append(f"{addr[0]}:{addr[1]}: {e or type(e).__name__}")
                    continue
                self.discoveries += 1
                if self._sentinels[0] != addr:
                    self._sentinels.remove(addr)
                    self._sentinels.insert(0, addr)
                await self._switch_to(master, f"sentinel {addr[0]}:{addr[1]}")
                return master
            self._stale = True
            raise rexc.ConnectionError(
                f"no sentinel named the master {self.service_name!r}: {'; '.join(reasons)}"
            )

    @property
    def epoch(self) -> int:
        """How many times the sentinels answered or announced a switch."""
        return self._epoch

    async def _switch_to(self, master: Address, source: str) -> None:
        """Take ``master`` as the master; close every connection to another server."""
        self._epoch += 1
        self._stale = False
        if master == self._master:
            return
        old, self._master = self._master, master
        self._master_params = self.params.for_node(*master)
        if old is None:
            return
        self.switches += 1
        log.warning("master %r moved from %s:%d to %s:%d (%s); closing connections to the old one",
                    self.service_name, old[0], old[1], master[0], master[1], source)
        for conn in list(self._conns):
            if conn.address != master:
                if conn.pooled:
                    await conn.aclose()  # idle ones are skipped, leased ones fail: re-sent
                else:
                    await conn.sever()

    # -- connections ---------------------------------------------------------------------
    async def _dial(self, name: str | None) -> Connection:
        for attempt in (0, 1):
            epoch = self._epoch
            fresh = self._stale or self._master_params is None
            if fresh:
                try:
                    await self.discover(epoch)
                except rexc.ConnectionError as e:
                    if self._master_params is None:
                        raise
                    # no sentinel answers: the last known master may still be one
                    # (the ROLE check below says whether it is)
                    log.warning("%s; trying the last known master", e)
            params = self._master_params
            assert params is not None and self._master is not None
            addr = self._master
            last = fresh or attempt == 1
            try:
                conn = await open_connection(
                    params, name=name,
                    factory=lambda stream, p: MasterConnection(stream, p, self),
                    detect=self.native,
                )
            except rexc.AuthenticationError:
                raise
            except rexc.ConnectionError as e:
                self.suspect(addr, "cannot connect")
                if last:
                    raise rexc.ConnectionError(
                        f"master {self.service_name!r} at {addr[0]}:{addr[1]} (as the sentinels "
                        f"name it) cannot be reached: {e}"
                    ) from e
                continue
            assert isinstance(conn, MasterConnection)
            try:
                role = await self._role(conn)
            except rexc.InvalidResponse as e:  # closed and suspected: as one that cannot connect
                if last:
                    raise rexc.ConnectionError(
                        f"master {self.service_name!r}, as the sentinels name it: {e}") from e
                continue
            if role == "master":
                if self._master != addr:  # a switch while we connected
                    await conn.aclose()
                    continue
                self._conns.add(conn)
                self._found(conn, f"master {self.service_name!r} at {addr[0]}:{addr[1]}")
                return conn
            await conn.aclose()
            self.refused += 1
            self.suspect(addr, f"ROLE is {role}")
            if last:
                raise rexc.ConnectionError(
                    f"{addr[0]}:{addr[1]}, named master of {self.service_name!r} by the sentinels, "
                    f"is a {role} (failover in progress?)"
                )
        raise rexc.ConnectionError(f"master {self.service_name!r} keeps moving")  # pragma: no cover

    async def _role(self, conn: Connection) -> str:
        try:
            reply = await conn.execute("ROLE", timeout=conn.params.connect_timeout)
        except rexc.ResponseError:  # ROLE not allowed to this user: trust the sentinels
            return "master"
        except BaseException:
            await conn.aclose()
            raise
        return _text(reply[0]) if reply else "?"

    async def _open(self) -> Connection:
        conn = await super()._open()
        if isinstance(conn, MasterConnection):
            conn.pooled = True
        return conn

    async def _release(self, conn: Connection) -> None:
        if isinstance(conn, MasterConnection) and conn.address != self._master:
            await conn.aclose()  # to an old master: never back into the pool
            return
        await super()._release(conn)

    async def check(self) -> None:
        """``PING`` the master (found through the sentinels); raises when it cannot be reached."""
        await self.execute("PING")

    # -- following +switch-master -----------------------------------------------------------
    @asynccontextmanager
    async def following(self) -> AsyncIterator[SentinelClient]:
        """Follow ``+switch-master`` in a background task while the block runs.

        What the block raises comes out as it is (not in an exception group).
        """
        raised: BaseException | None = None
        async with anyio.create_task_group() as tg:
            await tg.start(self.follow)
            try:
                yield self
            except BaseException as e:  # re-raised below, outside the task group
                raised = e
            finally:
                tg.cancel_scope.cancel()
        if raised is not None:
            raise raised

    async def follow(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
                     ) -> None:
        """Subscribe to ``+switch-master`` on one sentinel after another, forever.

        Reports started once subscribed, or once every sentinel failed (the
        client then works without the subscription, and this keeps trying).
        """
        reported = False
        failures = 0

        def subscribed() -> None:
            nonlocal reported, failures
            failures = 0
            if not reported:
                reported = True
                task_status.started()

        while True:
            for addr in list(self._sentinels):
                try:
                    await self._follow_one(addr, subscribed)
                except (rexc.RedisError, OSError, TimeoutError) as e:
                    # the first round at DEBUG: when no sentinel answers, the
                    # client's own check says so once (not this line too)
                    log.log(logging.INFO if reported else logging.DEBUG,
                            "+switch-master subscription on sentinel %s:%d: %s",
                            addr[0], addr[1], e)
                except Exception:  # a bug here must not end the client: log it, go on
                    log.exception("+switch-master subscription on sentinel %s:%d failed",
                                  addr[0], addr[1])
            if not reported:
                reported = True
                task_status.started()
            await anyio.sleep(random.uniform(0, min(2.0, 0.1 * 2 ** min(failures, 8))))
            failures += 1

    async def _follow_one(self, addr: Address, subscribed: Callable[[], None]) -> None:
        timeout = self.params.sentinel_timeout
        conn = await open_connection(self.params.for_sentinel(*addr), name=self.name)
        async with conn:
            ps = PubSub(conn, max_pending=100)
            await ps.subscribe(SWITCH_CHANNEL, timeout=timeout)
            self.subscribed_to = addr
            subscribed()
            # a switch may have happened while no subscription was listening
            try:
                await self.discover()
            except rexc.ConnectionError as e:
                log.warning("%s", e)
            try:
                await self._listen(ps, addr)
            finally:
                self.subscribed_to = None

    async def _listen(self, ps: PubSub, addr: Address) -> None:
        timeout = self.params.sentinel_timeout
        while True:
            msg = await ps.get_message(timeout=_PING_EVERY)
            if msg is None:
                await ps.ping(timeout=timeout)  # a quiet sentinel must still answer
                continue
            parts = _text(msg.data).split()  # name old-ip old-port new-ip new-port
            if len(parts) == 5 and parts[0] == self.service_name:
                await self._switch_to(
                    (parts[3], int(parts[4])), f"+switch-master from sentinel {addr[0]}:{addr[1]}"
                )
