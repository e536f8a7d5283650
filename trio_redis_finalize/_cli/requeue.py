"""The safe requeue of dead letters: ``requeue`` (the command line) and the dashboard.

Moved out of ``_cli`` (the command line imports it back) so both go through
the same gated scripts and the same refusal.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .._core._plan import DEAD_FIELDS, DEAD_REASON, why_key
from .._core.reliable_list.scripts import REQUEUE_LIST, REQUEUE_LIST_FORGET
from .._core.stream.scripts import REQUEUE_STREAM
from .._envelope import RETRIES_FIELD, CorruptEnvelope, unwrap, wrap
from .._table import CliError
from .._transport import Client
from .inspect import _has_list_traces, _list_records, _pairs, _str

log = logging.getLogger("trio_redis_finalize.cli")


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
