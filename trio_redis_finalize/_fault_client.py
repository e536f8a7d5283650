"""A fault-injecting transport client: the crash-point enumeration's and
:func:`trio_redis_finalize.testing.check_exactly_once`'s (private).

:class:`FaultClient` is the package's own transport ``Client`` with one
extra: :meth:`FaultClient.arm` picks the k-th *finalization command* sent
from now on (0-based, counted across pipelines) and what happens there:

* ``BEFORE``: the commands of the pipeline before it are sent and applied,
  then ``ConnectionError`` (it and what follows never reach Redis);
* ``AFTER``: the pipeline up to and including it is sent and applied, then
  ``ConnectionError``: the reply is lost, the outcome unknown to the caller;

and what follows the fault:

* ``then``: an async callable awaited at the fault point first (the
  command's request unsent, or applied with its reply not yet read): a
  racing finalization of the same delivery runs there, between the lost
  attempt and its resend; its own commands go through unharmed;

* by default ``ConnectionError`` (the caller may send again);
* ``cancel=True``: the call waits until it is cancelled (a shutdown deadline,
  a cancel scope around the finalizer): the request unsent (``BEFORE``) or
  applied with its reply never read (``AFTER``).  A call that is not
  cancelled (a shielded one) ends as a real stalled request would: with
  ``TimeoutError`` once its ``timeout`` is over;
* ``crash=True``: :class:`Crash`, and every later call of this client raises
  :class:`Crash` without touching Redis: the process "died" at that point; a
  new consumer (same name) on a fresh client plays the restarted process.

Finalization commands are the ones plans are made of: ``XACK``, ``XDEL``
(retention), ``XACKDEL`` (retention on Redis 8.2), ``XADD``, ``LREM``,
``LPUSH``, ``ZADD`` and the gated
finalization scripts (a batched call, many deliveries in one, is one command).
The retention trim script is not one.  Reads,
``XPENDING``, lease renewals and the delay-set mover are not counted.
"""

from __future__ import annotations

import enum
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
from redis import exceptions as rexc

from ._core.reliable_list import liveness as _reliable
from ._core.reliable_list import scripts as _list
from ._core.stream import scripts as _stream
from ._transport import Client, Command, Connection, parse_url, with_context

__all__ = ["Crash", "FaultClient", "FaultMode", "is_finalization", "open_fault_client"]


class Crash(Exception):
    """The simulated process died here: nothing after it reaches Redis."""


class FaultMode(enum.Enum):
    BEFORE = "before"
    AFTER = "after"


_FINALIZE_NAMES = {b"XACK", b"XDEL", b"XACKDEL", b"XADD", b"LREM", b"LPUSH", b"RPUSH", b"ZADD"}
_FINALIZE_SCRIPTS = {
    s.sha for s in (
        _stream.STREAM_COPY_ACK, _stream.STREAM_ZADD_ACK,
        _stream.STREAM_COPY_ACK_EX, _stream.STREAM_ZADD_ACK_DEL, _stream.STREAM_ZADD_ACKDEL,
        _stream.STREAM_COPY_ACK_BATCH, _stream.STREAM_ZADD_ACK_BATCH,
        _stream.STREAM_WRITES_ACK_BATCH, _list.LIST_WRITES_REMOVE_BATCH,
        _list.LIST_COPY_REMOVE, _list.LIST_ZADD_REMOVE, _list.LIST_REMOVE,
        _list.LIST_DEAD_PUSH, _stream.STREAM_WRITES, _list.LIST_WRITES,
        _stream.STREAM_COPY_ONCE, _stream.STREAM_XADD, _stream.STREAM_REMOVE_RECEIPT,
        _reliable.DELAYED_COPY,
    )
}


def _name(cmd: Command) -> bytes:
    head = cmd[0]
    return (head if isinstance(head, bytes) else str(head).encode()).upper()


def is_finalization(cmd: Command) -> bool:
    """True for a command a finalization plan is made of."""
    name = _name(cmd)
    if name == b"EVALSHA":
        sha = cmd[1]
        return (sha if isinstance(sha, bytes) else str(sha).encode()) in _FINALIZE_SCRIPTS
    return name in _FINALIZE_NAMES


class FaultClient(Client):
    """A :class:`Client` whose k-th finalization command can be made to fail."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._at: int | None = None
        self._mode = FaultMode.BEFORE
        self._crash = False
        self._cancel = False
        self.counted = 0
        """Finalization commands seen since the last :meth:`arm`."""
        self.sent: list[Command] = []
        """Every finalization command that reached Redis, in order."""
        self.applied: list[tuple[Command, Any]] = []
        """The same, with the reply Redis gave (seen here even when the caller
        was told the reply was lost)."""
        self.fired: Command | None = None
        """The command the fault hit, once it fired."""
        self.dead = False
        self._then: Callable[[], Awaitable[None]] | None = None

    def arm(self, k: int, mode: FaultMode, *, crash: bool = False, cancel: bool = False,
            then: Callable[[], Awaitable[None]] | None = None) -> None:
        """Fault at the k-th finalization command (0-based) sent from now on."""
        if crash and cancel:
            raise ValueError("crash and cancel exclude each other")
        self._then = then
        self._at = k
        self._mode = mode
        self._crash = crash
        self._cancel = cancel
        self.counted = 0
        self.fired = None

    def disarm(self) -> None:
        self._at = None

    def _check_alive(self) -> None:
        if self.dead:
            raise Crash("the simulated process is dead")

    async def pipeline(
        self,
        commands: Sequence[Command],
        *,
        raise_on_error: bool = True,
        timeout: float | None = None,
    ) -> list[Any]:
        self._check_alive()
        positions = [i for i, c in enumerate(commands) if is_finalization(c)]
        at = self._at
        if at is None or self.counted + len(positions) <= at:
            self.counted += len(positions)
            replies = await super().pipeline(commands, raise_on_error=False, timeout=timeout)
            self._record(commands, positions, replies, len(commands))
            if raise_on_error:
                for cmd, r in zip(commands, replies, strict=True):
                    if isinstance(r, rexc.RedisError):
                        raise with_context(r, cmd)
            return replies
        j = positions[at - self.counted]
        self._at = None
        self.counted += len(positions)
        upto = j + 1 if self._mode is FaultMode.AFTER else j
        if upto:
            replies = await super().pipeline(commands[:upto], raise_on_error=False, timeout=timeout)
            self._record(commands, positions, replies, upto)
        self.fired = commands[j]
        if self._then is not None:
            then, self._then = self._then, None
            await then()
        if self._crash:
            self.dead = True
            raise Crash(f"crash {self._mode.value} finalization command #{at}: {_name(commands[j])!r}")
        if self._cancel:
            # waits for a cancellation, as long as a real stalled request would
            with anyio.move_on_after(math.inf if timeout is None else timeout):
                await anyio.sleep_forever()
            raise rexc.TimeoutError(f"injected stall at finalization command #{at}: no reply "
                                    f"within {timeout} s (outcome unknown)")
        raise rexc.ConnectionError(
            f"injected fault {self._mode.value} finalization command #{at} ({_name(commands[j])!r})"
        )

    def _record(self, commands: Sequence[Command], positions: list[int], replies: list[Any],
                upto: int) -> None:
        for i in positions:
            if i < upto:
                self.sent.append(commands[i])
                self.applied.append((commands[i], replies[i]))

    async def execute(self, *args: Any, timeout: float | None = None) -> Any:
        self._check_alive()
        if is_finalization(args):
            (reply,) = await self.pipeline([args], timeout=timeout)
            return reply
        return await super().execute(*args, timeout=timeout)

    async def connect(self, **kwargs: Any) -> Connection:
        self._check_alive()
        return await super().connect(**kwargs)


@asynccontextmanager
async def open_fault_client(url: str, *, name: str | None = None) -> AsyncIterator[FaultClient]:
    client = FaultClient(parse_url(url), name=name, max_connections=64)
    try:
        await client.execute("PING")
        yield client
    finally:
        await client.aclose()
