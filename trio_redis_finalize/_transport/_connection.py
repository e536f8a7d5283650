"""One Redis connection on an anyio byte stream.

Commands are packed by ``hiredis.pack_command`` and replies parsed by a sans-IO
``hiredis.Reader``; error replies become redis-py exception classes.

The rule that keeps the connection in sync: one request (or pipeline) in
flight at a time, and a request interrupted after any byte was sent
(cancellation, timeout, I/O error) closes the connection for good.  It is
never reused, so a late reply can never be read as the answer to the next
request.
"""

from __future__ import annotations

import contextlib
import ssl
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import anyio
import anyio.abc
import hiredis
from redis import exceptions as rexc
from redis._parsers.base import BaseParser

from .._core import _caps
from .._core._caps import Capabilities
from .._core._commands import Arg, Command, Spliced, describe
from .._core._replies import (
    _EXTRA,
    _WRAPPED,
    NOT_RUN_CODES,
    NotRunError,
    with_context,
)
from ._keepalive import set_keepalive
from ._url import ConnectionParams

__all__ = ["DEFAULT_TIMEOUT", "Connection", "open_connection", "pack_command", "why_not_connected"]

pack_command = cast(Callable[[Sequence["Arg"]], bytes], hiredis.pack_command)
"""``hiredis.pack_command`` (its stub wrongly types the argument as a 1-tuple)."""
_parse_base = cast(Callable[[str], Exception], BaseParser.parse_error)

DEFAULT_TIMEOUT = 5.0
"""Seconds a pooled command (or pipeline) may take when its caller gives no
``timeout``: every command has a deadline."""

_NOT_ENOUGH = object()
_READ_SIZE = 65536
_CLOSE_TIMEOUT = 1.0  # a TLS close must not hang a cancelled caller
_NO_DEADLINE = contextlib.nullcontext()  # stateless: entered by any number of requests
_SHOWN = 32
"""Bytes of each end of the last read that an error about bytes that are not RESP shows."""


def _parse_error(text: str) -> rexc.RedisError:
    prefix = text.split(" ", 1)[0]
    extra = _EXTRA.get(prefix)
    err = extra(text) if extra is not None else cast(rexc.RedisError, _parse_base(text))
    if type(err) is rexc.ResponseError and (prefix in NOT_RUN_CODES or _WRAPPED.search(text)):
        err = NotRunError(str(err))
    # redis-py strips the prefix of the codes it knows (OOM, READONLY ...):
    # keep it, for :func:`classify`
    err.code = prefix  # type: ignore[attr-defined]
    return err


def _protocol_error(ref: weakref.ref[Connection]) -> Callable[[str], rexc.InvalidResponse]:
    """The parser's ``protocolError``, for the connection ``ref`` names.

    hiredis calls it with its own text (``Protocol error, got "H" as reply
    type byte``) and raises the *class* of what it returns, with that text
    again: so the class is made here, per error, and its message is the
    whole story (the address, the parser's text, the last read).
    Whoever called the parser (a round trip, a Pub/Sub read, an iterator
    over what was received) gets that error, and the connection is marked
    lost and closed for use (:meth:`Connection.not_redis`).
    """
    def error(text: str) -> rexc.InvalidResponse:
        conn = ref()
        if conn is None:  # pragma: no cover - a parser outliving its connection
            return rexc.InvalidResponse(text)
        message = str(conn.not_redis(f"{text}; {conn._last_read()}"))

        class InvalidResponse(rexc.InvalidResponse):
            def __init__(self, *args: object) -> None:
                super().__init__(message)

        # shown as redis-py's own (tracebacks, logs)
        InvalidResponse.__module__ = rexc.InvalidResponse.__module__
        InvalidResponse.__qualname__ = rexc.InvalidResponse.__qualname__
        return InvalidResponse()

    return error


class Connection:
    """A single connection; see the module docstring for the rules it keeps.

    Not for direct construction: use :func:`open_connection`.
    """

    __slots__ = ("__weakref__", "_busy", "_last", "_reader", "_stream", "broken", "capabilities",
                 "lost", "params", "read_size", "scripts")

    def __init__(self, stream: anyio.abc.ByteStream, params: ConnectionParams) -> None:
        self._stream = stream
        self._reader = self._new_reader()
        # the last read (for the error about bytes that are not RESP; at most read_size
        # bytes, held until the next read): kept, not sliced, so a read costs one
        # store (a subscriber reads a message or two at a time)
        self._last = b""
        self._busy = False
        self.read_size = _READ_SIZE
        """Bytes one read of the socket takes at most (a Pub/Sub connection reads less)."""
        self.broken = False
        self.lost = False
        self.scripts: set[bytes] = set()  # shas this connection loaded (SCRIPT LOAD)
        """The connection failed (I/O error, closed by the server), as opposed to
        being closed on purpose after a cancellation or timeout."""
        self.params = params
        self.capabilities: Capabilities | None = None
        """What the server said it can do when this connection was opened
        (``_core._caps``); None: not asked, or the server refused to say."""

    def _new_reader(self) -> hiredis.Reader:
        """A reply parser for this connection (see :func:`_protocol_error`)."""
        return hiredis.Reader(
            protocolError=_protocol_error(weakref.ref(self)),
            replyError=_parse_error,
            notEnoughData=_NOT_ENOUGH,
        )

    async def aclose(self) -> None:
        """Close the connection (shielded and bounded: safe inside a cancelled scope)."""
        self.broken = True
        with anyio.move_on_after(_CLOSE_TIMEOUT, shield=True):
            try:
                await self._stream.aclose()
            except Exception:
                pass

    def close_now(self) -> None:
        """Mark broken; the stream is closed by the next :meth:`aclose` or GC."""
        self.broken = True

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _receive(self) -> None:
        """Read what the socket has (waiting for some) into the reply parser."""
        try:
            data = await self._stream.receive(self.read_size)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                OSError) as e:
            self.lost = True
            raise rexc.ConnectionError(
                f"connection to {self.params.address} lost: {e!r}"
            ) from e
        self._last = data
        self._reader.feed(data)

    def _last_read(self) -> str:
        """The last read from the socket, in words: whole when it is short,
        else its two ends (:data:`_SHOWN` bytes each)."""
        data = self._last
        if len(data) > 2 * _SHOWN:
            return (f"the last read ({len(data)} bytes) began {data[:_SHOWN]!r} and ended "
                    f"{data[-_SHOWN:]!r}")
        return f"the last read: {data!r}"

    def not_redis(self, what: str) -> rexc.InvalidResponse:
        """The error saying ``what`` came instead of a reply: the peer is no
        Redis server (or not one any more).  It names the address; the
        connection is marked lost, as after an I/O error, and closed for use
        (its socket closed by the next :meth:`aclose`, which its owner
        awaits: a round trip at once, a pool on release, a Pub/Sub
        connection when its block ends)."""
        self.lost = True
        self.broken = True
        return rexc.InvalidResponse(f"{self.params.address} did not answer as a Redis server ({what})")

    async def _read_reply(self) -> Any:
        while True:
            reply = self._reader.gets()
            if reply is not _NOT_ENOUGH:
                return reply
            await self._receive()

    async def roundtrip(self, payload: bytes, n: int, timeout: float | None = None) -> list[Any]:
        """Send ``payload`` and read ``n`` replies (error replies returned, not raised).

        Raises:
            redis.exceptions.ConnectionError: the connection failed or was closed.
            redis.exceptions.TimeoutError: no complete answer within ``timeout``;
                the outcome of the request is unknown and the connection is closed.
            redis.exceptions.InvalidResponse: what came is not RESP (the peer is
                no Redis server): the outcome is unknown, the message names the
                address, and the connection is marked lost and closed.
        """
        if self.broken:
            raise rexc.ConnectionError(f"connection to {self.params.address} is closed")
        if self._busy:  # pragma: no cover - programming error
            raise RuntimeError("one request at a time per connection")
        self._busy = True
        ok = False
        # A bare cancel scope, not anyio.fail_after (two generator-based
        # context managers around the same scope): only its deadline can
        # cancel it, so a caught cancellation is the timeout.
        scope = None if timeout is None else anyio.CancelScope(
            deadline=anyio.current_time() + timeout)
        replies: list[Any] = []
        try:
            with _NO_DEADLINE if scope is None else scope:
                try:
                    await self._stream.send(payload)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
                    self.lost = True
                    raise rexc.ConnectionError(
                        f"connection to {self.params.address} lost: {e!r}"
                    ) from e
                # every reply parsed in this loop (no coroutine per reply); the
                # socket is read only when the parser has no complete reply
                # (bytes that are not RESP: the parser raises InvalidResponse
                # naming the address, see _protocol_error; closed below)
                gets = self._reader.gets
                append = replies.append
                while len(replies) < n:
                    reply = gets()
                    if reply is _NOT_ENOUGH:
                        await self._receive()
                    else:
                        append(reply)
            if scope is not None and scope.cancelled_caught:
                raise rexc.TimeoutError(
                    f"no reply from {self.params.address} within {timeout} s (outcome unknown)"
                )
            ok = True
            return replies
        finally:
            self._busy = False
            if not ok:
                await self.aclose()

    async def execute(self, *args: Arg, timeout: float | None = None) -> Any:
        """Run one command; an error reply is raised with the command and key named."""
        try:
            (reply,) = await self.roundtrip(pack_command(args), 1, timeout)
        except rexc.TimeoutError as e:
            raise rexc.TimeoutError(f"{e} ({describe(args)})") from None
        if isinstance(reply, rexc.RedisError):
            reply = await self._answer(args, reply, timeout)
            if isinstance(reply, rexc.RedisError):
                raise with_context(reply, args)
        return reply

    async def _answer(self, command: Command, reply: rexc.RedisError, timeout: float | None) -> Any:
        """The reply :meth:`execute` gives for ``command``, answered the error
        ``reply``: that error (a cluster's ``RoutedConnection`` follows redirections here)."""
        return reply

    async def pipeline(
        self, commands: Sequence[Command], *, timeout: float | None = None
    ) -> list[Any]:
        """Send all ``commands`` at once; replies in order, error replies as values.

        A command that is the same object as the one before it (a reader's
        ``[lmove] * 63``) is packed once.
        """
        parts: list[bytes] = []
        append = parts.append
        last: object = None
        packed = b""
        for c in commands:
            if c is not last:
                last = c
                if c.__class__ is tuple:
                    packed = pack_command(c)
                elif c.__class__ is Spliced:  # each distinct segment packed once
                    packed = c.packed(pack_command)
                else:
                    packed = pack_command(tuple(c))
            append(packed)
        payload = b"".join(parts)
        try:
            return await self.roundtrip(payload, len(commands), timeout)
        except rexc.TimeoutError as e:
            raise rexc.TimeoutError(f"{e} ({_describe_many(commands)})") from None


def _describe_many(commands: Sequence[Command]) -> str:
    if len(commands) == 1:
        return describe(commands[0])
    return f"{len(commands)} commands: " + ", ".join(describe(c) for c in commands[:3]) + (
        ", ..." if len(commands) > 3 else ""
    )


async def _connect_stream(params: ConnectionParams) -> anyio.abc.ByteStream:
    if params.path:
        return await anyio.connect_unix(params.path)
    if params.tls:
        ctx = ssl.create_default_context(cafile=params.tls_ca_certs)
        if not params.tls_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if params.tls_certfile:
            ctx.load_cert_chain(params.tls_certfile, params.tls_keyfile)
        return await anyio.connect_tcp(
            params.host, params.port, tls=True, ssl_context=ctx, tls_standard_compatible=False
        )
    return await anyio.connect_tcp(params.host, params.port)


def why_not_connected(e: BaseException, params: ConnectionParams) -> str:
    """Why a connection attempt failed, in words (``connection refused``, ...)."""
    if isinstance(e, TimeoutError):
        return f"no connection within {params.connect_timeout} s" + (
            " (TCP connect or TLS handshake: is it a TLS port?)" if params.tls else "")
    # anyio's connect_tcp: "All connection attempts failed", the attempt's error as the cause
    cause = e.__cause__ if isinstance(e.__cause__, OSError) else e
    if params.tls and isinstance(cause, (ssl.SSLError, anyio.BrokenResourceError)):
        why = getattr(cause, "verify_message", None) or getattr(cause, "reason", None) or (
            str(cause) or "the server closed the connection")
        return (f"TLS handshake failed ({why}): a plain (non-TLS) port, an unknown CA "
                "(?ssl_ca_certs=), or a server that wants a client certificate")
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused (is a Redis server running there?)"
    if isinstance(cause, FileNotFoundError):
        return "no such socket file (is a Redis server running there?)"
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror[:1].lower() + cause.strerror[1:]
    return str(cause) or type(cause).__name__


def _handshake(params: ConnectionParams, name: str | None) -> list[Command]:
    cmds: list[Command] = []
    if params.password is not None:
        if params.username:
            cmds.append(("AUTH", params.username, params.password))
        else:
            cmds.append(("AUTH", params.password))
    if params.db:
        cmds.append(("SELECT", params.db))
    if name:
        cmds.append(("CLIENT", "SETNAME", name))
    return cmds


async def open_connection(
    params: ConnectionParams, *, name: str | None = None, extra: Iterable[Command] = (),
    factory: Callable[[anyio.abc.ByteStream, ConnectionParams], Connection] = Connection,
    detect: bool = False,
) -> Connection:
    """Connect, authenticate, select the database and set the client name.

    ``factory`` builds the connection object (a :class:`Connection` subclass).
    ``detect``: ask the server what it can do (``_core._caps.DETECT``, in the
    handshake's round trip) into :attr:`Connection.capabilities`; a refused
    detection leaves it None and fails nothing.

    Raises:
        redis.exceptions.ConnectionError: the server cannot be reached in
            ``params.connect_timeout`` seconds, or the handshake failed.
    """
    try:
        with anyio.fail_after(params.connect_timeout):
            stream = await _connect_stream(params)
    except (OSError, TimeoutError, anyio.BrokenResourceError) as e:
        raise rexc.ConnectionError(
            f"cannot connect to {params.address}: {why_not_connected(e, params)}") from e
    set_keepalive(stream, params.keepalive)
    conn = factory(stream, params)
    cmds = [*_handshake(params, name), *extra]
    probe = _caps.DETECT if detect else ()
    if cmds or probe:
        try:
            replies = await conn.pipeline([*cmds, *probe], timeout=params.connect_timeout)
        except rexc.TimeoutError as e:
            raise rexc.ConnectionError(
                f"{params.address} did not answer as a Redis server (no reply to the handshake, "
                f"{_describe_many(cmds)}, within {params.connect_timeout} s)") from e
        except rexc.InvalidResponse as e:
            raise rexc.ConnectionError(str(e)) from e
        if probe:
            conn.capabilities = _caps.parse(replies[len(cmds):])
            del replies[len(cmds):]
        for cmd, reply in zip(cmds, replies, strict=True):
            if isinstance(reply, rexc.RedisError):
                await conn.aclose()
                if isinstance(reply, rexc.AuthenticationError):
                    raise rexc.AuthenticationError(f"{reply} ({params.address})")
                raise with_context(reply, cmd)
    return conn
