"""A loopback TCP fault proxy for trio tests (anyio; no docker, no toxiproxy).

::

    async with trio.open_nursery() as n:
        proxy = ChaosProxy(upstream_port=server.port)
        await n.start(proxy.serve)              # proxy.url: redis://127.0.0.1:<port>/0
        proxy.latency = 0.02                    # seconds per chunk, both directions
        proxy.stall(); proxy.heal()             # hold every byte (a silent partition)
        proxy.drop_down = True                  # read and discard server->client bytes
        await proxy.cut(rst=True)               # RST (or FIN) every live connection
        proxy.refuse = True                     # accept-and-close new connections
        n.cancel_scope.cancel()

A stall holds bytes inside the proxy: the kernel still accepts connections
and the peers see no error, exactly like a partition inside the TCP timeout.
Bytes read before or during a stall are forwarded after :meth:`heal` (a
request "lost" by the client may still reach the server late).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import anyio.abc
from anyio.abc import SocketAttribute, TaskStatus

P = TypeVar("P")


async def serve_loopback(proxy: Any, handle: Callable[[anyio.abc.SocketStream], Awaitable[None]],
                         task_status: TaskStatus[int]) -> None:
    """Accept on a free loopback port (``proxy.port``, also given to
    ``task_status``) and run ``handle`` for each connection, until cancelled."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    proxy.port = int(listener.extra(SocketAttribute.local_port))
    task_status.started(proxy.port)
    async with listener:
        await listener.serve(handle)


@asynccontextmanager
async def serving(proxy: P) -> AsyncIterator[P]:
    """``proxy`` serving meanwhile (its ``serve`` task cancelled on leaving)."""
    async with anyio.create_task_group() as tg:
        await tg.start(proxy.serve)  # type: ignore[attr-defined]
        try:
            yield proxy
        finally:
            tg.cancel_scope.cancel()

__all__ = ["ChaosProxy"]



async def close_stream(s: anyio.abc.SocketStream, *, rst: bool) -> None:
    """Close one side of a proxied connection, with a TCP RST (``SO_LINGER`` 0) when ``rst``."""
    if rst:
        try:
            raw: socket.socket = s.extra(SocketAttribute.raw_socket)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (OSError, anyio.TypedAttributeLookupError):
            pass
    with anyio.CancelScope(shield=True):
        try:
            await s.aclose()
        except Exception:
            pass

class ChaosProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream_host:upstream_port`` with faults."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.latency = 0.0
        self.drop_down = False  # server -> client bytes are read and discarded
        self.drop_up = False  # client -> server bytes are read and discarded
        self.refuse = False
        self._flowing = anyio.Event()
        self._flowing.set()
        self._conns: set[tuple[anyio.abc.SocketStream, anyio.abc.SocketStream]] = set()
        self.stats: dict[str, int] = {
            "accepted": 0, "refused": 0, "up_bytes": 0, "down_bytes": 0,
            "dropped_up": 0, "dropped_down": 0, "cut": 0,
        }

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def connections(self) -> int:
        return len(self._conns)

    def stall(self) -> None:
        """Stop forwarding (both directions) until :meth:`heal`."""
        if self._flowing.is_set():
            self._flowing = anyio.Event()

    def heal(self) -> None:
        self._flowing.set()

    async def cut(self, *, rst: bool = True) -> int:
        """Close every live connection, both sides: RST (``SO_LINGER`` 0) or FIN."""
        pairs = list(self._conns)
        self._conns.clear()
        for pair in pairs:
            for s in pair:
                await close_stream(s, rst=rst)
            self.stats["cut"] += 1
        return len(pairs)

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        await serve_loopback(self, self._handle, task_status)

    async def _wait_flowing(self) -> None:
        while not self._flowing.is_set():
            await self._flowing.wait()

    async def _pump(self, src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream,
                    direction: str) -> None:
        try:
            while True:
                await self._wait_flowing()
                data = await src.receive(65536)
                await self._wait_flowing()  # a stall that began mid-read holds the chunk
                if self.latency:
                    await anyio.sleep(self.latency)
                if (self.drop_down if direction == "down" else self.drop_up):
                    self.stats["dropped_" + direction] += len(data)
                    continue
                self.stats[direction + "_bytes"] += len(data)
                await dst.send(data)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            with anyio.CancelScope(shield=True):
                for s in (src, dst):
                    try:
                        await s.aclose()
                    except Exception:
                        pass

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        if self.refuse:
            self.stats["refused"] += 1
            await client.aclose()
            return
        self.stats["accepted"] += 1
        try:
            upstream = await anyio.connect_tcp(*self.upstream)
        except OSError:
            await client.aclose()
            return
        pair = (client, upstream)
        self._conns.add(pair)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._pump, client, upstream, "up")
                tg.start_soon(self._pump, upstream, client, "down")
        finally:
            self._conns.discard(pair)

    def __repr__(self) -> str:
        extra: dict[str, Any] = {"port": self.port, "stalled": not self._flowing.is_set()}
        return f"ChaosProxy({extra}, {self.stats})"
