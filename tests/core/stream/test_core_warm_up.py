"""The warm-up of a claiming mount's claims, sans-IO (``_core.stream.survey.warm_up``).

For a while after its first registration, a RECLAIM or CLAIMING mount claims
only entries idle the longest lease bound of the live peers its first look
found (when longer than its own ``min_idle``), until they have surely seen
its registration (counting the longest read ``block`` they registered) and
renewed.  Every consumer registers its ``block`` before the last
``min_idle``, readable by the rule of the version before.  The real-server
test is in ``tests/forms/stream/test_lease_peers_warm_up.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import pytest

from trio_redis_finalize._core.stream.liveness import SEEN_WITHIN, registration_value, stopped_value
from trio_redis_finalize._core.stream.survey import (
    MIN_IDLE_PART,
    Heartbeat,
    Peer,
    Registration,
    Survey,
    WarmUp,
    claim_min_idle,
    peer_bound,
    registration,
    warm_up,
    warm_up_note,
)
from trio_redis_finalize._subscription import Mode

PLAIN, RECLAIM, CLAIMING = Mode.PLAIN, Mode.RECLAIM, Mode.CLAIMING


def _peer(name: str, reg: str | None, hb: Heartbeat = Heartbeat.ALIVE) -> Peer:
    return Peer(name, 1, 0.1, hb, 10.0 if hb is Heartbeat.ALIVE else None,
                None if reg is None else registration(reg))


def _survey(*peers: Peer) -> Survey:
    return Survey(tuple(peers), (), 0, None)


def test_a_peers_bound_is_what_it_renews_against_before_it_sees_a_shorter_claimer() -> None:
    # RECLAIM: the shorter of min_idle and the reaper's heartbeat; CLAIMING: min_idle
    assert peer_bound(registration(registration_value(30.0, RECLAIM, 1.0, min_idle=9.0))) == 9.0
    assert peer_bound(registration(registration_value(5.0, RECLAIM, 1.0, min_idle=9.0))) == 5.0
    assert peer_bound(registration(registration_value(5.0, CLAIMING, 1.0, min_idle=9.0))) == 9.0
    # PLAIN registers no min_idle: its heartbeat (the reaper's guard)
    assert peer_bound(registration(registration_value(12.0, PLAIN, 1.0))) == 12.0
    # an earlier version's registration (no min_idle): its heartbeat
    assert peer_bound(registration("20000 reclaim 1000")) == 20.0
    # nothing known: not covered
    assert peer_bound(None) is None
    assert peer_bound(Registration(None, None)) is None
    assert peer_bound(Registration(None, CLAIMING, min_idle=4.0)) == 4.0


def test_no_live_peer_with_a_longer_bound_changes_nothing() -> None:
    found = _survey(
        _peer("same", registration_value(30.0, RECLAIM, 1.0, min_idle=1.5)),
        _peer("shorter", registration_value(30.0, CLAIMING, 1.0, min_idle=0.5)),
        _peer("lapsed", registration_value(30.0, RECLAIM, 1.0, min_idle=60.0), Heartbeat.LAPSED),
        _peer("stopped", "30000 reclaim 1000 stopped", Heartbeat.STOPPED),
        _peer("unknown", None, Heartbeat.NONE),
    )
    assert warm_up(RECLAIM, 1.5, 1.0, SEEN_WITHIN, found) is None
    assert warm_up(CLAIMING, 1.5, 1.0, SEEN_WITHIN, _survey()) is None
    # PLAIN claims nothing: never a warm-up
    longer = _survey(_peer("a", registration_value(30.0, RECLAIM, 1.0, min_idle=9.0)))
    assert warm_up(PLAIN, 1.5, 1.0, SEEN_WITHIN, longer) is None
    assert claim_min_idle(1.5, None, 0.0) == 1.5
    assert claim_min_idle(1.5, None, None) == 1.5


def test_the_longest_live_bound_lengthens_the_claims_until_the_peers_surely_renewed() -> None:
    found = _survey(
        _peer("a", registration_value(30.0, RECLAIM, 1.0, min_idle=9.0)),
        _peer("b", registration_value(12.0, PLAIN, 1.0)),
        _peer("c", registration_value(30.0, CLAIMING, 1.0, min_idle=3.0)),
        _peer("dead", registration_value(30.0, RECLAIM, 1.0, min_idle=99.0), Heartbeat.LAPSED),
    )
    w = warm_up(CLAIMING, 1.5, 0.25, SEEN_WITHIN, found)
    assert w is not None
    assert w.peer == "b" and w.min_idle == 12.0
    # the peers' registry read (SEEN_WITHIN), a read's block, the longest peer's lease period, the margin
    assert w.seconds == pytest.approx(SEEN_WITHIN + 0.25 + 12.0 / 3 + 0.5)
    assert claim_min_idle(1.5, w, 0.0) == 12.0
    assert claim_min_idle(1.5, w, None) == 12.0  # not registered yet: still the longer
    assert claim_min_idle(1.5, w, w.seconds - 0.001) == 12.0
    assert claim_min_idle(1.5, w, w.seconds) == 1.5
    assert claim_min_idle(1.5, w, w.seconds + 60) == 1.5


def test_a_tie_names_the_first_peer_by_name() -> None:
    found = _survey(_peer("z", registration_value(30.0, RECLAIM, 1.0, min_idle=9.0)),
                    _peer("m", registration_value(9.0, PLAIN, 1.0)))
    assert warm_up(RECLAIM, 1.5, 1.0, SEEN_WITHIN, found) == WarmUp(9.0, SEEN_WITHIN + 1.0 + 3.0 + 0.5, "m")


def test_the_note_names_the_peer_and_both_settings() -> None:
    w = WarmUp(9.0, 4.05, "a")
    level, msg, args, extra = warm_up_note("stream 's' group 'g'", 1.5, w)
    text = msg % args
    assert level == logging.INFO
    assert "consumer 'a'" in text and "min_idle=9 s" in text and "own 1.5 s" in text, text
    assert "for 4.0 s" in text or "for 4.1 s" in text, text
    assert extra == {"subscription": "stream 's' group 'g'"}


# -- the peers' read ``block`` (registered by every consumer) ---------------------------

def _registration_before_block(value: str) -> Registration:
    """The parsing rule of the version before ``block`` was registered
    (``survey.registration`` at b1508a4, verbatim but for its name): what a
    consumer of that version, still live in a rolling deploy, reads of a
    new consumer's registration."""
    parts = value.split(" ")
    min_idle: float | None = None
    if parts[-1].startswith(MIN_IDLE_PART) and len(parts) > 1:
        try:
            min_idle = int(parts.pop()[len(MIN_IDLE_PART):]) / 1000
        except ValueError:
            min_idle = None
    try:
        hb: float | None = int(parts[0]) / 1000
    except ValueError:
        hb = None
    try:
        m: Mode | None = Mode(parts[1]) if len(parts) > 1 else None
    except ValueError:
        m = None
    at: float | None = None
    if len(parts) > 2:
        try:
            at = int(parts[2]) / 1000
        except ValueError:
            at = None
    return Registration(hb, m, at, len(parts) > 3 and parts[3] == "stopped", min_idle)


@pytest.mark.parametrize("mode", [PLAIN, RECLAIM, CLAIMING])
def test_every_consumer_registers_its_block_before_min_idle_and_the_rule_before_reads_the_rest(
        mode: Mode) -> None:
    value = registration_value(30.0, mode, 1733360000.123, min_idle=9.0, block=0.25)
    claims = mode is not PLAIN
    tail = " min_idle=9000" if claims else ""
    assert value == f"30000 {mode.value} 1733360000123 block=250{tail}"
    reg = registration(value)
    assert reg == Registration(30.0, mode, 1733360000.123, min_idle=9.0 if claims else None,
                               block=0.25)
    for at, stopped, min_idle, block in itertools.product(
            (None, 12.0), (False, True), (None, 0.5), (None, 3.0, 0.0001)):
        if stopped and at is None:
            continue  # the stopped mark comes with its time
        v = registration_value(0.5, mode, at, stopped=stopped, min_idle=min_idle, block=block)
        new = registration(v)
        assert new.block == (None if block is None else max(block, 0.001)), v
        assert new.min_idle == (min_idle if claims else None), v
        # the rule before reads every other part as it reads them now
        assert _registration_before_block(v) == dataclasses.replace(new, block=None), v
    # the stopped mark registers no block (nobody waits for a stopped consumer's read)
    assert registration(stopped_value(30.0, mode, 12.0)).block is None


def test_a_registration_without_block_or_with_a_bad_one_tells_none() -> None:
    assert registration(b"30000 reclaim 1733360000123 min_idle=3000").block is None  # before
    assert registration(b"30000 reclaim 1 block=x min_idle=3000") == Registration(
        30.0, RECLAIM, 0.001, min_idle=3.0)
    assert registration(b"block=5") == Registration(None, None)  # not a registration at all
    # a part named as no version reads it (a later one's) is ignored, wherever it is
    assert registration(b"30000 claiming 1 later=7 block=50 min_idle=3000") == Registration(
        30.0, CLAIMING, 0.001, min_idle=3.0, block=0.05)
    assert registration(b"30000 plain 1 block=50 later=7").block == 0.05


def test_the_window_counts_the_longest_block_of_the_peers_it_waits_for() -> None:
    a = registration_value(30.0, RECLAIM, 1.0, min_idle=3.0, block=3.0)
    found = _survey(_peer("a", a))
    w = warm_up(CLAIMING, 0.5, 0.05, SEEN_WITHIN, found)
    # the peer reads the registry between two of its reads: its block, not the new mount's
    assert w == WarmUp(3.0, pytest.approx(SEEN_WITHIN + 3.0 + 1.0 + 0.5), "a")
    # a peer's shorter block than the new mount's: the peer's
    short = _survey(_peer("a", registration_value(30.0, RECLAIM, 1.0, min_idle=3.0, block=0.1)))
    w = warm_up(CLAIMING, 0.5, 2.0, SEEN_WITHIN, short)
    assert w is not None and w.seconds == pytest.approx(SEEN_WITHIN + 0.1 + 1.0 + 0.5)
    # an earlier version's peer (no block registered): the new mount's own
    old = _survey(_peer("a", "30000 reclaim 1000 min_idle=3000"))
    w = warm_up(CLAIMING, 0.5, 0.25, SEEN_WITHIN, old)
    assert w is not None and w.seconds == pytest.approx(SEEN_WITHIN + 0.25 + 1.0 + 0.5)
    # the longest of those it waits for, one without a block counting the own; a peer whose
    # bound is not longer (it renews in time anyway), or that is not alive, does not count
    mixed = _survey(
        _peer("a", a),
        _peer("b", registration_value(12.0, PLAIN, 1.0, block=4.0)),
        _peer("c", "30000 claiming 1000 min_idle=2000"),
        _peer("quick", registration_value(30.0, CLAIMING, 1.0, min_idle=0.4, block=60.0)),
        _peer("dead", registration_value(30.0, RECLAIM, 1.0, min_idle=9.0, block=60.0),
              Heartbeat.LAPSED),
    )
    w = warm_up(RECLAIM, 0.5, 5.0, SEEN_WITHIN, mixed)
    assert w == WarmUp(12.0, pytest.approx(SEEN_WITHIN + 5.0 + 4.0 + 0.5), "b")
    w = warm_up(RECLAIM, 0.5, 0.05, SEEN_WITHIN, mixed)
    assert w == WarmUp(12.0, pytest.approx(SEEN_WITHIN + 4.0 + 4.0 + 0.5), "b")
