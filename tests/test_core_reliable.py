"""The reliable list's sans-IO bookkeeping (``_core._reliable``)."""

from __future__ import annotations

from trio_redis_finalize._core._reliable import bumped, dec, heartbeat_key, registry_key, stranded
from trio_redis_finalize._envelope import unwrap


def test_keys_share_the_queues_slot() -> None:
    assert registry_key("jobs") == "{jobs}:consumers"
    assert heartbeat_key("jobs", "c1") == "{jobs}:heartbeat:c1"


def test_dec_counts_down_to_nothing() -> None:
    counts = {b"x": 2}
    assert dec(counts, b"x") == 2
    assert counts == {b"x": 1}
    assert dec(counts, b"x") == 1
    assert counts == {}
    assert dec(counts, b"x") == 0
    assert counts == {}


def test_bumped_counts_one_more_retry() -> None:
    once = bumped(b"job")
    assert once is not None
    body, retries, origin = unwrap(once)
    assert (body, retries) == (b"job", 1) and origin is not None
    twice = bumped(once)
    assert twice is not None and unwrap(twice) == (b"job", 2, origin)


def test_stranded_at_start_bumps_every_copy_not_held() -> None:
    # LRANGE order: newest first; one of the two X is held
    items = [b"Y", b"X", b"X"]
    assert stranded(items, {b"X": 1}, {}, (), start=True) == [(b"X", True), (b"Y", True)]


def test_stranded_later_bumps_only_leftovers_and_forgets_the_rest() -> None:
    leftover = {b"X": 1, b"Z": 1, b"W": 1}
    out = stranded([b"Y", b"X"], {}, leftover, {b"W"}, start=False)
    assert out == [(b"X", True), (b"Y", False)]
    assert leftover == {b"W": 1}  # Z's removal did remove it; W waits for its runtime copy
