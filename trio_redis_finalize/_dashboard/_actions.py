"""The dead-letter actions: requeue and delete, each first as a dry run.

Requeue goes through the CLI's safe requeue (``trio-redis-finalize
requeue``): the same refusal (a dead letter a consumer group reads with
entries pending, or whose entries this library did not write, unless
forced), the same gated scripts (``REQUEUE_STREAM``: copy to the source,
then ``XDEL``, only while the entry is still in the dead letter, so racing
requeues move an entry once; a list's ``REQUEUE_LIST``, oldest first), and
on Redis Cluster, for a source in another hash slot, copy first, then
remove (a duplicate, never a loss).

A confirmed action acts on what its dry run counted, never on dead letters
written since (a consumer dead-letters while the operator reads the
confirmation): the dry run's newest entry id (:attr:`Plan.upto`) travels
with the confirmation, and a stream's ``all`` and ``reason`` scopes stop
there (``XTRIM ... MINID`` for a delete of all, which keeps the key and its
groups); a list's delete of all runs only while the list is as long as
counted with the same newest element (``DELETE_LIST_DEAD``; else nothing is
deleted and the operator is told to look again), a list's requeue moves at
most the count it showed.  A stream entry goes back to the stream
its ``trf-dead-source`` names, a list element to the queue its reason
record names.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from .._cli import _queues, requeue
from .._cli._common import as_str, key_type
from .._core._plan import why_key
from .._core.reliable_list.scripts import DELETE_LIST_DEAD
from .._core.stream.scripts import REQUEUE_STREAM
from .._keys import same_slot
from .._transport import Client
from ._data import HISTOGRAM_CAP, read_stream

__all__ = ["Plan", "apply", "plan", "seen_of"]


class ActionError(Exception):
    """An action that cannot be done (shown to the user, nothing changed)."""


@dataclasses.dataclass
class Plan:
    """What an action will do: ``count`` messages, to where."""

    action: str  # "requeue" or "delete"
    key: str
    kind: str
    scope: str  # "ids", "reason", "all"
    ids: list[str]
    reason: str | None
    count: int
    targets: dict[str, int]
    refusal: str | None = None
    capped: bool = False
    upto: str | None = None
    """What the dry run saw last: a stream's newest entry id, a list's newest
    element's SHA-1 (hex); the confirmation acts on nothing newer."""

    def describe(self) -> str:
        what = f"{self.count} message{'s' if self.count != 1 else ''}"
        if self.action == "requeue":
            to = ", ".join(f"{n} to {t}" for t, n in sorted(self.targets.items()))
            return f"requeue {what} from {self.key}" + (f" ({to})" if to else "")
        return f"delete {what} from {self.key}"


def _select(entries: Sequence[dict[str, Any]], scope: str, ids: Sequence[str],
            reason: str | None) -> list[dict[str, Any]]:
    if scope == "ids":
        wanted = set(ids)
        return [e for e in entries if e["id"] in wanted]
    if scope == "reason":
        return [e for e in entries if (e["dead"] or {}).get("reason", "(none)") == reason]
    return list(entries)


async def plan(client: Client, key: str, action: str, scope: str, ids: Sequence[str] = (),
               reason: str | None = None, force: bool = False) -> Plan:
    """The dry run: what ``action`` on ``key`` would do now."""
    if action not in ("requeue", "delete"):
        raise ActionError(f"unknown action {action!r}")
    if scope not in ("ids", "reason", "all"):
        raise ActionError(f"unknown scope {scope!r}")
    if scope == "ids" and not ids:
        raise ActionError("no message selected")
    if scope == "reason" and not reason:
        raise ActionError("no reason given")
    kind = await key_type(client, key)
    if kind == "none":
        raise ActionError(f"dead letter {key!r} does not exist (empty, or deleted)")
    if kind not in ("stream", "list"):
        raise ActionError(f"{key!r} is a {kind}, not a dead letter (a stream or a list)")
    targets: dict[str, int] = {}
    capped = False
    upto: str | None = None
    if kind == "stream":
        newest = await client.execute("XREVRANGE", key, "+", "-", "COUNT", 1)
        upto = as_str(newest[0][0]) if newest else None
        length = int(await client.execute("XLEN", key))
        if scope == "all":
            count = length
            entries = await read_stream(client, key, HISTOGRAM_CAP) if action == "requeue" else []
            capped = length > HISTOGRAM_CAP and action == "requeue"
        elif scope == "ids":
            entries = await by_ids(client, key, ids)
            count = len(entries)
        else:
            entries = _select(await read_stream(client, key, HISTOGRAM_CAP), scope, ids, reason)
            count = len(entries)
            capped = length > HISTOGRAM_CAP
        for e in entries:
            t = (e["dead"] or {}).get("source")
            if t:
                targets[t] = targets.get(t, 0) + 1
        if action == "requeue" and any(not (e["dead"] or {}).get("source") for e in entries):
            raise ActionError("some selected entries have no trf-dead-source (nowhere to requeue them)")
    else:
        if scope != "all":
            raise ActionError("a list dead letter is requeued or deleted whole (scope 'all')")
        count = int(await client.execute("LLEN", key))
        head = await client.execute("LINDEX", key, 0)
        upto = hashlib.sha1(head).hexdigest() if head is not None else None
        if action == "requeue":
            oldest = await client.execute("LRANGE", key, -1, -1)
            record = (await _queues._list_records(client, key, oldest))[0] if oldest else None
            source = (record or {}).get("source")
            if not source:
                raise ActionError(f"dead letter {key!r}: its oldest element has no reason record "
                                  "naming its source queue")
            targets[str(source)] = count
    # a live queue (a group with entries pending, consumers reading a list), or a key whose
    # entries this library did not write: refused for delete as for requeue, unless forced
    why = None if force else await requeue.refusal(client, key, kind)
    return Plan(action, key, kind, scope, list(ids), reason, count, targets, why, capped, upto)


def seen_of(p: Plan, count: str | None, upto: str | None) -> Plan | None:
    """The dry run a confirmation names (its ``count`` and ``upto`` fields),
    as ``p`` saw it then; None when it names none (``p`` is acted on as it is)."""
    if count is None:
        return None
    try:
        n = int(count)
    except ValueError:
        raise ActionError(f"count: not a number: {count!r}") from None
    return dataclasses.replace(p, count=n, upto=upto or None)


def _next_id(eid: str) -> str:
    """The smallest stream id above ``eid``."""
    ms, _, seq = eid.partition("-")
    s = int(seq or 0)
    return f"{int(ms) + 1}-0" if s == 2**64 - 1 else f"{ms}-{s + 1}"


async def apply(client: Client, p: Plan, force: bool = False, seen: Plan | None = None) -> int:
    """Do what ``p`` planned (checked again: the refusal, the entries still there); how many moved.

    ``seen``: the dry run the operator confirmed (its ``count`` and ``upto``);
    nothing written since it is acted on (None: ``p`` itself)."""
    seen = seen or p
    if not force:
        why = await requeue.refusal(client, p.key, p.kind)
        if why is not None:
            raise ActionError(f"{why}; nothing done (tick 'force' to {p.action} anyway)")
    if p.kind == "list":
        if p.action == "delete":
            n = int(await client.evalsha(DELETE_LIST_DEAD, (p.key, why_key(p.key)),
                                         (seen.count, seen.upto or "")))
            if n < 0:
                raise ActionError(f"dead letter {p.key!r} changed since the dry run ({seen.count} "
                                  "counted then); nothing deleted: look again")
            return n
        (dest,) = p.targets
        split = bool(client.params.cluster_seeds) and not same_slot(p.key, dest)
        return await requeue._requeue_list(client, p.key, dest, seen.count, split)
    if seen.upto is None and p.scope != "ids":
        return 0  # the dry run saw an empty dead letter: nothing it counted to act on
    if p.action == "delete" and p.scope == "all" and seen.upto is not None:
        return int(await client.execute("XTRIM", p.key, "MINID", _next_id(seen.upto)))
    done = 0
    kinds: dict[str, str] = {}
    async for page in _pages(client, p, seen.upto):
        entries = _select(page, p.scope, p.ids, p.reason)
        if p.action == "delete":
            if entries:
                done += int(await client.execute("XDEL", p.key, *[e["id"] for e in entries]))
            continue
        for e in entries:
            to = (e["dead"] or {}).get("source")
            if not to:
                continue  # nowhere to requeue it (the dry run said so)
            if to not in kinds:
                kinds[to] = await key_type(client, to)
            if kinds[to] not in ("none", "stream"):
                raise ActionError(f"source {to!r} is a {kinds[to]}, not a stream; {done} moved")
            if await move_stream_entry(client, p.key, to, e["id"], e["raw"]):
                done += 1
    return done


async def _pages(client: Client, p: Plan, upto: str | None) -> AsyncIterator[list[dict[str, Any]]]:
    """The entries ``p`` may act on, a page at a time: the named ones, or the
    stream up to ``upto`` (the dry run's newest)."""
    if p.scope == "ids":
        yield await by_ids(client, p.key, p.ids)
        return
    start = "-"
    while True:
        rows = await client.execute("XRANGE", p.key, start, upto or "+", "COUNT", 500)
        if not rows:
            return
        yield [_queues.stream_entry(eid, flat) | {"raw": flat} for eid, flat in rows]
        start = "(" + as_str(rows[-1][0])


async def by_ids(client: Client, key: str, ids: Sequence[str]) -> list[dict[str, Any]]:
    """The entries of ``key`` with these ids that are still there (one pipeline)."""
    if not ids:
        return []
    replies = await client.pipeline([("XRANGE", key, i, i) for i in ids], raise_on_error=False)
    return [_queues.stream_entry(rows[0][0], rows[0][1]) | {"raw": rows[0][1]}
            for rows in replies if rows and not isinstance(rows, Exception)]


async def move_stream_entry(client: Client, dead: str, dest: str, eid: str,
                            flat: Sequence[bytes]) -> bool:
    """One dead entry back to ``dest``, as ``requeue`` moves it; False when it was gone."""
    fields = requeue.requeued_fields(flat)
    if not fields:
        return False
    if bool(client.params.cluster_seeds) and not same_slot(dead, dest):
        # different cluster slots: copy first, then remove (duplicate, never loss)
        if not await client.execute("XRANGE", dead, eid, eid):
            return False
        await client.execute("XADD", dest, "*", *fields)
        await client.execute("XDEL", dead, eid)
        return True
    return await client.evalsha(REQUEUE_STREAM, (dead, dest), (eid, *fields)) is not None


def text(value: Any) -> str:
    return as_str(value)
