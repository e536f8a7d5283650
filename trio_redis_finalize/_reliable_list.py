"""Reliable lists: ``ReliableListSubscription`` (BLMOVE into a processing list)."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections import Counter
from collections.abc import Sequence

import anyio
from anyio.abc import TaskStatus
from redis import exceptions as rexc

from ._delay_set import move_due
from ._delivery import Delivery
from ._envelope import CorruptEnvelope, unwrap, wrap
from ._keys import derived, same_slot
from ._list import build_delivery, check_type
from ._mount import FINALIZE_GRACE, FINALIZE_TIMEOUT, Item, Mount, backoff, describe_error, log
from ._plan import Effect, Plan, Target, content_origin
from ._scripts import MOVE_DUE_TO_LIST
from ._subscription import (
    DelayedRetry,
    Form,
    Subscription,
    check_key,
    check_limits,
    check_positive,
)
from ._transport import NOT_RUN, Command, Connection, Script, classify

__all__ = ["ReliableListReader", "ReliableListSubscription"]


@dataclasses.dataclass(frozen=True, slots=True)
class ReliableListSubscription(Subscription):
    """Read a list with ``BLMOVE queue processing RIGHT LEFT`` (producers LPUSH: FIFO).

    Args:
        queue: the list producers LPUSH onto.
        processing: this consumer's processing list (default
            ``{queue}:processing:<consumer name>``).
        delayed_retry: RUNTIME (default) or DURABLE_ZSET for ``retry_after``.
        max_attempts: attempts before a RETRY goes to ``dead_letter``.
        dead_letter: list that receives exhausted elements (LPUSH).
        block: seconds one BLMOVE blocks.
        delay_key: the durable delay set (default ``{queue}:delayed``).
        heartbeat: seconds after which a silent consumer counts as dead and
            its processing list is moved back onto the queue by a live one.
    """

    queue: str
    processing: str | None = None
    delayed_retry: DelayedRetry | None = None
    max_attempts: int | None = None
    dead_letter: str | None = None
    block: float = 1.0
    delay_key: str | None = None
    heartbeat: float = 30.0

    form = Form.RELIABLE_LIST

    def __post_init__(self) -> None:
        check_key("queue", self.queue)
        if self.processing is not None:
            check_key("processing", self.processing)
            if self.processing == self.queue:
                raise ValueError("processing must differ from queue")
        if self.delayed_retry is not None and not isinstance(self.delayed_retry, DelayedRetry):
            raise ValueError(f"delayed_retry must be a DelayedRetry or None, got {self.delayed_retry!r}")
        if self.delay_key is not None:
            check_key("delay_key", self.delay_key)
            if self.delayed_retry is not DelayedRetry.DURABLE_ZSET:
                raise ValueError("delay_key is only used with delayed_retry=DelayedRetry.DURABLE_ZSET")
        check_limits(self.max_attempts, self.dead_letter)
        if self.dead_letter is not None and self.dead_letter in (self.queue, self.processing):
            raise ValueError("dead_letter must differ from queue and processing")
        if self.delay_key is not None and self.delay_key in (self.queue, self.processing):
            raise ValueError("delay_key must differ from queue and processing")
        check_positive("block", self.block)
        check_positive("heartbeat", self.heartbeat)

    @property
    def name(self) -> str:
        return f"reliable list {self.queue!r}"

    def processing_key(self, consumer: str) -> str:
        return self.processing or derived(self.queue, f":processing:{consumer}")

    def target(self, consumer: str, *, cluster: bool = False) -> Target:
        """The resolved target.

        Raises:
            ValueError: in Redis Cluster (``cluster=True``), a ``processing``
                list or durable ``delay_key`` in another hash slot than the queue.
        """
        t = Target(
            form=Form.RELIABLE_LIST,
            name=self.name,
            source=self.queue,
            processing=self.processing_key(consumer),
            delayed_retry=self.delayed_retry or DelayedRetry.RUNTIME,
            delay_key=self.delay_key or derived(self.queue, ":delayed"),
            max_attempts=self.max_attempts,
            dead_letter=self.dead_letter,
            cluster=cluster,
        )
        if cluster:
            if not same_slot(t.source, t.processing):
                raise ValueError(
                    f"processing {t.processing!r} must share the hash slot of queue "
                    f"{t.source!r} in Redis Cluster (BLMOVE moves between them)"
                )
            if t.delayed_retry is DelayedRetry.DURABLE_ZSET and not same_slot(t.source, t.delay_key):
                raise ValueError(
                    f"delay_key {t.delay_key!r} must share the hash slot of queue {t.source!r} "
                    "in Redis Cluster (one script moves copies between them)"
                )
        return t


# -- runtime ------------------------------------------------------------------
#
# Keys beside the queue (all in the queue's hash slot):
#
# * ``{queue}:consumers``: a hash, consumer name -> its processing list; every
#   live consumer (re)registers itself there with each heartbeat;
# * ``{queue}:heartbeat:<consumer>``: a key with a TTL of ``heartbeat``
#   seconds, renewed every ``heartbeat / 3`` seconds while the consumer runs.
#
# A consumer whose heartbeat key is gone is dead: any live consumer moves its
# processing list back onto the queue (``_REAP``) and then forgets it.

_READ_MARGIN = 1.0
"""Seconds a blocking read may exceed ``block`` before it counts as lost."""
_PREFETCH_MAX = 64
"""At most this many elements move into the processing list per round trip."""
_CHUNK_WORK = 0.01
"""Seconds of handler work one prefetch aims at (fast handlers: bigger batches)."""
_REAP_PAGE = 100
_REAP_ROUNDS = 1000
_SMALL = 64

# KEYS: processing list.  ARGV: element, its rewritten copy.
# Replaces one occurrence of the element in place (a crash redelivery counts
# as an attempt, so a poison element that kills its consumer reaches
# max_attempts); false when the element is gone.
_BUMP = Script(
    """
local i = redis.call('LPOS', KEYS[1], ARGV[1])
if not i then return false end
redis.call('LSET', KEYS[1], i, ARGV[2])
return 1
""",
    name="reliable_list_bump",
)

# KEYS: dead consumer's processing list, queue, its heartbeat key, registry.
# ARGV: consumer name, element, rewritten element, element, rewritten, ...
# Gated on the heartbeat key being absent (the consumer may have come back);
# each element is removed from the processing list and pushed onto the
# consumer end (RIGHT) of the queue only when it was still there, so racing
# reapers move every element once.  Elements come newest first, so the
# oldest ends up rightmost: recovered elements are consumed first, in their
# original order.  Returns the number moved, or -1 when the consumer is alive.
_REAP = Script(
    """
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
local n = 0
for i = 2, #ARGV, 2 do
  if redis.call('LREM', KEYS[1], 1, ARGV[i]) == 1 then
    redis.call('RPUSH', KEYS[2], ARGV[i + 1])
    n = n + 1
  end
end
if redis.call('LLEN', KEYS[1]) == 0 then redis.call('HDEL', KEYS[4], ARGV[1]) end
return n
""",
    name="reliable_list_reap",
)


# KEYS: processing list, queue.  ARGV: elements, newest first.
# Gives back elements read but never handed to a handler (shutdown): each is
# removed from the processing list and pushed onto the consumer end of the
# queue only when it was still there.  Not counted as an attempt.
_GIVE_BACK = Script(
    """
local n = 0
for i = 1, #ARGV do
  if redis.call('LREM', KEYS[1], 1, ARGV[i]) == 1 then
    redis.call('RPUSH', KEYS[2], ARGV[i])
    n = n + 1
  end
end
return n
""",
    name="reliable_list_give_back",
)


def bumped(raw: bytes) -> bytes | None:
    """``raw`` with its retry counter one higher (a foreign element gets an
    envelope, retries 1, origin the digest of its bytes); None when corrupt."""
    try:
        body, retries, origin = unwrap(raw)
    except CorruptEnvelope:
        return None
    if retries >= 0xFFFFFFFF:
        return None
    return wrap(body, retries + 1, origin if origin is not None else content_origin(raw))


def _ident(raw: bytes) -> bytes:
    """A small key for the multiset of elements this reader holds."""
    if len(raw) <= _SMALL:
        return raw
    return b"#" + hashlib.blake2b(raw, digest_size=16).digest() + len(raw).to_bytes(8, "big")


def registry_key(queue: str) -> str:
    return derived(queue, ":consumers")


def heartbeat_key(queue: str, consumer: str) -> str:
    return derived(queue, f":heartbeat:{consumer}")


class ReliableListReader:
    """Reads one :class:`ReliableListSubscription`.

    * ``BLMOVE queue processing RIGHT LEFT`` on a dedicated connection, with
      up to 63 ``LMOVE`` pipelined behind it when the queue is busy and the
      handlers fast (the prefetch adapts: slow handlers keep it at 1, so
      other consumers get the rest).  The client-side deadline of a read is
      ``block`` + 1 s.
    * Crash recovery: on start, and after every read error (a lost BLMOVE
      reply strands an element), the processing list is read; what it holds
      that this reader did not deliver is delivered again, its retry counter
      bumped in place first (``LSET``), so a crash counts as an attempt and a
      poison element that kills its consumer reaches ``max_attempts`` (then
      it is dead-lettered without calling the handler).
    * Dead consumers: a heartbeat key with a TTL of ``heartbeat`` seconds,
      renewed every ``heartbeat / 3``; every ``heartbeat / 2`` each consumer
      looks in the registry for consumers whose heartbeat key is gone and
      moves their processing lists back onto the queue (gated script,
      element by element, counter bumped, to the consumer end in their
      original order: recovered elements are read first).  A slow handler
      does not stop the heartbeat; a blocked event loop does.
    * Shutdown: elements read but never handed to a handler go back onto the
      queue (consumer end, not counted as an attempt); those being handled
      when ``shutdown_grace`` ran out stay in the processing list, and the
      heartbeat is extended to cover the grace.
    * ``DelayedRetry.DURABLE_ZSET``: due copies are moved from the delay set
      before each read, and the read blocks no longer than the next is due.
    """

    def __init__(self, sub: ReliableListSubscription) -> None:
        self.sub = sub
        self._held: Counter[bytes] = Counter()  # idents delivered, maybe still in the list
        self._held_total = 0
        self._last_len = 0
        self._per_element = 0.0  # seconds of handler time per element (EMA)
        self._batch = 1
        self._next_move = 0.0
        self._target: Target | None = None

    def abandon(self, deliveries: Sequence[Delivery]) -> Plan | None:
        """Give elements read but never started (shutdown) back to the queue.

        They go to the consumer end, oldest rightmost, so they are read next
        (by any consumer), and their attempt is not counted; should that fail
        they stay in the processing list, recovered later as after a crash.
        """
        return self._give_back_plan([d.raw for d in deliveries if d.raw is not None])

    def _give_back_plan(self, raws: Sequence[bytes]) -> Plan | None:
        if not raws or self._target is None:
            return None
        t = self._target
        return Plan(Effect.NOTHING, (_GIVE_BACK.command((t.processing, t.source), raws[::-1]),))

    async def _hand_over(self, mount: Mount, built: list[tuple[Delivery, Plan | None]]) -> None:
        """:func:`dispatch`, giving back what was not handed over when cancelled."""
        direct: list[Item] = [(d, p) for d, p in built if p is not None]
        ready = [d for d, p in built if p is None]
        back = [d.raw for d, _ in built if d.raw is not None]
        try:
            if direct:
                await mount.finalize_now(direct)
            # one send when concurrency == 1: cancelled means not handed over;
            # else it may be partly handed over: leave the rest for recovery
            back = [d.raw for d in ready if d.raw is not None] if mount.concurrency == 1 else []
            await mount.deliver(ready)
        except BaseException:
            plan = self._give_back_plan(back)
            if plan is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(FINALIZE_TIMEOUT):
                    try:
                        await mount.client.pipeline(plan.commands, timeout=FINALIZE_TIMEOUT)
                    except (rexc.RedisError, OSError) as e:
                        log.warning("%s: could not give %d element(s) back to the queue (%s); "
                                    "they stay in the processing list", mount.name, len(back), e)
            raise

    # -- bookkeeping ----------------------------------------------------------
    def _hold(self, raw: bytes) -> None:
        self._held[_ident(raw)] += 1
        self._held_total += 1

    def _prune(self, items: Sequence[bytes]) -> Counter[bytes]:
        """Forget held elements no longer in the processing list ``items``."""
        present = Counter(_ident(e) for e in items)
        for k in list(self._held):
            keep = min(self._held[k], present[k])
            if keep:
                self._held[k] = keep
            else:
                del self._held[k]
        self._held_total = sum(self._held.values())
        self._last_len = len(items)
        return present

    # -- recovery -------------------------------------------------------------
    async def _rescan(self, conn: Connection, mount: Mount) -> None:
        """Deliver what the processing list holds that this reader does not."""
        t = mount.target
        items: list[bytes] = await conn.execute("LRANGE", t.processing, 0, -1,
                                                timeout=FINALIZE_TIMEOUT)
        self._prune(items)
        seen: Counter[bytes] = Counter()
        stranded: list[bytes] = []
        for e in reversed(items):  # oldest first
            k = _ident(e)
            seen[k] += 1
            if seen[k] > self._held[k]:
                stranded.append(e)
        if not stranded:
            return
        log.warning("%s: %d element(s) in processing list %r were not finalized; "
                    "delivering them again", mount.name, len(stranded), t.processing)
        for i in range(0, len(stranded), 500):
            await self._redeliver(mount, stranded[i : i + 500])

    async def _redeliver(self, mount: Mount, elements: list[bytes]) -> None:
        t = mount.target
        news = [bumped(e) for e in elements]
        cmds = [_BUMP.command((t.processing,), (e, n)) for e, n in zip(elements, news, strict=True)
                if n is not None]
        replies = iter(await mount.client.pipeline(cmds, timeout=FINALIZE_TIMEOUT) if cmds else [])
        built: list[tuple[Delivery, Plan | None]] = []
        for e, n in zip(elements, news, strict=True):
            if n is None:  # corrupt: cannot carry a counter, dead-lettered as it is
                raw = e
            elif next(replies) is None:  # gone meanwhile (reaped, finalized)
                continue
            else:
                raw = n
            self._hold(raw)
            built.append(build_delivery(mount, self.sub.queue, raw))
        await self._hand_over(mount, built)

    # -- heartbeat and reaper -----------------------------------------------------
    def _beat(self, mount: Mount, ttl: float) -> list[Command]:
        sub = self.sub
        me = mount.consumer.name
        return [
            ("SET", heartbeat_key(sub.queue, me), me, "PX", max(1, round(ttl * 1000))),
            ("HSET", registry_key(sub.queue), me, mount.target.processing),
        ]

    async def _heartbeat(self, mount: Mount) -> None:
        every = self.sub.heartbeat / 3
        while True:
            await anyio.sleep(every)
            try:
                await mount.client.pipeline(self._beat(mount, self.sub.heartbeat),
                                            timeout=FINALIZE_TIMEOUT)
            except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError, OSError) as e:
                log.warning("%s: heartbeat failed (%s); other consumers may take over this "
                            "consumer's processing list after %.1f s without one",
                            mount.name, e, self.sub.heartbeat)

    async def _reaper(self, mount: Mount) -> None:
        every = self.sub.heartbeat / 2
        while True:
            try:
                await self.reap(mount)
            except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError, OSError) as e:
                log.warning("%s: looking for dead consumers failed: %s", mount.name, e)
            await anyio.sleep(every * random.uniform(0.8, 1.2))

    async def reap(self, mount: Mount) -> int:
        """Move the processing lists of dead consumers back onto the queue."""
        sub = self.sub
        client = mount.client
        me = mount.consumer.name.encode()
        flat = await client.execute("HGETALL", registry_key(sub.queue), timeout=FINALIZE_TIMEOUT)
        others = [(n, p) for n, p in zip(flat[::2], flat[1::2], strict=True) if n != me]
        if not others:
            return 0
        alive = await client.pipeline(
            [("EXISTS", heartbeat_key(sub.queue, n.decode())) for n, _ in others],
            timeout=FINALIZE_TIMEOUT,
        )
        moved = 0
        for (name, proc), live in zip(others, alive, strict=True):
            if live:
                continue
            moved += await self._reap_one(mount, name.decode(), proc.decode())
        return moved

    async def _reap_one(self, mount: Mount, name: str, processing: str) -> int:
        sub = self.sub
        client = mount.client
        keys = (processing, sub.queue, heartbeat_key(sub.queue, name), registry_key(sub.queue))
        total = 0
        for _ in range(_REAP_ROUNDS):
            page: list[bytes] = await client.execute("LRANGE", processing, 0, _REAP_PAGE - 1,
                                                     timeout=FINALIZE_TIMEOUT)
            args: list[bytes | str] = [name]
            for e in page:  # newest first (see _REAP)
                args += [e, bumped(e) or e]
            n = int(await client.evalsha(_REAP, keys, args, timeout=FINALIZE_TIMEOUT))
            if n < 0:
                break  # it came back
            total += n
            if not page:
                break
        if total:
            mount.stats.effects["recovered"] += total
            log.warning("%s: consumer %r stopped its heartbeat; moved %d element(s) of its "
                        "processing list %r back onto the queue", mount.name, name, total,
                        processing)
        return total

    # -- the loop -------------------------------------------------------------------
    async def _move_due(self, mount: Mount) -> float:
        """Move due copies from the durable delay set; seconds until the next is due."""
        return await move_due(mount, MOVE_DUE_TO_LIST, self.sub.block)

    def _tune(self, waited: float, previous: int) -> None:
        """Pick the next prefetch from how long the handlers took per element.

        ``waited``: how long handing over this batch waited for the handlers,
        busy with the ``previous`` elements.  The prefetch at most doubles per
        round, so slow handlers keep it at 1 (other consumers get the rest).
        """
        if previous:
            self._per_element = 0.7 * self._per_element + 0.3 * (waited / previous)
        target = _PREFETCH_MAX if self._per_element <= 0 else int(_CHUNK_WORK / self._per_element)
        self._batch = max(1, min(_PREFETCH_MAX, target, self._batch * 2))

    async def run(self, mount: Mount, *, task_status: TaskStatus[None]) -> None:
        sub = self.sub
        t = self._target = mount.target
        client = mount.client
        await check_type(client, sub.queue, "list", sub.name)
        if t.processing != sub.queue:
            await check_type(client, t.processing, "list", sub.name)
        if t.dead_letter is not None:
            await check_type(client, t.dead_letter, "list", sub.name)
        await client.pipeline(self._beat(mount, sub.heartbeat))
        durable = t.delayed_retry is DelayedRetry.DURABLE_ZSET
        started = False
        failures = 0
        rescan = True
        conn: Connection | None = None
        blmove = ("BLMOVE", sub.queue, t.processing, "RIGHT", "LEFT")
        lmove = ("LMOVE", sub.queue, t.processing, "RIGHT", "LEFT")
        previous = 0
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat, mount)
                tg.start_soon(self._reaper, mount)
                while True:
                    try:
                        if conn is None or conn.broken:
                            conn = await client.connect(name=f"trf:{mount.consumer.name}:reader",
                                                    key=sub.queue)
                        block = sub.block
                        if durable:
                            if anyio.current_time() >= self._next_move:
                                wait = await self._move_due(mount)
                                self._next_move = anyio.current_time() + wait
                            block = max(0.001, min(block, self._next_move - anyio.current_time()))
                        if rescan or self._held_total > 2 * self._last_len + 256:
                            await self._rescan(conn, mount)
                            rescan = False
                        if not started:
                            task_status.started()
                            started = True
                        cmds: list[Command] = [(*blmove, f"{max(block, 0.001):.3f}")]
                        cmds += [lmove] * (self._batch - 1)
                        replies = await conn.pipeline(cmds, timeout=block + _READ_MARGIN)
                        failures = 0
                    except (rexc.RedisError, OSError) as e:
                        if not started:
                            raise
                        mount.stats.read_errors += 1
                        delay = backoff(failures)
                        failures += 1
                        if isinstance(e, rexc.ResponseError):  # WRONGTYPE, a script error...
                            # ... or one that did not run (BUSY, OOM ...): never the end
                            (log.warning if classify(e) is NOT_RUN else log.error)(
                                "%s: read failed (%s); reading again in %.2f s",
                                mount.name, e, delay)
                        else:
                            log.warning("%s: read failed (%s); reconnecting in %.2f s",
                                        mount.name, e, delay)
                            if conn is not None:
                                await conn.aclose()
                            conn = None
                        rescan = True
                        await anyio.sleep(delay)
                        continue
                    elements: list[bytes] = []
                    for cmd, r in zip(cmds, replies, strict=True):
                        if isinstance(r, rexc.RedisError):
                            mount.stats.read_errors += 1
                            log.error("%s: read failed: %s", mount.name, describe_error(r, cmd))
                        elif r is not None:
                            elements.append(r)
                    if any(isinstance(r, rexc.RedisError) for r in replies):
                        await anyio.sleep(backoff(failures, cap=1.0))
                        failures += 1
                    if not elements:
                        continue
                    for raw in elements:
                        self._hold(raw)
                    built = [build_delivery(mount, sub.queue, raw) for raw in elements]
                    before = anyio.current_time()
                    await self._hand_over(mount, built)
                    self._tune(anyio.current_time() - before, previous)
                    previous = len(elements)
        finally:
            if conn is not None:
                await conn.aclose()
            if started:
                # the handlers may still finish what they hold: keep the
                # heartbeat alive until they must have ended
                ttl = max(sub.heartbeat, mount.consumer.shutdown_grace + FINALIZE_GRACE)
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    try:
                        await client.pipeline(self._beat(mount, ttl), timeout=1.0)
                    except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError, OSError):
                        pass
