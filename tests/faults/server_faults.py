"""Real server-side faults for tests: OOM, another client's busy script.

* :class:`OomSwitch`: ``CONFIG SET maxmemory 1`` (noeviction): every command
  that may grow memory is answered ``OOM`` (scripts fail at their first such
  write; Redis 6.2 wraps it: ``Error running script ... -OOM ...``);
* :func:`busy_server`: another connection runs a Lua busy loop; every other
  client is answered ``BUSY`` until it is killed (``SCRIPT KILL``) on exit.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import hiredis
import trio

from trio_redis_finalize.testing import RedisServer

__all__ = ["OomSwitch", "busy_server", "command"]


def command(port: int, *args: Any) -> Any:
    """One command on a fresh socket; error replies are returned (``hiredis.ReplyError``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(hiredis.pack_command(args))
        reader = hiredis.Reader()
        while (reply := reader.gets()) is False:
            reader.feed(s.recv(65536))
        return reply


def _threshold(server: RedisServer) -> str:
    return "busy-reply-threshold" if server.version >= (7, 0, 0) else "lua-time-limit"


@asynccontextmanager
async def busy_server(server: RedisServer) -> AsyncIterator[None]:
    """Another client runs a Lua busy loop: every other command is answered BUSY
    until the loop is ended by ``SCRIPT KILL`` (on leaving)."""
    command(server.port, "CONFIG", "SET", _threshold(server), "50")
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        sock.sendall(hiredis.pack_command(("EVAL", "local i = 0 while true do i = i + 1 end", 0)))
        for _ in range(250):
            r = command(server.port, "GET", "probe")
            if isinstance(r, hiredis.ReplyError) and str(r).startswith("BUSY"):
                break
            await trio.sleep(0.02)
        else:
            raise AssertionError("the server never answered BUSY")
        yield
    finally:
        for _ in range(50):
            r = command(server.port, "SCRIPT", "KILL")
            if not (isinstance(r, hiredis.ReplyError) and str(r).startswith("BUSY")):
                break
            await trio.sleep(0.05)
        sock.close()
        command(server.port, "CONFIG", "SET", _threshold(server), "5000")


class OomSwitch:
    """OOM on and off (``maxmemory 1`` with ``noeviction``) on ``server``."""

    def __init__(self, server: RedisServer | int) -> None:
        self.port = server if isinstance(server, int) else server.port

    def on(self) -> None:
        command(self.port, "CONFIG", "SET", "maxmemory-policy", "noeviction")
        command(self.port, "CONFIG", "SET", "maxmemory", "1")

    def off(self) -> None:
        command(self.port, "CONFIG", "SET", "maxmemory", "0")
