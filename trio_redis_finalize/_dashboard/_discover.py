"""Which subscriptions and dead letters the dashboard shows (:func:`discover`).

Subscriptions are found with ``SCAN ... TYPE stream`` and ``SCAN ... TYPE
hash`` (the registries ``...:list-consumers:...`` of reliable lists, the
reason hashes ``...:why`` of list dead letters), on every master of a Redis
Cluster, at most every ``rediscover`` seconds; or named (``keys``: no
``SCAN`` at all).  A stream with groups is one subscription per group; a
stream without groups whose newest entry carries ``trf-dead-reason`` is a
dead letter, shown with the subscription its ``trf-dead-source`` /
``trf-dead-group`` name.  The dashboard knows a subscription by the type of
its key (``kind``: ``stream`` or ``list``), as ``TYPE`` and ``SCAN`` report it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

from redis import exceptions as rexc

from .._cli import _queues as queues
from .._cli._common import as_str, pairs
from .._core._plan import why_key
from .._core._types import DEAD_GROUP, DEAD_REASON, DEAD_SOURCE
from .._core.reliable_list.liveness import registry_key
from .._history import history_key
from .._keys import derived
from .._transport import Client, ClusterClient

__all__ = ["DeadLetter", "Found", "Sub", "discover"]


@dataclasses.dataclass
class Sub:
    """A subscription as the dashboard knows it: a stream's group, or a (reliable) list."""

    kind: str  # the key's type: "stream" or "list"
    key: str
    group: str = ""
    dead_letter: str | None = None

    @property
    def delay_key(self) -> str:
        return derived(self.key, ":delayed")

    @property
    def name(self) -> str:
        return f"{self.key} / {self.group}" if self.kind == "stream" else self.key

    @property
    def history(self) -> str:
        return history_key(self.key, self.group or None)


@dataclasses.dataclass
class DeadLetter:
    key: str
    kind: str  # "stream" or "list"
    source: str | None = None
    group: str | None = None


@dataclasses.dataclass
class Found:
    subs: list[Sub]
    dead: list[DeadLetter]
    commands: int = 0


def underived(name: str, suffix: str) -> str | None:
    """The key ``k`` whose ``derived(k, suffix)`` is ``name``, when there is one."""
    if not name.endswith(suffix):
        return None
    base = name[: -len(suffix)]
    candidates = [base]
    if base.startswith("{") and base.endswith("}"):
        candidates.insert(0, base[1:-1])
    for c in candidates:
        if derived(c, suffix) == name:
            return c
    return None


def _list_of_registry(name: str) -> str | None:
    """The queue whose reliable-list registry ``name`` is (``registry_key``;
    or ``{queue}:consumers``, the naming before), when it is one."""
    _, kind, rest = name.rpartition(":list-consumers:")
    if kind:
        queue = unquote(rest.split("~", 1)[0])  # escaped names have no "~" (derived's counter)
        return queue if registry_key(queue) == name else None
    return underived(name, ":consumers")


async def _scan(client: Client, *args: Any) -> list[str]:
    """Every key of ``SCAN 0 <args>`` (on each master of a cluster)."""
    pools: list[Client] = [client]
    if isinstance(client, ClusterClient):
        await client.check()
        pools = [client.node(a) for a in client.nodes]
    out: list[str] = []
    for pool in pools:
        cursor: Any = b"0"
        while True:
            cursor, batch = await pool.execute("SCAN", cursor, *args, "COUNT", 1000)
            out += [as_str(k) for k in batch]
            if cursor in (b"0", "0", 0):
                break
    return sorted(set(out))


async def discover(client: Client, keys: Sequence[str] = ()) -> Found:
    """The subscriptions and dead letters: ``keys`` (streams or lists), else what ``SCAN`` finds."""
    streams: list[str] = []
    lists: list[str] = []
    why_hashes: list[str] = []
    if keys:
        types = await client.pipeline([("TYPE", k) for k in keys])
        for k, t in zip(keys, types, strict=True):
            kind = as_str(t)
            if kind == "stream":
                streams.append(k)
            elif kind == "list" or (kind == "none" and await _is_list_queue(client, k)):
                lists.append(k)
    else:
        streams = await _scan(client, "TYPE", "stream")
        for h in await _scan(client, "TYPE", "hash"):
            if h.endswith(":why"):
                why_hashes.append(h)
            elif (q := _list_of_registry(h)) is not None:
                lists.append(q)
    found = Found([], [])
    if streams:
        replies = await client.pipeline([("XINFO", "GROUPS", s) for s in streams],
                                        raise_on_error=False)
        bare = []
        for s, groups in zip(streams, replies, strict=True):
            if isinstance(groups, rexc.RedisError):
                continue
            if groups:
                for g in groups:
                    found.subs.append(Sub("stream", s, as_str(pairs(g)["name"])))
            else:
                bare.append(s)
        if bare:
            newest = await client.pipeline([("XREVRANGE", s, "+", "-", "COUNT", 1) for s in bare],
                                           raise_on_error=False)
            for s, rows in zip(bare, newest, strict=True):
                if isinstance(rows, rexc.RedisError) or not rows:
                    continue
                f = pairs(rows[0][1])
                if DEAD_REASON.decode() in f:
                    found.dead.append(DeadLetter(s, "stream", as_str(f.get(DEAD_SOURCE.decode(), "")) or None,
                                                 as_str(f.get(DEAD_GROUP.decode(), "")) or None))
    for q in lists:
        found.subs.append(Sub("list", q))
    for h in why_hashes:
        d = underived(h, ":why")
        if d is None or why_key(d) != h:
            continue
        _, rows = await client.execute("HSCAN", h, 0, "COUNT", 10)
        source = None
        for record in queues.why_records(rows[1] if len(rows) > 1 else None):
            source = record.get("source")
            break
        found.dead.append(DeadLetter(d, "list", None if source is None else str(source)))
    for dl in found.dead:
        for sub in found.subs:
            mine = sub.key == dl.source and (dl.kind == "list" or sub.group == dl.group)
            if mine and sub.dead_letter is None:
                sub.dead_letter = dl.key
    found.subs.sort(key=lambda s: (s.key, s.group))
    return found


async def _is_list_queue(client: Client, key: str) -> bool:
    return bool(await client.execute("EXISTS", registry_key(key)))
