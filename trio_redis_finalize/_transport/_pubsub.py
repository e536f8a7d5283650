"""A Pub/Sub connection.

Nothing reads the socket in the background: a message is read from the
connection only when :meth:`PubSub.get_message` asks for one, so a slow
subscriber leaves messages in the kernel and in the server's output buffer
(which Redis bounds with ``client-output-buffer-limit pubsub``), never in an
unbounded queue here.  The only local buffer holds messages that arrived
while waiting for a confirmation, at most ``max_pending`` of them; past that
the oldest are dropped and counted in :attr:`PubSub.dropped`.

What is not a Pub/Sub reply -- bytes that are not RESP, or a reply no
Redis server sends a subscriber -- raises ``InvalidResponse`` naming the
address and what came, from whichever call met it (:meth:`PubSub.get_message`,
a confirmation, a ping, the iterator of :meth:`PubSub.received`,
:meth:`PubSub.other`): the connection is marked lost, as after an I/O error,
and closed (the iterator, which cannot wait, only marks it closed; the
socket closes when the owner's block ends).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from itertools import chain, islice
from typing import Any

import anyio
from redis import exceptions as rexc

from .._core._commands import Arg
from ._connection import _NOT_ENOUGH, Connection, pack_command

__all__ = ["Message", "PubSub"]


# ``init=False``: the ``__init__`` below sets the slots through their
# descriptors, about twice as fast as the generated frozen ``__init__`` (one
# ``object.__setattr__`` per field); a message is built per message received.
@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Message:
    """A published message: ``pattern`` is set for pattern subscriptions."""

    channel: bytes
    data: bytes
    pattern: bytes | None = None

    def __init__(self, channel: bytes, data: bytes, pattern: bytes | None = None) -> None:
        _set_channel(self, channel)
        _set_data(self, data)
        _set_pattern(self, pattern)


_set_channel = Message.__dict__["channel"].__set__
_set_data = Message.__dict__["data"].__set__
_set_pattern = Message.__dict__["pattern"].__set__


_SHOWN = 80
"""Characters of an unexpected reply an error shows at most."""

_READ_SIZE = 16384
"""Bytes a Pub/Sub connection reads from its socket at most at once.  The
parser (hiredis) moves what it holds to the front of its buffer after every
1 KiB of replies taken from it: with messages waiting in the socket (a
subscriber behind its publishers), a 64 KiB read costs about 32 bytes
moved per byte of messages, a 16 KiB read 8 (``bench instructions``: up to
1,000 instructions per message less, for one read more per 16 KiB)."""


class PubSub:
    """Subscribe, then read messages one by one; see the module docstring."""

    def __init__(self, conn: Connection, *, max_pending: int = 1000) -> None:
        conn.read_size = _READ_SIZE
        self.conn = conn
        self._pending: collections.deque[Message] = collections.deque()
        self._max_pending = max_pending
        self.dropped = 0
        self.channels: set[bytes] = set()
        self.patterns: set[bytes] = set()

    def _keep(self, msg: Message) -> None:
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append(msg)

    def _classify(self, reply: Any) -> tuple[bytes, Any]:
        if isinstance(reply, rexc.RedisError):
            raise reply
        if isinstance(reply, bytes) and reply.upper() == b"PONG":
            return b"pong", reply  # PING before any subscription: a plain +PONG
        if not isinstance(reply, list) or not reply or not isinstance(reply[0], bytes):
            raise self._unexpected(reply)
        kind = reply[0].lower()
        if kind == b"message":
            if len(reply) != 3:
                raise self._unexpected(reply)
            self._keep(Message(channel=reply[1], data=reply[2]))
        elif kind == b"pmessage":
            if len(reply) != 4:
                raise self._unexpected(reply)
            self._keep(Message(channel=reply[2], data=reply[3], pattern=reply[1]))
        return kind, reply

    def _unexpected(self, reply: Any) -> rexc.InvalidResponse:
        """The error for ``reply``, which no Redis server sends a subscriber
        (shown at most :data:`_SHOWN` characters long); the connection is
        marked lost and closed for use."""
        shown = repr(reply)
        if len(shown) > _SHOWN:
            shown = shown[:_SHOWN] + "..."
        return self.conn.not_redis(f"unexpected Pub/Sub reply {shown}")

    async def _send(self, *args: Arg) -> None:
        if self.conn.broken:
            raise rexc.ConnectionError(f"Pub/Sub connection to {self.conn.params.address} closed")
        ok = False
        try:
            await self.conn._stream.send(pack_command(args))
            ok = True
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
            self.conn.lost = True
            raise rexc.ConnectionError(f"Pub/Sub connection lost: {e!r}") from e
        finally:
            if not ok:  # also on cancellation: part of the command may have been sent
                await self.conn.aclose()

    async def _next(self) -> tuple[bytes, Any]:
        """The next reply read from the socket, classified (:meth:`_classify`);
        a lost connection or what is not a Pub/Sub reply closes the connection."""
        try:
            return self._classify(await self.conn._read_reply())
        except (rexc.ConnectionError, rexc.InvalidResponse):
            await self.conn.aclose()
            raise

    async def _confirm(self, kind: bytes, names: set[bytes], timeout: float) -> None:
        waiting = set(names)
        try:
            with anyio.fail_after(timeout):
                while waiting:
                    got, reply = await self._next()
                    if got == kind:
                        waiting.discard(bytes(reply[1]))
        except TimeoutError:
            await self.conn.aclose()
            raise rexc.TimeoutError(f"{kind.decode().upper()} not confirmed in {timeout} s") from None

    async def subscribe(self, *channels: bytes | str, timeout: float = 5.0) -> None:
        """SUBSCRIBE and wait until the server confirmed every channel."""
        names = {c.encode() if isinstance(c, str) else c for c in channels}
        await self._send("SUBSCRIBE", *names)
        self.channels |= names  # sent: the server subscribes even if we stop waiting
        await self._confirm(b"subscribe", names, timeout)

    async def psubscribe(self, *patterns: bytes | str, timeout: float = 5.0) -> None:
        """PSUBSCRIBE and wait until the server confirmed every pattern."""
        names = {p.encode() if isinstance(p, str) else p for p in patterns}
        await self._send("PSUBSCRIBE", *names)
        self.patterns |= names  # sent: the server subscribes even if we stop waiting
        await self._confirm(b"psubscribe", names, timeout)

    async def ping(self, timeout: float = 5.0) -> None:
        """PING through the subscription; raises when no ``pong`` comes in time."""
        await self._send("PING")
        try:
            with anyio.fail_after(timeout):
                while True:
                    kind, _ = await self._next()
                    if kind == b"pong":
                        return
        except TimeoutError:
            await self.conn.aclose()
            raise rexc.TimeoutError(f"Pub/Sub PING not answered in {timeout} s") from None

    def received(self, limit: int) -> Iterator[Any]:
        """Up to ``limit`` replies already received (no I/O, no wait), as the
        parser gives them: a message is ``[b"message", channel, data]``, a
        pattern's ``[b"pmessage", pattern, channel, data]`` (the channel and
        the data last in both).  Messages kept while a confirmation was
        awaited come first, in that shape.

        An iterator that calls the parser in C, one reply per step (none is
        parsed past the step that stops it).  A reply that is not a message
        the caller expects goes to :meth:`other`, and the caller stops there:
        what follows it is left for the next call (or :meth:`get_message`).
        Bytes that are not RESP raise ``InvalidResponse`` from the iterator
        (the address named, the connection marked lost and closed for use;
        see the module docstring).
        """
        gets = self.conn._reader.gets
        pending = self._pending
        if not pending:
            return islice(iter(gets, _NOT_ENOUGH), limit)
        kept: list[list[bytes]] = []
        while pending and len(kept) < limit:
            m = pending.popleft()
            kept.append([b"message", m.channel, m.data] if m.pattern is None
                        else [b"pmessage", m.pattern, m.channel, m.data])
        return chain(kept, islice(iter(gets, _NOT_ENOUGH), limit - len(kept)))

    def other(self, reply: Any) -> None:
        """A reply :meth:`received` gave that the caller does not take: an
        error reply raised, a message kept (:meth:`get_message` returns it
        first), a confirmation or a pong noted; anything else raises
        ``InvalidResponse`` (see the module docstring)."""
        self._classify(reply)

    async def get_message(self, timeout: float | None = None) -> Message | None:
        """The next message, or ``None`` when none came within ``timeout``.

        A message already received (kept while waiting for a confirmation, or
        read from the socket with others) is returned at once: no wait, no
        timer.  ``timeout=0`` returns only such a message, never reading the
        socket.  Waiting is safe to cancel: a partly received reply stays
        buffered.
        """
        if self._pending:
            return self._pending.popleft()
        # the replies already parsed from what was read: no cancel scope, no
        # checkpoint (the reading below is one, whenever this runs dry)
        gets = self.conn._reader.gets
        try:
            while True:
                reply = gets()
                if reply is _NOT_ENOUGH:
                    break
                if reply.__class__ is list:  # the common cases, without the queue
                    if len(reply) == 3 and reply[0] == b"message":
                        return Message(reply[1], reply[2])
                    if len(reply) == 4 and reply[0] == b"pmessage":
                        return Message(reply[2], reply[3], reply[1])
                self._classify(reply)
                if self._pending:
                    return self._pending.popleft()
        except rexc.InvalidResponse:  # not a Pub/Sub reply (marked lost): close it
            await self.conn.aclose()
            raise
        if timeout is not None and timeout <= 0:
            return None
        with anyio.move_on_after(timeout if timeout is not None else float("inf")):
            while not self._pending:
                await self._next()
        if self._pending:
            return self._pending.popleft()
        return None
