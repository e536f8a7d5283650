"""Reading a queue's state: what ``inspect`` prints and the dashboard shows.

A stream (groups, consumers and their heartbeats, what is stranded, the
oldest needed entry), a reliable list (its processing lists and their
owners' heartbeats), a delay set, a dead letter, the oldest entries or
elements (a dead letter's with why each is there), as plain dicts (``inspect
--json`` prints them as they are).  Apart from the ``inspect`` command
(``_cli/inspect``) so the dashboard and ``requeue`` read the same state the
same way without the command line's parser.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from .._core._plan import why_key
from .._core._types import DEAD_FIELDS
from .._core.reliable_list.liveness import heartbeat_key, registry_key
from .._core.stream import survey as presence
from .._core.stream.retention import GroupNeed, group_rows, oldest_needed
from .._envelope import ORIGIN_FIELD, RETRIES_FIELD, CorruptEnvelope, unwrap
from .._keys import derived_prefix
from .._transport import Client
from ._common import CliError, as_str, key_type, pairs


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


async def _delay_set(client: Client, key: str) -> dict[str, Any]:
    kind = await key_type(client, key)
    out: dict[str, Any] = {"key": key, "exists": kind != "none", "size": 0, "oldest_due_in": None}
    if kind == "none":
        return out
    if kind != "zset":
        out["error"] = f"is a {kind}, not a sorted set"
        return out
    out["size"] = int(await client.execute("ZCARD", key))
    first = await client.execute("ZRANGE", key, 0, 0, "WITHSCORES")
    if first:
        secs, micros = await client.execute("TIME")
        now_ms = int(secs) * 1000 + int(micros) // 1000
        out["oldest_due_in"] = round((float(first[1]) - now_ms) / 1000, 3)
    return out


async def _dead_letter(client: Client, key: str) -> dict[str, Any]:
    kind = await key_type(client, key)
    out: dict[str, Any] = {"key": key, "type": kind, "length": 0}
    if kind == "stream":
        out["length"] = int(await client.execute("XLEN", key))
    elif kind == "list":
        out["length"] = int(await client.execute("LLEN", key))
    elif kind != "none":
        out["error"] = f"is a {kind}, not a stream or a list"
    return out


async def _oldest_idle(client: Client, key: str, group: str) -> dict[str, Any] | None:
    """The pending entry idle longest among the 1000 oldest (by id)."""
    rows = await client.execute("XPENDING", key, group, "-", "+", 1000)
    if not rows:
        return None
    row = max(rows, key=lambda r: int(r[2]))
    return {"id": as_str(row[0]), "consumer": as_str(row[1]), "idle": int(row[2]) / 1000,
            "deliveries": int(row[3])}


async def _group_needs(client: Client, key: str, rows: Sequence[Any]) -> dict[str, GroupNeed]:
    """Each group's oldest needed entry (``XINFO GROUPS`` rows, an XPENDING summary each)."""
    out: dict[str, GroupNeed] = {}
    for g in group_rows(rows):
        if g.pending:
            summary = await client.execute("XPENDING", key, g.name)
            g = dataclasses.replace(g, first_pending=as_str(summary[1]) if summary[1] else None)
        out[g.name] = g
    return out


_COUNT_CAP = 100_000
"""Entries ``inspect`` counts at most below the oldest needed one."""


async def _count_below(client: Client, key: str, below: str) -> tuple[int, bool]:
    """How many entries are below ``below`` (what a trim would remove), and
    whether counting stopped at :data:`_COUNT_CAP`."""
    n = 0
    lo = "-"
    while n < _COUNT_CAP:
        page = await client.execute("XRANGE", key, lo, "(" + below, "COUNT", 1000)
        n += len(page)
        if len(page) < 1000:
            return n, False
        lo = "(" + as_str(page[-1][0])
    return n, True


async def inspect_stream(client: Client, key: str, group: str | None) -> dict[str, Any]:
    info = pairs(await client.execute("XINFO", "STREAM", key))
    first = info.get("first-entry")
    out: dict[str, Any] = {
        "key": key,
        "type": "stream",
        "length": int(info["length"]),
        "last_id": as_str(info.get("last-generated-id")),
        "first_id": as_str(first[0]) if first else None,
        "groups": [],
    }
    rows = await client.execute("XINFO", "GROUPS", key)
    groups = [pairs(g) for g in rows]
    needs = await _group_needs(client, key, rows)
    low = oldest_needed(list(needs.values()))
    trimmable, capped = await _count_below(client, key, low) if low is not None else (0, False)
    out["retention"] = {"oldest_needed_id": low, "trimmable": trimmable, "trimmable_capped": capped}
    if group is not None:
        groups = [g for g in groups if as_str(g["name"]) == group]
        if not groups:
            raise CliError(f"stream {key!r} has no consumer group {group!r}")
    for g in groups:
        gname = as_str(g["name"])
        rows = await client.execute("XINFO", "CONSUMERS", key, gname)
        consumer_list, stranded = await _consumers(client, key, gname, rows)
        out["groups"].append({
            "name": gname,
            "consumers": int(g["consumers"]),
            "pending": int(g["pending"]),
            "last_delivered_id": as_str(g["last-delivered-id"]),
            "oldest_needed_id": needs[gname].oldest_needed,
            "lag": _int_or_none(g.get("lag")),
            "oldest_idle_pending": await _oldest_idle(client, key, gname) if int(g["pending"]) else None,
            "stranded": stranded,
            "consumer_list": consumer_list,
        })
    return out


async def _consumers(client: Client, key: str, group: str, rows: Sequence[Any]
                     ) -> tuple[list[dict[str, Any]], int]:
    """The group's consumers (``XINFO CONSUMERS`` ``rows``, and those in the
    library's registry ``{KEY}:stream-consumers:<KEY>,<group>``), each with its heartbeat
    (``alive``, ``stopped``: stopped cleanly, its entries handed back,
    ``lapsed``: dead, ``none``: never kept one) and whether its
    pending entries are stranded (no live heartbeat); and how many entries are."""
    reg_key = presence.registry_key(key, group)
    registered = (presence.registry(await client.execute("HGETALL", reg_key))
                  if await key_type(client, reg_key) == "hash" else {})
    names = list(registered)
    ttls: dict[str, int] = {}
    if names:
        replies = await client.pipeline(
            [("PTTL", presence.heartbeat_key(key, group, n)) for n in names])
        ttls = {n: int(t) for n, t in zip(names, replies, strict=True)}
    found = presence.peers(presence.consumer_rows(rows), registered, ttls)
    out = []
    for p in found:
        reg = p.registration
        out.append({
            "name": p.name, "pending": p.pending, "idle": p.idle,
            "heartbeat": p.heartbeat.value, "heartbeat_ttl": p.ttl,
            "heartbeat_period": None if reg is None else reg.heartbeat,
            "mode": None if reg is None or reg.mode is None else reg.mode.value,
            "min_idle": None if reg is None else reg.min_idle,
            "block": None if reg is None else reg.block,
            "stranded": p.stranded,
        })
    return out, sum(p.pending for p in found if p.stranded)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


async def _heartbeat(client: Client, queue: str, owner: str, period: float) -> dict[str, Any]:
    """The owner's heartbeat key ``{queue}:list-heartbeat:<queue>,<owner>`` (a key with a TTL of
    ``heartbeat`` seconds, renewed every ``heartbeat / 3``): time left, and the
    age of the last beat estimated as ``period`` minus the time left."""
    key = heartbeat_key(queue, owner)
    ttl_ms = int(await client.execute("PTTL", key))
    if ttl_ms == -2:
        return {"heartbeat_key": key, "alive": False, "heartbeat_ttl": None, "heartbeat_age": None}
    ttl = None if ttl_ms < 0 else ttl_ms / 1000
    age = None if ttl is None else round(max(0.0, period - ttl), 3)
    return {"heartbeat_key": key, "alive": True, "heartbeat_ttl": ttl, "heartbeat_age": age}


async def inspect_list(client: Client, key: str, heartbeat: float) -> dict[str, Any]:
    out: dict[str, Any] = {"key": key, "type": "list", "length": int(await client.execute("LLEN", key)),
                           "processing": []}
    prefix = derived_prefix(key, ":processing:")
    owners: dict[str, str] = {}  # processing list -> owner
    cursor: Any = b"0"
    while True:
        cursor, batch = await client.execute("SCAN", cursor, "MATCH", _glob_escape(prefix) + "*",
                                             "COUNT", 1000)
        for b in batch:
            owners[as_str(b)] = as_str(b)[len(prefix):]
        if cursor in (b"0", "0", 0):
            break
    # consumers register name -> processing list in {queue}:consumers
    registry = registry_key(key)
    if await key_type(client, registry) == "hash":
        for name, plist in pairs(await client.execute("HGETALL", registry)).items():
            owners[as_str(plist)] = name
    for plist in sorted(owners):
        kind = await key_type(client, plist)
        if kind not in ("list", "none"):
            continue
        owner = owners[plist]
        out["processing"].append({
            "key": plist,
            "owner": owner,
            "length": int(await client.execute("LLEN", plist)) if kind == "list" else 0,
            **await _heartbeat(client, key, owner, heartbeat),
        })
    return out


async def _has_list_traces(client: Client, queue: str) -> bool:
    """True when a reliable list's registry or a processing list exists for ``queue``."""
    if await key_type(client, registry_key(queue)) != "none":
        return True
    cursor: Any = b"0"
    while True:
        cursor, batch = await client.execute(
            "SCAN", cursor, "MATCH", _glob_escape(derived_prefix(queue, ":processing:")) + "*", "COUNT", 1000)
        if batch:
            return True
        if cursor in (b"0", "0", 0):
            return False


_MAX_SHOWN = 200
"""Characters of a field value or list element shown by ``inspect --entries``."""


def _shown(value: bytes) -> str:
    text = as_str(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "..."


def _ms_time(ms: object) -> str | None:
    """The UTC time (ISO 8601, ms) of a Unix time in milliseconds."""
    try:
        stamp = datetime.datetime.fromtimestamp(int(ms) / 1000, tz=datetime.UTC)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError, OSError):
        return None
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _id_time(entry_id: str) -> str | None:
    """The UTC time (ISO 8601, ms) of a stream entry id generated by the server."""
    return _ms_time(entry_id.partition("-")[0])


_DEAD_NAMES = {f: as_str(f)[len("trf-dead-"):] for f in DEAD_FIELDS}


def stream_entry(eid: Any, flat: Sequence[bytes]) -> dict[str, Any]:
    """One stream entry as ``inspect --entries`` shows it.

    ``dead`` holds the ``trf-dead-*`` fields without the prefix (``reason``,
    ``source``, ``id``, ``group``, ``attempt``, and ``error`` when the
    library recorded the handler's exception, and ``time``: epoch ms), or is
    ``None`` for an entry that is not a dead letter.  ``time`` (ISO 8601, UTC):
    for a dead letter when it was dead-lettered (its ``trf-dead-time``, the
    server's clock), else the time in the entry's id (when it was written).
    """
    entry_id = as_str(eid)
    fields: dict[str, str] = {}
    dead: dict[str, str] = {}
    header: dict[str, str] = {}
    for k, v in zip(flat[::2], flat[1::2], strict=False):
        if k in _DEAD_NAMES:
            dead[_DEAD_NAMES[k]] = _shown(v)
        elif k.startswith(b"trf-dead-"):
            dead[as_str(k)[len("trf-dead-"):]] = _shown(v)
        elif k in (RETRIES_FIELD, ORIGIN_FIELD):
            header[as_str(k)] = as_str(v)
        else:
            fields[as_str(k)] = _shown(v)
    # when it was dead-lettered: its trf-dead-time (the server's clock at that
    # step); else (older dead letters, other entries) the time in its id
    when = _ms_time(dead["time"]) if "time" in dead else None
    return {"id": entry_id, "time": when or _id_time(entry_id), "fields": fields,
            "header": header, "dead": dead or None}


def why_records(value: bytes | None) -> list[dict[str, Any]]:
    """The reason records of one element's bytes in a list dead letter's
    :func:`~._plan.why_key` hash, oldest first (a line that does not decode
    is kept as ``{"unreadable": ...}``)."""
    out: list[dict[str, Any]] = []
    for line in (value or b"").splitlines():
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        out.append(record if isinstance(record, dict) else {"unreadable": _shown(line)})
    return out


def list_element(element: bytes, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """One list element as ``inspect --entries`` shows it (envelope decoded).

    ``dead``: for an element of a reliable list's dead letter, why it is
    there (its reason record: ``reason``, ``error`` when the handler raised,
    ``attempt``, ``source`` (the queue), ``processing``, ``origin``), else
    ``None``; ``time``: when it was dead-lettered (server time), or ``None``.
    """
    dead = None
    when = None
    if record is not None:
        dead = {k: (_shown(v.encode()) if isinstance(v, str) else v)
                for k, v in record.items() if k != "time_ms"}
        when = _ms_time(record.get("time_ms"))
    try:
        body, retries, origin = unwrap(element)
    except CorruptEnvelope as e:
        return {"data": _shown(element), "retries": None, "origin": None, "corrupt": str(e),
                "dead": dead, "time": when}
    return {"data": _shown(body), "retries": retries, "origin": origin, "corrupt": None,
            "dead": dead, "time": when}


def _digest(element: bytes) -> str:
    """The field of ``element`` in its dead letter's reason hash (``redis.sha1hex``)."""
    return hashlib.sha1(element).hexdigest()


async def _list_records(client: Client, key: str, oldest_first: Sequence[bytes]
                        ) -> list[dict[str, Any] | None]:
    """The reason record of each element (oldest first) of list ``key``: the
    k-th copy of some bytes from the tail has the k-th record of those bytes."""
    if not oldest_first or await key_type(client, why_key(key)) != "hash":
        return [None] * len(oldest_first)
    digests = list(dict.fromkeys(_digest(e) for e in oldest_first))
    values = await client.execute("HMGET", why_key(key), *digests)
    records = {d: why_records(v) for d, v in zip(digests, values, strict=True)}
    seen: dict[str, int] = {}
    out: list[dict[str, Any] | None] = []
    for e in oldest_first:
        d = _digest(e)
        k = seen.get(d, 0)
        seen[d] = k + 1
        rs = records[d]
        out.append(rs[k] if k < len(rs) else None)
    return out


async def _entries(client: Client, key: str, kind: str, n: int) -> list[dict[str, Any]]:
    if kind == "stream":
        rows = await client.execute("XRANGE", key, "-", "+", "COUNT", n)
        return [stream_entry(eid, flat) for eid, flat in rows]
    # the oldest elements are at the tail (LPUSH adds at the head, consumers pop the tail)
    elements = list(reversed(await client.execute("LRANGE", key, -n, -1)))
    records = await _list_records(client, key, elements)
    return [list_element(e, r) for e, r in zip(elements, records, strict=True)]
