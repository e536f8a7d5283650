"""A batched writes call against its single scripts sent one after the other
(``runtime/test_writes.py``, ``runtime/test_writes_type_cache.py``): the
stream's set-up, the two ways of sending the plans, and the comparison."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import trio

from trio_redis_finalize._core._batch import batch_replies, first_round
from trio_redis_finalize._core._commands import Command
from trio_redis_finalize._core._replies import classify
from trio_redis_finalize._core._types import Plan
from trio_redis_finalize._transport import Client


async def pending_six(c: Client, stream: str, group: str, closed: Iterable[int]) -> None:
    """A flushed server, then ``stream`` with ``group`` and six entries
    (``1-0`` .. ``1-5``) read by consumer ``c1``: all pending but those
    numbered in ``closed`` (acked)."""
    await c.execute("FLUSHALL")
    await c.execute("XGROUP", "CREATE", stream, group, "0", "MKSTREAM")
    for k in range(6):
        await c.execute("XADD", stream, f"1-{k}", "f", "v")
    await c.execute("XREADGROUP", "GROUP", group, "c1", "STREAMS", stream, ">")
    for k in closed:
        await c.execute("XACK", stream, group, f"1-{k}")


async def send(c: Client, plans: Sequence[Plan], batched: bool,
               call: Sequence[Command] | None = None) -> list[Any]:
    """Each plan's answer: ``batched``, from the plans' one batched call
    (``call``, or the one ``first_round`` makes of them, checked to be one
    call for all); else from its single script, sent one after the other."""
    if not batched:
        return [(await c.pipeline(p.commands, raise_on_error=False))[0] for p in plans]
    if call is None:
        call, owners, _ = first_round((), plans)
        assert len(call) == 1 and owners == [tuple(range(len(plans)))]
    (reply,) = await c.pipeline(call, raise_on_error=False)
    answers = batch_replies(reply, len(plans))
    assert answers is not None
    return answers


def same(a: Any, b: Any) -> bool:
    """The same element, or an error of the same class and message (Redis 6.2
    wraps a single script's error: "Error running script ...: ERR ...")."""
    if isinstance(a, Exception) or isinstance(b, Exception):
        return (isinstance(a, Exception) and isinstance(b, Exception)
                and classify(a) is classify(b) and (str(a) in str(b) or str(b) in str(a)))
    return bool(a == b)


def assert_batch_is_its_singles(
    go: Callable[[bool], Awaitable[tuple[list[Any], list[Any]]]],
) -> None:
    """``go(batched)`` (answers, state): the batched call and its singles in
    order leave the same state and answer each delivery alike (``same``)."""
    (batch_answers, batch_state), (single_answers, single_state) = (
        trio.run(go, True), trio.run(go, False))
    assert batch_state == single_state
    assert all(same(a, b) for a, b in zip(batch_answers, single_answers, strict=True)), (
        [str(a) for a in batch_answers], [str(b) for b in single_answers])
