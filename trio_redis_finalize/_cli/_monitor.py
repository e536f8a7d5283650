"""What the demo observes (``trio-redis-finalize demo``): the lines of a
``MONITOR`` connection parsed (:func:`parse_monitor_line`), the finalization
commands kept and grouped under the script that ran them (:class:`Monitor`),
each attributed to the delivery and outcome that caused it
(:class:`Attributor`: stream ids matched with what the handlers saw, copies by
their content and retry counter), and the form x outcome table they make
(:func:`observed_table`)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import anyio
from anyio.abc import TaskStatus

from .._core._types import DEAD_ATTEMPT
from .._envelope import RETRIES_FIELD, CorruptEnvelope, unpack_parts, unwrap
from .._transport import Client, Connection, ConnectionParams, open_connection, parse_url
from ._scenarios import COLUMNS, MSG, PEL, Form, Observed

__all__ = ["Attributor", "Monitor", "observed_table", "parse_monitor_line"]

_FINAL_COMMANDS = {b"XACK", b"XADD", b"EVALSHA", b"LREM", b"LPUSH", b"ZADD", b"PUBLISH"}
"""The commands that finalize a delivery (alone, or inside a script)."""

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

