"""``trio-redis-finalize demo``: every form x every outcome, observed with MONITOR.

One subscription of every form is mounted on one consumer; a producer writes
messages whose handlers return every outcome (ACK; RETRY once, then ACK;
DROP; ``retry_after(0.2)`` once, then ACK; and, where ``max_attempts``
applies, RETRY until the message is dead-lettered).  A separate raw
connection runs ``MONITOR`` meanwhile; every finalization command it sees
(XACK, XADD, EVALSHA and the commands inside the scripts, LREM, LPUSH, ZADD,
PUBLISH) is attributed to the delivery and outcome that caused it: stream
ids are matched with what the handlers saw, copies by their content and
retry counter.  The result is printed as a form x outcome table, followed
by a check that every message produced to a stream or reliable list was
finalized (``lost: 0``).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
import time
from typing import Any

import anyio

from .._consumer import Consumer, open_consumer
from .._forms.reliable_list import ReliableListSubscription
from .._forms.stream import StreamSubscription
from .._transport import Client, open_client
from ._common import CliError, Command, check_url, positive_int, print_table
from ._monitor import Monitor, observed_table
from ._scenarios import COLUMNS, EXPECTED, Form, Observed, _forms, _handler, _produce

__all__ = ["COMMAND", "arguments", "demo", "execute", "server_name"]

TIMEOUT = 20.0


def arguments(p: argparse.ArgumentParser) -> None:
    """The ``demo`` command's options (run as :func:`execute`)."""
    p.add_argument("--url", default=None,
                   help="use this server (keys are prefixed trf-demo-<random> and deleted after); "
                        "default: start a private redis-server on a free port")
    p.add_argument("--messages", type=positive_int, default=3, metavar="N",
                   help="messages per form and outcome (default 3)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the library's log records")


def execute(args: argparse.Namespace) -> int:
    if args.url is not None:
        check_url(args.url)
    return demo(args.url, verbose=args.verbose, per_cell=args.messages)


def _out(text: str = "") -> None:
    print(text, flush=True)


# -- the run --------------------------------------------------------------------


class _Collect(logging.Handler):
    def __init__(self, verbose: bool) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self.verbose = verbose

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if self.verbose:
            print(f"  log {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)


async def _remaining(client: Client, form: Form, consumer: str) -> int:
    """Messages of ``form`` still physically in Redis (pending, queued, delayed)."""
    sub = form.sub
    n = 0
    if isinstance(sub, StreamSubscription):
        summary = await client.execute("XPENDING", sub.stream, sub.group)
        n += int(summary[0])
        target = sub.target(consumer)
        n += int(await client.execute("ZCARD", target.delay_key))
        info = _pairs(await client.execute("XINFO", "STREAM", sub.stream))
        for g in await client.execute("XINFO", "GROUPS", sub.stream):
            gi = _pairs(g)
            if gi[b"name"] == sub.group.encode() and gi[b"last-delivered-id"] != info[b"last-generated-id"]:
                # entries never delivered to the group
                rest = await client.execute("XRANGE", sub.stream, b"(" + gi[b"last-delivered-id"], "+")
                n += len(rest)
    elif isinstance(sub, ReliableListSubscription):
        target = sub.target(consumer)
        n += int(await client.execute("LLEN", sub.queue))
        n += int(await client.execute("LLEN", target.processing))
        n += int(await client.execute("ZCARD", target.delay_key))
    return n


def _pairs(flat: list[Any]) -> dict[bytes, Any]:
    return dict(zip(flat[::2], flat[1::2], strict=False))


def server_name(info: bytes) -> str:
    """The server and its version from ``INFO server``: ``Redis 8.2.3``,
    ``Valkey 9.1.2``.  Valkey answers ``redis_version:7.2.4`` (the Redis
    version it is compatible with) beside ``server_name:valkey`` and
    ``valkey_version``; the name's own version field wins."""
    fields = dict(line.partition(":")[::2] for line in info.decode(errors="replace").splitlines()
                  if ":" in line and not line.startswith("#"))
    name = fields.get("server_name", "redis").strip() or "redis"
    version = fields.get(f"{name}_version") or fields.get("redis_version") or "?"
    return f"{'Redis' if name == 'redis' else name.capitalize()} {version.strip()}"


def _finalized(stats: dict[str, Any]) -> int:
    effects = stats.get("effects", {})
    return sum(int(effects.get(k, 0)) for k in ("acked", "dropped", "dead_lettered", "exhausted"))


async def _demo(url: str, verbose: bool, per_cell: int) -> tuple[int, int]:
    """Run the demo; ``(exit code, lost)``."""
    run = "trf-demo-" + secrets.token_hex(3)
    forms = _forms(run)
    seen = Observed()
    collect = _Collect(verbose)
    lib_log = logging.getLogger("trio_redis_finalize")
    lib_log.addHandler(collect)
    lib_log.setLevel(logging.WARNING)
    lib_log.propagate = False
    t0 = time.monotonic()
    code = 0
    lost = 0
    async with open_client(url, name="trf-demo:producer", max_connections=8) as client:
        info = await client.execute("INFO", "server")
        _out(f"{server_name(info)} at {client.server_params.address}; keys prefixed {run}")
        monitor = Monitor(client.server_params, run.encode())  # a sentinel URL: the master
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(monitor.run)
                async with open_consumer(client, name="demo", shutdown_grace=5.0) as consumer:
                    for index, form in enumerate(forms):
                        await consumer.mount(form.sub, _handler(consumer, index, form, seen),
                                             concurrency=2)
                    _out(f"mounted {len(forms)} subscriptions: "
                         + ", ".join(f.label for f in forms))
                    total = await _produce(client, forms, run, per_cell)
                    _out(f"produced {total} messages "
                         f"({per_cell} per form and outcome); handling...")
                    finished = await _wait(consumer, forms, seen, total, client, t0)
                    if not finished:
                        _out(f"timed out after {TIMEOUT:.0f} s waiting for the handlers")
                        code = 1
                    stats = consumer.stats()
                # the consumer is closed: every outcome finalized, held copies sent
                if not await monitor.sync(client):
                    _out("MONITOR did not catch up in 5 s; the table may be incomplete")
                tg.cancel_scope.cancel()
            table = observed_table(forms, monitor.groups, seen)
            _print_table(forms, table)
            lost, report = await _check(client, forms, stats, per_cell)
            for line in report:
                _out(line)
            warnings = sum(1 for r in collect.records if r.levelno == logging.WARNING)
            errors = sum(1 for r in collect.records if r.levelno >= logging.ERROR)
            _out(f"library log: {warnings} warnings, {errors} errors"
                 + ("" if verbose else " (-v prints them)")
                 + f"; {monitor.lines} MONITOR lines; {time.monotonic() - t0:.1f} s")
        finally:
            lib_log.removeHandler(collect)
            lib_log.propagate = True
            with anyio.CancelScope(shield=True):
                await _cleanup(client, run)
    return (1 if lost or code else 0), lost


async def _wait(consumer: Consumer, forms: list[Form], seen: Observed, total: int, client: Client,
                t0: float) -> bool:
    """Progress lines until every message reached its last outcome and was finalized."""
    deadline = time.monotonic() + TIMEOUT
    last_print = 0.0
    durable = {f.sub.name: f.produced for f in forms if f.durable}
    while True:
        stats = consumer.stats()
        finalized = sum(_finalized(s) for name, s in stats.items() if name in durable)
        want = sum(durable.values())
        held = sum(int(s.get("held", 0)) for s in stats.values())
        in_flight = sum(int(s.get("in_flight", 0)) for s in stats.values())
        done = len(seen.done) >= total and finalized >= want and held == 0
        now = time.monotonic()
        if done or now - last_print >= 0.25:
            last_print = now
            _out(f"  {now - t0:5.1f} s  handled {seen.handled:4d}  last outcome {len(seen.done):3d}/{total}"
                 f"  finalized (streams, reliable list) {finalized:3d}/{want}"
                 f"  in flight {in_flight}  delayed copies held {held}")
        if done:
            return True
        if now > deadline:
            return False
        await anyio.sleep(0.05)


def _print_table(forms: list[Form], table: dict[str, dict[str, str]]) -> None:
    _out()
    _out("Finalization commands observed with MONITOR (form x outcome; EVALSHA(...) lists the "
         "commands its script ran):")
    headers = ["form", *[title for _, title in COLUMNS]]
    rows = [[f.label, *[table[f.label][col] for col, _ in COLUMNS]] for f in forms]
    print_table(headers, rows)
    differ = [
        f"  {label} / {col}: observed {row[col]!r}, expected {EXPECTED[label][col]!r}"
        for label, row in table.items()
        for col, _ in COLUMNS
        if label in EXPECTED and row[col] != EXPECTED[label][col]
    ]
    if differ:
        _out(f"{len(differ)} cells differ from the expected table:")
        for line in differ:
            _out(line)
    else:
        _out("every cell matches the expected table")
    _out()


async def _check(client: Client, forms: list[Form], stats: dict[str, Any],
                 per_cell: int) -> tuple[int, list[str]]:
    lost = 0
    lines = ["No loss (streams and the reliable list):"]
    for form in forms:
        if not form.durable:
            continue
        s = stats.get(form.sub.name, {})
        effects = s.get("effects", {})
        finalized = _finalized(s)
        left = await _remaining(client, form, "demo")
        dead = 0
        if form.dead_letter:
            kind = (await client.execute("TYPE", form.dead_letter)).decode()
            dead = int(await client.execute("XLEN" if kind == "stream" else "LLEN", form.dead_letter)) \
                if kind != "none" else 0
        missing = max(0, form.produced - finalized - left)
        lost += missing
        lines.append(
            f"  {form.label}: produced {form.produced}, acked {effects.get('acked', 0)}, "
            f"dropped {effects.get('dropped', 0)}, dead-lettered {effects.get('dead_lettered', 0)} "
            f"({dead} in {form.dead_letter}), still in Redis {left}"
            + (f", MISSING {missing}" if missing else "")
            + (f", {finalized - form.produced} finalized twice" if finalized > form.produced else "")
        )
        if dead != per_cell:
            lines.append(f"    expected {per_cell} dead-lettered entries in {form.dead_letter}")
    return lost, lines


async def _cleanup(client: Client, run: str) -> None:
    try:
        cursor: Any = b"0"
        while True:
            cursor, keys = await client.execute("SCAN", cursor, "MATCH", f"*{run}*", "COUNT", 1000)
            if keys:
                await client.execute("DEL", *keys)
            if cursor in (b"0", 0, "0"):
                return
    except Exception as e:  # best effort
        _out(f"could not delete the demo's keys: {e}")


def demo(url: str | None, *, verbose: bool = False, per_cell: int = 3) -> int:
    """Run the demo against ``url``, or a private redis-server when ``url`` is None."""
    from ..testing import RedisServer

    server = None
    if url is None:
        try:
            server = RedisServer().start()
        except (RuntimeError, OSError) as e:
            raise CliError(f"cannot start a private redis-server: {e}") from None
        _out(f"started a private redis-server (pid {server.pid}, port {server.port})")
        url = server.url
    try:
        code, lost = anyio.run(_demo, url, verbose, per_cell, backend="trio")
    finally:
        if server is not None:
            server.stop()
            _out("stopped the private redis-server")
    _out(f"lost: {lost}")
    return code


COMMAND = Command(
    "demo", arguments, execute,
    help="every form x every outcome against a real server; prints the observed table",
    description=("Mount one subscription of every form (stream, claiming stream, stream with "
                 "a durable delay set, reliable list, simple list, channel, pattern), produce "
                 "messages whose handlers return every outcome, record with MONITOR the "
                 "Redis commands each finalization issued, print them as a form x outcome "
                 "table and check that nothing was lost (last line 'lost: N'; exit 1 if N > 0)."),
)
"""This command's row of ``_cli.COMMANDS``."""
