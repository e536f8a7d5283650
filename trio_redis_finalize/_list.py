"""Simple lists: ``ListSubscription`` (BRPOP; nothing to acknowledge)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import anyio
from anyio.abc import TaskStatus
from redis import exceptions as rexc

from ._context import FINALIZE_TIMEOUT, READ_MARGIN, Context, backoff, hand_over, log
from ._core._plan import Effect, Plan, Target, attempt_of, content_origin, plan_dead
from ._delivery import Delivery
from ._envelope import MAGIC, CorruptEnvelope, unwrap
from ._subscription import Form, Subscription, check_key, check_limits, check_positive
from ._transport import NOT_RUN, Client, Connection, WrongTypeError, classify

__all__ = ["ListReader", "ListSubscription"]


@dataclasses.dataclass(frozen=True, slots=True)
class ListSubscription(Subscription):
    """Pop elements with BRPOP.  At-most-once: a crash during a handler loses
    the element.  ACK/RETRY/DROP are refused (:class:`AckUnsupported`);
    ``retry_after`` LPUSHes a copy back after the delay.

    Args:
        key: the list producers LPUSH onto.
        block: seconds one BRPOP blocks.
        max_attempts: attempts after which a ``retry_after`` copy is dropped
            (with a warning) instead of written.
    """

    key: str
    _: dataclasses.KW_ONLY  # the rest keyword-only, as documented
    block: float = 1.0
    max_attempts: int | None = None

    form = Form.LIST

    def __post_init__(self) -> None:
        check_key("key", self.key)
        check_positive("block", self.block)
        check_limits(self.max_attempts, None)

    @property
    def name(self) -> str:
        return f"list {self.key!r}"

    def target(self, consumer: str, *, cluster: bool = False) -> Target:
        return Target(form=Form.LIST, name=self.name, source=self.key,
                      max_attempts=self.max_attempts, cluster=cluster)


# -- runtime ------------------------------------------------------------------

_MAGIC_HEAD = MAGIC[:1]


def open_envelope(raw: bytes) -> tuple[bytes, int, str, str | None]:
    """``(body, retries, origin id, corrupt reason)`` of a list element or payload.

    A foreign payload (no envelope) is ``(raw, 0, content_origin(raw), None)``;
    a corrupt envelope is ``(raw, 0, content_origin(raw), reason)``.
    """
    try:
        body, retries, origin = unwrap(raw)
    except CorruptEnvelope as e:
        return raw, 0, content_origin(raw), f"corrupt envelope: {e}"
    return body, retries, origin if origin is not None else content_origin(raw), None


def build_delivery(mount: Context, source: str, raw: bytes) -> tuple[Delivery, Plan | None]:
    """The delivery of ``raw``, and the plan that finalizes it without a handler
    (corrupt envelope, or already past ``max_attempts``), if any."""
    if raw[:1] == _MAGIC_HEAD:
        body, retries, origin, corrupt = open_envelope(raw)
    else:  # cannot be an envelope: a foreign element
        body, retries, origin, corrupt = raw, 0, content_origin(raw), None
    attempt = attempt_of(retries)
    d = Delivery(
        source=source, id=None, fields={}, data=body, attempt=attempt, origin_id=origin,
        raw=raw, retries=retries, mount=mount.name, corrupt=corrupt,
    )
    if corrupt is not None:
        what = "dead-lettered" if mount.target.dead_letter is not None else "dropped"
        log.error("%s: %s in a %d-byte element from %r (origin %s); %s",
                  mount.name, corrupt, len(raw), source, origin, what)
        return d, plan_dead(mount.target, d, corrupt)
    limit = mount.target.max_attempts
    if limit is not None and attempt > limit:
        return d, plan_dead(
            mount.target, d, f"arrived at attempt {attempt}, past max_attempts={limit}"
        )
    return d, None


async def check_type(client: Client, key: str, wanted: str, what: str) -> None:
    """Raise :class:`WrongTypeError` naming ``key`` and its type unless it is ``wanted``."""
    kind = await client.execute("TYPE", key)
    kind = kind.decode() if isinstance(kind, bytes) else str(kind)
    if kind not in (wanted, "none"):
        raise WrongTypeError(f"WRONGTYPE key {key!r} holds a {kind}, not a {wanted} (mounting {what})")


class ListReader:
    """Pops one :class:`ListSubscription` with BRPOP on a dedicated connection.

    At-most-once: BRPOP removes the element from Redis, so a crash (or a lost
    read reply) loses it.  Elements popped but never started at shutdown are
    pushed back where they came from (:meth:`abandon`).
    """

    def __init__(self, sub: ListSubscription) -> None:
        self.sub = sub

    def abandon(self, deliveries: Sequence[Delivery]) -> Plan | None:
        """RPUSH the elements back, the oldest last (BRPOP takes it first again)."""
        raws = [d.raw for d in deliveries if d.raw is not None]
        if not raws:
            return None
        return Plan(Effect.NOTHING, (("RPUSH", self.sub.key, *reversed(raws)),), gated=False)

    async def _give_back(self, mount: Context, raws: list[bytes]) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(FINALIZE_TIMEOUT) as scope:
            attempt = 0
            while True:
                try:
                    await mount.client.execute("RPUSH", self.sub.key, *reversed(raws),
                                               timeout=FINALIZE_TIMEOUT)
                    return
                except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError) as e:
                    if classify(e) is NOT_RUN:  # OOM, READONLY ...: did not run, again
                        await anyio.sleep(backoff(attempt))
                        attempt += 1
                        continue
                    log.error("%s: could not push %d popped elements back: %s",
                              mount.name, len(raws), e)
                    return
        if scope.cancelled_caught:
            log.error("%s: could not push %d popped elements back within %g s", mount.name,
                      len(raws), FINALIZE_TIMEOUT)

    async def run(self, mount: Context, *, task_status: TaskStatus[None]) -> None:
        sub = self.sub
        client = mount.client
        await check_type(client, sub.key, "list", sub.name)
        conn: Connection | None = None
        started = False
        failures = 0
        timeout = f"{max(sub.block, 0.001):.3f}"  # "0.000" would block forever
        try:
            while True:
                try:
                    if conn is None or conn.broken:
                        conn = await client.connect(name=f"trf:{mount.consumer.name}:reader",
                                                    key=sub.key)
                    if not started:
                        task_status.started()
                        started = True
                    reply = await conn.execute("BRPOP", sub.key, timeout,
                                               timeout=sub.block + READ_MARGIN)
                    failures = 0
                except (rexc.RedisError, OSError) as e:
                    if not started:
                        raise
                    mount.stats.read_errors += 1
                    delay = backoff(failures)
                    failures += 1
                    log.warning("%s: read failed (%s); reading again in %.2f s", mount.name, e, delay)
                    if conn is not None and not isinstance(e, rexc.ResponseError):
                        await conn.aclose()
                        conn = None
                    await anyio.sleep(delay)
                    continue
                if reply is None:
                    continue
                raw: bytes = reply[1]
                try:
                    await hand_over(mount, [build_delivery(mount, sub.key, raw)])
                except BaseException:
                    # popped but not handed over (shutdown): put it back
                    await self._give_back(mount, [raw])
                    raise
        finally:
            if conn is not None:
                await conn.aclose()
