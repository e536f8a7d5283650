"""The README's examples run as written: the quick starts as scripts, the
testing examples as a user's tests, the dead-letter and writes snippets inside
a consumer.  Every Python block of the README is run by one test here (or, the
"Testing your own code" one, by tests/api/test_pytest_plugin.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
from _paths import ROOT

import trio_redis_finalize as trf
from trio_redis_finalize.pytest_plugin import consume_until

README = ROOT / "README.rst"
BLOCK = re.compile(r"\.\. code-block:: python\n\n((?:    .*\n|\n)+)")


def _blocks(title: str) -> list[str]:
    """The Python blocks of one README section, dedented."""
    text = README.read_text()
    section = text.split(f"\n{title}\n{'-' * len(title)}\n", 1)[1]
    section = re.split(r"\n\S[^\n]*\n-{3,}\n", section, maxsplit=1)[0]
    return ["\n".join(line[4:] for line in m.group(1).splitlines()) + "\n"
            for m in BLOCK.finditer(section)]


def _run_script(code: str, tmp_path: Path, name: str) -> str:
    script = tmp_path / name
    script.write_text(code)
    # a bound, not an expectation: the examples take a second or two
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_every_python_block_is_run_by_a_test() -> None:
    """The README's Python blocks are those the tests below (and the plugin's
    test) run: a block added to the README needs a test here."""
    counted = {title: len(_blocks(title)) for title in (
        "Quick start", "Quick start with asyncio", "Handler errors and dead letters",
        "Exactly-once effects", "Testing your own code")}
    assert counted == {"Quick start": 1, "Quick start with asyncio": 1,
                       "Handler errors and dead letters": 1, "Exactly-once effects": 1,
                       "Testing your own code": 3}, counted
    assert len(BLOCK.findall(README.read_text())) == sum(counted.values())


def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    out = _run_script(_blocks("Quick start")[0], tmp_path, "quick_start.py")
    assert out.strip().splitlines()[-1] == "[b'0', b'1', b'2']"


def test_asyncio_quick_start_runs_as_written(tmp_path: Path) -> None:
    code = _blocks("Quick start with asyncio")[0]
    assert 'backend="asyncio"' in code and "import asyncio" in code
    out = _run_script(code, tmp_path, "quick_start_asyncio.py")
    assert out.strip().splitlines()[-1] == "[b'0', b'1', b'2']"


async def test_the_dead_letter_snippet_dead_letters_at_the_fifth_attempt(redis_url: str) -> None:
    """The mount as written: a message that is always retried reaches the
    dead letter at attempt 5, with why."""
    import redis

    producer = redis.Redis.from_url(redis_url)
    producer.xadd("orders", {"n": "1"})
    attempts: list[int] = []

    async def handle(d: trf.Delivery) -> trf.Outcome:
        attempts.append(d.attempt)
        return trf.RETRY

    scope: dict[str, Any] = {name: getattr(trf, name) for name in trf.__all__}
    exec("async def snippet(consumer, handle):\n" + textwrap.indent(_blocks(
        "Handler errors and dead letters")[0], "    "), scope)
    async with trf.open_consumer(redis_url, name="readme") as consumer:
        await scope["snippet"](consumer, handle)
        with anyio.fail_after(60):  # a bound: it takes well under a second
            while producer.xlen("{orders}:dead") < 1:
                await anyio.sleep(0.02)
    assert attempts == [1, 2, 3, 4, 5]
    [(_, fields)] = producer.xrange("{orders}:dead")
    assert fields[b"n"] == b"1" and fields[b"trf-dead-attempt"] == b"5"


async def test_the_writes_snippet_commits_its_writes_once(redis_url: str) -> None:
    import redis

    producer = redis.Redis.from_url(redis_url)
    for cents in (100, 250):
        producer.xadd("orders", {"order": json.dumps(
            {"currency": "EUR", "cents": cents, "customer": f"c{cents}"})})
    scope: dict[str, Any] = {"json": json, **{name: getattr(trf, name) for name in trf.__all__}}
    exec(_blocks("Exactly-once effects")[0], scope)
    calls: list[trf.Delivery] = []

    async def counted(d: trf.Delivery) -> trf.Outcome:
        calls.append(d)
        outcome: trf.Outcome = await scope["handle"](d)
        return outcome

    stats = await consume_until(redis_url, trf.StreamSubscription("orders", "billing", block=0.05),
                                counted, lambda: len(calls) == 2, timeout=60)  # a bound
    assert stats["effects"] == {"acked": 2, "writes": 4}, stats  # two writes each
    assert producer.hgetall("{orders}:totals") == {b"EUR": b"350"}
    assert producer.smembers("{orders}:customers") == {b"c100", b"c250"}
    assert producer.xpending("orders", "billing")["pending"] == 0


async def test_the_handler_unit_test_passes_as_written() -> None:
    scope: dict[str, Any] = {}
    exec(_blocks("Testing your own code")[1], scope)
    tests = [v for k, v in scope.items() if k.startswith("test_")]
    assert len(tests) == 1
    await tests[0]()


async def test_the_exactly_once_check_passes_as_written() -> None:
    """The README's ``check_exactly_once`` example: its own server, every fault."""
    scope: dict[str, Any] = {}
    exec(_blocks("Testing your own code")[2], scope)
    tests = [v for k, v in scope.items() if k.startswith("test_")]
    assert len(tests) == 1
    with anyio.fail_after(240):  # a bound: a few seconds
        await tests[0]()
