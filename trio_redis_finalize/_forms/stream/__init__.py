"""The stream form's home: :class:`StreamSubscription` (PLAIN, RECLAIM, CLAIMING).

Beside it: ``reader.py`` (the read steps), ``own_pel.py`` (the own PEL taken
back, a catch-up's I/O: recovery, claims, the reaper's take, Backoffs not
due yet), ``pending.py`` (the Backoff redelivery), ``liveness.py``
(heartbeat, registry, reaper) and ``retention.py`` (the trim); their sans-IO
rules are in ``_core/stream/``.
"""

from __future__ import annotations

import dataclasses
import re

from ..._core._types import Target
from ..._core.stream.liveness import HEARTBEAT_FLOOR
from ..._keys import derived, same_slot
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

__all__ = ["MIN_IDLE_FLOOR", "StreamSubscription"]

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
            renewed every ``min_idle / 3``, or every third of a live peer's
            when it registered a shorter one: a warning names it).
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
    ``header retries + server delivery count`` (a copy counts its own
    deliveries on top of the attempts before it), and the reader keeps
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
