"""Shared helpers for the benchmark modules: a private server, timing, server cost, tables."""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import trio_redis_finalize
from trio_redis_finalize.testing import RedisServer

__all__ = ["EVAL_FAMILY", "Meter", "Result", "Sample", "Timer", "internal", "library_banner",
           "print_table", "redis_server"]


def internal(name: str) -> ModuleType:
    """The library's internal module ``name`` (``"_scripts"`` ...) wherever the
    imported checkout keeps it: ``trio_redis_finalize._core.<name>`` (since the
    runtime redesign) or ``trio_redis_finalize.<name>`` (before) -- so that one
    harness measures old and new checkouts (``TRF_BENCH_LIB``)."""
    for package in ("trio_redis_finalize._core", "trio_redis_finalize"):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name not in (package, f"{package}.{name}"):
                raise
    if name in _SPLIT:  # split since: one namespace of the modules it became
        merged = ModuleType(f"trio_redis_finalize._core.{name}")
        for part in _SPLIT[name]:
            merged.__dict__.update(vars(importlib.import_module(f"trio_redis_finalize._core.{part}")))
        return merged
    raise ModuleNotFoundError(f"trio_redis_finalize has no internal module {name!r}")


_SPLIT = {"_scripts": ("_lua", "stream.scripts", "reliable_list.scripts")}
"""Internal modules split into several since (issue 36: the scripts in their forms' homes)."""


def library_banner() -> str:
    """Which ``trio_redis_finalize`` was imported (``TRF_BENCH_LIB``, see
    ``benchmarks/__init__``) and the git HEAD of its checkout, if any."""
    root = Path(trio_redis_finalize.__file__).resolve().parent.parent
    head = "no git checkout"
    try:
        out = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %cI %s"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no",
                                "--", "trio_redis_finalize"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        head = out[:100] + (" (+ uncommitted changes in trio_redis_finalize/)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    wanted = os.environ.get("TRF_BENCH_LIB")
    how = f"TRF_BENCH_LIB={wanted}" if wanted else "TRF_BENCH_LIB not set"
    return f"trio_redis_finalize from {root} [{how}]; HEAD {head}"


@contextlib.contextmanager
def redis_server(*, appendonly: bool = False, extra_args: Sequence[str] = ()) -> Iterator[RedisServer]:
    """A private redis-server (never port 6379), stopped on exit; prints its version."""
    server = RedisServer(appendonly=appendonly, extra_args=extra_args)
    with server:
        version = ".".join(map(str, server.version))
        print(
            f"redis-server {version} on port {server.port} ({server.binary}); "
            f"Python {platform.python_version()} on {sys.platform}\n{library_banner()}",
            flush=True,
        )
        yield server


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        self._py = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start


@dataclass(frozen=True)
class Result:
    """One measured row: ``count`` operations (entries) in ``seconds``."""

    label: str
    count: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("inf")


def print_table(title: str, results: Sequence[Result], *, baseline: str, unit: str = "ops/s") -> None:
    """Print ``results`` with their rate and the ratio to the row labelled ``baseline``."""
    base = next((r.rate for r in results if r.label == baseline), None)
    width = max(len(r.label) for r in results)
    print(f"\n{title}")
    print(f"  {'':{width}}  {unit:>12}  {'seconds':>8}  {'vs ' + baseline:>14}")
    for r in results:
        ratio = f"{r.rate / base:.2f}x" if base else "-"
        print(f"  {r.label:{width}}  {r.rate:12,.0f}  {r.seconds:8.2f}  {ratio:>14}")
    sys.stdout.flush()


EVAL_FAMILY = frozenset({"eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"})
_OWN = frozenset({"info", "config|resetstat"})  # the meter's own commands


def _text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _server_cpu(info: str) -> float:
    """``used_cpu_sys`` + ``used_cpu_user`` of an ``INFO cpu`` reply, seconds."""
    values = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    return float(values["used_cpu_sys"]) + float(values["used_cpu_user"])


def _commandstats(info: str) -> dict[str, tuple[int, int]]:
    """``{command: (calls, usec)}`` of an ``INFO commandstats`` reply (the meter's own left out)."""
    out: dict[str, tuple[int, int]] = {}
    for line in info.splitlines():
        if not line.startswith("cmdstat_"):
            continue
        name, _, rest = line[len("cmdstat_"):].partition(":")
        if name in _OWN:
            continue
        values = dict(kv.split("=", 1) for kv in rest.split(","))
        out[name] = (int(values["calls"]), int(values["usec"]))
    return out


@dataclass(frozen=True)
class Sample:
    """One measured run: wall seconds, the server's CPU seconds (``INFO cpu``
    delta) and its ``INFO commandstats`` over the same window, and this process's CPU seconds."""

    seconds: float
    cpu: float
    client: float = 0.0  # this process's CPU seconds (library and floors run in it)
    commands: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (calls, usec)

    @property
    def cmd_usec(self) -> int:
        """µs of the data commands, each counted once (also when a script called it)."""
        return sum(u for name, (_, u) in self.commands.items() if name not in EVAL_FAMILY)

    @property
    def eval_usec(self) -> int:
        """µs of the script calls (EVALSHA ...), which include the commands they called."""
        return sum(u for name, (_, u) in self.commands.items() if name in EVAL_FAMILY)

    @property
    def busy(self) -> float:
        """Server CPU as a share of wall time."""
        return self.cpu / self.seconds if self.seconds > 0 else 0.0

    @property
    def client_busy(self) -> float:
        """This process's CPU as a share of wall time."""
        return self.client / self.seconds if self.seconds > 0 else 0.0


class Meter:
    """``async with Meter(client) as m: ...`` then ``m.sample``: the timed window,
    with ``CONFIG RESETSTAT`` and ``INFO cpu`` before it and ``INFO cpu`` +
    ``INFO commandstats`` after it (all outside the wall time)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._cpu = 0.0
        self._start = 0.0
        self._py = 0.0
        self.sample = Sample(0.0, 0.0)

    @property
    def seconds(self) -> float:
        return self.sample.seconds

    async def __aenter__(self) -> Meter:
        await self._client.execute("CONFIG", "RESETSTAT")
        self._cpu = _server_cpu(_text(await self._client.execute("INFO", "cpu")))
        self._start = time.perf_counter()
        self._py = time.process_time()
        return self

    async def __aexit__(self, *exc: object) -> None:
        seconds = time.perf_counter() - self._start
        client = time.process_time() - self._py
        if exc[0] is not None:
            return
        cpu = _server_cpu(_text(await self._client.execute("INFO", "cpu"))) - self._cpu
        stats = _commandstats(_text(await self._client.execute("INFO", "commandstats")))
        self.sample = Sample(seconds, cpu, client, stats)
