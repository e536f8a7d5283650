"""Stream consumer groups: ``StreamSubscription`` (PLAIN, RECLAIM, CLAIMING)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any

import anyio
from redis import exceptions as rexc

from ..._context import FINALIZE_TIMEOUT, READ_MARGIN, Context, Item, log
from ..._core._decode import Entry, as_str, id_key, lost_entry, read_entries, stream_deliveries
from ..._core._plan import Effect, Plan, Target
from ..._core._recovery import LEASE, SCHEDULE_LEFT, lease_lost, schedule_key, schedule_left
from ..._core._replies import NOT_RUN, BusyGroupError, classify, error_code
from ..._core.stream.liveness import HEARTBEAT_FLOOR, lease_every
from ..._core.stream.scripts import REDELIVER, move_due_to_stream
from ..._delivery import Delivery
from ..._keys import derived, same_slot
from ..._shutdown import cleanup
from ..._subscription import (
    DEFAULT_MAX_ATTEMPTS,
    STREAM_DEAD_LETTER,
    DelayedRetry,
    Form,
    Mode,
    Retention,
    Subscription,
    check_delay,
    check_key,
    check_limits,
    check_maxlen,
    check_positive,
    resolve_dead_letter,
)
from ..._transport import Client, Connection
from .._delay_set import move_due
from .._read_loop import Pending, check_type, reader_connection, retry_not_run
from .liveness import StreamPresence
from .retention import check_retention, trim

__all__ = ["MIN_IDLE_FLOOR", "StreamReader", "StreamSubscription"]

MIN_IDLE_FLOOR = 0.01
"""The shortest ``min_idle`` of RECLAIM and CLAIMING: the lease of an entry
being handled is renewed every ``min_idle / 3``, and needs the room."""

_STREAM_ID = re.compile(r"\A(?:\$|[0-9]+(?:-[0-9]+)?)\Z")


@dataclasses.dataclass(frozen=True, slots=True)
class StreamSubscription(Subscription):
    """Read a stream as consumer ``<consumer name>`` of ``group``.

    The group is created at ``start_id`` (default ``"0"``: entries written
    before the group existed are consumed too) with MKSTREAM when missing.

    Args:
        stream: the stream key.
        group: the consumer group.
        mode: :class:`Mode` ``PLAIN``, ``RECLAIM`` or ``CLAIMING``.
        min_idle: seconds an entry must be idle before RECLAIM/CLAIMING claims it
            (at least 0.01 there: entries being handled have their lease
            renewed every ``min_idle / 3``).
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
        max_attempts: attempts before a RETRY (or a failure under
            ``Backoff``) goes to ``dead_letter``; default 10
            (``DEFAULT_MAX_ATTEMPTS``); ``None``: retried forever, no dead letter.
        dead_letter: stream that receives exhausted and rejected entries;
            default ``{stream}:dead`` (same hash slot; none when
            ``max_attempts=None``); ``None``: exhausted entries are dropped
            with a warning and ``reject`` is refused.
        block: seconds one XREADGROUP blocks.
        count: entries per read.
        start_id: where a new group starts: ``"0"`` (everything in the
            stream), ``"$"`` (only what is added from now on) or an entry id
            (``ms`` or ``ms-seq``).  A group destroyed while the consumer runs
            (``XGROUP DESTROY``, a flush, a restart without persistence) is
            recreated at the last id this reader delivered, not at
            ``start_id``: nothing is skipped, nothing handled twice.
        retention: what is removed from the stream besides acknowledging
            (:class:`Retention`).  ``None`` (default): nothing, the stream
            keeps every entry.  ``Retention.DELETE_ON_FINALIZE``: each
            original is deleted (XDEL) when finalized, whatever the outcome
            (for a work queue one group reads; ``mount()`` raises
            ``ValueError`` naming the other groups when the stream has any
            -- except on Redis 8.2, where one ``XACKDEL ... ACKED`` per
            finalization deletes an entry only once no group references it,
            so several groups may share the stream).
            ``Retention.TRIM_ACKED``: at least every 10 s the stream is
            trimmed below the oldest entry any of its groups still needs
            (pending, or not read yet): never an entry a group has not read
            or has pending (on Redis 8.2 ``XTRIM ... ACKED`` also removes
            the acknowledged entries above a stuck pending one).  Both also
            trim, periodically, what a crash left acknowledged in the stream.
        copy_maxlen: cap (``XADD ... MAXLEN ~ n``) on the copies this
            subscription writes to the stream (RETRY, delayed copies).  The
            cap trims the stream itself, read or not: entries beyond it are
            lost to every group; off (``None``) by default.
        dead_letter_maxlen: cap (``MAXLEN ~ n``) on the dead letter's XADDs:
            the oldest dead letters go first; off (``None``) by default.
        heartbeat: seconds after which a consumer of the group that stopped
            without a clean shutdown (a crash, SIGKILL) counts as dead (at
            least 0.01).  Each mount keeps a heartbeat key
            ``{stream}:stream-heartbeat:<stream>,<group>,<consumer>`` with
            this TTL, renewed every ``heartbeat / 3``, and registers in
            ``{stream}:stream-consumers:<stream>,<group>``.  In PLAIN and RECLAIM mode a live
            consumer takes over a dead consumer's pending entries once they
            have been idle ``heartbeat`` (entries being handled have their
            lease renewed every ``heartbeat / 3``, so a live consumer whose
            key vanished keeps them), counting the crash as an attempt: with
            the defaults, a killed consumer's entries are delivered again
            about ``heartbeat`` (30 s) after the kill, whatever the consumer
            names.  CLAIMING mode leaves a dead consumer's PEL to its
            XAUTOCLAIM (its PEL holds delayed retries).  A dead consumer with
            nothing pending is deleted from the group (``XGROUP
            DELCONSUMER``); so is a cleanly stopped one whose PEL is empty.
            A graceful stop waits for no heartbeat: what the consumer read
            and did not finish is handed back (made idle at once, the
            consumer marked stopped in the registry) and the group's live
            consumers take it within about a second, at the attempt it had.
            Entries pending for a consumer that never kept a heartbeat
            (another client) are not taken in PLAIN mode: ``mount()`` warns
            about them (name, count, idle time, how to recover them), and
            ``trio-redis-finalize inspect STREAM --group G`` marks them
            stranded.

    Attempts count handler calls that may have happened.  ``attempt`` is
    ``max(header retries + 1, server delivery count)``, and the reader keeps
    the server count honest: a read whose reply was lost, a re-read of its
    own PEL while a delivery is in flight and a delivery given back unstarted
    at shutdown do not count (recovery inside a running process takes its
    entries with ``XPENDING`` + ``XCLAIM ... RETRYCOUNT``; the give-back sets
    the count back by one); a crash during a handler does (the first look at
    the own PEL after a start counts one more).  What remains: a lost
    ``XAUTOCLAIM`` reply (RECLAIM, CLAIMING) may count one attempt too many
    for what it claimed -- a poison entry may reach the dead letter one
    attempt early, the handler is never called past ``max_attempts``; and
    after a crash, entries read but not yet started count one attempt too.
    A failed entry under ``on_error=Backoff()`` stays in the PEL and is taken
    again by this consumer with ``XCLAIM ... RETRYCOUNT <next attempt>``
    before its handler runs, so the count is the attempt being made: a crash
    during the wait or the handler counts exactly as above.  Its due time is
    kept in Redis (``{stream}:backoff:<group>``, see
    :class:`~trio_redis_finalize.Backoff`): the own-PEL recovery after a
    restart, and a claim, let it wait out the rest.  A finalization Redis
    refuses for good (a write's key of another type ...) leaves the entry
    pending; it is held again and delivered again, as its next attempt, 1 s
    after the refusal (doubling with each attempt, at most 30 s), in every
    mode and under any traffic.
    """

    stream: str
    group: str
    _: dataclasses.KW_ONLY  # the rest keyword-only, as documented
    mode: Mode = Mode.PLAIN
    min_idle: float = 60.0
    delayed_retry: DelayedRetry | None = None
    delay_key: str | None = None
    max_attempts: int | None = DEFAULT_MAX_ATTEMPTS
    dead_letter: str | None = STREAM_DEAD_LETTER
    block: float = 1.0
    count: int = 100
    start_id: str = "0"
    retention: Retention | None = None
    copy_maxlen: int | None = None
    dead_letter_maxlen: int | None = None
    heartbeat: float = 30.0

    form = Form.STREAM

    def __post_init__(self) -> None:
        check_key("stream", self.stream)
        check_key("group", self.group)
        if not isinstance(self.mode, Mode):
            raise ValueError(f"mode must be a Mode, got {self.mode!r}")
        check_positive("min_idle", self.min_idle, allow_zero=True)
        if self.mode is not Mode.PLAIN and self.min_idle < MIN_IDLE_FLOOR:
            raise ValueError(
                f"min_idle must be >= {MIN_IDLE_FLOOR} s in {self.mode.name} mode (the lease of "
                f"an entry being handled is renewed every min_idle / 3), got {self.min_idle!r}"
            )
        check_positive("block", self.block)
        check_positive("heartbeat", self.heartbeat)
        if self.heartbeat < HEARTBEAT_FLOOR:
            raise ValueError(f"heartbeat must be >= {HEARTBEAT_FLOOR} s (too short to renew a "
                             f"consumer's heartbeat and lease), got {self.heartbeat!r}")
        check_delay(self.delayed_retry, self.delay_key)
        # the default dead letter ({stream}:dead), named now (None without max_attempts)
        object.__setattr__(self, "dead_letter", resolve_dead_letter(
            self.stream if isinstance(self.stream, str) else "", self.max_attempts, self.dead_letter))
        check_limits(self.max_attempts, self.dead_letter)
        if self.dead_letter == self.stream:
            raise ValueError("dead_letter must differ from stream (dead entries would loop)")
        if self.delay_key == self.stream:
            raise ValueError("delay_key must differ from stream")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"count must be an int >= 1, got {self.count!r}")
        check_key("start_id", self.start_id)
        if not _STREAM_ID.match(self.start_id) or any(
            int(part) >= 2**64 for part in self.start_id.split("-") if part != "$"
        ):
            raise ValueError(
                f"start_id must be a stream id ('0', '$', '<ms>' or '<ms>-<seq>'), "
                f"got {self.start_id!r}"
            )
        if self.retention is not None and not isinstance(self.retention, Retention):
            raise ValueError(f"retention must be a Retention or None, got {self.retention!r}")
        check_maxlen("copy_maxlen", self.copy_maxlen)
        check_maxlen("dead_letter_maxlen", self.dead_letter_maxlen)
        if self.dead_letter_maxlen is not None and self.dead_letter is None:
            raise ValueError("dead_letter_maxlen needs a dead_letter (it caps the dead letter)")
        if self.dead_letter is not None:
            delay_key = self.delay_key or derived(self.stream, ":delayed")
            if self.dead_letter == delay_key:
                raise ValueError(
                    f"dead_letter must differ from delay_key {delay_key!r} "
                    "(the delay set and the dead letter would share one key)"
                )

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
            retention=self.retention,
            copy_maxlen=self.copy_maxlen,
            dead_letter_maxlen=self.dead_letter_maxlen,
        )
        if (cluster and t.delayed_retry is DelayedRetry.DURABLE_ZSET
                and not same_slot(t.source, t.delay_key)):
            raise ValueError(
                f"delay_key {t.delay_key!r} must share the hash slot of stream {t.source!r} "
                "in Redis Cluster (one script moves copies between them)"
            )
        return t


# -- runtime ------------------------------------------------------------------

_RECOVER_EVERY = 60.0
"""Seconds between two looks at the own PEL (PLAIN, RECLAIM), whatever the traffic."""
_CLAIM_EVERY_MAX = 30.0
_CLAIMED_TIMEOUT = 5.0
"""Seconds the counts of entries just claimed are asked again while the server
answers that it cannot serve now (OOM, BUSY ...): the claim cost an attempt
already, a second claim would cost another."""
_MOVE_RETRY = 5.0
"""Seconds before a move of due copies that Redis refused is tried again."""


class StreamReader:
    """Reads one :class:`StreamSubscription` on a dedicated connection.

    The steps of :func:`~._read_loop.drive`: ``setup`` (key types, the group,
    the retention's precondition, the first heartbeat), ``background`` (the
    heartbeat, the lease of entries in hand, the retention trim),
    ``connected`` (plans a look at the own PEL), ``catch_up`` (a destroyed
    group recreated, due durable copies moved back, the own PEL recovered,
    dead consumers taken over (``_presence``), claims), ``turn`` (one
    ``XREADGROUP``, handed over), ``failed`` (NOGROUP, UNBLOCKED: the group
    recreated; a refused step: a recovery planned) and ``closing`` (the last
    heartbeat, over the shutdown); after the shutdown, ``closed``
    deregisters a consumer with nothing pending.  Entries become
    deliveries in :func:`~._core._decode.stream_deliveries`.
    """

    def __init__(self, sub: StreamSubscription) -> None:
        self.sub = sub
        self._cursor = "0-0"
        self._next_claim = 0.0
        self._next_move = 0.0
        self._durable = sub.resolved_delay is DelayedRetry.DURABLE_ZSET
        self._me = ""  # the consumer name (set by setup)
        self._read: tuple[str | int, ...] = ()  # XREADGROUP ... COUNT n (set by setup)
        # The own PEL is to be looked at before the next read (after a
        # (re)connect, a refused step, a lost reply, and every minute while no
        # entry is in hand); the first look after a start counts a crash.
        self._recover_due = False
        self._first_recovery = sub.mode is not Mode.CLAIMING
        self._next_recover = 0.0
        # The group was destroyed: recreate it before the next read.
        self._regroup = False
        # The greatest id this reader knows it was handed (by a read, a claim or
        # a recovery), or the group's last delivered id at start: an own
        # pending entry above it came from a read whose reply was lost.
        self._last: bytes | None = None
        # Server delivery counts of deliveries handed over with a count other
        # than 1 (recovered, claimed): what abandon() sets back.  Pruned.
        self._given: dict[str, int] = {}
        # A read (or claim) was sent and its reply not seen: it may have
        # moved entries into the own PEL unseen.
        self._unsure = False
        # Own pending entries being taken over, and the attempt each is to
        # count (None: the server count as it is), until handed over: a
        # recovery after a failure in between counts them alike (no bump twice).
        self._taking: dict[bytes, int | None] = {}
        # Ids given back unstarted at shutdown (abandon): handed back at the stop.
        self._abandoned: set[str] = set()
        # the heartbeat, the reaper of dead consumers, the hand-back at a stop
        self._presence = StreamPresence(sub.stream, sub.group, sub.mode, sub.min_idle,
                                        sub.heartbeat, sub.count, self._claiming, self._adopt)

    @property
    def pending(self) -> Pending:
        """This reader: failed deliveries stay pending (``redeliver``, ``leave_pending``)."""
        return self

    gates = None  # nothing counted: ids are unique

    def abandon(self, deliveries: Sequence[Delivery]) -> Plan | None:
        """Give deliveries read but never started back to the PEL, uncounted.

        Each stays pending for this consumer (recovered at restart, or claimed
        by another in RECLAIM/CLAIMING), its server delivery count set back by
        one with ``XCLAIM ... RETRYCOUNT`` so the next delivery does not count
        a handler call that never happened.
        """
        given = [(d.id, self._given.get(d.id, 1)) for d in deliveries if d.id is not None]
        self._abandoned.update(eid for eid, _ in given)
        return self._give_back(given)

    def _give_back(self, items: Sequence[tuple[str | bytes, int]]) -> Plan | None:
        by_count: dict[int, list[str | bytes]] = {}
        for eid, count in items:
            by_count.setdefault(max(count - 1, 0), []).append(eid)
        sub = self.sub
        commands = tuple(
            ("XCLAIM", sub.stream, sub.group, self._me, 0, *ids, "RETRYCOUNT", n, "JUSTID")
            for n, ids in by_count.items()
        )
        return Plan(Effect.NOTHING, commands) if commands else None

    # -- the read loop's steps (_read_loop.drive) --------------------------------
    async def setup(self, ctx: Context) -> None:
        """Key types, the group (created when missing), the retention's
        precondition, and the group's last delivered id."""
        sub = self.sub
        client = ctx.client
        self._me = ctx.consumer.name
        self._read = ("XREADGROUP", "GROUP", sub.group, self._me, "COUNT", sub.count)
        await check_type(client, sub.stream, "stream", sub.name)
        await self._check_keys(ctx)
        await self._ensure_group(client)
        await self._presence.register(ctx)  # before the first read
        await check_retention(ctx, sub.retention, sub.stream, sub.group, sub.name)
        last = await self._group_last(client)
        if last is not None and (self._last is None or id_key(last) > id_key(self._last)):
            self._last = last
        self._next_recover = anyio.current_time() + _RECOVER_EVERY

    def background(self, ctx: Context) -> Sequence[Callable[[], Coroutine[Any, Any, None]]]:
        tasks: list[Callable[[], Coroutine[Any, Any, None]]] = [
            partial(self._presence.beats, ctx), partial(self._lease, ctx),
        ]
        sub = self.sub
        if sub.retention is not None:
            tasks.append(partial(trim, ctx, sub.retention, sub.stream, sub.group))
        return tasks

    def connection(self, ctx: Context) -> AbstractAsyncContextManager[Connection]:
        return reader_connection(ctx, self.sub.stream)

    async def connected(self, ctx: Context, conn: Connection) -> None:
        # (re)connected: a read's reply may have been lost with the old
        # connection (CLAIMING claims its own PEL back anyway)
        self._plan_recovery()

    async def catch_up(self, ctx: Context, conn: Connection) -> None:
        """The group again if it was destroyed, due durable copies moved back,
        the own PEL recovered when planned, dead consumers taken over when a
        look at the group is due (at mount, then see ``_presence``), one page
        claimed (RECLAIM when due, CLAIMING always)."""
        sub = self.sub
        if self._regroup:  # here, so that a connection error is retried
            await self._ensure_group(ctx.client, self._resume_at())
            self._regroup = False
        if self._unsure:  # a read's reply was lost: it may have left entries
            self._recover_due, self._unsure = True, False
        if self._durable and anyio.current_time() >= self._next_move:
            wait = await self._move_due(ctx)
            self._next_move = anyio.current_time() + wait
        if self._recover_due:
            await self._recover(conn, ctx, start=self._first_recovery)
            self._recover_due = self._first_recovery = False
        if self._presence.due():
            await self._presence.step(ctx)
        if sub.mode is Mode.CLAIMING or (
            sub.mode is Mode.RECLAIM and anyio.current_time() >= self._next_claim
        ):
            await self._claim(conn, ctx)

    async def turn(self, ctx: Context, conn: Connection) -> None:
        """One XREADGROUP of new entries, handed over."""
        sub = self.sub
        now = anyio.current_time()
        self._unsure = True
        if (self._durable and self._next_move <= now) or self._presence.more or (
            sub.mode is not Mode.PLAIN and self._next_claim == 0.0
        ):
            # more due copies to move, or more of the PEL to claim: read what
            # is new without blocking, then go on at once (a BLOCK, however
            # short, can last the server's timer resolution, 100 ms at the
            # default hz)
            reply = await conn.execute(*self._read, "STREAMS", sub.stream, ">",
                                       timeout=FINALIZE_TIMEOUT)
        else:
            block = sub.block
            if self._durable:
                block = max(0.001, min(block, self._next_move - now))
            reply = await conn.execute(
                *self._read, "BLOCK", max(1, round(block * 1000)), "STREAMS", sub.stream, ">",
                timeout=block + READ_MARGIN,
            )
        self._unsure = False
        if reply:
            entries = read_entries(reply)
            self._last = entries[-1][0]
            await self._hand_over(ctx, entries)
        now = anyio.current_time()
        if sub.mode is not Mode.CLAIMING and now >= self._next_recover:
            self._next_recover = now + _RECOVER_EVERY
            # under traffic too: what is held (read, handled, waiting for a
            # Backoff or a refused finalization's retry) is skipped; what is
            # pending and not held was stranded (a full waiting set ...)
            self._recover_due = True

    def failed(self, ctx: Context, err: Exception) -> float | None:
        """The group destroyed (NOGROUP; UNBLOCKED: the key was deleted while
        the read blocked on it, Redis 7+): recreated at once, at the last id
        this reader delivered.  The server did not run a step (BUSY, OOM, a
        replica after a failover ...): the own PEL is recovered after the
        backoff."""
        if error_code(err) in ("NOGROUP", "UNBLOCKED"):
            ctx.stats.group_recreated += 1
            log.warning("%s: group is gone (%s); recreating it at %s, the last id this reader "
                        "delivered", ctx.name, err, self._resume_at(),
                        extra={"subscription": ctx.name})
            self._regroup = True
            self._unsure = False  # the PEL went with the group
            self._plan_recovery()
            return 0.0
        if classify(err) is NOT_RUN:
            self._plan_recovery()
        return None

    async def closing(self, ctx: Context) -> None:
        """The last heartbeat: the handlers and the finalizer may still finish what
        they hold, so it lasts until they must have ended (``_shutdown.Budget``)."""
        await self._presence.last_beat(ctx)

    async def closed(self, ctx: Context) -> None:
        """After the shutdown: hand back what is still pending for this consumer
        (made idle at once, so a live consumer of the group takes it within a
        look; CLAIMING: only what it read and did not finalize, its delayed
        retries keep their delay), leave the stopped mark; nothing pending:
        the consumer is deleted from the group.  An entry waiting for its
        Backoff stays pending as it is (its schedule is kept in Redis: a
        restart of this name delivers it when due; a live consumer takes it
        once idle ``heartbeat``)."""
        waiting = {d.id for d in ctx.backing_off()}
        ids = [i for i in (*ctx.in_hand, *self._abandoned) if i not in waiting]
        await self._presence.deregister(
            ctx, ids, whole=self.sub.mode is not Mode.CLAIMING and not waiting)

    def _plan_recovery(self) -> None:
        """Look at the own PEL before the next read (CLAIMING: its claims do)."""
        if self.sub.mode is not Mode.CLAIMING:
            self._recover_due = True

    # -- on_error=Backoff: failed entries wait pending, then come back ------------
    async def redeliver(self, ctx: Context, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Deliver again, as their next attempt, entries whose handler failed.

        Called by the mount once their :class:`~trio_redis_finalize.Backoff`
        delay is over.  They stayed in the PEL, held by this consumer (the
        lease kept other consumers off them).  One script takes each back
        only while it is still pending for this consumer (``XPENDING ... me``,
        then ``XCLAIM ... 0 id RETRYCOUNT attempt+1``): its body, and a server
        delivery count that already counts the attempt about to be made, so a
        crash during it is counted (the next start adds one) and a crash
        before it is too (still the failed attempt's count).  An entry another
        consumer took meanwhile (a lease that lapsed) is forgotten, logged;
        so is one whose group was destroyed meanwhile (recreated at the last
        id this reader delivered, its PEL gone) -- as a RETRY of an entry
        being handled then finds its gate closed.  One deleted from the
        stream meanwhile is acknowledged and reported lost.
        Raises (nothing delivered, nothing changed but idempotent counts) when
        the script gets no answer.  Returns what is to be tried again a moment
        later (nothing, for a stream).
        """
        sub = self.sub
        me = ctx.consumer.name
        args: list[str | int] = [sub.group, me]
        for d in deliveries:
            assert d.id is not None
            args += [d.id, d.attempt + 1]
        reply = await ctx.client.evalsha(REDELIVER, (sub.stream,), args, timeout=FINALIZE_TIMEOUT)
        held = ctx.in_hand
        entries: list[Entry] = []
        counts: dict[bytes, int] = {}
        gone: list[bytes] = []
        for d, r in zip(deliveries, reply, strict=True):
            assert d.id is not None
            if isinstance(r, list) and len(r) == 2 and isinstance(r[1], list):
                entries.append((r[0], r[1]))
                counts[r[0]] = d.attempt + 1
                continue
            held.discard(d.id)
            if r == 0:
                log.warning("%s: entry %s (attempt %d) is no longer pending for this consumer "
                            "(claimed by another, or acknowledged); not delivered again",
                            ctx.name, d.id, d.attempt,
                            extra={"subscription": ctx.name, "entry_id": d.id, "attempt": d.attempt})
            else:
                gone.append(d.id.encode())
        await self._deliver_taken(ctx, entries, counts, gone)
        return []  # nothing to try again later

    def leave_pending(self, ctx: Context, deliveries: Sequence[Delivery]) -> None:
        """Forget failed entries without a timer (the mount's waiting set is
        full): they stay in the PEL, for the own-PEL re-read (after a read
        error, at a start, and every minute while no entry is in hand) and,
        in RECLAIM and CLAIMING, for a claim once idle ``min_idle``."""
        ctx.in_hand.difference_update([d.id for d in deliveries if d.id is not None])

    def hold_again(self, ctx: Context, d: Delivery) -> None:
        """A delivery whose finalization Redis refused for good, still in the
        PEL: held (leased) again until :meth:`redeliver` takes it back."""
        if d.id is not None:
            ctx.in_hand.add(d.id)

    async def _scheduled(self, ctx: Context, ids: Sequence[bytes]) -> dict[bytes, tuple[float, int]]:
        """Ids among ``ids`` whose Backoff is not due yet (``_core._recovery``'s
        schedule, by the server's clock): id -> (seconds left, the attempt
        that failed)."""
        if not ids:
            return {}
        t = ctx.target
        try:
            reply = await ctx.client.evalsha(SCHEDULE_LEFT, (schedule_key(t),), list(ids),
                                             timeout=FINALIZE_TIMEOUT)
        except rexc.ResponseError as e:
            if classify(e) is NOT_RUN:
                raise
            # final (the key is of another type ...): recovery goes on without it
            log.warning("%s: reading the Backoff schedule %r failed (%s); %d recovered entries "
                        "are delivered now", ctx.name, schedule_key(t), e, len(ids),
                        extra={"subscription": ctx.name})
            return {}
        return {eid: got for eid, got in zip(ids, schedule_left(reply), strict=True) if got[0] > 0}

    def _defer(self, ctx: Context, entries: Sequence[Entry],
               left: dict[bytes, tuple[float, int]]) -> set[bytes]:
        """Entries in the own PEL whose Backoff is not due yet (``left``: seconds
        left, the attempt that failed): they wait, held, and come back as
        their next attempt when due (the mount's redeliverer,
        :meth:`redeliver`).  Returns the ids that wait (the others: deliver now)."""
        if not left:
            return set()
        counts = {eid: max(a, 1) for eid, (_, a) in left.items()}
        ready, _direct = stream_deliveries(ctx.target, [e for e in entries if e[0] in left], counts)
        waiting: set[bytes] = set()
        for d in ready:
            assert d.id is not None
            eid = d.id.encode()
            if ctx.defer(d, left[eid][0]):
                waiting.add(eid)
        if waiting:
            log.info("%s: %d recovered entries wait out the rest of their Backoff (kept in %r) "
                     "before they are delivered again: %s", ctx.name, len(waiting),
                     schedule_key(ctx.target), ", ".join(sorted(e.decode() for e in waiting)[:20]),
                     extra={"subscription": ctx.name})
        return waiting

    async def _claimed_waits(self, ctx: Context, live: list[Entry]) -> list[Entry]:
        """Of entries just claimed, those whose Backoff is not due yet (their
        consumer stopped while they waited, or this one restarted) wait out the
        rest (:meth:`_defer`), their server count set back to the attempt that
        failed (the claim counted a delivery that did not happen); returns the
        others.  Shielded (bounded): a stop in between would leave the count
        one higher for each claim it cut."""
        with cleanup(FINALIZE_TIMEOUT):
            left = await self._scheduled(ctx, [e[0] for e in live])
            if not left:
                return live
            waiting = self._defer(ctx, live, left)
            p = self._give_back([(eid, left[eid][1] + 1) for eid in waiting])
            if p is not None:
                await ctx.client.pipeline(p.commands, timeout=FINALIZE_TIMEOUT)
        return [e for e in live if e[0] not in waiting]

    # -- set-up ---------------------------------------------------------------
    async def _check_keys(self, ctx: Context) -> None:
        """The dead letter must be a stream, the durable delay set a sorted set."""
        t = ctx.target
        if t.dead_letter is not None:
            await check_type(ctx.client, t.dead_letter, "stream", f"{self.sub.name}, its dead_letter")
        if t.delayed_retry is DelayedRetry.DURABLE_ZSET:
            await check_type(ctx.client, t.delay_key, "zset", f"{self.sub.name}, its delay_key")

    async def _ensure_group(self, client: Client, at: str | None = None) -> bool:
        try:
            await client.execute(
                "XGROUP", "CREATE", self.sub.stream, self.sub.group, at or self.sub.start_id,
                "MKSTREAM",
            )
            return True
        except BusyGroupError:
            return False

    async def _group_last(self, client: Client) -> bytes | None:
        """The group's last delivered id (``XINFO GROUPS``), None if unknown."""
        for row in await client.execute("XINFO", "GROUPS", self.sub.stream, timeout=FINALIZE_TIMEOUT):
            info = dict(zip(row[::2], row[1::2], strict=False))
            if as_str(info.get(b"name", b"")) == self.sub.group:
                last = info.get(b"last-delivered-id")
                return last if isinstance(last, bytes) else None
        return None

    # -- deliveries -----------------------------------------------------------
    async def _hand_over(
        self, ctx: Context, entries: list[Entry], counts: dict[bytes, int] | None = None,
    ) -> None:
        """Hand entries over (decoded by :func:`~._core._decode.stream_deliveries`):
        plans first, then the deliveries for the handlers.

        ``Context.deliver`` hands a batch over all or nothing, so cancelled
        (shutdown) inside, none of ``entries`` reached a handler: their
        delivery counts are set back (see :meth:`abandon`), shielded and
        bounded; should that fail they stay pending as they are.
        """
        ready, direct = stream_deliveries(ctx.target, entries, counts)
        try:
            if direct:
                await ctx.send_plans([*direct])
            await ctx.deliver(ready)
        except anyio.get_cancelled_exc_class():
            got = counts or {}
            p = self._give_back([(eid, got.get(eid, 1)) for eid, flat in entries if flat is not None])
            if p is not None:
                with cleanup(FINALIZE_TIMEOUT):
                    try:
                        await ctx.client.pipeline(p.commands, timeout=FINALIZE_TIMEOUT)
                    except (rexc.RedisError, OSError) as e:
                        log.warning("%s: could not give %d unstarted entries back (%s); they "
                                    "stay pending", ctx.name, len(entries), e,
                                    extra={"subscription": ctx.name})
            raise

    def _claiming(self, ids: list[bytes]) -> None:
        """The reaper is about to claim ``ids`` (their count one higher) into the
        own PEL: should its reply be lost, the own PEL is looked at before the
        next read, and those found there count as they are (the claim counted
        the attempt already)."""
        self._unsure = True
        self._taking.update(dict.fromkeys(ids))

    async def _adopt(self, ctx: Context, ids: list[bytes], entries: list[Entry],
                     counts: dict[bytes, int], gone: list[bytes]) -> None:
        """What the reaper's claim of ``ids`` took into the own PEL (``counts``:
        the delivery count of each, set by the claim), handed over; ``gone``:
        ids the stream no longer has, acknowledged and reported lost."""
        self._unsure = False  # its reply is here
        # until handed over: a recovery after a failure in between counts them alike
        self._taking.update(counts)
        try:
            await self._deliver_taken(ctx, entries, counts, gone)
        finally:
            for eid in ids:
                self._taking.pop(eid, None)

    async def _deliver_taken(self, ctx: Context, entries: list[Entry], counts: dict[bytes, int],
                             gone: Sequence[bytes]) -> None:
        """Entries taken into the own PEL (a recovery, a claim, a redelivery, the
        reaper), with the delivery count each has now: the ids the stream no
        longer has acknowledged and reported lost, the others remembered
        (:meth:`_note`) and handed over."""
        await self._lost(ctx, gone)
        if entries:
            self._note(ctx, entries, counts)
            await self._hand_over(ctx, entries, counts)

    def _note(self, ctx: Context, entries: Sequence[tuple[bytes, Any]], counts: dict[bytes, int]) -> None:
        """Remember what recovery and claims hand over: the last id, counts other than 1."""
        if not entries:
            return
        top = max((e[0] for e in entries), key=id_key)
        if self._last is None or id_key(top) > id_key(self._last):
            self._last = top
        given = self._given
        if len(given) > 2 * len(ctx.in_hand) + 1000:  # forget what was finalized
            self._given = given = {k: v for k, v in given.items() if k in ctx.in_hand}
        for eid, _ in entries:
            n = counts.get(eid, 1)
            if n != 1:
                given[eid.decode()] = n

    async def _counts(self, client: Client, consumer: str, ids: list[bytes]) -> dict[bytes, int]:
        """Server delivery counts of ``ids`` (claimed by ``consumer`` just now).

        One ``XPENDING`` over the range of the ids first; a capped range can
        miss ids when the consumer holds many other entries in between, so
        those missed are then asked one ``XPENDING`` each (pipelined).
        """
        if not ids:
            return {}
        sub = self.sub
        rows = await client.execute(
            "XPENDING", sub.stream, sub.group, min(ids, key=id_key), max(ids, key=id_key),
            len(ids) + 100, consumer, timeout=FINALIZE_TIMEOUT,
        )
        wanted = set(ids)
        out = {r[0]: int(r[3]) for r in rows if r[0] in wanted}
        missed = [eid for eid in ids if eid not in out]
        if missed:
            replies = await client.pipeline(
                [("XPENDING", sub.stream, sub.group, eid, eid, 1) for eid in missed],
                timeout=FINALIZE_TIMEOUT,
            )
            out.update((r[0][0], int(r[0][3])) for r in replies if r)
        return out

    async def _lost(self, ctx: Context, ids: Sequence[bytes]) -> None:
        """Acknowledge entries deleted while pending, once each (reported lost)."""
        items: list[Item] = []
        held = ctx.in_hand
        for eid in ids:
            entry_id = eid.decode()
            if entry_id in held:  # reported already (its acknowledgement is on the way), or handled
                continue
            held.add(entry_id)  # until finalized: no second report meanwhile
            items.append(lost_entry(ctx.target, entry_id))
        await ctx.send_plans(items)

    async def _recover(self, conn: Connection, ctx: Context, *, start: bool = False) -> None:
        """Take back this consumer's own pending entries that no handler holds.

        Page by page: ``XPENDING`` (ids, idle times, delivery counts), then
        ``XCLAIM ... RETRYCOUNT n`` of those entries to this consumer (their
        bodies, the count set to exactly what the next attempt is; only if
        still as idle as seen, so an entry another consumer claimed
        meanwhile stays there).  The attempt counted:

        * ``start`` (the first look after a (re)start): one more than the
          server count; a crash may have interrupted the handler;
        * later (after a read error, periodically): an entry above the last id
          this reader was handed came from a read whose reply was lost; it was
          never handled, its count stays.  One at or below it was handed
          before and is handed again: one more.  CLAIMING takes only the
          former: the PEL holds its delayed retries, claimed back later.

        Entries the stream no longer has are acknowledged and reported lost.
        """
        sub = self.sub
        me = ctx.consumer.name
        start = start or self._last is None  # a reader that knows nothing: a restart
        lo = "-"
        while True:
            rows = await conn.execute(
                "XPENDING", sub.stream, sub.group, lo, "+", sub.count, me, timeout=FINALIZE_TIMEOUT,
            )
            if not rows:
                self._taking.clear()  # the whole PEL seen: what is left there is not ours
                return
            lo = "(" + as_str(rows[-1][0])
            last = id_key(self._last) if self._last is not None else (-1, -1)
            wanted: dict[int, list[tuple[bytes, int]]] = {}  # attempt -> (id, idle ms)
            held = ctx.in_hand
            taking = self._taking
            # failed under a Backoff and not due yet (a restart while they waited)
            waits = await self._waits(ctx, [r for r in rows if r[0].decode() not in held
                                            and r[0] not in taking])
            for eid, _owner, idle, count in rows:
                if eid.decode() in held or eid in waits:
                    continue
                n = int(count)
                if eid in taking:
                    n = taking[eid] or n
                elif start:
                    n += 1
                elif id_key(eid) <= last:
                    if sub.mode is Mode.CLAIMING:
                        continue
                    n += 1
                wanted.setdefault(max(n, 1), []).append((eid, int(idle)))
            for n, taken in wanted.items():
                await self._take(conn, ctx, taken, n)
            if len(rows) < sub.count:
                self._taking.clear()
                return

    async def _waits(self, ctx: Context, rows: list[list[Any]]) -> set[bytes]:
        """Of own pending entries (``XPENDING`` rows, none held), those whose
        Backoff is not due yet, set waiting (:meth:`_defer`) as the attempt
        they failed at (the schedule's; the redelivery sets the server count
        one higher)."""
        left = await self._scheduled(ctx, [r[0] for r in rows])
        if not left:
            return set()
        ids = list(left)
        found = await ctx.client.pipeline([("XRANGE", self.sub.stream, eid, eid) for eid in ids],
                                          timeout=FINALIZE_TIMEOUT)
        entries: list[Entry] = [(hit[0][0], hit[0][1]) for hit in found if hit]
        return self._defer(ctx, entries, left)

    async def _take(self, conn: Connection, ctx: Context, taken: list[tuple[bytes, int]], n: int) -> None:
        """XCLAIM own pending entries with their count set to ``n``; hand them over."""
        sub = self.sub
        ids = [eid for eid, _ in taken]
        self._taking.update(dict.fromkeys(ids, n))
        reply = await conn.execute(
            "XCLAIM", sub.stream, sub.group, ctx.consumer.name, min(idle for _, idle in taken),
            *ids, "RETRYCOUNT", n, timeout=FINALIZE_TIMEOUT,
        )
        entries: list[Entry] = [
            (e[0], e[1]) for e in reply if e is not None and e[1] is not None
        ]
        got = {e[0] for e in entries}
        missing = [eid for eid in ids if eid not in got]
        gone: list[bytes] = []
        if missing:
            # deleted while pending (Redis 7 drops them from the PEL here, 6.2
            # answers nil and keeps them), or claimed by another consumer
            found = await ctx.client.pipeline(
                [("XRANGE", sub.stream, eid, eid) for eid in missing], timeout=FINALIZE_TIMEOUT
            )
            gone = [eid for eid, hit in zip(missing, found, strict=True) if not hit]
        await self._deliver_taken(ctx, entries, dict.fromkeys(got, n), gone)
        for eid in ids:
            self._taking.pop(eid, None)

    async def _claim(self, conn: Connection, ctx: Context) -> None:
        """XAUTOCLAIM entries idle ``min_idle`` (any consumer), one page."""
        sub = self.sub
        self._unsure = True
        reply = await conn.execute(
            "XAUTOCLAIM", sub.stream, sub.group, ctx.consumer.name,
            round(sub.min_idle * 1000), self._cursor, "COUNT", sub.count,
            timeout=FINALIZE_TIMEOUT,
        )
        start, self._cursor = self._cursor, as_str(reply[0])
        claimed: list[Entry] = [e for e in reply[1] if e is not None]
        # claimed (count + 1), not yet handed over: a recovery after a failure
        # below takes them as they are
        self._taking.update(dict.fromkeys([e[0] for e in claimed], None))
        if len(claimed) < len(reply[1]):
            # Redis < 7 answers nil (no id) for an entry deleted while pending,
            # and claims it into our PEL: find the vanished ids by hand.
            await self._ack_vanished(ctx, start, self._cursor, {e[0] for e in claimed})
        deleted: list[bytes] = list(reply[2]) if len(reply) > 2 else []
        held = ctx.in_hand
        for eid in deleted:  # Redis 7+: dropped from the PEL by XAUTOCLAIM itself
            if eid.decode() in held:  # reported already, or being handled
                continue
            ctx.stats.effects["lost_before_handling"] += 1
            log.warning("%s: entry %s was deleted while pending; dropped from the PEL",
                        ctx.name, eid.decode(),
                        extra={"subscription": ctx.name, "entry_id": eid.decode()})
        await self._lost(ctx, [e[0] for e in claimed if e[1] is None])
        live = [e for e in claimed if e[1] is not None]
        if live:
            ids = [e[0] for e in live]
            counts = await retry_not_run(
                ctx, partial(self._counts, ctx.client, ctx.consumer.name, ids),
                deadline=anyio.current_time() + _CLAIMED_TIMEOUT,
                what=f"counts of {len(ids)} claimed entries",
            )
            # our own entries still being handled, whose lease lapsed (a
            # stalled process): never to a second handler, and their claim
            # did not count an attempt
            own = [e[0] for e in live if e[0].decode() in held]
            if own:
                log.warning("%s: %d entries being handled were idle min_idle=%g s (lease "
                            "renewal late); kept with their handlers", ctx.name, len(own),
                            sub.min_idle, extra={"subscription": ctx.name})
                p = self._give_back([(eid, counts.get(eid, 2)) for eid in own])
                if p is not None:
                    await ctx.client.pipeline(p.commands, timeout=FINALIZE_TIMEOUT)
                live = [e for e in live if e[0].decode() not in held]
            # failed under a Backoff and not due yet (their consumer stopped, or
            # this one restarted): they wait out the rest, as the attempt they
            # failed at (the claim counted one more)
            live = await self._claimed_waits(ctx, live)
            await self._deliver_taken(ctx, live, counts, [])
        for e in claimed:
            self._taking.pop(e[0], None)
        self._unsure = False
        interval = min(max(sub.min_idle / 2, 0.05), _CLAIM_EVERY_MAX)
        # a full page or a cursor mid-PEL: claim again at once
        self._next_claim = 0.0 if self._cursor != "0-0" else anyio.current_time() + interval

    async def _ack_vanished(
        self, ctx: Context, start: str, end: str, claimed: set[bytes]
    ) -> None:
        """Acknowledge our pending entries in [start, end) that the stream no longer has."""
        sub = self.sub
        client = ctx.client
        stop = None if end == "0-0" else id_key(end.encode())
        lo = start
        page = sub.count + 100
        while True:
            rows = await client.execute(
                "XPENDING", sub.stream, sub.group, lo, "+", page, ctx.consumer.name,
                timeout=FINALIZE_TIMEOUT,
            )
            inside = [r[0] for r in rows if stop is None or id_key(r[0]) < stop]
            candidates = [eid for eid in inside if eid not in claimed and eid.decode() not in ctx.in_hand]
            if candidates:
                found = await client.pipeline(
                    [("XRANGE", sub.stream, eid, eid) for eid in candidates], timeout=FINALIZE_TIMEOUT
                )
                await self._lost(ctx, [eid for eid, hit in zip(candidates, found, strict=True)
                                         if not hit])
            if len(rows) < page or len(inside) < len(rows):
                return
            lo = "(" + as_str(rows[-1][0])

    async def _move_due(self, ctx: Context) -> float:
        """Move due copies from the durable delay set; seconds until the next is due."""
        try:
            return await move_due(ctx, move_due_to_stream(self.sub.copy_maxlen), self.sub.block)
        except rexc.ResponseError as e:
            # Redis refused a write (the stream is of another type now, or at
            # its last possible id, ...): what was not written is still in the
            # set.  Keep reading the stream and try again later, loudly,
            # rather than let one bad key end the consumer.
            t = ctx.target
            ctx.stats.read_errors += 1
            log.error("%s: moving due copies from %r back to %r failed: %s; trying again in %g s",
                      ctx.name, t.delay_key, t.source, e, _MOVE_RETRY,
                      extra={"subscription": ctx.name})
            return _MOVE_RETRY

    async def _lease(self, ctx: Context) -> None:
        """Keep held entries' idle time low so no other consumer claims them.

        Renewed every third of the shortest idle time after which another
        consumer may take an entry (``_core._presence.lease_every``: the
        reaper's ``heartbeat`` in PLAIN and RECLAIM, ``min_idle`` in
        RECLAIM and CLAIMING), so an entry being handled stays well below
        it while the process runs -- even should this consumer's heartbeat
        key vanish (evicted, flushed); should one lapse all the same, the
        claim that finds it keeps it with its handler (see :meth:`_claim`).

        Only entries still pending for this consumer are renewed, checked in
        the same script (``_core._recovery.LEASE``): after a stall longer
        than ``min_idle`` (a stopped process, a blocked event loop) another
        consumer may rightly have claimed some; they stay with it.  Those,
        and those pending for nobody any more, are dropped
        (:meth:`~._context.Context.disown`): the ones no handler started
        never start here; a running handler finishes, its finalization finds
        the gate as the other consumer left it.
        """
        sub = self.sub
        interval = lease_every(sub.mode, sub.min_idle, sub.heartbeat)
        while True:
            await anyio.sleep(interval)
            ids = sorted(ctx.in_hand)
            for i in range(0, len(ids), 500):
                part = ids[i : i + 500]
                try:
                    replies = await ctx.client.evalsha(
                        LEASE, (sub.stream,), (sub.group, ctx.consumer.name, *part),
                        timeout=FINALIZE_TIMEOUT,
                    )
                except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError) as e:
                    log.warning("%s: lease renewal failed: %s", ctx.name, e,
                                extra={"subscription": ctx.name})
                    continue
                others = lease_lost(part, replies)
                if others:
                    self._disown(ctx, others)

    def _disown(self, ctx: Context, others: dict[str, str]) -> None:
        """Entries the lease found pending for another consumer: dropped, the
        unstarted ones never started; logged.  (One pending for nobody is left
        as it is: finalized meanwhile -- its finalization is on the way --, or
        its group recreated at the last id read, where a queued entry must
        still be handled, not skipped.)"""
        dropped = ctx.disown(others)
        owners = sorted(set(others.values()))
        log.warning("%s: %d entries held by this consumer are now pending for %s (claimed "
                    "while this consumer stalled past the lease); left with them, dropped "
                    "from this consumer's lease: %s", ctx.name, len(others),
                    ", ".join(repr(o) for o in owners), ", ".join(sorted(others)[:20]),
                    extra={"subscription": ctx.name, "entry_ids": sorted(others)})
        if dropped:
            log.warning("%s: %d entries read and not started are another consumer's now; "
                        "not started here: %s",
                        ctx.name, len(dropped), ", ".join(str(d.id) for d in dropped[:20]),
                        extra={"subscription": ctx.name, "entry_ids": [d.id for d in dropped]})

    def _resume_at(self) -> str:
        """Where a group destroyed mid-run is recreated: the last id handed over."""
        return self._last.decode() if self._last is not None else self.sub.start_id
