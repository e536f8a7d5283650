"""TCP keepalive on a connection's socket: a peer that went silent is noticed.

A connection that carries no request (an idle pooled connection, a Pub/Sub
subscription waiting for messages) sends nothing, so a silent partition or a
server host that vanished is never noticed by the connection itself.  With
keepalive the kernel probes it after ``idle`` seconds of silence, every
:data:`INTERVAL` seconds, and declares it dead after :data:`PROBES` missed
probes: the next receive then fails with an error instead of hanging.
"""

from __future__ import annotations

import socket

import anyio
import anyio.abc

__all__ = ["INTERVAL", "PROBES", "set_keepalive"]

INTERVAL = 5
"""Seconds between keepalive probes (at most ``idle``)."""
PROBES = 3
"""Probes lost before the kernel declares the connection dead."""

_TCP_KEEPALIVE_MACOS = 0x10  # macOS names TCP_KEEPIDLE TCP_KEEPALIVE


def set_keepalive(stream: anyio.abc.ByteStream, idle: float) -> bool:
    """Turn on TCP keepalive on ``stream``'s socket (TLS streams too); ``idle`` 0: off.

    Options the platform lacks are skipped (``SO_KEEPALIVE`` alone then uses
    the system's timers).  Returns whether keepalive is on.
    """
    if idle <= 0:
        return False
    try:
        sock: socket.socket = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    except anyio.TypedAttributeLookupError:
        return False
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False  # unix sockets: no TCP, nothing to probe
    seconds = max(1, int(idle))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle_opt = getattr(socket, "TCP_KEEPIDLE", None)
        if idle_opt is None and hasattr(socket, "TCP_KEEPINTVL"):
            idle_opt = _TCP_KEEPALIVE_MACOS
        for opt, value in (
            (idle_opt, seconds),
            (getattr(socket, "TCP_KEEPINTVL", None), min(INTERVAL, seconds)),
            (getattr(socket, "TCP_KEEPCNT", None), PROBES),
        ):
            if opt is not None:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
    except OSError:
        return False
    return True
