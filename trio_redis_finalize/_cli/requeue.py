"""``trio-redis-finalize requeue DEAD_LETTER``: the safe requeue of dead
letters, for the command line and the dashboard.

Both go through the same gated scripts (each move copies, then removes, gated
on the message still being in the dead letter: racing requeues move it once)
and the same :func:`refusal` (not a dead letter this library wrote, or a
queue still being read).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import anyio

from .._core._plan import why_key
from .._core._types import DEAD_FIELDS, DEAD_REASON
from .._core.reliable_list.scripts import REQUEUE_LIST, REQUEUE_LIST_FORGET
from .._core.stream.scripts import REQUEUE_STREAM
from .._envelope import RETRIES_FIELD, CorruptEnvelope, unwrap, wrap
from .._keys import same_slot
from .._subscription import source_of_dead_letter
from .._transport import Client, open_client
from ._common import (
    PROG,
    CliError,
    Command,
    as_str,
    check_url,
    key_type,
    pairs,
    positive_int,
    require_key,
    url_arg,
)
from ._queues import _has_list_traces, _list_records

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
                log.warning("dead entry %s has no fields of its own; left in %s", as_str(eid), dead)
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
        start = "(" + as_str(entries[-1][0])
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
            info = pairs(g)
            if int(info["pending"]):
                return (f"dead letter {dead!r}: consumer group {as_str(info['name'])!r} reads it with "
                        f"{int(info['pending'])} entries pending (a live stream, not a dead letter)")
        for eid, flat in await client.execute("XRANGE", dead, "-", "+", "COUNT", 100):
            if DEAD_REASON not in flat[::2]:
                return (f"dead letter {dead!r}: entry {as_str(eid)} has no "
                        f"{as_str(DEAD_REASON)} field (not a dead letter written by trio_redis_finalize)")
        return None
    if await _has_list_traces(client, dead):
        return f"dead letter {dead!r}: consumers are reading it (processing lists exist)"
    oldest = list(reversed(await client.execute("LRANGE", dead, -100, -1)))
    for i, record in enumerate(await _list_records(client, dead, oldest)):
        if record is None:
            return (f"dead letter {dead!r}: element #{i} (oldest first) has no reason record in "
                    f"{why_key(dead)!r} (not a dead letter written by trio_redis_finalize)")
    return None


def arguments(p: argparse.ArgumentParser) -> None:
    """The ``requeue`` command's options (run as :func:`execute`)."""
    p.add_argument("dead_letter", metavar="DEAD_LETTER", help="the dead-letter stream or list")
    p.add_argument("--to", default=None, metavar="KEY",
                   help="where the messages go (default: the source of a default dead letter, "
                        "{KEY}:dead -> KEY)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="move at most N messages (default: all)")
    p.add_argument("--force", action="store_true",
                   help="move even from a stream or list whose entries are not dead letters "
                        "written by this library, or that a consumer group reads with entries "
                        "pending, or from a list that consumers are reading (processing lists "
                        "exist)")
    url_arg(p)


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


def execute(args: argparse.Namespace) -> int:
    url = check_url(args.url)
    if args.to is None:  # a default dead letter names its source
        args.to = source_of_dead_letter(args.dead_letter)
        if args.to is None:
            raise CliError(f"--to KEY is needed: {args.dead_letter!r} is not a default dead "
                           f"letter ('{{SOURCE}}:dead') (see {PROG} requeue --help)")
    moved = anyio.run(_requeue, url, args.dead_letter, args.to, args.limit, args.force, backend="trio")
    print(f"requeued {moved} message{'s' if moved != 1 else ''} from {args.dead_letter} to {args.to}")
    return 0


COMMAND = Command(
    "requeue", arguments, execute,
    help="move dead-lettered messages back onto a queue",
    description=("Move messages from DEAD_LETTER (oldest first) back to --to, with their "
                 "retry counter reset and their origin id kept. Stream entries lose the "
                 "trf-dead-* fields; each move is one script gated on the entry still being in "
                 "the dead letter (copy first, then XDEL / RPOP), so racing requeues move a "
                 "message once; a list element's reason record ({DEAD_LETTER}:why) goes with "
                 "it. Refused, unless --force: a stream whose entries lack the trf-dead-* "
                 "fields, a list whose elements have no reason record (not a dead letter this "
                 "library wrote), a stream a consumer group reads with entries pending, a list "
                 "consumers are reading."),
)
"""This command's row of ``_cli.COMMANDS``."""
