"""The stream's attempt rules, sans-IO (in ``_core/stream/decode.py``): which
attempt a recovered, claimed, given-back or redelivered entry counts.  No
server: the commands these rules shape run against one in
``tests/forms/stream/test_recovery.py`` and ``test_recovery_joints.py``."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trio_redis_finalize._core._types import Effect
from trio_redis_finalize._core.stream.decode import (
    AS_IS,
    GIVE_BACK,
    GIVE_BACK_PER_CALL,
    as_handed,
    claimed_waiting,
    give_back,
    given_back,
    lapsed_own,
    recovered,
    redelivered,
    set_back_claimed,
    waiting,
)

ids = st.builds(lambda ms, seq: f"{ms}-{seq}".encode(), st.integers(0, 50), st.integers(0, 3))
counts = st.integers(0, 20)
rows = st.lists(st.tuples(ids, counts), unique_by=lambda r: r[0], max_size=12)


def _key(eid: bytes) -> tuple[int, int]:
    ms, seq = eid.split(b"-")
    return int(ms), int(seq)


def test_recovery_at_a_start_counts_the_crash() -> None:
    got = recovered([(b"5-0", 1), (b"9-0", 3)], start=True, last=b"7-0", claiming=False, taking={})
    assert got == [(b"5-0", 2), (b"9-0", 4)]


def test_recovery_later_splits_at_the_last_id() -> None:
    """At or below the last id handed: handed before, one more; above it: a
    lost read's reply, never handled, its count stays."""
    got = recovered([(b"5-0", 1), (b"7-0", 2), (b"7-1", 1)], start=False, last=b"7-0",
                    claiming=False, taking={})
    assert got == [(b"5-0", 2), (b"7-0", 3), (b"7-1", 1)]


def test_claiming_recovery_leaves_what_it_was_handed() -> None:
    """CLAIMING: the PEL holds its delayed retries; only a lost read's entries are taken."""
    got = recovered([(b"5-0", 1), (b"7-0", 2), (b"8-0", 1)], start=False, last=b"7-0",
                    claiming=True, taking={})
    assert got == [(b"8-0", 1)]
    # at a start, CLAIMING takes them all, one more each
    assert recovered([(b"5-0", 1)], start=True, last=b"7-0", claiming=True, taking={}) == [
        (b"5-0", 2)]


def test_a_reader_that_knows_no_last_id_counts_as_a_start() -> None:
    assert recovered([(b"5-0", 1)], start=False, last=None, claiming=True, taking={}) == [
        (b"5-0", 2)]


def test_entries_being_taken_count_as_they_were_being_taken() -> None:
    """No bump twice: an entry a failure cut while it was taken over keeps the
    attempt it was being taken at; a claimed one (AS_IS) its server count."""
    got = recovered([(b"1-0", 4), (b"2-0", 2), (b"3-0", 0)], start=True, last=b"9-0",
                    claiming=True, taking={b"1-0": 3, b"2-0": AS_IS, b"3-0": AS_IS})
    assert got == [(b"1-0", 3), (b"2-0", 2), (b"3-0", 1)]


@given(rows=rows, start=st.booleans(), last=st.none() | ids, claiming=st.booleans(),
       taken=st.dictionaries(ids, st.none() | st.integers(1, 20), max_size=6))
def test_recovery_rules(rows: list[tuple[bytes, int]], start: bool, last: bytes | None,
                        claiming: bool, taken: dict[bytes, int | None]) -> None:
    got = recovered(rows, start=start, last=last, claiming=claiming, taking=taken)
    by_id = dict(got)
    assert [eid for eid, _ in got] == [eid for eid, _ in rows if eid in by_id]  # order kept
    fresh = start or last is None
    for eid, count in rows:
        if eid in taken:
            want: int | None = taken[eid] or count
        elif fresh:
            want = count + 1
        elif last is not None and _key(eid) <= _key(last):
            want = None if claiming else count + 1
        else:
            want = count  # above the last id: a lost read's reply, never handled
        assert by_id.get(eid) == (None if want is None else max(want, 1)), (eid, count)
    assert all(n >= 1 for _, n in got)


@given(st.lists(st.tuples(ids, st.integers(0, 20)), max_size=10))
def test_given_back_sets_the_count_one_lower(items: list[tuple[bytes, int]]) -> None:
    back = given_back(items)
    assert [eid for eid, _ in back] == [eid for eid, _ in items]
    assert [n for _, n in back] == [max(n - 1, 0) for _, n in items]


@given(st.lists(st.tuples(ids, st.integers(1, 20)), unique_by=lambda r: r[0], max_size=10))
def test_a_given_back_entry_recovered_at_a_start_counts_the_attempt_it_had(
        items: list[tuple[bytes, int]]) -> None:
    """Handed over with count n and never started, given back, the process
    stops: the start's recovery counts it n again, not n + 1."""
    again = recovered(given_back(items), start=True, last=None, claiming=False, taking={})
    assert again == items


@given(st.lists(st.tuples(ids, st.integers(0, 20)), unique_by=lambda r: r[0], max_size=10))
def test_give_back_is_one_owner_checked_call(items: list[tuple[bytes, int]]) -> None:
    """The give-back is one GIVE_BACK call: each entry with the count it was
    handed with (the script's check: still pending for ``me`` at that count,
    so a claim another consumer made meanwhile keeps its entry) and the
    count it is set back to; never a plain ``XCLAIM ... 0``, which takes an
    entry from whoever holds it."""
    plan = give_back("s", "g", "me", items)
    if not items:
        assert plan is None
        return
    assert plan is not None
    assert plan.effect is Effect.NOTHING and plan.gated  # safe to send again
    [cmd] = plan.commands
    assert GIVE_BACK.calls(cmd)
    assert GIVE_BACK.field(cmd, "stream") == "s"
    assert (GIVE_BACK.field(cmd, "group"), GIVE_BACK.field(cmd, "consumer")) == ("g", "me")
    assert GIVE_BACK.groups(cmd, "id") == [(eid, n, max(n - 1, 0)) for eid, n in items]


def test_a_long_give_back_is_cut_into_calls() -> None:
    """GIVE_BACK_PER_CALL entries per call, every entry once, in order."""
    items = [(f"{i}-0", 1 + i % 3) for i in range(2 * GIVE_BACK_PER_CALL + 1)]
    plan = give_back("s", "g", "me", items)
    assert plan is not None
    assert len(plan.commands) == 3
    assert all(GIVE_BACK.calls(c) for c in plan.commands)
    got = [g for c in plan.commands for g in GIVE_BACK.groups(c, "id")]
    assert got == [(eid, n, n - 1) for eid, n in items]


def test_give_back_of_str_ids_as_the_stop_sends_it() -> None:
    """The stop's second give-back (the reader's ``closed`` step) sends the
    ids it was handed as text, each with its count: the same call."""
    plan = give_back("s", "g", "me", {"1-0": 1, "2-0": 3}.items())
    assert plan is not None
    [cmd] = plan.commands
    assert GIVE_BACK.groups(cmd, "id") == [("1-0", 1, 0), ("2-0", 3, 2)]


@given(st.lists(st.tuples(ids, st.integers(0, 20)), unique_by=lambda r: r[0], max_size=10))
def test_set_back_claimed_commands(items: list[tuple[bytes, int]]) -> None:
    """Entries this consumer has just claimed and lets wait out their Backoff:
    the give-back's checked script (``GIVE_BACK``), each entry set one lower
    only while still pending for ``me`` at the count it is given back from
    (a peer's claim in between keeps it, see ``test_claimed_set_back``)."""
    plan = set_back_claimed("s", "g", "me", items)
    if not items:
        assert plan is None
        return
    assert plan is not None
    assert plan.effect is Effect.NOTHING
    assert all(GIVE_BACK.calls(cmd) for cmd in plan.commands)
    assert [GIVE_BACK.field(cmd, "consumer") for cmd in plan.commands] == ["me"] * len(plan.commands)
    got = [g for cmd in plan.commands for g in GIVE_BACK.groups(cmd, "id")]
    assert got == [(eid, n, max(n - 1, 0)) for eid, n in items]


def test_counts_given_back_from() -> None:
    assert as_handed(["1-0", "2-0"], {"2-0": 3}) == [("1-0", 1), ("2-0", 3)]
    # a claim took an entry still being handled: the claim counted one more
    assert lapsed_own([b"1-0", b"2-0"], {b"1-0": 5}) == [(b"1-0", 5), (b"2-0", 2)]
    # a claimed entry waiting out its Backoff is set back to the attempt that failed
    left = {b"1-0": (2.5, 3)}
    assert given_back(claimed_waiting([b"1-0"], left)) == [(b"1-0", 3)]


def test_waiting_entries_are_held_as_the_attempt_that_failed() -> None:
    assert waiting({b"1-0": (1.0, 3), b"2-0": (0.5, 0)}) == {b"1-0": 3, b"2-0": 1}


@given(st.lists(st.tuples(st.text(min_size=1), st.integers(1, 50)), max_size=10))
def test_redelivery_counts_the_attempt_about_to_be_made(items: list[tuple[str, int]]) -> None:
    assert redelivered(items) == [(eid, a + 1) for eid, a in items]
