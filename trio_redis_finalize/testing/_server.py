"""One private ``redis-server`` (``trio_redis_finalize.testing``): :class:`RedisServer`.

Also what the topologies (``_cluster``, ``_sentinel``) build on: free ports,
a ``PING`` probe, the ``with`` protocol every server and topology shares
(:class:`_Started`, :class:`_Topology`), and :func:`command`, a raw
synchronous client of one command (``INFO`` read by :func:`_info`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import hiredis

from ._binaries import find_redis_server, redis_server_version

__all__ = ["RedisServer", "command", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (never 6379)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != 6379:
            return port


def _ping(port: int, password: str | None, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            if password is not None:
                s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(password), password.encode()))
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class _Started:
    """What the servers and topologies share: the binary's :attr:`version`,
    and ``with``: ``__enter__`` is ``start()`` (its default timeout),
    ``__exit__`` is ``stop()``."""

    binary: str

    @property
    def version(self) -> tuple[int, int, int]:
        return redis_server_version(self.binary)

    def start(self) -> object:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def stop(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RedisServer(_Started):
    """A ``redis-server`` process owned by the caller.

    Args:
        binary: the ``redis-server`` to run; default :func:`find_redis_server`.
        port: the port; default a free one (kept across :meth:`restart`).
        appendonly: run with ``--appendonly yes --appendfsync always``.
        password: ``--requirepass``.
        extra_args: more ``redis-server`` arguments, e.g. ``("--maxmemory", "10mb")``.

    Resource handling: the data directory is a temporary directory removed by
    :meth:`stop`; :meth:`kill` and :meth:`restart` keep it (for AOF restarts).
    """

    def __init__(
        self,
        *,
        binary: str | None = None,
        port: int | None = None,
        appendonly: bool = False,
        password: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self.appendonly = appendonly
        self.password = password
        self.extra_args = tuple(extra_args)
        self.dir: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("redis-server is not running")
        return self.process.pid

    def _args(self) -> list[str]:
        assert self.dir is not None
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
        ]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        return args + list(self.extra_args)

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="trf-redis-"))
        for attempt in range(5):
            self.process = subprocess.Popen(
                self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                if _ping(self.port, self.password):
                    return self
                time.sleep(0.01)
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
                raise RuntimeError(f"redis-server on port {self.port} did not answer in {timeout} s")
            # exited early: most likely the port was taken meanwhile
            if attempt < 4:
                self.port = free_port()
        log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server {self.binary} failed to start:\n{log}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL by default) and wait for the process to end."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait()
        self.process = None

    def pause(self) -> None:
        """SIGSTOP: the server freezes (connections still accepted by the kernel)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        os.kill(self.pid, signal.SIGCONT)

    def restart(self, sig: int = signal.SIGKILL) -> None:
        """Kill (SIGKILL by default) and start again on the same port and dir."""
        self.kill(sig)
        self.start()

    def stop(self) -> None:
        """SIGTERM, wait, and remove the data directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
        self.kill(signal.SIGTERM)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def command(
    port: int, *args: str | bytes | int | float, timeout: float = 5.0, password: str | None = None
) -> Any:
    """Run one command on the server at ``127.0.0.1:port`` (synchronous).

    ``password``: ``AUTH`` first.  An error reply is raised as
    :class:`RuntimeError` naming the command.
    """
    from .._transport._connection import pack_command

    sent = [("AUTH", password), args] if password is not None else [args]
    replies: list[Any] = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"".join(pack_command(c) for c in sent))
        reader = hiredis.Reader()
        while len(replies) < len(sent):
            reply = reader.gets()
            if reply is not False:
                replies.append(reply)
                continue
            data = s.recv(65536)
            if not data:
                raise ConnectionError(f"127.0.0.1:{port} closed the connection")
            reader.feed(data)
    for cmd, reply in zip(sent, replies, strict=True):
        if isinstance(reply, hiredis.ReplyError):
            raise RuntimeError(f"{cmd[0]!r} on 127.0.0.1:{port}: {reply}")
    return replies[-1]


def _info(text: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.decode().splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            out[k] = v.strip()
    return out


class _Topology(_Started):
    """What the topologies of several servers share: the binary, the extra
    ``redis-server`` arguments, the data servers started (:attr:`servers`)
    and their :attr:`ports`."""

    def __init__(self, binary: str | None, extra_args: Sequence[str]) -> None:
        self.binary = binary or find_redis_server()
        self.extra_args = tuple(extra_args)
        self.servers: list[RedisServer] = []

    @property
    def ports(self) -> list[int]:
        """The ports of :attr:`servers`, in order."""
        return [s.port for s in self.servers]
