"""The reliable list's sans-IO bookkeeping (``_core._reliable``)."""

from __future__ import annotations

from trio_redis_finalize._core.reliable_list.liveness import (
    bumped,
    dec,
    doubtful,
    heartbeat_key,
    registry_key,
    stranded,
)
from trio_redis_finalize._envelope import unwrap


def test_keys_share_the_queues_slot() -> None:
    assert registry_key("jobs") == "{jobs}:list-consumers:jobs"
    assert heartbeat_key("jobs", "c1") == "{jobs}:list-heartbeat:jobs,c1"


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


def test_a_copy_finalized_while_the_lrange_ran_is_not_stranded() -> None:
    """Held when the LRANGE was sent, its removal answered before the LRANGE's
    reply was read: the LRANGE may have run first, so it is not delivered again
    (it was, under load: a handled copy handled twice); the rescan is doubtful."""
    leftover = {b"X": 1}
    items = [b"X", b"Y"]
    before = {b"X": 1, b"Y": 1}
    held: dict[bytes, int] = {b"Y": 1}  # X's removal answered meanwhile
    assert stranded(items, held, leftover, (), start=False, before=before) == []
    assert leftover == {b"X": 1}  # kept for the next look
    assert doubtful(items, held, before)
    assert not doubtful(items, held, held)


def test_a_copy_beyond_what_was_held_is_stranded_all_the_same() -> None:
    # two X in the list, one held before the LRANGE, none now: one is stranded
    out = stranded([b"X", b"X"], {}, {}, (), start=False, before={b"X": 1})
    assert out == [(b"X", False)]
    assert doubtful([b"X", b"X"], {}, {b"X": 1})
    # nothing held before nor now: no doubt, as without ``before``
    assert stranded([b"Z"], {}, {}, (), start=False, before={}) == [(b"Z", False)]
    assert not doubtful([b"Z"], {}, {})


def test_list_gates_hold_and_leave_count_copies_without_io() -> None:
    """The counted gates alone (sans-IO): copies held are counted; one left
    without its removal is forgotten and marked leftover."""
    from trio_redis_finalize._core.reliable_list.gates import ListGates

    g = ListGates()
    for raw in (b"x", b"x", b"y"):
        g.hold(raw)
    assert g.unsent == g.in_hand == {b"x": 2, b"y": 1}
    assert g.take(b"x") == 2 and g.unsent == {b"x": 1, b"y": 1}
    assert g.take(b"gone") == 1  # not held: a plain gate
    g.leave(b"y")
    g.leave(b"never held")
    assert g.in_hand == {b"x": 2} and g.unsent == {b"x": 1} and g.leftover == {b"y": 1}
    # no target yet (before the reader's setup): commands as they are
    cmds = [("LREM", "p", -1, b"x")]
    assert g.prepare(list(cmds)) == cmds and g.resend(cmds, [], []) == cmds


def test_a_stop_counts_only_what_a_handler_held() -> None:
    """:func:`stop_args`: an element the reader holds (cut by the grace, waiting
    for a backoff) goes back bumped; a copy it does not hold (a read cut at
    the stop stranded it, no handler saw it) as it is."""
    from trio_redis_finalize._core.reliable_list.liveness import bumped, stop_args

    held = {b"a": 1}
    assert stop_args([b"a", b"a", b"b"], held) == [
        b"a", bumped(b"a"), b"a", b"a", b"b", b"b"]
    assert held == {}
