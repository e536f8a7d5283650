"""Every test is bounded by pytest-timeout (see pyproject); fixtures come from
the package's own pytest plugin (``trio_redis_finalize.pytest_plugin``)."""

from collections.abc import AsyncIterator

import pytest

from trio_redis_finalize._transport import Client, open_client


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Client]:
    """A transport client on the per-test (flushed) server."""
    async with open_client(redis_url) as c:
        yield c
