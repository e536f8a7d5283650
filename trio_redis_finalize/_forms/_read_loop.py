"""The one read loop every form runs: connection, readiness, errors, backoff.

A form's reader supplies the steps of ``_port.Steps``; ``drive`` runs them::

    setup(ctx)                              once (type checks, the group ...)
    background(ctx)                         tasks beside the loop (lease, trim, heartbeat ...)
    loop:
        async with connection(ctx) as conn:  a connection of the reader's own
            connected(ctx, conn)            after every (re)connect (subscribe, plan a recovery)
            loop:
                catch_up(ctx, conn)         what is due before a read (recovery, claims, moves)
                -- started --               the first time: mount() returns
                turn(ctx, conn)             one read (it may block), handed over
    closing(ctx)                            at the end, shielded and time-bounded

Errors: before ``started`` a reply saying the server did not run a command
(OOM, BUSY, LOADING ...; ``_core._replies.classify``) is tried again
for ``SETUP_PATIENCE`` seconds, any other error fails
``mount()``.  Once started, nothing ends the loop but cancellation: an error
reply keeps the connection (the reader's ``failed`` hook may react, e.g.
recreate a destroyed group) and the step is tried again after a backoff; a
lost connection or a timeout closes it and connects again after a backoff.
Every error is counted (``read_errors``) and logged with the subscription.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from redis import exceptions as rexc

from .._core._replies import NOT_RUN, WrongTypeError, classify
from .._deadlines import FINALIZE_TIMEOUT, SETUP_PATIENCE, backoff, log
from .._shutdown import CLOSING_TIMEOUT, cleanup
from ._port import Context, Steps

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

    from .._transport import Client, Connection

__all__ = ["check_type", "drive", "reader_connection", "retry_not_run"]

T = TypeVar("T")


async def drive(steps: Steps[Any], ctx: Context, *, task_status: TaskStatus[None]) -> None:
    """Run a reader's steps until cancelled (see the module docstring)."""
    patience = anyio.current_time() + SETUP_PATIENCE
    set_up = started = False
    failures = 0
    try:
        async with anyio.create_task_group() as tg:
            while True:
                try:
                    if not set_up:
                        await steps.setup(ctx)
                        set_up = True
                        for task in steps.background(ctx):
                            tg.start_soon(task)
                    async with steps.connection(ctx) as conn:
                        await steps.connected(ctx, conn)
                        while True:
                            try:
                                await steps.catch_up(ctx, conn)
                                if not started:
                                    task_status.started()
                                    started = True
                                await steps.turn(ctx, conn)
                                failures = 0
                            except rexc.ResponseError as e:
                                # an error reply: the connection is fine, stay on it
                                _go_on_or_raise(e, started, patience)
                                await anyio.sleep(_failed(steps, ctx, e, failures, started,
                                                          "reading again"))
                                failures += 1
                except (rexc.RedisError, OSError) as e:
                    _go_on_or_raise(e, started, patience)
                    await anyio.sleep(_failed(steps, ctx, e, failures, started, "reconnecting"))
                    failures += 1
    finally:
        if started:
            with cleanup(CLOSING_TIMEOUT):
                try:
                    await steps.closing(ctx)
                except (rexc.RedisError, OSError) as e:
                    log.warning("%s: closing the reader failed: %s", ctx.name, e,
                                extra={"subscription": ctx.name})


def _go_on_or_raise(err: Exception, started: bool, patience: float) -> None:
    """Before ``started``, only a reply saying the server did not run a
    command (OOM, BUSY, LOADING ...) is waited out, until ``patience``: any
    other error fails ``mount()``, with the error itself."""
    if started:
        return
    if (not isinstance(err, rexc.RedisError) or classify(err) is not NOT_RUN
            or anyio.current_time() >= patience):
        raise err


def _failed(steps: Steps[Any], ctx: Context, err: Exception, failures: int, started: bool,
            then: str) -> float:
    ctx.stats.read_errors += 1
    wait = steps.failed(ctx, err) if started else None
    if wait is None:
        not_run = classify(err) is NOT_RUN
        if not started:
            wait = backoff(failures, cap=1.0)
            log.warning("%s: set-up refused by the server for now (%s); trying again in %.2f s",
                        ctx.name, err, wait, extra={"subscription": ctx.name})
            return wait
        wait = backoff(failures, cap=5.0 if not_run else 2.0)
        what = "server refused the read for now" if not_run else "read failed"
        log.warning("%s: %s (%s); %s in %.2f s", ctx.name, what, err, then, wait,
                    extra={"subscription": ctx.name})
    return wait


async def check_type(client: Client, key: str, wanted: str, what: str) -> None:
    """Raise :class:`WrongTypeError` naming ``key`` and its type unless it is ``wanted``."""
    kind = await client.execute("TYPE", key, timeout=FINALIZE_TIMEOUT)
    kind = kind.decode() if isinstance(kind, bytes) else str(kind)
    if kind not in (wanted, "none"):
        raise WrongTypeError(f"WRONGTYPE key {key!r} holds a {kind}, not a {wanted} (mounting {what})")


@asynccontextmanager
async def reader_connection(ctx: Context, key: str) -> AsyncIterator[Connection]:
    """A connection of the reader's own (named ``trf:<consumer>:reader``), closed on exit."""
    async with await ctx.client.connect(name=f"trf:{ctx.consumer.name}:reader", key=key) as conn:
        yield conn


async def retry_not_run(ctx: Context, fn: Callable[[], Awaitable[T]], *, deadline: float,
                        what: str) -> T:
    """``await fn()``, asked again while the server answers that it did not
    run it (OOM, BUSY, LOADING ...; ``_core._replies.classify``), until
    ``deadline`` (``anyio.current_time()``); then that error.

    For a step inside a reader's step that must not be taken again from the
    start (the counts of entries just claimed: a second claim would count
    another attempt).  Each refusal is counted (``read_errors``) and logged.
    """
    failures = 0
    while True:
        try:
            return await fn()
        except (rexc.RedisError, OSError) as e:
            if classify(e) is not NOT_RUN or anyio.current_time() >= deadline:
                raise
            ctx.stats.read_errors += 1
            wait = backoff(failures, cap=0.5)
            failures += 1
            log.warning("%s: %s refused by the server for now (%s); asking again in %.2f s",
                        ctx.name, what, e, wait, extra={"subscription": ctx.name})
            await anyio.sleep(wait)
