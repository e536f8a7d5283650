"""The client: a bounded connection pool, scripts, dedicated connections, Pub/Sub.

This is the small internal interface the consumer is written against:

* :meth:`Client.execute` - one command on a pooled connection;
* :meth:`Client.pipeline` / :meth:`Client.transaction` - many in one round trip;
* :meth:`Client.evalsha` - a :class:`Script`, loaded on ``NOSCRIPT``;
* :meth:`Client.connect` - a dedicated connection (blocking reads);
* :meth:`Client.pubsub` - a Pub/Sub connection;
* :meth:`Client.capabilities_for` - what the server can do beyond Redis 6.2.

Every connection the client opens asks the server, in its handshake's round
trip, what it can do (``_core._caps``) and keeps the answer
(``Connection.capabilities``); the client reports the latest answer.  A new
connection that finds fewer capabilities than the client reported before (a
failover to an older server, a downgrade) is logged as an error naming what
is missing: subscriptions mounted before planned with it, and their
commands that use it now fail with an error reply (``ERR unknown command``,
or a syntax error): their deliveries stay pending, nothing is lost, and a
remount (a restart of the consumer) plans again with what the server has.
``native=False`` -- or the environment variable ``TRF_FALLBACK=1``, read in
:func:`native_default` -- asks nothing and reports no capability: every plan
takes the fallback (to compare the two, or to keep the older behaviour).

No automatic retries anywhere: a failed call raises, and the caller decides
what is safe to send again.  Every pooled call has a deadline: ``timeout``
when the caller gives one, else ``DEFAULT_TIMEOUT`` (5 s); a call that
gets no answer in time raises ``redis.exceptions.TimeoutError`` naming its
command and key.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
from redis import exceptions as rexc

from .._core._caps import NO_CAPABILITIES, Capabilities
from .._core._commands import SCRIPTS, Arg, Command, Script
from .._core._replies import raise_first_error
from ._connection import DEFAULT_TIMEOUT, Connection, open_connection
from ._pubsub import PubSub
from ._url import ConnectionParams

__all__ = ["FALLBACK_ENV", "Client", "Script", "native_default", "transaction_result"]

log = logging.getLogger("trio_redis_finalize.transport")

FALLBACK_ENV = "TRF_FALLBACK"
"""The environment variable that forces the fallback (see :func:`native_default`)."""


def native_default() -> bool:
    """Whether clients detect and use what the server adds (Redis 8.2's stream
    commands ...): yes unless ``TRF_FALLBACK`` is set to something other than
    ``""`` or ``"0"``.  The one place the variable is read."""
    return os.environ.get(FALLBACK_ENV, "") in ("", "0")


def _loads(commands: Sequence[Command], loaded: set[bytes]) -> tuple[dict[bytes, Command], bool]:
    """``SCRIPT LOAD`` (by sha) of every script ``commands`` run that is not in
    ``loaded``; and whether any command is an ``EVALSHA`` (:func:`_is_evalsha`:
    only those can be answered ``NOSCRIPT``)."""
    out: dict[bytes, Command] = {}
    scripts = False
    for c in commands:
        name = c[0]
        if name == b"EVALSHA":
            scripts = True
            sha = c[1]
            if isinstance(sha, bytes) and sha not in loaded and sha not in out:
                script = SCRIPTS.get(sha)
                if script is not None:
                    out[sha] = (b"SCRIPT", b"LOAD", script.source)
        elif isinstance(name, str) and len(name) == 7 and name.upper() == "EVALSHA":
            scripts = True
    return out, scripts


def _is_evalsha(cmd: Command) -> bool:
    return cmd[0] == b"EVALSHA" or (isinstance(cmd[0], str) and cmd[0].upper() == "EVALSHA")


HEALTH_CHECK_TIMEOUT = 1.0
"""Deadline of the ``PING`` that checks an idle pooled connection before reuse."""


class Client:
    """A pool of at most ``max_connections`` connections to one server.

    Waiting for a free slot is fair (FIFO) and cancellation-safe; a slot is
    given back whatever happens to the call that held it.  A connection that
    was interrupted mid-request is closed, and its slot is then filled with a
    fresh connection on demand.

    Connections that notice silence: an idle connection is reused only after
    a ``PING`` (deadline ``health_check_timeout``) when it has been idle
    ``params.health_check_interval`` seconds or more, so a connection a
    firewall or a partition silently cut costs a short check, not a command's
    whole deadline; a failed check closes it and every connection idle even
    longer.  (Every connection also has TCP keepalive, ``params.keepalive``.)

    Use :func:`open_client` to build one.
    """

    def __init__(
        self, params: ConnectionParams, *, name: str | None = None, max_connections: int = 32,
        health_check_timeout: float = HEALTH_CHECK_TIMEOUT, native: bool | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not health_check_timeout > 0:
            raise ValueError(f"health_check_timeout must be > 0, got {health_check_timeout!r}")
        self.params = params
        self.name = name
        self.max_connections = max_connections
        self.health_check_timeout = health_check_timeout
        # fast_acquire: no extra trip through the scheduler when a slot is free;
        # a released slot still goes to the longest waiter first.
        self._slots = anyio.Semaphore(max_connections, fast_acquire=True)
        self._idle: list[tuple[Connection, float]] = []  # (connection, idle since), oldest first
        self._closed = False
        self.connections_opened = 0
        self.health_checks = 0
        self.health_check_failures = 0
        self.native = native_default() if native is None else native
        """Detect and report what the server can do beyond Redis 6.2 (False:
        report nothing: the fallback everywhere)."""
        self._caps: Capabilities | None = None if self.native else NO_CAPABILITIES
        self._reported = NO_CAPABILITIES  # what capabilities_for() handed out so far

    # -- capabilities ------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities | None:
        """What the latest connection opened found the server can do (None:
        no connection answered yet)."""
        return self._caps

    def _found(self, conn: Connection, where: str | None = None) -> None:
        """A new connection's detected capabilities (``conn.capabilities``)."""
        if not self.native:
            return
        caps = conn.capabilities
        if caps is None:  # the server did not say (refused COMMAND): nothing learnt
            return
        lost = self._reported.missing(caps)
        if lost:
            log.error(
                "%s has no %s, which subscriptions mounted earlier planned with (a "
                "failover to an older server?): their commands that use it now fail and "
                "their deliveries stay pending; remount (restart the consumer) to plan with "
                "what this server has", where or self.params.address, ", ".join(lost),
                extra={"capabilities": str(caps), "missing": lost},
            )
            # said once: a mount from now on plans with what this server has
            self._reported = Capabilities(**{n: True for n in self._reported.names if n not in lost})
        self._caps = caps

    async def capabilities_for(self, key: Arg | None = None) -> Capabilities:
        """What the server that serves ``key`` can do, for a mount to plan
        with (opens a connection when none answered yet).  Remembered: a
        later connection finding less is logged (see the module docstring)."""
        if self._caps is None:
            await self.execute("PING")  # a pooled connection: detected in its handshake
        caps = self._caps or NO_CAPABILITIES
        self._reported = self._reported.union(caps)
        return caps

    # -- pool --------------------------------------------------------------
    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    @property
    def free_slots(self) -> int:
        return self._slots.value

    @property
    def server_params(self) -> ConnectionParams:
        """The parameters of the server commands go to now (a Sentinel client: the master's)."""
        return self.params

    async def _dial(self, name: str | None) -> Connection:
        """A new connection to the server (pooled or dedicated), its
        capabilities detected (see :attr:`native`)."""
        conn = await open_connection(self.params, name=name, detect=self.native)
        self._found(conn)
        return conn

    async def _open(self) -> Connection:
        if self._closed:
            raise rexc.ConnectionError("client is closed")
        conn = await self._dial(self.name)
        self.connections_opened += 1
        return conn

    async def _lease(self) -> Connection:
        idle = self._idle
        while idle:
            conn, since = idle.pop()  # the most recently used first
            if conn.broken:
                continue
            quiet = anyio.current_time() - since >= self.params.health_check_interval
            if quiet and not await self._healthy(conn):
                # the others have been idle even longer: most likely just as dead
                stale, self._idle = self._idle, []
                for other, _ in stale:
                    await other.aclose()
                break
            return conn
        return await self._open()

    async def _healthy(self, conn: Connection) -> bool:
        """``PING`` an idle connection before reuse; a failed one is closed."""
        self.health_checks += 1
        try:
            await conn.execute("PING", timeout=self.health_check_timeout)
        except (rexc.RedisError, OSError):
            self.health_check_failures += 1
            await conn.aclose()
            return False
        return True

    async def _release(self, conn: Connection) -> None:
        """Give ``conn`` back: kept when healthy, else closed (never reused).

        When the connection was *lost* (I/O error, killed or restarted server)
        the idle connections are closed too: they are most likely just as dead,
        and each would otherwise cost a caller one more ``ConnectionError``.
        """
        if not conn.broken and not self._closed:
            self._idle.append((conn, anyio.current_time()))
            return
        await conn.aclose()  # shielded; a no-op when already closed
        if conn.lost:
            idle, self._idle = self._idle, []
            for other, _ in idle:
                await other.aclose()

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[Connection]:
        """Hold one pooled connection for several requests."""
        async with self._slots:
            conn = await self._lease()
            try:
                yield conn
            finally:
                await self._release(conn)

    async def execute(self, *args: Arg, timeout: float | None = None) -> Any:
        """Run one command on a pooled connection; error replies raise.

        ``timeout``: seconds (``None``: 5 s, ``DEFAULT_TIMEOUT``).
        """
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        async with self._slots:
            conn = await self._lease()
            try:
                return await conn.execute(*args, timeout=timeout)
            finally:
                await self._release(conn)

    async def pipeline(
        self,
        commands: Sequence[Command],
        *,
        raise_on_error: bool = True,
        timeout: float | None = None,
    ) -> list[Any]:
        """Send ``commands`` in one round trip; replies in order.

        ``EVALSHA`` commands answered ``NOSCRIPT`` did not run: their scripts
        are loaded and those commands (only) are sent again, in their order.
        With ``raise_on_error`` the first error reply is raised (the other
        commands ran); otherwise error replies are returned as values.
        ``timeout`` bounds each round trip (``None``: ``DEFAULT_TIMEOUT``).
        """
        replies = await self._send(commands, DEFAULT_TIMEOUT if timeout is None else timeout)
        if raise_on_error:
            raise_first_error(commands, replies)
        return replies

    async def _send(self, commands: Sequence[Command], timeout: float) -> list[Any]:
        """What :meth:`pipeline` sends: ``commands`` in one round trip on a
        pooled connection; replies in order, error replies as values."""
        if not commands:
            return []
        async with self._slots:
            conn = await self._lease()
            try:
                # Scripts this connection has not loaded go first, in the same
                # round trip: an EVALSHA answered NOSCRIPT would run only
                # after the commands behind it, out of their order (a copy
                # after the removal of an identical element, say).
                loads, scripts = _loads(commands, conn.scripts)
                if loads:
                    replies = await conn.pipeline([*loads.values(), *commands], timeout=timeout)
                    for sha, r in zip(loads, replies, strict=False):
                        if not isinstance(r, rexc.RedisError):
                            conn.scripts.add(sha)
                    del replies[: len(loads)]
                else:
                    replies = await conn.pipeline(commands, timeout=timeout)
                missing = [
                    i for i, r in enumerate(replies)
                    if isinstance(r, rexc.NoScriptError) and _is_evalsha(commands[i])
                ] if scripts else None
                if missing:
                    await self._load_scripts(conn, [commands[i] for i in missing], timeout)
                    again = await conn.pipeline([commands[i] for i in missing], timeout=timeout)
                    for i, r in zip(missing, again, strict=True):
                        replies[i] = r
            finally:
                await self._release(conn)
        return replies

    async def transaction(
        self, commands: Sequence[Command], *, timeout: float | None = None
    ) -> list[Any]:
        """``MULTI`` … ``EXEC``; returns the list of replies of the commands."""
        replies = await self.pipeline(
            [("MULTI",), *commands, ("EXEC",)], raise_on_error=False, timeout=timeout
        )
        return transaction_result(commands, replies)

    async def _load_scripts(
        self, conn: Connection, commands: Sequence[Command], timeout: float | None
    ) -> None:
        shas = {bytes(c[1]) if isinstance(c[1], bytes) else str(c[1]).encode() for c in commands}
        loads: list[Command] = []
        for sha in shas:
            script = SCRIPTS.get(sha)
            if script is None:
                raise rexc.NoScriptError(f"NOSCRIPT and no source known for sha {sha!r}")
            loads.append((b"SCRIPT", b"LOAD", script.source))
        for r in await conn.pipeline(loads, timeout=timeout):
            if isinstance(r, rexc.RedisError):
                raise r

    async def evalsha(
        self, script: Script, keys: Sequence[Arg], args: Sequence[Arg], *,
        timeout: float | None = None,
    ) -> Any:
        """Run ``script``; a ``NOSCRIPT`` answer loads it and runs it once more."""
        (reply,) = await self.pipeline([script.command(keys, args)], timeout=timeout)
        return reply

    # -- dedicated connections -------------------------------------------------
    async def connect(self, *, name: str | None = None, key: Arg | None = None) -> Connection:
        """A new connection outside the pool, owned (and closed) by the caller.

        Use ``async with await client.connect() as conn:``.  ``key``: the key
        the connection will serve (Redis Cluster connects to its node; one
        server ignores it).
        """
        return await self._dial(name or self.name)

    @asynccontextmanager
    async def pubsub(
        self, *, name: str | None = None, max_pending: int = 1000, key: Arg | None = None
    ) -> AsyncIterator[PubSub]:
        """A Pub/Sub connection, closed on exit (``key``: as for :meth:`connect`)."""
        conn = await self._subscriber(name or self.name, key)
        ps = PubSub(conn, max_pending=max_pending)
        try:
            yield ps
        finally:
            await conn.aclose()

    async def _subscriber(self, name: str | None, key: Arg | None) -> Connection:
        """The new connection :meth:`pubsub` subscribes on."""
        return await self._dial(name)

    async def check(self) -> None:
        """``PING`` the server (raises when it cannot be reached).

        Raises:
            redis.exceptions.ConnectionError: the server cannot be reached,
                or what answers is not a Redis server (the message names
                the address).
        """
        try:
            await self.execute("PING")
        except rexc.InvalidResponse as e:
            raise rexc.ConnectionError(str(e)) from e
        except rexc.TimeoutError as e:
            raise rexc.ConnectionError(
                f"{self.params.address} did not answer as a Redis server (no reply to PING "
                f"within {DEFAULT_TIMEOUT} s)") from e

    async def aclose(self) -> None:
        """Close every idle connection; leased ones close when given back."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            await conn.aclose()


def transaction_result(commands: Sequence[Command], replies: Sequence[Any]) -> list[Any]:
    """The commands' replies from the replies of ``MULTI``, ``commands``, ``EXEC``."""
    raise_first_error(commands, replies[1:-1])
    result = replies[-1]
    if isinstance(result, rexc.RedisError):
        raise result
    if result is None:
        raise rexc.WatchError("transaction aborted")
    out: list[Any] = result
    return out
