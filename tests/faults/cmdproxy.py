"""A command-aware fault proxy: one fault at the k-th request of a command kind.

::

    async with anyio.create_task_group() as tg:
        proxy = CommandProxy(upstream_port=server.port, flavour="redis")
        await tg.start(proxy.serve)                  # proxy.url: redis://127.0.0.1:<port>/0
        proxy.arm("XACK", LOST)                      # the 1st XACK runs, its reply is lost
        proxy.arm("XREADGROUP>", BLACKHOLE, at=2)    # the 3rd XREADGROUP >: a silent link
        proxy.arm("EVALSHA:stream_copy_ack", error("OOM"))   # OOM instead of running it
        ...
        tg.cancel_scope.cancel()

The proxy parses the RESP requests the client sends (pipelines included:
several requests in one TCP segment) and the replies the server sends back,
and maps each reply to its request in order.  Every request gets a *kind*
(see :func:`kind_of`): the command name, refined where one name does several
jobs (``XREADGROUP>`` reads new entries, ``XREADGROUP0`` re-reads the own
PEL, ``EVALSHA:<script name>`` names the library's script by its sha,
``XGROUP CREATE``, ``XPENDING IDLE`` is the stream reaper's look for a dead
consumer's entries idle enough).  For an armed ``(kind, k)`` the k-th request of that kind
(0-based, counted from :meth:`CommandProxy.arm`) meets its fault:

* :data:`LOST` -- forwarded (the server runs it); its reply is dropped and
  both sides of the connection are reset (RST): "the reply was lost";
* :data:`BLACKHOLE` -- neither it nor anything after it on that connection is
  forwarded, either way; the sockets stay open: a silently dead link (the
  client only learns by its own deadline);
* :func:`error` -- an error reply is sent *instead of* running it (the request
  never reaches the server), in the server's own wording
  (:data:`TRANSIENT_ERRORS`, or a final one of :data:`FINAL_ERRORS`);
  :func:`wrapped` gives the Redis 6.2 form of an error raised inside a
  script (``-ERR Error running script ... -READONLY``);
* :data:`GARBLED` -- forwarded (the server runs it); its reply is replaced
  with bytes that are not RESP (:data:`NOT_RESP`, an HTTP status line) and
  nothing more is sent to the client on that connection: "something that is
  not Redis answered", the outcome unknown to the client;
  :data:`GARBLED_INSTEAD` sends those bytes *instead of* running it.

A reply can be rewritten per kind (:attr:`CommandProxy.rewrites`): e.g. the
node addresses of ``CLUSTER SLOTS``, so that a cluster client's connections
to a one-node Redis Cluster go through the proxy too.

Once a connection sent ``SUBSCRIBE``/``PSUBSCRIBE`` its replies are no longer
one per request (pushed messages): from then on they are forwarded as they
come (faults still apply to the requests), and :meth:`CommandProxy.push`
sends such a connection's client bytes of the test's own (a message, or
:data:`NOT_RESP`), as if the server had.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import anyio.abc
import hiredis
from anyio.abc import TaskStatus

from .chaosproxy import close_stream, serve_loopback

__all__ = [
    "BLACKHOLE",
    "FINAL_ERRORS",
    "GARBLED",
    "GARBLED_INSTEAD",
    "LOST",
    "NOT_RESP",
    "TRANSIENT_ERRORS",
    "CommandProxy",
    "Fault",
    "error",
    "kind_of",
    "script_names",
    "wrapped",
]

# The servers' own wording (Redis 6.2/7.0, Valkey 9.1: "Valkey" for "Redis").
TRANSIENT_ERRORS: dict[str, str] = {
    "OOM": "OOM command not allowed when used memory > 'maxmemory'.",
    "BUSY": "BUSY {Server} is busy running a script. You can only call SCRIPT KILL or "
            "SHUTDOWN NOSAVE.",
    "READONLY": "READONLY You can't write against a read only replica.",
    "LOADING": "LOADING {Server} is loading the dataset in memory",
    "MASTERDOWN": "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set "
                  "to 'no'.",
    "MISCONF": "MISCONF {Server} is configured to save RDB snapshots, but it's currently "
               "unable to persist to disk. Commands that may modify the data set are "
               "disabled, because this instance is configured to report errors during "
               "writes if RDB snapshotting fails (stop-writes-on-bgsave-error option). "
               "Please check the {Server} logs for details about the RDB error.",
    "NOREPLICAS": "NOREPLICAS Not enough good replicas to write.",
    "TRYAGAIN": "TRYAGAIN Multiple keys request during rehashing of slot",
    "CLUSTERDOWN": "CLUSTERDOWN The cluster is down",
    "NOSCRIPT": "NOSCRIPT No matching script. Please use EVAL.",
}
# Final error replies (the command will not succeed if sent again), for
# :func:`error` too: what an ACL change or a key of another type answers.
FINAL_ERRORS: dict[str, str] = {
    "NOPERM": "NOPERM this user has no permissions to run this command",
    "WRONGTYPE": "WRONGTYPE Operation against a key holding the wrong kind of value",
}
_ERRORS = {**TRANSIENT_ERRORS, **FINAL_ERRORS}
NOT_RESP = b"HTTP/1.1 400 Bad Request\r\n"
"""What :data:`GARBLED` answers: no RESP type byte (``H``)."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """What happens to the chosen request: ``lost``, ``blackhole``, ``error``,
    ``garbled`` or ``garbled-instead``."""

    action: str
    code: str = ""  # error: the error's prefix (OOM, BUSY, ...)
    wrapped: bool = False  # error: the Redis 6.2 "Error running script" form

    @property
    def label(self) -> str:
        if self.action != "error":
            return self.action
        return f"{'wrapped-' if self.wrapped else ''}{self.code}"

    def reply(self, flavour: str, sha: str = "") -> bytes:
        if self.action == "garbled-instead":
            return NOT_RESP
        server = "Valkey" if flavour == "valkey" else "Redis"
        text = _ERRORS[self.code].format(Server=server)
        if self.wrapped:
            text = (f"ERR Error running script (call to f_{sha}): @user_script:4: "
                    f"@user_script: 4: -{text}")
        return b"-" + text.encode() + b"\r\n"


LOST = Fault("lost")
BLACKHOLE = Fault("blackhole")
GARBLED = Fault("garbled")
GARBLED_INSTEAD = Fault("garbled-instead")


def error(code: str) -> Fault:
    if code not in _ERRORS:
        raise ValueError(f"code must be one of {sorted(_ERRORS)}, got {code!r}")
    return Fault("error", code)


def wrapped(code: str) -> Fault:
    return dataclasses.replace(error(code), wrapped=True)


def script_names() -> dict[bytes, str]:
    """sha -> name of every script the library defines (any of its modules)."""
    from trio_redis_finalize._transport import Script

    out: dict[bytes, str] = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("trio_redis_finalize") or mod is None:
            continue
        for value in list(vars(mod).values()):
            if isinstance(value, Script):
                sha = value.sha if isinstance(value.sha, bytes) else str(value.sha).encode()
                out[sha] = str(value.name or sha.decode())
    return out


def kind_of(args: Sequence[bytes], scripts: dict[bytes, str] | None = None) -> str:
    """The kind of a request (see the module docstring)."""
    if not args:
        return "?"
    name = args[0].upper().decode(errors="replace")
    if name in ("EVALSHA", "EVALSHA_RO") and len(args) > 1:
        names = scripts if scripts is not None else script_names()
        return "EVALSHA:" + names.get(args[1].lower(), args[1].decode(errors="replace"))
    if name == "XREADGROUP":
        upper = [a.upper() for a in args]
        if b"STREAMS" in upper:
            ids = args[upper.index(b"STREAMS") + 1:]
            last = ids[len(ids) // 2:] if ids else []
            return "XREADGROUP>" if last and all(i == b">" for i in last) else "XREADGROUP0"
    if name == "XPENDING" and len(args) > 3 and args[3].upper() == b"IDLE":
        return "XPENDING IDLE"
    if name in ("XGROUP", "SCRIPT", "CLIENT", "CONFIG", "XINFO", "CLUSTER") and len(args) > 1:
        return f"{name} {args[1].upper().decode(errors='replace')}"
    return name


def _frame_end(buf: bytes | bytearray, pos: int) -> int | None:
    """End offset of the RESP2/RESP3 frame at ``pos``, or None while incomplete."""
    nl = buf.find(b"\r\n", pos)
    if nl < 0:
        return None
    t = buf[pos:pos + 1]
    end = nl + 2
    if t in (b"$", b"!", b"="):
        n = int(buf[pos + 1:nl])
        if n < 0:
            return end
        end += n + 2
        return end if len(buf) >= end else None
    if t in (b"*", b"~", b">", b"%", b"|"):
        n = int(buf[pos + 1:nl])
        if n < 0:
            return end
        for _ in range(2 * n if t in (b"%", b"|") else n):
            e = _frame_end(buf, end)
            if e is None:
                return None
            end = e
        return end
    return end  # simple string, error, integer, RESP3 scalars, inline command


def _parse_request(frame: bytes) -> list[bytes]:
    if not frame.startswith(b"*"):  # an inline command
        return frame.strip().split()
    reader = hiredis.Reader()
    reader.feed(frame)
    parsed = reader.gets()
    return [a if isinstance(a, bytes) else str(a).encode() for a in parsed] if parsed else []


@dataclasses.dataclass
class _Slot:
    """One reply the client waits for: from the server, injected, or to be lost."""

    kind: str
    inject: bytes | None = None
    lose: bool = False
    garble: bool = False


@dataclasses.dataclass
class Fired:
    """A fault that fired: which request, on which connection."""

    kind: str
    k: int
    fault: Fault
    args: list[bytes]
    conn: int


class _Conn:
    def __init__(self, proxy: CommandProxy, cid: int, client: anyio.abc.SocketStream,
                 upstream: anyio.abc.SocketStream) -> None:
        self.proxy = proxy
        self.id = cid
        self.client = client
        self.upstream = upstream
        self.slots: collections.deque[_Slot] = collections.deque()
        self.send_lock = anyio.Lock()
        self.blackholed = False
        self.pubsub = False
        self.closed = False

    async def _to_client(self, data: bytes) -> None:
        if data and not self.blackholed and not self.closed:
            async with self.send_lock:
                await self.client.send(data)

    async def _flush_injected(self) -> None:
        out = b""
        while self.slots and self.slots[0].inject is not None:
            out += self.slots.popleft().inject or b""
        await self._to_client(out)

    async def _frames(self, stream: anyio.abc.SocketStream) -> AsyncIterator[list[bytes]]:
        """What arrives on ``stream``, as the complete RESP frames of each read
        (nothing once the connection is blackholed)."""
        buf = bytearray()
        while True:
            data = await stream.receive(65536)
            if self.blackholed:
                continue
            buf += data
            frames = []
            pos = 0
            while (end := _frame_end(buf, pos)) is not None:
                frames.append(bytes(buf[pos:end]))
                pos = end
            del buf[:pos]
            yield frames
            if self.blackholed:
                buf.clear()

    async def up(self) -> None:
        async for frames in self._frames(self.client):
            forward = bytearray()
            for frame in frames:
                if not frame.strip():
                    continue
                args = _parse_request(frame)
                kind = kind_of(args, self.proxy.scripts)
                fault = self.proxy._decide(kind, args, self.id)
                if fault is not None and fault.action == "blackhole":
                    self.blackholed = True
                    break
                if fault is not None and fault.action in ("error", "garbled-instead"):
                    sha = args[1].decode(errors="replace") if len(args) > 1 else ""
                    self.slots.append(_Slot(kind, inject=fault.reply(self.proxy.flavour, sha)))
                    if forward:
                        await self.upstream.send(bytes(forward))
                        forward.clear()
                    await self._flush_injected()
                    continue
                garble = fault is not None and fault.action == "garbled"
                if not self.pubsub:
                    self.slots.append(_Slot(kind, lose=fault is not None and not garble,
                                            garble=garble))
                elif fault is not None:  # in Pub/Sub mode: the next frame is the victim
                    self.slots.append(_Slot(kind, lose=not garble, garble=garble))
                if kind in ("SUBSCRIBE", "PSUBSCRIBE", "SSUBSCRIBE") and fault is None:
                    self.pubsub = True
                forward += frame
            if forward:
                await self.upstream.send(bytes(forward))

    async def down(self) -> None:
        async for frames in self._frames(self.upstream):
            out = bytearray()
            for frame in frames:
                if self.pubsub and not any(s.lose or s.garble for s in self.slots):
                    out += frame
                    continue
                while self.slots and self.slots[0].inject is not None:
                    out += self.slots.popleft().inject or b""
                slot = self.slots.popleft() if self.slots else _Slot("?")
                if slot.lose:
                    await self._to_client(bytes(out))
                    await self.proxy._reset(self)
                    return
                if slot.garble:  # the client gets nothing more; it closes the connection
                    await self._to_client(bytes(out) + NOT_RESP)
                    self.closed = True
                    await anyio.sleep_forever()
                rewrite = self.proxy.rewrites.get(slot.kind)
                out += frame if rewrite is None else rewrite(frame)
            while self.slots and self.slots[0].inject is not None:
                out += self.slots.popleft().inject or b""
            await self._to_client(bytes(out))


class CommandProxy:
    """Forward ``127.0.0.1:<port>`` to a redis-server; faults per command kind.

    Args:
        upstream_port: the real server's port (loopback).
        flavour: ``"redis"`` or ``"valkey"``: the wording of injected errors.
    """

    def __init__(self, upstream_port: int, *, flavour: str = "redis",
                 upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.flavour = flavour
        self.port = 0
        self.scripts = script_names()
        self.seen: collections.Counter[str] = collections.Counter()
        """Requests per kind since the last :meth:`reset`."""
        self.fired: list[Fired] = []
        self.rewrites: dict[str, Callable[[bytes], bytes]] = {}
        """kind -> a function of its reply (the RESP frame) that the client gets instead."""
        self._armed: dict[tuple[str, int], Fault] = {}
        self._conns: dict[int, _Conn] = {}
        self._next_id = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def arm(self, kind: str, fault: Fault, *, at: int = 0) -> None:
        """Apply ``fault`` to the ``at``-th request (0-based) of ``kind`` from now on."""
        self._armed[kind, self.seen[kind] + at] = fault

    def disarm(self) -> None:
        """Forget the faults that have not fired."""
        self._armed.clear()

    def reset(self) -> None:
        """Forget armed faults, counts and fired faults (a new case)."""
        self._armed.clear()
        self.seen.clear()
        self.fired.clear()

    @property
    def pending(self) -> list[tuple[str, int, Fault]]:
        """Armed faults that have not fired."""
        return [(k, n, f) for (k, n), f in self._armed.items()]

    def _decide(self, kind: str, args: list[bytes], cid: int) -> Fault | None:
        n = self.seen[kind]
        self.seen[kind] += 1
        fault = self._armed.pop((kind, n), None)
        if fault is not None:
            self.fired.append(Fired(kind, n, fault, args, cid))
        return fault

    async def _reset(self, conn: _Conn) -> None:
        conn.closed = True
        self._conns.pop(conn.id, None)
        for s in (conn.client, conn.upstream):
            await close_stream(s, rst=True)

    async def push(self, data: bytes) -> int:
        """Send ``data`` to the client of every connection in Pub/Sub mode, in
        one write, as if the server had sent it; how many connections got it."""
        n = 0
        for conn in list(self._conns.values()):
            if conn.pubsub and not conn.closed and not conn.blackholed:
                await conn._to_client(data)
                n += 1
        return n

    async def cut_all(self) -> None:
        """Reset every connection (blackholed ones included), e.g. between cases."""
        for conn in list(self._conns.values()):
            await self._reset(conn)

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        await serve_loopback(self, self._handle, task_status)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        try:
            upstream = await anyio.connect_tcp(*self.upstream)
        except OSError:
            await client.aclose()
            return
        self._next_id += 1
        conn = _Conn(self, self._next_id, client, upstream)
        self._conns[conn.id] = conn
        try:
            async with anyio.create_task_group() as tg:
                async def pump(fn: Any) -> None:
                    try:
                        await fn()
                    except (anyio.EndOfStream, anyio.BrokenResourceError,
                            anyio.ClosedResourceError, OSError):
                        pass
                    if conn.blackholed and fn == conn.down:
                        # a silent link: the client's side stays open until it closes it
                        await anyio.sleep_forever()
                    tg.cancel_scope.cancel()

                tg.start_soon(pump, conn.up)
                tg.start_soon(pump, conn.down)
        finally:
            await self._reset(conn)

    def __repr__(self) -> str:
        return f"CommandProxy(port={self.port}, fired={self.fired}, armed={self.pending})"


C = TypeVar("C", bound=CommandProxy)


@asynccontextmanager
async def serving(proxy: C) -> AsyncIterator[C]:
    """``proxy`` serving meanwhile; on leaving every connection is cut, then it stops."""
    async with anyio.create_task_group() as tg:
        await tg.start(proxy.serve)
        yield proxy
        await proxy.cut_all()
        tg.cancel_scope.cancel()
