"""A stream subscription's retention (``StreamSubscription.retention``), as
its reader runs it: the refusal at mount of ``Retention.DELETE_ON_FINALIZE``
on a stream other groups read, and the periodic trim task
(``_core._retention`` decides the scripts and reads their replies)."""

from __future__ import annotations

import anyio
from redis import exceptions as rexc

from ..._core._replies import FINAL, classify
from ..._core.stream.retention import TRIM_LIMIT, delete_refusal, group_rows, parse_trim, trim_script
from ..._deadlines import FINALIZE_TIMEOUT, log
from ..._subscription import Retention
from .._port import Context

__all__ = ["check_retention", "trim"]

_TRIM_EVERY = 5.0
"""Seconds between two retention trim steps (the contract: at least every 10 s)."""
_TRIM_AGAIN = 0.01
"""Seconds before the next step when a trim step says more may be left."""


async def check_retention(ctx: Context, retention: Retention | None, stream: str, group: str,
                          mount: str) -> None:
    """``Retention.DELETE_ON_FINALIZE`` on a stream other groups read: refused.

    Deleting an entry takes it from every group of the stream, so a
    work-queue retention on a shared stream would lose the other groups'
    unread entries.  A group created later is reported by the periodic
    trim (it cannot be refused any more).  Not on a server whose
    ``XACKDEL ... ACKED`` removes (``Target.xackdel``): it deletes an
    entry only once no group references it.
    """
    if retention is not Retention.DELETE_ON_FINALIZE or ctx.target.xackdel:
        return
    rows = await ctx.client.execute("XINFO", "GROUPS", stream, timeout=FINALIZE_TIMEOUT)
    why = delete_refusal(stream, group, [g.name for g in group_rows(rows)])
    if why is not None:
        raise ValueError(f"{why} (mounting {mount})")


async def trim(ctx: Context, retention: Retention | None, stream: str, group: str) -> None:
    """Retention: one bounded trim step (``_retention.TRIM_ACKED``) every
    ``_TRIM_EVERY`` seconds, at once again while a step says more is left.

    Errors are logged and the step is tried again next period; they
    never end the reader.
    """
    client = ctx.client
    t = ctx.target
    script = trim_script(t.acked)
    reported: tuple[str, ...] = ()
    while True:
        wait = _TRIM_EVERY
        try:
            reply = await client.evalsha(
                script, (stream,), (TRIM_LIMIT,), timeout=FINALIZE_TIMEOUT
            )
        except (rexc.RedisError, OSError) as e:
            kind = classify(e)
            (log.error if kind is FINAL else log.warning)(
                "%s: retention trim of stream %r failed (%s: %s); trying again in %g s",
                ctx.name, stream, kind.value, e, wait,
                extra={"subscription": ctx.name},
            )
        else:
            result = parse_trim(reply)
            if result.removed:
                ctx.stats.effects["trimmed"] += result.removed
                log.debug("%s: trimmed %d entries below %s", ctx.name, result.removed,
                          result.threshold)
            if result.more:
                wait = _TRIM_AGAIN
            if retention is Retention.DELETE_ON_FINALIZE and result.groups != reported:
                reported = result.groups
                why = delete_refusal(stream, group, result.groups, xackdel=t.xackdel)
                if why is not None:
                    log.error("%s: %s -- they are losing entries now", ctx.name, why,
                              extra={"subscription": ctx.name})
        await anyio.sleep(wait)
