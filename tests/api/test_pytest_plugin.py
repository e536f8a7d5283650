"""The pytest plugin's ``run_consumer`` fixture and ``consume_until`` helper,
including the README's "Testing your own code" example run as a user's test
file (in a pytest subprocess that loads the plugin from the entry point)."""

from __future__ import annotations

import re
import time

import pytest
import trio
from _paths import ROOT
from _procs import always

from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    Delivery,
    ListSubscription,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
)
from trio_redis_finalize._transport import Client, open_client
from trio_redis_finalize.pytest_plugin import RunConsumer, consume_until

pytest_plugins = ["pytester"]

README = ROOT / "README.rst"


def _readme_example() -> str:
    section = README.read_text().split("Testing your own code\n---------------------", 1)[1]
    m = re.search(r"\.\. code-block:: python\n\n((?:    .*\n|\n)+)", section)
    assert m is not None, "no code block in 'Testing your own code'"
    return "\n".join(line[4:] for line in m.group(1).splitlines())


def test_readme_example_passes_as_a_users_test(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntrio_mode = true\n")
    pytester.makepyfile(test_billing=_readme_example())
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=90)
    result.assert_outcomes(passed=1)


async def test_outcomes_are_finalized_when_it_returns(
    run_consumer: RunConsumer, client: Client
) -> None:
    """An async predicate reading Redis; the processing list is empty on return."""
    await client.execute("LPUSH", "jobs", "a", "b", "c", "d")
    seen: list[bytes | None] = []

    async def handle(d: Delivery) -> Outcome:
        seen.append(d.data)
        return DROP if d.data == b"d" else ACK

    async def queue_empty() -> bool:
        return len(seen) == 4 and await client.execute("LLEN", "jobs") == 0

    sub = ReliableListSubscription("jobs", block=0.05)
    stats = await run_consumer(sub, handle, queue_empty, timeout=30, name="w1")
    assert sorted(seen) == [b"a", b"b", b"c", b"d"]
    assert stats["outcomes"] == {"ack": 3, "drop": 1}
    assert stats["effects"] == {"acked": 3, "dropped": 1}
    assert stats["in_flight"] == 0 and stats["held"] == 0
    assert await client.execute("LLEN", "{jobs}:processing:w1") == 0


async def test_predicate_is_checked_after_each_handler_call(redis_url: str, client: Client) -> None:
    """With polling made very slow, the check after the handler call ends it."""
    await client.execute("LPUSH", "q", "x")
    seen: list[Delivery] = []

    async def handle(d: Delivery) -> Outcome:
        seen.append(d)
        return ACK

    start = trio.current_time()
    stats = await consume_until(redis_url, ListSubscription("q", block=0.05), handle,
                                lambda: bool(seen), timeout=90, poll=90)
    assert trio.current_time() - start < 45  # well before the poll's 90 s (a bound under load)
    assert stats["received"] == 1 and len(seen) == 1


async def test_timeout_names_the_subscription_and_its_counters(redis_url: str, client: Client) -> None:
    await client.execute("XADD", "orders", "*", "n", "1")

    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.attempt < 3 else ACK

    sub = StreamSubscription("orders", group="g", block=0.05)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        await consume_until(redis_url, sub, handle, lambda: False, timeout=0.5)
    assert time.monotonic() - t0 < 30  # the consumer was shut down, not left running (a bound)
    msg = str(info.value)
    assert sub.name in msg and "within 0.5 s" in msg and "'outcomes': {" in msg
    assert (await client.execute("XPENDING", "orders", "g"))[0] == 0  # finalized all the same


async def test_with_a_client_and_errors_raised_as_they_are(redis_url: str) -> None:
    handle = always(ACK)
    async with open_client(redis_url) as client:
        await client.execute("SET", "notalist", "x")
        with pytest.raises(Exception, match="notalist") as info:  # mount() fails: WRONGTYPE
            await consume_until(client, ListSubscription("notalist", block=0.05), handle, lambda: True)
        assert not isinstance(info.value, BaseExceptionGroup)

        def broken() -> bool:
            raise ZeroDivisionError("predicate bug")

        with pytest.raises(ZeroDivisionError, match="predicate bug"):
            await consume_until(client, ListSubscription("q", block=0.05), handle, broken)
        stats = await consume_until(client, ListSubscription("q", block=0.05), handle, lambda: True)
        assert stats["received"] == 0


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"timeout": 0}, "timeout"), ({"timeout": "5"}, "timeout"), ({"predicate": 3}, "predicate")],
)
async def test_bad_arguments_name_the_parameter(
    redis_url: str, kwargs: dict[str, object], param: str
) -> None:
    args: dict[str, object] = {"predicate": lambda: True, **kwargs}
    with pytest.raises(ValueError, match=param):
        await consume_until(redis_url, ListSubscription("q"), always(ACK), **args)  # type: ignore[arg-type]
