"""The command line: ``python -m trio_redis_finalize`` / ``trio-redis-finalize``.

Commands (``--help`` on each)::

    demo [--url URL]                                every form x every outcome, as observed
    run MODULE:FACTORY [--url URL] [--backend trio|asyncio] [--metrics-port N] [--metrics-host H]
                                                    run a consumer defined in your code
    inspect KEY [--group G] [--entries N] [--url URL] [--json]
                                                    a queue's state (table, or --json)
    requeue DEAD_LETTER --to KEY [--limit N] [--force] [--url URL]
                                                    move dead-lettered messages back
    dashboard [--url URL] [--host H] [--port N] [--token T | --basic-auth U:P] [--read-only]
                                                    serve the web dashboard (_dashboard)

``--url`` defaults to ``redis://127.0.0.1:6379/0`` (``demo`` without
``--url`` starts a private redis-server instead).

Exit codes: 0 success; 1 failure at run time (the demo lost messages); 2 bad
input (unknown URL scheme, unreachable server, missing key, bad argument, a
factory module that fails to import, a factory that raises or mounts
nothing): one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import importlib
import inspect as pyinspect
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import anyio
from anyio.abc import TaskStatus
from redis import exceptions as rexc

from ._core import _presence as presence
from ._core._plan import DEAD_FIELDS, DEAD_REASON, Effect, why_key
from ._core._reliable import heartbeat_key, registry_key
from ._core._retention import GroupNeed, group_rows, oldest_needed
from ._core._scripts import LUA_XADD, why_pop
from ._envelope import ORIGIN_FIELD, RETRIES_FIELD, CorruptEnvelope, unwrap, wrap
from ._keys import derived, has_hash_tag, same_slot
from ._table import CliError, print_table
from ._transport import Client, Script, open_client, parse_url

__all__ = ["CliError", "main"]

PROG = "trio-redis-finalize"
DEFAULT_URL = "redis://127.0.0.1:6379/0"

log = logging.getLogger("trio_redis_finalize.cli")


# -- output -------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def _pairs(flat: Sequence[Any]) -> dict[str, Any]:
    """A RESP2 flat ``[name, value, name, value, ...]`` reply as a dict."""
    return {_str(k): v for k, v in zip(flat[::2], flat[1::2], strict=False)}


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


# -- connections and key checks ---------------------------------------------------


def check_url(url: str) -> str:
    """Parse ``url`` now so a bad one fails before anything starts."""
    try:
        parse_url(url)
    except ValueError as e:
        raise CliError(str(e)) from None
    return url


async def key_type(client: Client, key: str) -> str:
    return _str(await client.execute("TYPE", key))


async def require_key(client: Client, key: str, what: str, types: Sequence[str]) -> str:
    kind = await key_type(client, key)
    if kind == "none":
        raise CliError(f"{what} {key!r} does not exist")
    if kind not in types:
        raise CliError(f"{what} {key!r} is a {kind}, not a {' or a '.join(types)}")
    return kind


# -- run ----------------------------------------------------------------------


def load_factory(spec: str) -> Callable[[Any], Awaitable[None]]:
    """``package.module:function`` -> the function (cwd is importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"factory {spec!r} must look like MODULE:FACTORY (e.g. myapp.worker:setup)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise CliError(f"factory {spec!r}: no module named {e.name!r}") from None
        raise CliError(f"factory {spec!r}: importing {module_name!r} failed: {_describe(e)}") from None
    except Exception as e:
        raise CliError(f"factory {spec!r}: importing {module_name!r} failed: {_describe(e)}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliError(f"factory {spec!r}: module {module_name!r} has no {attr!r}") from None
    if not callable(obj):
        raise CliError(f"factory {spec!r} is not callable")
    factory: Callable[[Any], Awaitable[None]] = obj
    return factory


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (of its first leaf, for a group), on one line."""
    leaves = _leaves(exc)
    first = leaves[0] if leaves else exc
    text = _one_line(str(first))
    return f"{type(first).__name__}: {text}" if text else type(first).__name__


def shutdown_summary(stats: dict[str, dict[str, Any]]) -> str:
    """One line: what the consumer finalized and what it left pending."""
    effects: dict[str, int] = {}
    received = handled = 0
    for s in stats.values():
        received += int(s.get("received", 0))
        handled += sum(int(n) for n in s.get("outcomes", {}).values())
        for effect, n in s.get("effects", {}).items():
            effects[effect] = effects.get(effect, 0) + int(n)
    # effects of finalizing a delivery (not: recovered lists, moves out of the delay set, ...)
    kinds = {e.value for e in Effect} - {Effect.LEFT_PENDING.value}
    finalized = sum(n for e, n in effects.items() if e in kinds)
    detail = ", ".join(f"{e} {n}" for e, n in sorted(effects.items()) if n and e in kinds)
    left = max(0, received - handled) + effects.get("left_pending", 0)
    stranded = [f"{n} in {name}" for name, s in stats.items() if (n := s.get("stranded"))]
    return (f"stopped: finalized {finalized} deliver{'y' if finalized == 1 else 'ies'}"
            f"{f' ({detail})' if detail else ''}; left pending {left} by this consumer "
            "(redelivered later)" + (
                f"; stranded: {', '.join(stranded)} (entries pending for other consumers of the "
                "group with no live heartbeat, as last seen: dead ones are taken over by the "
                "next live consumer, those that never kept one are not -- see inspect KEY "
                "--group G)" if stranded else ""))


async def _watch_signals(signals: Any, stop: anyio.CancelScope) -> None:
    count = 0
    async for signum in signals:
        count += 1
        name = signal.Signals(signum).name
        if count == 1:
            log.warning("%s: shutting down gracefully (send it again to exit at once)", name)
            stop.cancel()
        else:
            log.warning("%s again: exiting now", name)
            logging.shutdown()
            os._exit(128 + int(signum))


async def _run(url: str, factory: Callable[[Any], Awaitable[None]], spec: str, name: str | None,
               grace: float, metrics_port: int | None, metrics_prefix: str,
               metrics_host: str = "127.0.0.1") -> int:
    from ._consumer import open_consumer

    failure: str | None = None
    summary = ""
    running: Any = None
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as outer:
            stop = anyio.CancelScope()
            outer.start_soon(_watch_signals, signals, stop)
            with stop:
                async with open_consumer(url, name=name, shutdown_grace=grace) as consumer:
                    running = consumer
                    if metrics_port is not None:  # before the factory: serves from the first mount
                        await outer.start(_serve_metrics, consumer, metrics_host, metrics_port,
                                          metrics_prefix)
                    log.info("consumer %s connected to %s; calling %s", consumer.name,
                             parse_url(url).address, spec)
                    try:
                        result = factory(consumer)
                        if not pyinspect.isawaitable(result):
                            failure = (
                                f"factory {spec!r} must be an async function taking the consumer "
                                "(async def setup(consumer): await consumer.mount(...))"
                            )
                        else:
                            await result
                    except Exception as e:
                        failure = f"factory {spec!r} failed: {_describe(e)}"
                    if failure is None and not consumer.mounts:
                        failure = (f"factory {spec!r} mounted nothing "
                                   "(call await consumer.mount(subscription, handler))")
                    if failure is None:
                        log.info("running %d subscription(s); SIGINT/SIGTERM to stop",
                                 len(consumer.mounts))
                        await anyio.sleep_forever()
            if failure is None and running is not None:
                summary = shutdown_summary(running.stats())
            outer.cancel_scope.cancel()
    if failure is not None:
        raise CliError(failure)
    log.info("stopped")
    print(f"{PROG} run: {summary}", file=sys.stderr, flush=True)
    return 0


async def _serve_metrics(consumer: Any, host: str, port: int, prefix: str, *,
                         task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    try:
        from . import prometheus
    except ImportError as e:
        raise CliError(str(e)) from None
    try:
        await prometheus.serve(consumer, port, host=host, prefix=prefix, task_status=task_status)
    except OSError as e:  # cannot listen (before started: the port in use, say)
        raise CliError(f"--metrics-port {port}: {e.strerror or e}") from None


def cmd_run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    url = check_url(args.url)
    factory = load_factory(args.factory)
    code: int = anyio.run(_run, url, factory, args.factory, args.name, args.shutdown_grace,
                          args.metrics_port, args.metrics_prefix, args.metrics_host,
                          backend=args.backend)
    return code


# -- inspect ------------------------------------------------------------------


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
    return {"id": _str(row[0]), "consumer": _str(row[1]), "idle": int(row[2]) / 1000,
            "deliveries": int(row[3])}


async def _group_needs(client: Client, key: str, rows: Sequence[Any]) -> dict[str, GroupNeed]:
    """Each group's oldest needed entry (``XINFO GROUPS`` rows, an XPENDING summary each)."""
    out: dict[str, GroupNeed] = {}
    for g in group_rows(rows):
        if g.pending:
            summary = await client.execute("XPENDING", key, g.name)
            g = dataclasses.replace(g, first_pending=_str(summary[1]) if summary[1] else None)
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
        lo = "(" + _str(page[-1][0])
    return n, True


async def inspect_stream(client: Client, key: str, group: str | None) -> dict[str, Any]:
    info = _pairs(await client.execute("XINFO", "STREAM", key))
    first = info.get("first-entry")
    out: dict[str, Any] = {
        "key": key,
        "type": "stream",
        "length": int(info["length"]),
        "last_id": _str(info.get("last-generated-id")),
        "first_id": _str(first[0]) if first else None,
        "groups": [],
    }
    rows = await client.execute("XINFO", "GROUPS", key)
    groups = [_pairs(g) for g in rows]
    needs = await _group_needs(client, key, rows)
    low = oldest_needed(list(needs.values()))
    trimmable, capped = await _count_below(client, key, low) if low is not None else (0, False)
    out["retention"] = {"oldest_needed_id": low, "trimmable": trimmable, "trimmable_capped": capped}
    if group is not None:
        groups = [g for g in groups if _str(g["name"]) == group]
        if not groups:
            raise CliError(f"stream {key!r} has no consumer group {group!r}")
    for g in groups:
        gname = _str(g["name"])
        rows = await client.execute("XINFO", "CONSUMERS", key, gname)
        consumer_list, stranded = await _consumers(client, key, gname, rows)
        out["groups"].append({
            "name": gname,
            "consumers": int(g["consumers"]),
            "pending": int(g["pending"]),
            "last_delivered_id": _str(g["last-delivered-id"]),
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
    library's registry ``{KEY}:consumers:<group>``), each with its heartbeat
    (``alive``, ``lapsed``: dead, ``none``: never kept one) and whether its
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
            "stranded": p.stranded,
        })
    return out, sum(p.pending for p in found if p.stranded)


def _heartbeat_text(c: dict[str, Any]) -> str:
    if c["heartbeat"] == "alive":
        return "alive" + ("" if c["heartbeat_ttl"] is None else f" (expires in {c['heartbeat_ttl']:.3f} s)")
    if c["heartbeat"] == "lapsed":
        return "lapsed (dead)"
    return "none"


def _stranded_text(c: dict[str, Any]) -> str:
    if not c["stranded"]:
        return "-"
    if c["heartbeat"] == "lapsed":
        if c["mode"] == "claiming":
            return "yes: a CLAIMING mount claims them back once idle min_idle"
        return "yes: a live PLAIN/RECLAIM mount takes them over"
    return "yes: no heartbeat; only Mode.RECLAIM (min_idle) or XCLAIM takes them"


def _processing_prefix(queue: str) -> str:
    if has_hash_tag(queue) or "}" not in queue:
        return derived(queue, ":processing:")
    return queue + ":processing:"  # see _keys.derived: such names end in ~<hex>


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


async def _heartbeat(client: Client, queue: str, owner: str, period: float) -> dict[str, Any]:
    """The owner's heartbeat key ``{queue}:heartbeat:<owner>`` (a key with a TTL of
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
    prefix = _processing_prefix(key)
    owners: dict[str, str] = {}  # processing list -> owner
    cursor: Any = b"0"
    while True:
        cursor, batch = await client.execute("SCAN", cursor, "MATCH", _glob_escape(prefix) + "*",
                                             "COUNT", 1000)
        for b in batch:
            owners[_str(b)] = _str(b)[len(prefix):]
        if cursor in (b"0", "0", 0):
            break
    # consumers register name -> processing list in {queue}:consumers
    registry = registry_key(key)
    if await key_type(client, registry) == "hash":
        for name, plist in _pairs(await client.execute("HGETALL", registry)).items():
            owners[_str(plist)] = name
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
            "SCAN", cursor, "MATCH", _glob_escape(_processing_prefix(queue)) + "*", "COUNT", 1000)
        if batch:
            return True
        if cursor in (b"0", "0", 0):
            return False


_MAX_SHOWN = 200
"""Characters of a field value or list element shown by ``inspect --entries``."""


def _shown(value: bytes) -> str:
    text = _str(value)
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


_DEAD_NAMES = {f: _str(f)[len("trf-dead-"):] for f in DEAD_FIELDS}


def stream_entry(eid: Any, flat: Sequence[bytes]) -> dict[str, Any]:
    """One stream entry as ``inspect --entries`` shows it.

    ``dead`` holds the ``trf-dead-*`` fields without the prefix (``reason``,
    ``source``, ``id``, ``group``, ``attempt``, and ``error`` when the
    library recorded the handler's exception, and ``time``: epoch ms), or is
    ``None`` for an entry that is not a dead letter.  ``time`` (ISO 8601, UTC):
    for a dead letter when it was dead-lettered (its ``trf-dead-time``, the
    server's clock), else the time in the entry's id (when it was written).
    """
    entry_id = _str(eid)
    fields: dict[str, str] = {}
    dead: dict[str, str] = {}
    header: dict[str, str] = {}
    for k, v in zip(flat[::2], flat[1::2], strict=False):
        if k in _DEAD_NAMES:
            dead[_DEAD_NAMES[k]] = _shown(v)
        elif k.startswith(b"trf-dead-"):
            dead[_str(k)[len("trf-dead-"):]] = _shown(v)
        elif k in (RETRIES_FIELD, ORIGIN_FIELD):
            header[_str(k)] = _str(v)
        else:
            fields[_str(k)] = _shown(v)
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


async def _inspect(url: str, key: str, group: str | None, delay_key: str | None,
                   dead_letter: str | None, heartbeat: float, entries: int | None = None
                   ) -> dict[str, Any]:
    async with open_client(url, name="trf-cli:inspect", max_connections=2) as client:
        kind = await key_type(client, key)
        if kind == "none" and await _has_list_traces(client, key):
            kind = "list"  # an empty queue (Redis deletes empty lists) with live consumers
        if kind == "none":
            raise CliError(f"key {key!r} does not exist")
        if kind not in ("stream", "list"):
            raise CliError(f"key {key!r} is a {kind}, not a stream or a list")
        if kind == "stream":
            info = await inspect_stream(client, key, group)
        else:
            if group is not None:
                raise CliError(f"--group: key {key!r} is a list, not a stream")
            info = await inspect_list(client, key, heartbeat)
        info["delay_set"] = await _delay_set(client, delay_key or derived(key, ":delayed"))
        info["dead_letter"] = await _dead_letter(client, dead_letter) if dead_letter else None
        if entries is not None:
            info["entries"] = await _entries(client, key, kind, entries)
        return info


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def print_inspect(info: dict[str, Any]) -> None:
    rows: list[list[str]] = [["type", info["type"]], ["length", str(info["length"])]]
    if info["type"] == "stream":
        rows.append(["first id", info["first_id"] or "-"])
        shown = info.get("entries")
        if shown is not None and len(shown) < info["length"]:
            # --entries N lists N entries: the newest, not among them, by its time only
            newest = _id_time(_str(info["last_id"])) or "-"
            rows.append(["entries shown", f"the {len(shown)} oldest of {info['length']} "
                                          f"(the newest written {newest})"])
        else:
            rows.append(["last id", info["last_id"]])
        ret = info["retention"]
        if ret["oldest_needed_id"] is None:
            rows.append(["oldest needed", "- (no groups: a trim leaves the stream alone)"])
        else:
            rows.append(["oldest needed", f"{ret['oldest_needed_id']} (over all groups)"])
            more = "+" if ret["trimmable_capped"] else ""
            rows.append(["trim would remove", f"{ret['trimmable']}{more} entries"])
    ds = info["delay_set"]
    due = ds["oldest_due_in"]
    due_text = "" if due is None else (f", oldest due in {due:.3f} s" if due >= 0
                                       else f", oldest overdue by {-due:.3f} s")
    rows.append(["delay set", f"{ds['key']}: {ds['size']}{due_text}" + (
        f" ({ds['error']})" if "error" in ds else "")])
    dl = info["dead_letter"]
    if dl is not None:
        rows.append(["dead letter", f"{dl['key']}: {dl['length']}" + (
            f" ({dl['error']})" if "error" in dl else "" if dl["type"] != "none" else " (absent)")])
    print_table(["", info["key"]], rows)
    if info["type"] == "stream":
        print()
        grows = []
        for g in info["groups"]:
            o = g["oldest_idle_pending"]
            oldest = "-" if o is None else (
                f"{o['id']} idle {o['idle']:.3f} s, {o['deliveries']} deliveries, {o['consumer']}")
            grows.append([g["name"], str(g["consumers"]), str(g["pending"]), g["last_delivered_id"],
                          "-" if g["lag"] is None else str(g["lag"]), oldest, g["oldest_needed_id"]])
        print_table(["group", "consumers", "pending", "last delivered", "lag",
                     "oldest idle pending", "oldest needed"],
                    grows or [["(no groups)", "", "", "", "", "", ""]])
        for g in info["groups"]:
            if g["consumer_list"]:
                print()
                print_table(
                    [f"consumer of {g['name']}", "pending", "idle", "heartbeat", "stranded"],
                    [[c["name"], str(c["pending"]), _seconds(c["idle"]), _heartbeat_text(c),
                      _stranded_text(c)] for c in g["consumer_list"]],
                )
                if g["stranded"]:
                    print(f"stranded in group {g['name']}: {g['stranded']} pending entries under "
                          "consumers with no live heartbeat")
    else:
        print()
        prows = [[p["key"], p["owner"], str(p["length"]),
                  _seconds(p["heartbeat_age"]) if p["alive"] else "none (owner dead)",
                  _seconds(p["heartbeat_ttl"])]
                 for p in info["processing"]]
        print_table(["processing list", "owner", "length", "heartbeat age", "expires in"],
                    prows or [["(none)", "", "", "", ""]])
    if "entries" in info:
        print()
        print_entries(info["type"], info["entries"])


def _fields_text(fields: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items())


def print_entries(kind: str, entries: list[dict[str, Any]]) -> None:
    """The ``--entries`` table: dead-letter columns when any entry is a dead letter."""
    if kind == "stream":
        if any(e["dead"] for e in entries):
            rows = []
            for e in entries:
                d = e["dead"] or {}
                rows.append([e["id"], e["time"] or "-", d.get("reason", "-"), d.get("source", "-"),
                             d.get("id", "-"), d.get("group", "-"), d.get("attempt", "-"),
                             d.get("error", "-"), _fields_text(e["fields"])])
            print_table(["entry", "dead-lettered at", "reason", "source", "source id", "group",
                         "attempt", "error", "fields"], rows)
        else:
            print_table(["entry", "written at", "fields"],
                        [[e["id"], e["time"] or "-", _fields_text(e["fields"])] for e in entries]
                        or [["(empty)", "", ""]])
        return
    def origin(e: dict[str, Any]) -> str:
        return str(e["origin"] or (e["corrupt"] and f"corrupt: {e['corrupt']}") or "-")

    if any(e["dead"] for e in entries):
        rows = []
        for i, e in enumerate(entries):
            d = e["dead"] or {}
            rows.append([str(i), e["time"] or "-", str(d.get("reason", "-")),
                         str(d.get("source", "-")), str(d.get("attempt", "-")),
                         str(d.get("error", "-")), origin(e), e["data"]])
        print_table(["#", "dead-lettered at", "reason", "source", "attempt", "error", "origin",
                     "data"], rows)
        return
    print_table(["#", "data", "retries", "origin"],
                [[str(i), e["data"], "-" if e["retries"] is None else str(e["retries"]), origin(e)]
                 for i, e in enumerate(entries)] or [["(empty)", "", "", ""]])


def cmd_inspect(args: argparse.Namespace) -> int:
    url = check_url(args.url)
    info = anyio.run(_inspect, url, args.key, args.group, args.delay_key, args.dead_letter,
                     args.heartbeat, args.entries, backend="trio")
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        print_inspect(info)
    return 0


# -- requeue ------------------------------------------------------------------

# KEYS: dead letter, destination.  ARGV: entry id, field, value, ...
# Gated on the entry still being in the dead letter: racing requeues move it once.
REQUEUE_STREAM = Script(
    LUA_XADD  # an entry of any width (Lua's unpack stops near 8,000 values)
    + """
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return false end
local new = xadd(KEYS[2], ARGV, 2)
redis.call('XDEL', KEYS[1], ARGV[1])
return new
""",
    name="requeue_stream",
)

# KEYS: dead letter, destination, the dead letter's reason hash.  ARGV:
# element as read (oldest, at the tail), new element.  The moved element's
# reason record (the oldest of those bytes: the tail's) goes with it.
REQUEUE_LIST = Script(
    """
if redis.call('LINDEX', KEYS[1], -1) ~= ARGV[1] then return false end
redis.call('LPUSH', KEYS[2], ARGV[2])
redis.call('RPOP', KEYS[1])
"""
    + why_pop(3, 1, 1)
    + """
return 1
""",
    name="requeue_list",
)

# KEYS: dead letter, its reason hash.  ARGV: element.  The removal step of a
# requeue to another Redis Cluster hash slot (after the copy was pushed there).
REQUEUE_LIST_FORGET = Script(
    """
if redis.call('LREM', KEYS[1], -1, ARGV[1]) == 0 then return 0 end
"""
    + why_pop(2, 1, 1)
    + """
return 1
""",
    name="requeue_list_forget",
)

_DROP_ON_REQUEUE = {*DEAD_FIELDS, RETRIES_FIELD}


def requeued_fields(flat: Sequence[bytes]) -> list[bytes]:
    """A dead entry's fields without the dead-letter fields and the retry counter."""
    out: list[bytes] = []
    for k, v in zip(flat[::2], flat[1::2], strict=False):
        if k not in _DROP_ON_REQUEUE and not k.startswith(b"trf-dead-"):
            out += [k, v]
    return out


def requeued_element(element: bytes) -> bytes:
    """A dead list element with its envelope's retry counter reset (origin kept)."""
    try:
        body, retries, origin = unwrap(element)
    except CorruptEnvelope:
        return element
    if origin is None or retries == 0:
        return element
    return wrap(body, 0, origin)


async def _requeue_stream(client: Client, dead: str, dest: str, limit: int | None,
                          split: bool) -> int:
    moved = 0
    start = "-"
    while limit is None or moved < limit:
        page = 100 if limit is None else min(100, limit - moved)
        entries = await client.execute("XRANGE", dead, start, "+", "COUNT", page)
        if not entries:
            break
        for eid, flat in entries:
            fields = requeued_fields(flat)
            if not fields:
                log.warning("dead entry %s has no fields of its own; left in %s", _str(eid), dead)
                continue
            if split:  # different cluster slots: copy first, then remove (duplicate, never loss)
                if not await client.execute("XRANGE", dead, eid, eid):
                    continue
                await client.execute("XADD", dest, "*", *fields)
                await client.execute("XDEL", dead, eid)
                moved += 1
            elif await client.evalsha(REQUEUE_STREAM, (dead, dest), (eid, *fields)) is not None:
                moved += 1
            if limit is not None and moved >= limit:
                break
        start = "(" + _str(entries[-1][0])
    return moved


async def _requeue_list(client: Client, dead: str, dest: str, limit: int | None, split: bool) -> int:
    moved = 0
    misses = 0
    while limit is None or moved < limit:
        element = await client.execute("LINDEX", dead, -1)
        if element is None:
            break
        new = requeued_element(element)
        if split:
            await client.execute("LPUSH", dest, new)
            await client.evalsha(REQUEUE_LIST_FORGET, (dead, why_key(dead)), (element,))
            moved += 1
            continue
        if await client.evalsha(REQUEUE_LIST, (dead, dest, why_key(dead)), (element, new)) is None:
            misses += 1  # someone else moved it meanwhile: read the tail again
            if misses > 1000:
                raise CliError(f"dead letter {dead!r} keeps changing under requeue; try again")
            continue
        moved += 1
    return moved


async def refusal(client: Client, dead: str, kind: str) -> str | None:
    """Why ``requeue`` should not move from ``dead`` (``None``: it is a dead letter).

    A stream: an entry among the oldest 100 without ``trf-dead-reason`` (not
    a dead letter this library wrote), or a consumer group with entries
    pending (a live queue: moving would take work from under its consumers).
    A list: a reliable list's consumers registered or processing lists, or
    an element among the oldest 100 without a reason record in the dead
    letter's reason hash (:func:`~._plan.why_key`).
    """
    if kind == "stream":
        for g in await client.execute("XINFO", "GROUPS", dead):
            info = _pairs(g)
            if int(info["pending"]):
                return (f"dead letter {dead!r}: consumer group {_str(info['name'])!r} reads it with "
                        f"{int(info['pending'])} entries pending (a live stream, not a dead letter)")
        for eid, flat in await client.execute("XRANGE", dead, "-", "+", "COUNT", 100):
            if DEAD_REASON not in flat[::2]:
                return (f"dead letter {dead!r}: entry {_str(eid)} has no "
                        f"{_str(DEAD_REASON)} field (not a dead letter written by trio_redis_finalize)")
        return None
    if await _has_list_traces(client, dead):
        return f"dead letter {dead!r}: consumers are reading it (processing lists exist)"
    oldest = list(reversed(await client.execute("LRANGE", dead, -100, -1)))
    for i, record in enumerate(await _list_records(client, dead, oldest)):
        if record is None:
            return (f"dead letter {dead!r}: element #{i} (oldest first) has no reason record in "
                    f"{why_key(dead)!r} (not a dead letter written by trio_redis_finalize)")
    return None


async def _requeue(url: str, dead: str, dest: str, limit: int | None, force: bool = False) -> int:
    if dead == dest:
        raise CliError("--to must differ from the dead letter")
    async with open_client(url, name="trf-cli:requeue", max_connections=2) as client:
        kind = await require_key(client, dead, "dead letter", ("stream", "list"))
        dest_kind = await key_type(client, dest)
        if dest_kind not in ("none", kind):
            raise CliError(f"--to {dest!r} is a {dest_kind}, but dead letter {dead!r} is a {kind}")
        if not force:
            why = await refusal(client, dead, kind)
            if why is not None:
                raise CliError(f"{why}; nothing moved (--force moves anyway)")
        split = bool(client.params.cluster_seeds) and not same_slot(dead, dest)
        if kind == "stream":
            return await _requeue_stream(client, dead, dest, limit, split)
        return await _requeue_list(client, dead, dest, limit, split)


def cmd_requeue(args: argparse.Namespace) -> int:
    url = check_url(args.url)
    moved = anyio.run(_requeue, url, args.dead_letter, args.to, args.limit, args.force, backend="trio")
    print(f"requeued {moved} message{'s' if moved != 1 else ''} from {args.dead_letter} to {args.to}")
    return 0


# -- demo ---------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import demo

    if args.url is not None:
        check_url(args.url)
    return demo(args.url, verbose=args.verbose, per_cell=args.messages)


# -- parser -------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # bad input is one line on stderr, exit 2 (no usage block); --help shows the usage
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_N = TypeVar("_N", int, float)


def _checked(
    convert: Callable[[str], _N], noun: str, ok: Callable[[_N], bool], refusal: str
) -> Callable[[str], _N]:
    """An argparse ``type``: ``convert(text)`` (else "is not ``noun``"), kept
    when ``ok`` (else "``refusal``")."""

    def parse(text: str) -> _N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} {refusal}")
        return value

    return parse


_positive_int = _checked(int, "an integer", lambda v: v >= 1, "must be >= 1")
_port = _checked(int, "a port number", lambda v: 0 <= v <= 65535, "is not a port number (0-65535)")
_non_negative = _checked(float, "a number", lambda v: v >= 0, "must be >= 0")  # NaN: refused


def _url_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", default=DEFAULT_URL,
        help=f"Redis URL: redis://[user:password@]host:port/db, rediss://, unix://path "
             f"(default: {DEFAULT_URL})",
    )


def _command(
    sub: argparse._SubParsersAction[_Parser],
    func: Callable[[argparse.Namespace], int], name: str, *, help: str, description: str,
) -> argparse.ArgumentParser:
    """The sub-command ``name``, run as ``func(args)``."""
    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Consume Redis streams, lists and Pub/Sub from trio, finalizing every "
                    "delivery with the commands proper to its form and outcome.",
        epilog="Exit codes: 0 ok; 1 failure at run time (the demo lost messages); 2 bad input "
               "(one line on stderr).",
    )
    from ._version import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    p = _command(
        sub, cmd_demo, "demo",
        help="every form x every outcome against a real server; prints the observed table",
        description="Mount one subscription of every form (stream, claiming stream, stream with "
                    "a durable delay set, reliable list, simple list, channel, pattern), produce "
                    "messages whose handlers return every outcome, record with MONITOR the "
                    "Redis commands each finalization issued, print them as a form x outcome "
                    "table and check that nothing was lost (last line 'lost: N'; exit 1 if N > 0).",
    )
    p.add_argument("--url", default=None,
                   help="use this server (keys are prefixed trf-demo-<random> and deleted after); "
                        "default: start a private redis-server on a free port")
    p.add_argument("--messages", type=_positive_int, default=3, metavar="N",
                   help="messages per form and outcome (default 3)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the library's log records")

    p = _command(
        sub, cmd_run, "run",
        help="run a consumer whose subscriptions your code mounts",
        description="Import MODULE, open a consumer and await FACTORY(consumer), e.g. "
                    "'async def setup(consumer): await consumer.mount(StreamSubscription(...), "
                    "handle)'; then run until SIGINT or SIGTERM: the first stops gracefully "
                    "(in-flight handlers finish, outcomes are finalized), a second exits at once "
                    "(code 128+signal). Logs go to stderr. The current directory is importable.",
    )
    p.add_argument("factory", metavar="MODULE:FACTORY", help="e.g. myapp.worker:setup")
    _url_arg(p)
    p.add_argument("--name", default=None,
                   help="consumer name (stable names let a restart recover pending work; "
                        "default: host-pid-random)")
    p.add_argument("--shutdown-grace", type=_non_negative, default=10.0, metavar="SECONDS",
                   help="seconds in-flight handlers get to finish on shutdown (default 10)")
    p.add_argument("--backend", default="trio", choices=["trio", "asyncio"],
                   help="the event loop the consumer and your handlers run on: trio (default) "
                        "or asyncio (for handlers that use asyncio libraries)")
    p.add_argument("--metrics-port", type=_port, default=None, metavar="N",
                   help="serve Prometheus metrics on http://HOST:N/metrics, with the "
                        "process metrics (needs the [prometheus] extra)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="the address the metrics are served on (default 127.0.0.1: this host "
                        "only; 0.0.0.0: every interface, e.g. scraped from outside a container)")
    p.add_argument("--metrics-prefix", default="trf", metavar="PREFIX",
                   help="prefix of the metric names (default trf)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO")

    p = _command(
        sub, cmd_inspect, "inspect",
        help="show a stream's or list's state: groups, pending, delay set, dead letter",
        description="For a stream: length, consumer groups (consumers, pending, last delivered id, "
                    "oldest needed entry, lag, oldest idle pending entry), consumers, the oldest "
                    "entry any group still needs and how many entries below it a trim "
                    "(Retention.TRIM_ACKED) would remove. For a list: length and the "
                    "processing lists ({KEY}:processing:* and those registered in {KEY}:consumers) "
                    "with their owners' heartbeat age. "
                    "For both: the delay set ({KEY}:delayed unless --delay-key) and, with "
                    "--dead-letter, the dead letter's length.",
    )
    p.add_argument("key", metavar="KEY", help="the stream or list")
    p.add_argument("--group", default=None, help="only this consumer group (streams)")
    _url_arg(p)
    p.add_argument("--delay-key", default=None, help="the durable delay set (default {KEY}:delayed)")
    p.add_argument("--dead-letter", default=None, metavar="KEY", help="also show this dead letter")
    p.add_argument("--heartbeat", type=_non_negative, default=30.0, metavar="SECONDS",
                   help="the subscriptions' heartbeat setting, to estimate heartbeat age from the "
                        "heartbeat key's TTL (lists; default 30, the library's default)")
    p.add_argument("--entries", type=_positive_int, default=None, metavar="N",
                   help="also list the N oldest entries (stream) or elements (list); for a dead "
                        "letter, with why each was dead-lettered (reason, error, source, entry id "
                        "or processing list, group, attempt, time)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")

    p = _command(
        sub, cmd_requeue, "requeue",
        help="move dead-lettered messages back onto a queue",
        description="Move messages from DEAD_LETTER (oldest first) back to --to, with their "
                    "retry counter reset and their origin id kept. Stream entries lose the "
                    "trf-dead-* fields; each move is one script gated on the entry still being in "
                    "the dead letter (copy first, then XDEL / RPOP), so racing requeues move a "
                    "message once; a list element's reason record ({DEAD_LETTER}:why) goes with "
                    "it. Refused, unless --force: a stream whose entries lack the trf-dead-* "
                    "fields, a list whose elements have no reason record (not a dead letter this "
                    "library wrote), a stream a consumer group reads with entries pending, a list "
                    "consumers are reading.",
    )
    p.add_argument("dead_letter", metavar="DEAD_LETTER", help="the dead-letter stream or list")
    p.add_argument("--to", required=True, metavar="KEY", help="where the messages go")
    p.add_argument("--limit", type=_positive_int, default=None, metavar="N",
                   help="move at most N messages (default: all)")
    p.add_argument("--force", action="store_true",
                   help="move even from a stream or list whose entries are not dead letters "
                        "written by this library, or that a consumer group reads with entries "
                        "pending, or from a list that consumers are reading (processing lists "
                        "exist)")
    _url_arg(p)

    from ._dashboard._command import add_command

    add_command(sub, _command, _url_arg, _port)
    return parser


# -- main ---------------------------------------------------------------------

_BAD_INPUT = (CliError, ValueError, rexc.RedisError, OSError)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m trio_redis_finalize`` and ``trio-redis-finalize``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        leaves = _leaves(exc)
        if any(isinstance(e, KeyboardInterrupt) for e in leaves):
            return 130
        if isinstance(exc, SystemExit):
            raise
        bad = [e for e in leaves if isinstance(e, _BAD_INPUT)]
        if bad and len(bad) == len(leaves):
            print(f"{PROG} {args.command}: error: {_one_line(str(bad[0]))}", file=sys.stderr)
            return 2
        raise
