"""Stream consumer groups: ``StreamSubscription`` (PLAIN, RECLAIM, CLAIMING)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import anyio
from anyio.abc import TaskStatus
from redis import exceptions as rexc

from ._delay_set import move_due
from ._delivery import Delivery
from ._envelope import ORIGIN_FIELD, RETRIES_FIELD
from ._keys import derived, same_slot
from ._mount import FINALIZE_TIMEOUT, Item, Mount, backoff, log
from ._plan import Plan, Target, attempt_of, plan_dead, plan_lost
from ._scripts import MOVE_DUE_TO_STREAM
from ._subscription import (
    DelayedRetry,
    Form,
    Mode,
    Subscription,
    check_key,
    check_limits,
    check_positive,
)
from ._transport import NOT_RUN_ERRORS, BusyGroupError, Client, Connection, NoGroupError, WrongTypeError

__all__ = ["StreamReader", "StreamSubscription"]


@dataclasses.dataclass(frozen=True, slots=True)
class StreamSubscription(Subscription):
    """Read a stream as consumer ``<consumer name>`` of ``group``.

    The group is created at ``start_id`` (default ``"0"``: entries written
    before the group existed are consumed too) with MKSTREAM when missing.

    Args:
        stream: the stream key.
        group: the consumer group.
        mode: :class:`Mode` ``PLAIN``, ``RECLAIM`` or ``CLAIMING``.
        min_idle: seconds an entry must be idle before RECLAIM/CLAIMING claims it.
        delayed_retry: where ``retry_after`` waits; ``None``: RUNTIME for plain
            and reclaim, the PEL for claiming.  RUNTIME acknowledges the
            original at once and holds the copy in process memory (lost if
            the process dies meanwhile).  DURABLE_ZSET puts the copy in
            ``delay_key`` (scored with the server's clock) and acknowledges
            the original; every read moves due copies back, so the delay holds
            to within one ``block``.  The PEL (claiming): the entry stays
            pending and is claimed back, same id, once idle ``min_idle`` -- a
            shorter delay lasts ``min_idle``, a longer one is cut to
            ``min_idle`` (a warning is logged once per subscription); give
            DURABLE_ZSET to a claiming subscription to honour longer delays.
        delay_key: the durable delay set (default ``{stream}:delayed``).
        max_attempts: attempts before a RETRY goes to ``dead_letter``.
        dead_letter: stream that receives exhausted entries.
        block: seconds one XREADGROUP blocks.
        count: entries per read.
        start_id: where a new group starts.
    """

    stream: str
    group: str
    mode: Mode = Mode.PLAIN
    min_idle: float = 60.0
    delayed_retry: DelayedRetry | None = None
    delay_key: str | None = None
    max_attempts: int | None = None
    dead_letter: str | None = None
    block: float = 1.0
    count: int = 100
    start_id: str = "0"

    form = Form.STREAM

    def __post_init__(self) -> None:
        check_key("stream", self.stream)
        check_key("group", self.group)
        if not isinstance(self.mode, Mode):
            raise ValueError(f"mode must be a Mode, got {self.mode!r}")
        check_positive("min_idle", self.min_idle, allow_zero=True)
        check_positive("block", self.block)
        if self.delayed_retry is not None and not isinstance(self.delayed_retry, DelayedRetry):
            raise ValueError(f"delayed_retry must be a DelayedRetry or None, got {self.delayed_retry!r}")
        if self.delay_key is not None:
            check_key("delay_key", self.delay_key)
            if self.delayed_retry is not DelayedRetry.DURABLE_ZSET:
                raise ValueError("delay_key is only used with delayed_retry=DelayedRetry.DURABLE_ZSET")
        check_limits(self.max_attempts, self.dead_letter)
        if self.dead_letter == self.stream:
            raise ValueError("dead_letter must differ from stream (dead entries would loop)")
        if self.delay_key == self.stream:
            raise ValueError("delay_key must differ from stream")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"count must be an int >= 1, got {self.count!r}")
        check_key("start_id", self.start_id)

    @property
    def name(self) -> str:
        return f"stream {self.stream!r} group {self.group!r}"

    @property
    def resolved_delay(self) -> DelayedRetry | None:
        """The way ``retry_after`` works here; ``None`` means the PEL (claiming)."""
        if self.delayed_retry is not None:
            return self.delayed_retry
        return None if self.mode is Mode.CLAIMING else DelayedRetry.RUNTIME

    def target(self, consumer: str, *, cluster: bool = False) -> Target:
        """The resolved target.

        Raises:
            ValueError: in Redis Cluster (``cluster=True``), a durable
                ``delay_key`` in another hash slot than the stream.
        """
        t = Target(
            form=Form.STREAM,
            name=self.name,
            source=self.stream,
            mode=self.mode,
            group=self.group,
            delayed_retry=self.resolved_delay,
            delay_key=self.delay_key or derived(self.stream, ":delayed"),
            max_attempts=self.max_attempts,
            dead_letter=self.dead_letter,
            min_idle=self.min_idle,
            cluster=cluster,
        )
        if (cluster and t.delayed_retry is DelayedRetry.DURABLE_ZSET
                and not same_slot(t.source, t.delay_key)):
            raise ValueError(
                f"delay_key {t.delay_key!r} must share the hash slot of stream {t.source!r} "
                "in Redis Cluster (one script moves copies between them)"
            )
        return t


# -- runtime ------------------------------------------------------------------

_READ_MARGIN = 1.0
"""Seconds a blocking read may exceed ``block`` before it counts as lost."""
_RECOVER_EVERY = 60.0
_CLAIM_EVERY_MAX = 30.0
_MOVE_RETRY = 5.0
"""Seconds before a move of due copies that Redis refused is tried again."""


def _str(b: bytes | str) -> str:
    return b.decode() if isinstance(b, bytes) else b


def _entries(reply: Any) -> list[tuple[bytes, list[bytes] | None]]:
    """Entries of an XREADGROUP reply for one stream (RESP2)."""
    if not reply:
        return []
    out: list[tuple[bytes, list[bytes] | None]] = reply[0][1]
    return out


class StreamReader:
    """Reads one :class:`StreamSubscription` on a dedicated connection."""

    def __init__(self, sub: StreamSubscription) -> None:
        self.sub = sub
        self._cursor = "0-0"
        self._next_claim = 0.0
        self._next_move = 0.0
        self._conn: Connection | None = None
        self._reread = False  # re-read the own PEL at the next turn (Redis < 7 nil claims)

    def abandon(self, deliveries: Sequence[Delivery]) -> Plan | None:
        return None  # unstarted entries stay in the PEL

    # -- set-up ---------------------------------------------------------------
    async def _check_type(self, client: Client) -> None:
        kind = _str(await client.execute("TYPE", self.sub.stream))
        if kind not in ("stream", "none"):
            raise WrongTypeError(
                f"WRONGTYPE key {self.sub.stream!r} holds a {kind}, not a stream "
                f"(mounting {self.sub.name})"
            )

    async def _ensure_group(self, client: Client) -> bool:
        try:
            await client.execute(
                "XGROUP", "CREATE", self.sub.stream, self.sub.group, self.sub.start_id, "MKSTREAM"
            )
            return True
        except BusyGroupError:
            return False

    # -- deliveries -----------------------------------------------------------
    def _build(
        self, mount: Mount, eid: bytes, flat: list[bytes], count: int
    ) -> tuple[Delivery, Plan | None]:
        """A delivery, and the plan that finalizes it without a handler, if any."""
        it = iter(flat)
        fields = dict(zip(it, it, strict=False))
        entry_id = eid.decode()
        corrupt = None
        retries = 0
        raw_retries = fields.pop(RETRIES_FIELD, None)
        if raw_retries is not None:
            try:
                retries = int(raw_retries)
                if retries < 0:
                    raise ValueError
            except ValueError:
                corrupt = f"corrupt {RETRIES_FIELD.decode()} header {raw_retries!r}"
                retries = 0
        raw_origin = fields.pop(ORIGIN_FIELD, None)
        origin = raw_origin.decode("utf-8", "replace") if raw_origin is not None else entry_id
        attempt = attempt_of(retries, count)
        d = Delivery(
            source=self.sub.stream, id=entry_id, fields=fields, data=None, attempt=attempt,
            origin_id=origin, retries=retries, mount=mount.name, corrupt=corrupt,
        )
        if corrupt is not None:
            return d, plan_dead(mount.target, d, corrupt)
        limit = self.sub.max_attempts
        if limit is not None and attempt > limit:
            return d, plan_dead(
                mount.target, d, f"arrived at attempt {attempt}, past max_attempts={limit}"
            )
        return d, None

    async def _dispatch(
        self, mount: Mount, entries: list[tuple[bytes, list[bytes] | None]],
        counts: dict[bytes, int] | None = None,
    ) -> None:
        ready: list[Delivery] = []
        direct: list[Item] = []
        build = self._build
        source = self.sub.stream
        name = mount.name
        for eid, flat in entries:
            if flat is None:  # deleted while pending
                d = Delivery(source=source, id=eid.decode(), fields={}, data=None,
                             attempt=1, origin_id=eid.decode(), mount=name)
                log.warning("%s: entry %s was deleted while pending; acknowledged", name,
                            d.id)
                direct.append((d, plan_lost(mount.target, d)))
                continue
            count = counts.get(eid, 1) if counts else 1
            if count == 1:
                it = iter(flat)
                fields = dict(zip(it, it, strict=False))
                if RETRIES_FIELD not in fields and ORIGIN_FIELD not in fields:
                    # the common case: what _build does for the first delivery of
                    # an original (no header field, attempt 1: within any limit)
                    entry_id = eid.decode()
                    ready.append(Delivery(source, entry_id, fields, None, 1, entry_id,
                                          None, 0, name, None))
                    continue
            d, p = build(mount, eid, flat, count)
            if p is None:
                ready.append(d)
            else:
                direct.append((d, p))
        if direct:
            await mount.finalize_now(direct)
        await mount.deliver(ready)

    async def _counts(self, client: Client, consumer: str, ids: list[bytes]) -> dict[bytes, int]:
        """Server delivery counts of ``ids`` in this consumer's PEL."""
        if not ids:
            return {}
        rows = await client.execute(
            "XPENDING", self.sub.stream, self.sub.group, min(ids, key=_id_key),
            max(ids, key=_id_key), len(ids) + 1000, consumer,
        )
        wanted = set(ids)
        return {r[0]: int(r[3]) for r in rows if r[0] in wanted}

    async def _recover(self, conn: Connection, mount: Mount) -> None:
        """Re-read this consumer's own PEL (``XREADGROUP ... 0``), page by page."""
        sub = self.sub
        last = "0"
        while True:
            reply = await conn.execute(
                "XREADGROUP", "GROUP", sub.group, mount.consumer.name, "COUNT", sub.count,
                "STREAMS", sub.stream, last, timeout=FINALIZE_TIMEOUT,
            )
            entries = _entries(reply)
            if not entries:
                return
            last = entries[-1][0].decode()
            fresh = [e for e in entries if e[0].decode() not in mount.held]
            live = [e[0] for e in fresh if e[1] is not None]
            counts = await self._counts(mount.client, mount.consumer.name, live)
            await self._dispatch(mount, fresh, counts)
            if len(entries) < sub.count:
                return

    async def _claim(self, conn: Connection, mount: Mount) -> None:
        """XAUTOCLAIM entries idle ``min_idle`` (any consumer), one page."""
        sub = self.sub
        reply = await conn.execute(
            "XAUTOCLAIM", sub.stream, sub.group, mount.consumer.name,
            round(sub.min_idle * 1000), self._cursor, "COUNT", sub.count,
            timeout=FINALIZE_TIMEOUT,
        )
        start, self._cursor = self._cursor, _str(reply[0])
        entries: list[tuple[bytes, list[bytes] | None]] = [e for e in reply[1] if e is not None]
        if len(entries) < len(reply[1]):
            # Redis < 7 answers nil (no id) for an entry deleted while pending,
            # and claims it into our PEL.  RECLAIM: the own-PEL re-read
            # acknowledges it.  CLAIMING never re-reads its own PEL (that would
            # undo the delays it keeps there): find the vanished ids by hand.
            if sub.mode is Mode.RECLAIM:
                self._reread = True
            else:
                await self._ack_vanished(mount, start, self._cursor, {e[0] for e in entries})
        deleted: list[bytes] = list(reply[2]) if len(reply) > 2 else []
        for eid in deleted:
            mount.stats.effects["lost_before_handling"] += 1
            log.warning("%s: entry %s was deleted while pending; dropped from the PEL",
                        mount.name, eid.decode())
        if entries:
            live = [e[0] for e in entries if e[1] is not None]
            counts = await self._counts(mount.client, mount.consumer.name, live)
            await self._dispatch(mount, entries, counts)
        interval = min(max(sub.min_idle / 2, 0.05), _CLAIM_EVERY_MAX)
        # a full page or a cursor mid-PEL: claim again at once
        self._next_claim = 0.0 if self._cursor != "0-0" else anyio.current_time() + interval

    async def _ack_vanished(
        self, mount: Mount, start: str, end: str, claimed: set[bytes]
    ) -> None:
        """Acknowledge our pending entries in [start, end) that the stream no longer has."""
        sub = self.sub
        client = mount.client
        rows = await client.execute(
            "XPENDING", sub.stream, sub.group, start, "+",
            sub.count + len(mount.held) + 100, mount.consumer.name, timeout=FINALIZE_TIMEOUT,
        )
        stop = None if end == "0-0" else _id_key(end.encode())
        candidates = [
            r[0] for r in rows
            if r[0] not in claimed and r[0].decode() not in mount.held
            and (stop is None or _id_key(r[0]) < stop)
        ]
        if not candidates:
            return
        found = await client.pipeline(
            [("XRANGE", sub.stream, eid, eid) for eid in candidates], timeout=FINALIZE_TIMEOUT
        )
        gone = [eid for eid, hit in zip(candidates, found, strict=True) if not hit]
        items: list[Item] = []
        for eid in gone:
            d = Delivery(source=sub.stream, id=eid.decode(), fields={}, data=None,
                         attempt=1, origin_id=eid.decode(), mount=mount.name)
            log.warning("%s: entry %s was deleted while pending; acknowledged", mount.name, d.id)
            items.append((d, plan_lost(mount.target, d)))
        await mount.finalize_now(items)

    async def _move_due(self, mount: Mount) -> float:
        """Move due copies from the durable delay set; seconds until the next is due."""
        try:
            return await move_due(mount, MOVE_DUE_TO_STREAM, self.sub.block)
        except rexc.ResponseError as e:
            # Redis refused a write (the stream is of another type now, or at
            # its last possible id, ...): what was not written is still in the
            # set.  Keep reading the stream and try again later, loudly,
            # rather than let one bad key end the consumer.
            t = mount.target
            mount.stats.read_errors += 1
            log.error("%s: moving due copies from %r back to %r failed: %s; trying again in %g s",
                      mount.name, t.delay_key, t.source, e, _MOVE_RETRY)
            return _MOVE_RETRY

    async def _lease(self, mount: Mount) -> None:
        """Keep held entries' idle time low so no other consumer claims them."""
        interval = max(self.sub.min_idle / 3, 0.05)
        while True:
            await anyio.sleep(interval)
            ids = sorted(mount.held)
            for i in range(0, len(ids), 500):
                try:
                    await mount.client.execute(
                        "XCLAIM", self.sub.stream, self.sub.group, mount.consumer.name, 0,
                        *ids[i : i + 500], "JUSTID", timeout=FINALIZE_TIMEOUT,
                    )
                except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError) as e:
                    log.warning("%s: lease renewal failed: %s", mount.name, e)

    # -- the loop ---------------------------------------------------------------
    async def run(self, mount: Mount, *, task_status: TaskStatus[None]) -> None:
        sub = self.sub
        client = mount.client
        consumer = mount.consumer.name
        await self._check_type(client)
        await self._ensure_group(client)
        durable = mount.target.delayed_retry is DelayedRetry.DURABLE_ZSET
        leased = sub.mode in (Mode.RECLAIM, Mode.CLAIMING)
        recover = sub.mode is not Mode.CLAIMING
        next_recover = anyio.current_time() + _RECOVER_EVERY
        started = False
        failures = 0
        regroup = False
        conn: Connection | None = None
        read_now = ("XREADGROUP", "GROUP", sub.group, consumer, "COUNT", sub.count)
        read = (*read_now, "BLOCK")
        claiming = sub.mode is not Mode.PLAIN
        try:
            async with anyio.create_task_group() as tg:
                if leased:
                    tg.start_soon(self._lease, mount)
                while True:
                    try:
                        if conn is None or conn.broken:
                            conn = await client.connect(name=f"trf:{consumer}:reader", key=sub.stream)
                        if regroup:  # here, so that a connection error is retried
                            await self._ensure_group(client)
                            regroup = False
                        block = sub.block
                        if durable and anyio.current_time() >= self._next_move:
                            wait = await self._move_due(mount)
                            self._next_move = anyio.current_time() + wait
                        if durable:
                            block = max(0.001, min(block, self._next_move - anyio.current_time()))
                        if recover or self._reread:
                            await self._recover(conn, mount)
                            recover = self._reread = False
                        if sub.mode is Mode.CLAIMING or (
                            sub.mode is Mode.RECLAIM and anyio.current_time() >= self._next_claim
                        ):
                            await self._claim(conn, mount)
                        if not started:
                            task_status.started()
                            started = True
                        if (durable and self._next_move <= anyio.current_time()) or (
                            claiming and self._next_claim == 0.0
                        ):
                            # more due copies to move, or more of the PEL to claim:
                            # read what is new without blocking, then go on at once
                            # (a BLOCK, however short, can last the server's
                            # timer resolution, 100 ms at the default hz)
                            reply = await conn.execute(
                                *read_now, "STREAMS", sub.stream, ">", timeout=FINALIZE_TIMEOUT,
                            )
                        else:
                            reply = await conn.execute(
                                *read, max(1, round(block * 1000)), "STREAMS", sub.stream, ">",
                                timeout=block + _READ_MARGIN,
                            )
                        failures = 0
                        if reply:
                            await self._dispatch(mount, _entries(reply))
                        now = anyio.current_time()
                        if sub.mode is not Mode.CLAIMING and now >= next_recover:
                            next_recover = now + _RECOVER_EVERY
                            recover = not mount.held
                    except NOT_RUN_ERRORS as e:
                        # the server did not run it (another client's long script:
                        # BUSY; OOM; a replica after a failover, loading, slot
                        # moving ...): wait, read again
                        if not started:
                            raise
                        mount.stats.read_errors += 1
                        delay = backoff(failures, cap=5.0)
                        failures += 1
                        log.warning("%s: server refused the read for now (%s); again in %.2f s",
                                    mount.name, e, delay)
                        recover = sub.mode is not Mode.CLAIMING
                        await anyio.sleep(delay)
                    except rexc.ResponseError as e:
                        # NOGROUP; or UNBLOCKED: the key was deleted (FLUSHALL,
                        # DEL) while this read blocked on it (Redis 7+)
                        if not started or not (
                            isinstance(e, NoGroupError) or str(e).startswith("UNBLOCKED")
                        ):
                            raise
                        mount.stats.group_recreated += 1
                        log.warning("%s: group is gone (%s); recreating it at %s",
                                    mount.name, e, sub.start_id)
                        regroup = True
                        recover = sub.mode is not Mode.CLAIMING
                    except (rexc.ConnectionError, rexc.TimeoutError, OSError) as e:
                        if not started:
                            raise
                        mount.stats.read_errors += 1
                        delay = backoff(failures)
                        failures += 1
                        log.warning("%s: read failed (%s); reconnecting in %.2f s",
                                    mount.name, e, delay)
                        if conn is not None:
                            await conn.aclose()
                        conn = None
                        recover = sub.mode is not Mode.CLAIMING
                        await anyio.sleep(delay)
        finally:
            if conn is not None:
                await conn.aclose()


def _id_key(eid: bytes) -> tuple[int, int]:
    ms, _, seq = eid.partition(b"-")
    return int(ms), int(seq or 0)
