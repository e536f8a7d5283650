"""Shared helpers for the benchmark modules: a private server, timing, tables."""

from __future__ import annotations

import contextlib
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from trio_redis_finalize.testing import RedisServer

__all__ = ["Result", "Timer", "print_table", "redis_server"]


@contextlib.contextmanager
def redis_server(*, appendonly: bool = False, extra_args: Sequence[str] = ()) -> Iterator[RedisServer]:
    """A private redis-server (never port 6379), stopped on exit; prints its version."""
    server = RedisServer(appendonly=appendonly, extra_args=extra_args)
    with server:
        version = ".".join(map(str, server.version))
        print(
            f"redis-server {version} on port {server.port} ({server.binary}); "
            f"Python {platform.python_version()} on {sys.platform}",
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
