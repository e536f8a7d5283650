"""What the dashboard's pages show, read from Redis (pipelined, no ``KEYS``):
the overview of the subscriptions ``_discover`` found, a subscription's page,
a dead letter's page.

A refresh of the overview (:func:`overview`) is two pipelines:

1. ``TIME``; per stream ``XINFO GROUPS``; per stream group ``XINFO
   CONSUMERS``, ``HGETALL`` of the consumer registry, ``XPENDING key group
   - + 1`` (the oldest pending entry, when any is pending) and ``HGETALL``
   of the history (:mod:`~trio_redis_finalize._history`); per list
   ``LLEN``, ``HGETALL`` registry and history; per delay set ``ZCARD`` and
   ``ZRANGE 0 0 WITHSCORES``; per dead letter ``XLEN`` / ``LLEN``.
2. ``PTTL`` of each registered consumer's heartbeat key, ``LLEN`` of each
   registered processing list, and (Redis 6.2, or a group whose lag the
   server does not know) ``XRANGE key (last-delivered + COUNT 101``.

So a stream group with ``c`` registered consumers costs ``5 + c``
commands (plus 2 for its delay set, shared by the stream's groups, and 1
for a dead letter), in two round trips for the whole page.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from redis import exceptions as rexc

from .._cli import _queues as queues
from .._cli._common import as_str, key_type, pairs
from .._core.reliable_list.liveness import heartbeat_key, registry_key
from .._core.stream import survey as presence
from .._history import buckets
from .._transport import Client
from ._discover import DeadLetter, Found, Sub

__all__ = ["Overview", "Row", "dead_letter", "overview", "subscription"]

LAG_CAP = 100
"""Entries counted at most when the server does not say a group's lag (Redis 6.2)."""
OVERDUE_WARN = 5.0
"""Seconds a delay set's oldest copy may be overdue before the overview warns."""
IDLE_WARN = 60.0
"""Seconds the oldest pending entry may be idle before the overview warns."""
LAG_WARN = 100
"""Entries a group may lag before the overview warns."""


# -- the overview ------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One subscription on the overview."""

    sub: Sub
    lag: int | None = None
    lag_capped: bool = False
    pending: int = 0
    oldest_pending_idle: float | None = None
    delay_size: int = 0
    overdue: float | None = None
    """Seconds the oldest copy in the delay set is overdue (negative: due in)."""
    dead_depth: int | None = None
    alive: int = 0
    lapsed: int = 0
    stopped: int = 0
    stranded: int = 0
    stranded_consumers: list[str] = dataclasses.field(default_factory=list)
    history: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    problems: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(level, text): level ``bad`` or ``warn``."""
    error: str | None = None
    path: str = ""
    """The server path its consumers plan with: ``native: <what the server adds
    beyond Redis 6.2>`` or ``fallback`` (Redis 6.2 commands)."""

    @property
    def level(self) -> int:
        levels = {lvl for lvl, _ in self.problems}
        return 0 if "bad" in levels or self.error else 1 if "warn" in levels else 2


@dataclasses.dataclass
class Overview:
    rows: list[Row]
    dead: list[DeadLetter]
    now_ms: int
    commands: int
    round_trips: int


async def overview(client: Client, found: Found) -> Overview:
    """Two pipelines: the numbers of every subscription of ``found`` (see the module)."""
    cmds: list[tuple[Any, ...]] = [("TIME",)]
    streams = sorted({s.key for s in found.subs if s.kind == "stream"})
    delay_keys = sorted({s.delay_key for s in found.subs})
    dead_kind = {d.key: d.kind for d in found.dead}
    dead_keys = sorted({s.dead_letter for s in found.subs if s.dead_letter})
    at: dict[tuple[str, ...], int] = {}

    def add(tag: tuple[str, ...], *cmd: Any) -> None:
        at[tag] = len(cmds)
        cmds.append(cmd)

    for s in streams:
        add(("groups", s), "XINFO", "GROUPS", s)
    for sub in found.subs:
        if sub.kind == "stream":
            add(("consumers", sub.key, sub.group), "XINFO", "CONSUMERS", sub.key, sub.group)
            add(("registry", sub.key, sub.group), "HGETALL", presence.registry_key(sub.key, sub.group))
            add(("oldest", sub.key, sub.group), "XPENDING", sub.key, sub.group, "-", "+", 1)
        else:
            add(("llen", sub.key), "LLEN", sub.key)
            add(("registry", sub.key, ""), "HGETALL", registry_key(sub.key))
        add(("history", sub.key, sub.group), "HGETALL", sub.history)
    for d in delay_keys:
        add(("zcard", d), "ZCARD", d)
        add(("zfirst", d), "ZRANGE", d, 0, 0, "WITHSCORES")
    for d in dead_keys:
        add(("dead", d), "XLEN" if dead_kind.get(d, "stream") == "stream" else "LLEN", d)
    replies = await client.pipeline(cmds, raise_on_error=False)

    def reply(*tag: str) -> Any:
        r = replies[at[tag]]
        return None if isinstance(r, rexc.RedisError) else r

    secs, micros = replies[0]
    now_ms = int(secs) * 1000 + int(micros) // 1000
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for s in streams:
        for g in reply("groups", s) or []:
            info = pairs(g)
            groups[(s, as_str(info["name"]))] = info
    rows: list[Row] = []
    second: list[tuple[Any, ...]] = []
    later: list[tuple[Row, str, Any]] = []  # what each command of the second pipeline is for
    for sub in found.subs:
        row = Row(sub)
        rows.append(row)
        caps = await client.capabilities_for(sub.key)  # known from the connection's handshake
        row.path = f"native: {', '.join(caps.names)}" if caps.names else "fallback"
        reg_flat = reply("registry", sub.key, sub.group) or []
        registered = presence.registry(reg_flat) if sub.kind == "stream" else pairs(reg_flat)
        if sub.kind == "stream":
            ginfo = groups.get((sub.key, sub.group))
            if ginfo is None:
                row.error = f"stream {sub.key!r} has no consumer group {sub.group!r} (any more)"
                continue
            row.pending = int(ginfo["pending"])
            lag = ginfo.get("lag")
            if lag is not None:
                row.lag = int(lag)
            else:
                second.append(("XRANGE", sub.key, "(" + as_str(ginfo["last-delivered-id"]), "+",
                               "COUNT", LAG_CAP + 1))
                later.append((row, "lag", None))
            oldest = reply("oldest", sub.key, sub.group)
            if oldest:
                row.oldest_pending_idle = int(oldest[0][2]) / 1000
            rows_c = presence.consumer_rows(reply("consumers", sub.key, sub.group) or [])
            names = list(registered)
            for n in names:
                second.append(("PTTL", presence.heartbeat_key(sub.key, sub.group, n)))
                later.append((row, "pttl", (rows_c, registered, n)))
            if not names:
                _peers(row, rows_c, registered, {})
        else:
            row.lag = int(reply("llen", sub.key) or 0)
            for owner, plist in registered.items():
                second.append(("PTTL", heartbeat_key(sub.key, owner)))
                later.append((row, "list-pttl", owner))
                second.append(("LLEN", as_str(plist)))
                later.append((row, "list-llen", owner))
        row.delay_size = int(reply("zcard", sub.delay_key) or 0)
        first = reply("zfirst", sub.delay_key)
        if first:
            row.overdue = (now_ms - float(first[1])) / 1000
        if sub.dead_letter:
            d = reply("dead", sub.dead_letter)
            row.dead_depth = None if d is None else int(d)
        row.history = buckets(reply("history", sub.key, sub.group) or [], now_ms // 60000)
    trips = 1
    if second:
        trips = 2
        answers = await client.pipeline(second, raise_on_error=False)
        ttls: dict[int, dict[str, int]] = {}
        pending_list: dict[int, dict[str, int]] = {}
        list_ttls: dict[int, dict[str, int]] = {}
        streams_done: dict[int, tuple[Row, Any, Any]] = {}
        for (row, what, extra), ans in zip(later, answers, strict=True):
            ok = not isinstance(ans, rexc.RedisError)
            if what == "lag":
                seen = len(ans) if ok else 0
                row.lag, row.lag_capped = min(seen, LAG_CAP), seen > LAG_CAP
            elif what == "pttl":
                rows_c, registered, name = extra
                ttls.setdefault(id(row), {})[name] = int(ans) if ok else -2
                streams_done[id(row)] = (row, rows_c, registered)
            elif what == "list-pttl":
                list_ttls.setdefault(id(row), {})[extra] = int(ans) if ok else -2
            elif what == "list-llen":
                pending_list.setdefault(id(row), {})[extra] = int(ans) if ok else 0
        for key, (row, rows_c, registered) in streams_done.items():
            _peers(row, rows_c, registered, ttls.get(key, {}))
        for row in rows:
            if row.sub.kind != "list":
                continue
            t = list_ttls.get(id(row), {})
            lengths = pending_list.get(id(row), {})
            row.pending = sum(lengths.values())
            for owner, ttl in t.items():
                if ttl == -2:
                    row.lapsed += 1
                    if lengths.get(owner):
                        row.stranded += lengths[owner]
                        row.stranded_consumers.append(owner)
                else:
                    row.alive += 1
    for row in rows:
        _judge(row)
    rows.sort(key=lambda r: (r.level, r.sub.key, r.sub.group))
    return Overview(rows, found.dead, now_ms, len(cmds) + len(second), trips)


def _peers(row: Row, rows_c: Any, registered: Any, ttls: dict[str, int]) -> None:
    for p in presence.peers(rows_c, registered, ttls):
        if p.heartbeat is presence.Heartbeat.ALIVE:
            row.alive += 1
        elif p.heartbeat is presence.Heartbeat.LAPSED:
            row.lapsed += 1
        else:
            row.stopped += 1
        if p.stranded:
            row.stranded += p.pending
            row.stranded_consumers.append(p.name)


def _judge(row: Row) -> None:
    """The row's problems, worst first."""
    p = row.problems
    if row.stranded:
        p.append(("bad", f"{row.stranded} stranded under {', '.join(row.stranded_consumers)} "
                         "(no live heartbeat)"))
    if row.lapsed:
        p.append(("bad", f"{row.lapsed} lapsed consumer{'s' if row.lapsed > 1 else ''}"))
    if row.overdue is not None and row.overdue > OVERDUE_WARN:
        p.append(("bad" if row.overdue > 60 else "warn", f"delay set overdue {row.overdue:.0f} s"))
    dead_recent = sum(row.history.get("dead", [])[-15:])
    if dead_recent:
        p.append(("warn", f"{dead_recent} dead-lettered in 15 min"))
    if row.lag is not None and row.lag >= LAG_WARN:
        p.append(("warn", f"lag {row.lag}{'+' if row.lag_capped else ''}"))
    if row.oldest_pending_idle is not None and row.oldest_pending_idle > IDLE_WARN:
        p.append(("warn", f"oldest pending idle {row.oldest_pending_idle:.0f} s"))
    if row.lag and not row.alive and row.sub.kind == "stream":
        p.append(("warn", "lagging with no live consumer"))


# -- one subscription, dead letters ------------------------------------------------

PAGE = 50


async def subscription(client: Client, sub: Sub, after: str | None = None) -> dict[str, Any]:
    """A subscription's page: consumers, pending entries (paged), retention, delay set."""
    if sub.kind == "stream":
        info = await queues.inspect_stream(client, sub.key, sub.group)
        start = "-" if not after else "(" + after
        rows = await client.execute("XPENDING", sub.key, sub.group, start, "+", PAGE)
        info["pending_page"] = [{"id": as_str(r[0]), "consumer": as_str(r[1]), "idle": int(r[2]) / 1000,
                                 "attempt": int(r[3])} for r in rows]
    else:
        info = await queues.inspect_list(client, sub.key, 30.0)
        page = []
        for p in info["processing"]:
            for e in await client.execute("LRANGE", p["key"], 0, PAGE - 1):
                item = queues.list_element(e)
                item["owner"] = p["owner"]
                item["attempt"] = (item["retries"] or 0) + 1
                page.append(item)
        info["pending_page"] = page[:PAGE]
    info["delay_set"] = await queues._delay_set(client, sub.delay_key)
    if info["delay_set"]["size"]:
        due = await client.execute("ZRANGE", sub.delay_key, 0, 0, "WITHSCORES")
        info["delay_set"]["next_due_ms"] = float(due[1]) if due else None
    return info


HISTOGRAM_CAP = 5000
"""Dead letters read at most (oldest first) for the reason histogram and the counts of bulk actions."""


async def dead_letter(client: Client, key: str, after: str | None = None,
                      reason: str | None = None) -> dict[str, Any]:
    """A dead letter's page: entries (oldest first, paged), the reason histogram."""
    kind = await key_type(client, key)
    out: dict[str, Any] = {"key": key, "kind": kind, "entries": [], "reasons": {}, "capped": False,
                           "length": 0}
    if kind == "stream":
        out["length"] = int(await client.execute("XLEN", key))
        entries = await read_stream(client, key, HISTOGRAM_CAP)
        out["capped"] = out["length"] > HISTOGRAM_CAP
        hist: dict[str, int] = {}
        shown: list[dict[str, Any]] = []
        for e in entries:
            r = (e["dead"] or {}).get("reason", "(none)")
            hist[r] = hist.get(r, 0) + 1
            if reason and r != reason:
                continue
            if after and _id_key(e["id"]) <= _id_key(after):
                continue
            if len(shown) < PAGE:
                shown.append(e)
        out["entries"], out["reasons"] = shown, hist
        out["more"] = len(shown) == PAGE
    elif kind == "list":
        out["length"] = int(await client.execute("LLEN", key))
        n = min(out["length"], HISTOGRAM_CAP)
        elements = list(reversed(await client.execute("LRANGE", key, -n, -1))) if n else []
        records = await queues._list_records(client, key, elements)
        hist = {}
        shown = []
        for i, (e, r) in enumerate(zip(elements, records, strict=True)):
            item = queues.list_element(e, r)
            item["index"] = i
            rs = str((item["dead"] or {}).get("reason", "(none)"))
            hist[rs] = hist.get(rs, 0) + 1
            if (not reason or rs == reason) and i >= int(after or 0) and len(shown) < PAGE:
                shown.append(item)
        out["entries"], out["reasons"] = shown, hist
        out["capped"] = out["length"] > HISTOGRAM_CAP
        out["more"] = len(shown) == PAGE
    return out


def _id_key(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


async def read_stream(client: Client, key: str, cap: int) -> list[dict[str, Any]]:
    """Up to ``cap`` entries of stream ``key``, oldest first, as ``inspect`` shows them."""
    out: list[dict[str, Any]] = []
    start = "-"
    while len(out) < cap:
        rows = await client.execute("XRANGE", key, start, "+", "COUNT", min(1000, cap - len(out)))
        out += [queues.stream_entry(eid, flat) | {"raw": flat} for eid, flat in rows]
        if len(rows) < 1000:
            break
        start = "(" + as_str(rows[-1][0])
    return out
