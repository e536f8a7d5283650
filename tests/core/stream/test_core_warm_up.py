"""The warm-up of a claiming mount's claims, sans-IO (``_core.stream.survey.warm_up``).

For a while after its first registration, a RECLAIM or CLAIMING mount claims
only entries idle the longest lease bound of the live peers its first look
found (when longer than its own ``min_idle``), until they have surely seen
its registration and renewed.  The real-server test is in
``tests/forms/stream/test_lease_peers_warm_up.py``.
"""

from __future__ import annotations

import logging

import pytest

from trio_redis_finalize._core.stream.liveness import SEEN_WITHIN, registration_value
from trio_redis_finalize._core.stream.survey import (
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
