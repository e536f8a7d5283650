"""settle(): the effect counted from what Redis answered, not what was planned
(issue 12 item 14).  Sans-IO: plans from the real planner, replies as the
transport returns them (values; error replies as exception values)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from redis import exceptions as rexc

from trio_redis_finalize import ACK, RETRY, Delivery, StreamSubscription, retry_after
from trio_redis_finalize._core._plan import plan
from trio_redis_finalize._core._types import FAILED, GATE_CLOSED, Plan, settle
from trio_redis_finalize._subscription import DelayedRetry
from trio_redis_finalize._transport import NotRunError


def _d(attempt: int = 1) -> Delivery:
    return Delivery(source="orders", id="1-0", fields={b"k": b"v"}, data=None, attempt=attempt,
                    origin_id="1-0", mount="m")


def _plan(outcome: Any, *, cluster: bool = False, attempt: int = 1, **kw: Any) -> Plan:
    sub = StreamSubscription("orders", "billing", **kw)
    return plan(sub.target("c1", cluster=cluster), _d(attempt), outcome)


def test_gated_copy_written() -> None:
    p = _plan(RETRY)
    assert settle(p, [b"2-0"]) == "copied"


def test_gated_copy_gate_closed() -> None:
    p = _plan(RETRY)
    assert settle(p, [None]) == GATE_CLOSED
    assert settle(p, [False]) == GATE_CLOSED


def test_gate_closed_on_a_resend_after_an_unknown_outcome_counts_the_earlier_send() -> None:
    # the first send's reply was lost: the resend finds the gate closed
    # because that send wrote the copy and removed the original
    p = _plan(RETRY)
    assert settle(p, [None], unsure=True) == "copied"
    assert settle(p, [rexc.ResponseError("WRONGTYPE x")], unsure=True) == FAILED


def test_durable_delay_gate_closed_is_not_delayed() -> None:
    p = _plan(retry_after(5), delayed_retry=DelayedRetry.DURABLE_ZSET)
    assert settle(p, [12345]) == "delayed"
    assert settle(p, [None]) == GATE_CLOSED


def test_dead_letter_gate_closed_is_not_dead_lettered() -> None:
    p = _plan(RETRY, attempt=3, max_attempts=3, dead_letter="{orders}:dead")
    assert settle(p, [b"9-0"]) == "dead_lettered"
    assert settle(p, [None]) == GATE_CLOSED


def test_cross_slot_copy_then_ack() -> None:
    p = _plan(RETRY, cluster=True, attempt=3, max_attempts=3, dead_letter="dead-orders")
    assert not p.gated and len(p.commands) == 2
    assert settle(p, [b"9-0", 1]) == "dead_lettered"
    # the copy failed: the removal was never sent
    assert settle(p, [rexc.ResponseError("WRONGTYPE x")]) == FAILED
    assert settle(p, [b"9-0", rexc.ResponseError("NOGROUP x")]) == FAILED
    # an XACK answering 0 (acknowledged already) is not a closed gate: the copy was written
    assert settle(p, [b"9-0", 0]) == "dead_lettered"


def test_plain_removal() -> None:
    p = _plan(ACK)
    assert settle(p, [1]) == "acked"
    assert settle(p, [rexc.ResponseError("NOGROUP x")]) == FAILED


def test_runtime_delayed_plan_counts_held() -> None:
    p = _plan(retry_after(1.0))
    assert settle(p, [1]) == "held"
    assert settle(p, [NotRunError("OOM x")]) == FAILED


@given(st.lists(st.one_of(st.none(), st.binary(max_size=4), st.integers()), max_size=3),
       st.integers(min_value=0, max_value=2))
def test_any_error_or_missing_step_is_failed(replies: list[Any], at: int) -> None:
    p = _plan(RETRY, cluster=True, attempt=3, max_attempts=3, dead_letter="dead-orders")
    at = min(at, len(replies), len(p.commands) - 1)
    with_error = [*replies[:at], rexc.ResponseError("ERR x"), *replies[at:]][: len(p.commands)]
    assert settle(p, with_error) == FAILED
    if len(replies) < len(p.commands):
        assert settle(p, replies) == FAILED


def test_first_round_holds_back_the_removal_of_a_cross_slot_copy() -> None:
    """The finalizer's first pipeline carries only the copy of an ungated
    two-step plan; its XACK waits for the copy's reply (sans-IO part)."""
    from trio_redis_finalize._core._batch import first_round

    cross = _plan(RETRY, cluster=True, attempt=3, max_attempts=3, dead_letter="dead-orders")
    gated = _plan(RETRY)
    ack = _plan(ACK)
    fast = [("XACK", "orders", "billing", "5-0", "6-0")]
    commands, owners, rest = first_round(fast, [cross, gated, ack])
    names = [c[0] for c in commands]
    assert names == ["XACK", b"EVALSHA", b"EVALSHA", "XACK"]
    assert commands[1] == cross.commands[0]  # the cross-slot copy (a plain XADD, as stream_xadd)
    assert commands[0] == ("XACK", "orders", "billing", "5-0", "6-0")  # the hot path's own
    assert commands[3] == ("XACK", "orders", "billing", "1-0")  # the plan's, apart
    assert owners == [(-1,), (0,), (1,), (2,)]
    assert rest == [[cross.commands[1]], [], []]
