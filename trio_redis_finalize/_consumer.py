"""Placeholder; the runtime is being written."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any


class Consumer:
    pass


@asynccontextmanager
async def open_consumer(
    url_or_client: Any, *, name: str | None = None, shutdown_grace: float = 10.0
) -> AsyncIterator[Consumer]:
    raise NotImplementedError
    yield Consumer()
