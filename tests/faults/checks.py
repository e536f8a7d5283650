"""What Redis physically holds for each message, and the verdict on it.

A *message* is identified by its origin id (the first entry's id for a
stream, the envelope's origin or the content digest for a list).  It is
*present* while some token of it is in Redis where a consumer will find it:
an unread stream entry, a PEL row, a delay-set member, a queue element, a
processing-list element.  The checker's categories (after Jepsen's
total-queue):

* ``lost``: produced, not finalized, and not present anywhere;
* ``stranded``: still pending (PEL / processing list) after recovery ran;
* ``copies``: successor copies per origin (stream entries / list elements
  carrying the origin, delay-set members, dead-letter entries).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from typing import Any

from trio_redis_finalize import ORIGIN_FIELD, RETRIES_FIELD
from trio_redis_finalize._core._types import content_origin
from trio_redis_finalize._envelope import CorruptEnvelope, unpack_parts, unwrap
from trio_redis_finalize._transport import Client

__all__ = ["ListState", "StreamState", "Verdict", "judge", "list_state", "stream_state"]


def _id(eid: bytes | str) -> tuple[int, int]:
    s = eid.decode() if isinstance(eid, bytes) else eid
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


@dataclasses.dataclass
class Entry:
    id: str
    fields: dict[bytes, bytes]

    @property
    def origin(self) -> str:
        o = self.fields.get(ORIGIN_FIELD)
        return o.decode() if o is not None else self.id

    @property
    def retries(self) -> int:
        return int(self.fields.get(RETRIES_FIELD, b"0"))

    @property
    def is_copy(self) -> bool:
        return ORIGIN_FIELD in self.fields


@dataclasses.dataclass
class StreamState:
    entries: list[Entry]
    pending: dict[str, tuple[str, int]]  # id -> (consumer, delivery count)
    last_delivered: str
    delayed: list[dict[bytes, bytes]]  # fields of each delay-set member
    dead: list[Entry]

    def unread(self) -> list[Entry]:
        last = _id(self.last_delivered)
        return [e for e in self.entries if _id(e.id) > last]

    def origin_of(self, eid: str) -> str:
        for e in self.entries:
            if e.id == eid:
                return e.origin
        return eid  # deleted entry

    def present(self) -> Counter[str]:
        """Tokens per origin: unread entries, PEL rows, delay-set members."""
        c: Counter[str] = Counter(e.origin for e in self.unread())
        c.update(self.origin_of(i) for i in self.pending)
        c.update(_delayed_origin(f) for f in self.delayed)
        return c

    def copies(self) -> Counter[str]:
        """Successor copies per origin: copies in the stream and in the delay set."""
        c: Counter[str] = Counter(e.origin for e in self.entries if e.is_copy)
        c.update(_delayed_origin(f) for f in self.delayed)
        return c

    def dead_letters(self) -> Counter[str]:
        return Counter(e.origin for e in self.dead)

    def stranded(self) -> Counter[str]:
        return Counter(self.origin_of(i) for i in self.pending)


def _delayed_origin(fields: dict[bytes, bytes]) -> str:
    return fields.get(ORIGIN_FIELD, b"?").decode()


async def _entries(client: Client, key: str) -> list[Entry]:
    rows = await client.execute("XRANGE", key, "-", "+")
    return [Entry(r[0].decode(), _pairs(r[1])) for r in rows]


async def stream_state(
    client: Client, stream: str, group: str, *, delay_key: str | None = None,
    dead_letter: str | None = None,
) -> StreamState:
    entries = await _entries(client, stream)
    pending: dict[str, tuple[str, int]] = {}
    last = "0-0"
    groups = await client.execute("XINFO", "GROUPS", stream) if await client.execute(
        "EXISTS", stream) else []
    for g in groups:
        info = _pairs(g)
        if info[b"name"].decode() == group:
            last = info[b"last-delivered-id"].decode()
            rows = await client.execute("XPENDING", stream, group, "-", "+", 100_000)
            pending = {r[0].decode(): (r[1].decode(), int(r[3])) for r in rows}
    delayed: list[dict[bytes, bytes]] = []
    if delay_key is not None:
        for m in await client.execute("ZRANGE", delay_key, 0, -1):
            parts = unpack_parts(m)
            delayed.append(_pairs(parts[1:]))
    dead = await _entries(client, dead_letter) if dead_letter is not None else []
    return StreamState(entries, pending, last, delayed, dead)


def element_origin(element: bytes) -> tuple[str, int]:
    """``(origin, retries)`` of a list element (envelope or foreign)."""
    try:
        body, retries, origin = unwrap(element)
    except CorruptEnvelope:
        return content_origin(element), 0
    return (origin if origin is not None else content_origin(body)), retries


@dataclasses.dataclass
class ListState:
    queue: list[bytes]
    processing: dict[str, list[bytes]]
    delayed: list[bytes]  # elements waiting in the delay set
    dead: list[bytes]

    def present(self) -> Counter[str]:
        c: Counter[str] = Counter(element_origin(e)[0] for e in self.queue)
        for items in self.processing.values():
            c.update(element_origin(e)[0] for e in items)
        c.update(element_origin(e)[0] for e in self.delayed)
        return c

    def copies(self) -> Counter[str]:
        """Enveloped elements (copies) queued, processing or delayed, per origin."""
        c: Counter[str] = Counter()
        for e in [*self.queue, *self.delayed, *(x for v in self.processing.values() for x in v)]:
            if unwrap_safe(e):
                c[element_origin(e)[0]] += 1
        return c

    def dead_letters(self) -> Counter[str]:
        return Counter(element_origin(e)[0] for e in self.dead)

    def stranded(self) -> Counter[str]:
        c: Counter[str] = Counter()
        for items in self.processing.values():
            c.update(element_origin(e)[0] for e in items)
        return c


def unwrap_safe(element: bytes) -> bool:
    """True when ``element`` is a library envelope (a copy)."""
    try:
        return unwrap(element)[2] is not None
    except CorruptEnvelope:
        return False


async def list_state(
    client: Client, queue: str, processing: Iterable[str], *, delay_key: str | None = None,
    dead_letter: str | None = None,
) -> ListState:
    q = list(await client.execute("LRANGE", queue, 0, -1))
    proc = {p: list(await client.execute("LRANGE", p, 0, -1)) for p in processing}
    delayed: list[bytes] = []
    if delay_key is not None:
        for m in await client.execute("ZRANGE", delay_key, 0, -1):
            delayed.append(unpack_parts(m)[1])
    dead = list(await client.execute("LRANGE", dead_letter, 0, -1)) if dead_letter else []
    return ListState(q, proc, delayed, dead)


@dataclasses.dataclass
class Verdict:
    lost: set[str]
    stranded: set[str]
    present: Counter[str]

    def __bool__(self) -> bool:  # "all good"
        return not self.lost and not self.stranded


def judge(produced: Iterable[str], finalized: Iterable[str], state: Any,
          *, recovered: bool = True) -> Verdict:
    """``lost``: produced, not finalized, not present.  ``stranded`` (only when
    ``recovered``): still in a PEL / processing list."""
    present = state.present()
    done = set(finalized)
    lost = {o for o in produced if o not in done and present[o] == 0}
    stranded = set(state.stranded()) if recovered else set()
    return Verdict(lost, stranded, present)
