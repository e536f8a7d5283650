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

import dataclasses
import logging
import secrets
import sys
import time
from collections import defaultdict
from typing import Any

import anyio
from anyio.abc import TaskStatus

from .._consumer import Consumer, open_consumer
from .._core._plan import DEAD_ATTEMPT
from .._delivery import Delivery
from .._envelope import RETRIES_FIELD, CorruptEnvelope, unpack_parts, unwrap
from .._errors import AckUnsupported
from .._forms.pubsub import ChannelSubscription, PatternSubscription
from .._forms.reliable_list.reader import ReliableListSubscription
from .._forms.simple_list import ListSubscription
from .._forms.stream import StreamSubscription
from .._outcome import ACK, DROP, RETRY, Outcome, OutcomeKind, retry_after
from .._subscription import DelayedRetry, Mode, Subscription
from .._transport import Client, Connection, ConnectionParams, open_client, open_connection, parse_url

__all__ = ["demo", "parse_monitor_line", "server_name"]

BLOCK = 0.1
MIN_IDLE = 0.25
DELAY = 0.2
MAX_ATTEMPTS = 2
TIMEOUT = 20.0
MSG = b"msg"

COLUMNS = [
    ("ack", "ACK"),
    ("retry", "RETRY (then ACK)"),
    ("drop", "DROP"),
    ("retry_after", f"retry_after({DELAY}) (then ACK)"),
    ("dead", f"RETRY at max_attempts={MAX_ATTEMPTS}"),
]
SCENARIOS = ("ack", "retry", "drop", "later", "poison")
_FINAL_COMMANDS = {b"XACK", b"XADD", b"EVALSHA", b"LREM", b"LPUSH", b"ZADD", b"PUBLISH"}

PEL = "none: same id re-read from the PEL"
EXPECTED: dict[str, dict[str, str]] = {
    "stream": {"ack": "XACK", "retry": "EVALSHA(XADD, XACK)", "drop": "XACK",
               "retry_after": "EVALSHA(XACK) then EVALSHA(XADD)", "dead": "EVALSHA(XADD, XACK)"},
    "claiming stream": {"ack": "XACK", "retry": PEL, "drop": "XACK", "retry_after": PEL,
                        "dead": "EVALSHA(XADD, XACK)"},
    "stream (durable delay)": {"ack": "XACK", "retry": "EVALSHA(XADD, XACK)", "drop": "XACK",
                              "retry_after": "EVALSHA(ZADD, XACK) then EVALSHA(XADD)",
                              "dead": "EVALSHA(XADD, XACK)"},
    "reliable list": {"ack": "LREM", "retry": "EVALSHA(LPUSH, LREM)", "drop": "LREM",
                      "retry_after": "EVALSHA(LPUSH, LREM)", "dead": "EVALSHA(LPUSH, LREM)"},
    "simple list": {"ack": "refused", "retry": "refused", "drop": "refused",
                    "retry_after": "LPUSH", "dead": "-"},
    "channel": {"ack": "refused", "retry": "refused", "drop": "refused",
                "retry_after": "PUBLISH", "dead": "-"},
    "pattern": {"ack": "refused", "retry": "refused", "drop": "refused",
                "retry_after": "PUBLISH", "dead": "-"},
}


def _out(text: str = "") -> None:
    print(text, flush=True)


# -- MONITOR --------------------------------------------------------------------

_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("a"): b"\a",
            ord("b"): b"\b", ord('"'): b'"', ord("\\"): b"\\"}


def _unquote_args(text: bytes) -> list[bytes]:
    """The arguments of a MONITOR line: ``"a" "b\\n" "\\x00"`` (``sdscatrepr``)."""
    args: list[bytes] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] != ord('"'):
            i += 1
            continue
        i += 1
        buf = bytearray()
        while i < n and text[i] != ord('"'):
            c = text[i]
            if c == ord("\\") and i + 1 < n:
                nxt = text[i + 1]
                if nxt == ord("x") and i + 3 < n:
                    buf.append(int(text[i + 2 : i + 4], 16))
                    i += 4
                    continue
                buf += _ESCAPES.get(nxt, bytes([nxt]))
                i += 2
                continue
            buf.append(c)
            i += 1
        args.append(bytes(buf))
        i += 1
    return args


def parse_monitor_line(line: bytes) -> tuple[int, bool, list[bytes]] | None:
    """``(db, from_lua, args)`` of one MONITOR line, or None when it is not one."""
    start = line.find(b"[")
    end = line.find(b"] ", start)
    if start < 0 or end < 0:
        return None
    db_text, _, client = line[start + 1 : end].partition(b" ")
    try:
        db = int(db_text)
    except ValueError:
        return None
    args = _unquote_args(line[end + 2 :])
    if not args:
        return None
    args[0] = args[0].upper()
    return db, client == b"lua", args


@dataclasses.dataclass
class Group:
    """A top-level command; for EVALSHA, the finalization commands its script ran."""

    args: list[bytes]
    inner: list[list[bytes]] = dataclasses.field(default_factory=list)


class Monitor:
    """Reads MONITOR on its own connection; keeps the demo's finalization commands."""

    def __init__(self, url: str | ConnectionParams, marker: bytes) -> None:
        self.params = parse_url(url) if isinstance(url, str) else url
        self.marker = marker
        self.groups: list[Group] = []
        self.synced = anyio.Event()
        self.lines = 0

    def _is_demo(self, args: list[bytes]) -> bool:
        if args[0] == b"EVALSHA":
            try:
                nkeys = int(args[2])
            except (IndexError, ValueError):
                return False
            return any(self.marker in k for k in args[3 : 3 + nkeys])
        return len(args) > 1 and self.marker in args[1]

    def feed(self, line: bytes) -> None:
        parsed = parse_monitor_line(line)
        if parsed is None:
            return
        db, lua, args = parsed
        if db != self.params.db:
            return
        self.lines += 1
        current = self.groups[-1] if self.groups else None
        if lua:
            if (current is not None and current.args[0] == b"EVALSHA"
                    and args[0] in _FINAL_COMMANDS and self._is_demo(args)):
                current.inner.append(args)
            return
        if args[0] == b"ECHO" and len(args) > 1 and args[1] == self.marker + b":sync":
            self.synced.set()
            return
        if args[0] in _FINAL_COMMANDS and self._is_demo(args):
            self.groups.append(Group(args))
        elif current is not None and current.args[0] == b"EVALSHA":
            self.groups.append(Group([b"(other)"]))  # closes the script's group

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        conn: Connection = await open_connection(self.params, name="trf-demo:monitor")
        async with conn:
            await conn.execute("MONITOR")
            task_status.started()
            while True:
                reply = await conn._read_reply()
                if isinstance(reply, bytes):
                    self.feed(reply)

    async def sync(self, client: Client, timeout: float = 5.0) -> bool:
        """Wait until MONITOR has shown everything sent before this call."""
        await client.execute("ECHO", self.marker + b":sync")
        with anyio.move_on_after(timeout):
            await self.synced.wait()
        return self.synced.is_set()


# -- the forms ------------------------------------------------------------------


@dataclasses.dataclass
class Form:
    label: str
    sub: Subscription
    durable: bool  # stream or reliable list: must lose nothing
    source: str  # where the producer writes
    dead_letter: str | None = None
    max_attempts: int | None = None
    produced: int = 0


def _forms(run: str) -> list[Form]:
    def stream(name: str, **kw: Any) -> StreamSubscription:
        return StreamSubscription(f"{run}:{name}", "demo", block=BLOCK, max_attempts=MAX_ATTEMPTS,
                                  dead_letter=f"{run}:{name}:dead", **kw)

    s1 = stream("stream")
    s2 = stream("claiming", mode=Mode.CLAIMING, min_idle=MIN_IDLE)
    s3 = stream("durable", delayed_retry=DelayedRetry.DURABLE_ZSET)
    rl = ReliableListSubscription(f"{run}:rlist", block=BLOCK, max_attempts=MAX_ATTEMPTS,
                                  dead_letter=f"{run}:rlist:dead")
    return [
        Form("stream", s1, True, s1.stream, s1.dead_letter, MAX_ATTEMPTS),
        Form("claiming stream", s2, True, s2.stream, s2.dead_letter, MAX_ATTEMPTS),
        Form("stream (durable delay)", s3, True, s3.stream, s3.dead_letter, MAX_ATTEMPTS),
        Form("reliable list", rl, True, rl.queue, rl.dead_letter, MAX_ATTEMPTS),
        Form("simple list", ListSubscription(f"{run}:list", block=BLOCK), False, f"{run}:list"),
        Form("channel", ChannelSubscription(f"{run}:channel"), False, f"{run}:channel"),
        Form("pattern", PatternSubscription(f"{run}:pattern:*", retry_channel=f"{run}:pattern:retry"),
             False, f"{run}:pattern:events"),
    ]


def _decide(scenario: str, attempt: int) -> Outcome:
    if scenario == "ack":
        return ACK
    if scenario == "drop":
        return DROP
    if scenario == "retry":
        return RETRY if attempt == 1 else ACK
    if scenario == "later":
        return retry_after(DELAY) if attempt == 1 else ACK
    return RETRY  # poison: until max_attempts sends it to the dead letter


@dataclasses.dataclass
class Observed:
    """What the handlers saw (filled while the demo runs)."""

    outcomes: dict[tuple[str, int], tuple[int, str]] = dataclasses.field(default_factory=dict)
    ids: dict[tuple[bytes, bytes], tuple[str, int]] = dataclasses.field(default_factory=dict)
    same_id: set[tuple[int, str]] = dataclasses.field(default_factory=set)
    refused: dict[tuple[int, str], str] = dataclasses.field(default_factory=dict)
    done: set[str] = dataclasses.field(default_factory=set)
    handled: int = 0


def _column(form: Form, outcome: Outcome, attempt: int) -> str:
    kind = outcome.kind
    if kind is OutcomeKind.ACK:
        return "ack"
    if kind is OutcomeKind.DROP:
        return "drop"
    if form.max_attempts is not None and attempt >= form.max_attempts:
        return "dead"
    return "retry" if kind is OutcomeKind.RETRY else "retry_after"


def _handler(consumer: Consumer, index: int, form: Form, seen: Observed) -> Any:
    async def handle(d: Delivery) -> Outcome:
        token = (d.fields.get(MSG, b"") if d.id is not None else d.data or b"").decode()
        scenario = token.split("/")[2] if token.count("/") == 3 else "ack"
        outcome = _decide(scenario, d.attempt)
        col = _column(form, outcome, d.attempt)
        seen.handled += 1
        seen.outcomes[(token, d.attempt)] = (index, col)
        if d.id is not None:
            key = (d.source.encode(), d.id.encode())
            previous = seen.ids.get(key)
            if previous is not None and previous in seen.outcomes:
                seen.same_id.add(seen.outcomes[previous])  # re-read from the PEL
            seen.ids[key] = (token, d.attempt)
        if not form.durable and outcome.kind is not OutcomeKind.RETRY_AFTER:
            try:
                await consumer.finalize(d, outcome)  # what a no-ack form says to it
            except AckUnsupported as e:
                seen.refused[(index, col)] = str(e)
        if outcome.kind in (OutcomeKind.ACK, OutcomeKind.DROP) or (
            outcome.kind is OutcomeKind.RETRY and (not form.durable or col == "dead")
        ):
            seen.done.add(token)
        return outcome

    return handle


# -- attribution ------------------------------------------------------------------


class Attributor:
    """Maps a finalization command back to ``(token, attempt)`` of its delivery."""

    def __init__(self, forms: list[Form], seen: Observed) -> None:
        self.seen = seen
        self.dead_letters = {f.dead_letter.encode() for f in forms if f.dead_letter}

    @staticmethod
    def _token(body: bytes) -> str | None:
        text = body.decode("utf-8", "replace")
        return text if text.count("/") == 3 else None

    def _fields(self, flat: list[bytes]) -> list[tuple[str, int]]:
        fields = dict(zip(flat[::2], flat[1::2], strict=False))
        token = self._token(fields.get(MSG, b""))
        if token is None:
            return []
        if DEAD_ATTEMPT in fields:
            return [(token, int(fields[DEAD_ATTEMPT]))]
        if RETRIES_FIELD in fields:  # a copy: made by the attempt its counter names
            return [(token, int(fields[RETRIES_FIELD]))]
        return []  # an original from the producer

    def _element(self, element: bytes, *, as_read: bool) -> list[tuple[str, int]]:
        try:
            body, retries, origin = unwrap(element)
        except CorruptEnvelope:
            return []
        token = self._token(body)
        if token is None:
            return []
        if as_read:  # the element as a delivery read it: its attempt is retries + 1
            return [(token, retries + 1)]
        if origin is None:
            return []  # an original from the producer
        return [(token, retries)]

    def command(self, args: list[bytes]) -> list[tuple[str, int]]:
        name = args[0]
        try:
            if name == b"XACK":
                return [self.seen.ids[(args[1], i)] for i in args[3:] if (args[1], i) in self.seen.ids]
            if name == b"XADD":
                return self._fields(args[3:])
            if name == b"LREM":
                return self._element(args[3], as_read=True)
            if name == b"LPUSH":
                dead = args[1] in self.dead_letters
                return [a for e in args[2:] for a in self._element(e, as_read=dead)]
            if name == b"ZADD":
                parts = unpack_parts(args[3])
                if len(parts) == 2:
                    return self._element(parts[1], as_read=False)
                return self._fields(parts[1:])
            if name == b"PUBLISH":
                return self._element(args[2], as_read=False)
        except (IndexError, ValueError):
            return []
        return []


def observed_table(
    forms: list[Form], groups: list[Group], seen: Observed
) -> dict[str, dict[str, str]]:
    """Form label -> column -> the commands observed for that cell."""
    attr = Attributor(forms, seen)
    sequences: dict[tuple[str, int], list[str]] = defaultdict(list)
    for g in groups:
        if g.args[0] == b"EVALSHA":
            # one script may finalize several deliveries (the delay-set mover):
            # each gets the commands the script ran for it
            parts: dict[tuple[str, int], list[str]] = {}
            for inner in g.inner:
                for owner in dict.fromkeys(attr.command(inner)):
                    parts.setdefault(owner, []).append(inner[0].decode())
            for owner, names in parts.items():
                sequences[owner].append("EVALSHA(" + ", ".join(names) + ")")
        else:
            for owner in attr.command(g.args):
                sequences[owner].append(g.args[0].decode())
    cells: dict[tuple[int, str], set[str]] = defaultdict(set)
    delivered: set[tuple[int, str]] = set()
    for key, (index, col) in seen.outcomes.items():
        delivered.add((index, col))
        seq = sequences.get(key)
        if seq:
            cells[(index, col)].add(" then ".join(seq))
    table: dict[str, dict[str, str]] = {}
    for index, form in enumerate(forms):
        row: dict[str, str] = {}
        for col, _ in COLUMNS:
            found = cells.get((index, col))
            if found:
                text = " | ".join(sorted(found))
                if (index, col) in seen.refused:
                    text = "refused, yet " + text
            elif (index, col) in seen.refused:
                text = "refused"
            elif (index, col) in seen.same_id:
                text = PEL
            elif (index, col) in delivered:
                text = "none"
            else:
                text = "-"
            row[col] = text
        table[form.label] = row
    return table


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


async def _produce(client: Client, forms: list[Form], run: str, per_cell: int) -> int:
    total = 0
    for index, form in enumerate(forms):
        commands: list[tuple[Any, ...]] = []
        for scenario in SCENARIOS:
            if scenario == "poison" and not form.durable:
                continue
            for n in range(per_cell):
                token = f"{run}/{index}/{scenario}/{n}".encode()
                if isinstance(form.sub, StreamSubscription):
                    commands.append(("XADD", form.source, "*", MSG, token))
                elif isinstance(form.sub, ReliableListSubscription | ListSubscription):
                    commands.append(("LPUSH", form.source, token))
                else:
                    commands.append(("PUBLISH", form.source, token))
        await client.pipeline(commands)
        form.produced = len(commands)
        total += len(commands)
    return total


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
    from .._table import print_table

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
            from .._table import CliError

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
