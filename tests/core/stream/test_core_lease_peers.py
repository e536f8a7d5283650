"""The lease period follows the group's live claiming peers, sans-IO.

A consumer of a stream group registers its ``min_idle`` (RECLAIM, CLAIMING;
``_core.stream.liveness.registration_value``), and renews the lease of the
entries it holds every third of the shortest ``min_idle`` among itself and
the live registered peers that claim (``survey.claimers``,
``liveness.lease_every``); a registry probe finds a new such peer between
two looks (``claimer_probe``), or the lease's own read of the registry
while the read loop's probe is overdue (``follow_at``, ``alive_claimers``),
and each is warned about once (``shorter_notes``).  The real-server test is in
``tests/forms/stream/test_lease_peers.py``.
"""

from __future__ import annotations

import logging

from trio_redis_finalize._core.stream.liveness import (
    SEEN_WITHIN,
    STOP_PROBE,
    alive_claimers,
    claimer_probe,
    follow_at,
    lease_every,
    lease_guard,
    registration_value,
    shorter_notes,
    stopped_value,
)
from trio_redis_finalize._core.stream.survey import (
    Heartbeat,
    Peer,
    Registration,
    Survey,
    claimers,
    registration,
    registry,
)
from trio_redis_finalize._subscription import Mode

PLAIN, RECLAIM, CLAIMING = Mode.PLAIN, Mode.RECLAIM, Mode.CLAIMING


def _read_before(value: str) -> tuple[str, ...]:
    """What a reader from before ``min_idle`` was registered reads of a
    value: its positional parts -- heartbeat ms, mode, unix ms, and the
    stopped mark when the fourth part is ``stopped`` (``survey.registration``
    then) -- with the rest ignored."""
    parts = value.split(" ")
    return (*parts[:3], "stopped" if len(parts) > 3 and parts[3] == "stopped" else "")


def test_a_claiming_consumer_registers_its_min_idle_last_and_older_readers_read_the_rest() -> None:
    value = registration_value(30.0, RECLAIM, 1733360000.123, min_idle=3.0)
    assert value == "30000 reclaim 1733360000123 min_idle=3000"
    assert registration(value) == Registration(30.0, RECLAIM, 1733360000.123, min_idle=3.0)
    assert registration(value).claims
    assert _read_before(value) == ("30000", "reclaim", "1733360000123", "")
    claiming = registration_value(0.5, CLAIMING, None, min_idle=0.25)
    assert claiming == "500 claiming min_idle=250"
    assert registration(claiming) == Registration(0.5, CLAIMING, min_idle=0.25)
    assert _read_before(claiming)[:2] == ("500", "claiming")  # the third (no unix ms) unread
    # PLAIN claims nothing: no min_idle written
    assert registration_value(30.0, PLAIN, 12.0, min_idle=3.0) == "30000 plain 12000"
    # the stopped mark is read alike by both
    stopped = stopped_value(30.0, RECLAIM, 12.0)
    assert registration(stopped) == Registration(30.0, RECLAIM, 12.0, stopped=True)
    assert _read_before(stopped) == ("30000", "reclaim", "12000", "stopped")


def test_a_registration_without_min_idle_or_with_a_bad_one_claims_nothing_known() -> None:
    old = registration(b"30000 reclaim 1733360000123")  # an older consumer's
    assert old.min_idle is None and not old.claims
    bad = registration(b"30000 reclaim 1733360000123 min_idle=x")
    assert bad == Registration(30.0, RECLAIM, 1733360000.123)
    assert registration(b"min_idle=5") == Registration(None, None)  # not a registration at all
    assert not registration(b"30000 plain 1 min_idle=5").claims  # PLAIN claims nothing


def _peer(name: str, hb: Heartbeat, reg: str | None) -> Peer:
    return Peer(name, 1, 0.1, hb, 10.0 if hb is Heartbeat.ALIVE else None,
                None if reg is None else registration(reg))


def test_claimers_are_the_live_registered_peers_that_claim() -> None:
    found = Survey((
        _peer("b", Heartbeat.ALIVE, "30000 reclaim 1 min_idle=1000"),
        _peer("c", Heartbeat.ALIVE, "30000 claiming 1 min_idle=5000"),
        _peer("lapsed", Heartbeat.LAPSED, "30000 reclaim 1 min_idle=100"),
        _peer("stopped", Heartbeat.STOPPED, "30000 reclaim 1 stopped min_idle=100"),
        _peer("older", Heartbeat.ALIVE, "30000 reclaim 1"),  # no min_idle: not known
        _peer("plain", Heartbeat.ALIVE, "30000 plain 1"),
        _peer("foreign", Heartbeat.NONE, None),  # never registered: not known
    ), (), 0, None)
    assert claimers(found) == {"b": 1.0, "c": 5.0}


def test_the_lease_renews_every_third_of_the_shortest_min_idle_of_itself_and_its_peers() -> None:
    assert lease_every(RECLAIM, 9.0, 30.0, None) == 3.0  # no peer known: its own
    assert lease_every(RECLAIM, 9.0, 30.0, 1.5) == 0.5  # a peer claims sooner
    assert lease_every(RECLAIM, 9.0, 30.0, 60.0) == 3.0  # a longer one changes nothing
    assert lease_every(CLAIMING, 3.0, 30.0, 0.75) == 0.25
    assert lease_every(PLAIN, 60.0, 30.0, 6.0) == 2.0  # a RECLAIM peer beside PLAIN
    assert lease_guard(RECLAIM, 9.0, 6.0) == 6.0 and lease_guard(PLAIN, 1.0, 6.0) == 6.0


def test_the_registry_probe_names_a_new_peer_that_claims_sooner_once() -> None:
    regs = registry([b"me", b"30000 reclaim 5 min_idle=9000",
                     b"b", b"30000 reclaim 7 min_idle=1500",  # new, claims sooner
                     b"slow", b"30000 reclaim 7 min_idle=20000",  # claims later
                     b"gone", b"30000 reclaim 7 stopped min_idle=100",
                     b"old", b"30000 reclaim 7"])  # older version: not known
    assert claimer_probe(regs, "me", 9.0, {}, set()) == ["b"]
    # the last look found it alive so: nothing new
    assert claimer_probe(regs, "me", 9.0, {"b": 1.5}, set()) == []
    # the last look read this registration and did not find it alive (dead): no look again
    assert claimer_probe(regs, "me", 9.0, {}, {("b", 0.007)}) == []
    # it beat again, or came back with another min_idle: a look
    again = registry([b"b", b"30000 reclaim 8 min_idle=1000"])
    assert claimer_probe(again, "me", 9.0, {"b": 1.5}, {("b", 0.007)}) == ["b"]


def test_the_lease_reads_the_registry_only_while_the_read_loops_probe_is_overdue() -> None:
    """The read loop's probe due at 10.0, reads blocking 1 s: the lease's own
    read is due once the probe is late by a block and a probe period (a
    read loop that probes in time makes it send nothing), then every
    probe period after the last; a new registration is read within
    :data:`SEEN_WITHIN` and a block either way."""
    assert follow_at(10.0, 0.0, 1.0) == 10.0 + 1.0 + STOP_PROBE
    assert follow_at(12.0, 0.0, 1.0) == 12.0 + 1.0 + STOP_PROBE  # the read loop probed again
    assert follow_at(10.0, 11.6, 1.0) == 11.6 + STOP_PROBE  # its own last read
    # the registry read at 9.5 (the probe, due again at 10.0): read again by 11.5 at the latest
    assert follow_at(10.0, 0.0, 1.0) - 9.5 == SEEN_WITHIN + 1.0


def test_the_lease_follows_the_new_claimers_whose_heartbeat_key_is_there() -> None:
    regs = registry([b"b", b"30000 reclaim 7 min_idle=1500", b"c", b"30000 claiming 7 min_idle=800",
                     b"d", b"30000 reclaim 7 min_idle=500"])
    names = claimer_probe(regs, "me", 9.0, {}, set())
    assert names == ["b", "c", "d"]
    # PTTL: alive, alive with no expiry, gone (dead: a look reaps it, it claims nothing)
    assert alive_claimers(regs, names, [29000, -1, -2]) == {"b": 1.5, "c": 0.8}
    assert alive_claimers(regs, names, [b"-2", b"-2", b"-2"]) == {}


def test_each_peer_that_claims_sooner_is_warned_about_once_per_min_idle() -> None:
    notes = shorter_notes("sub", RECLAIM, 9.0, 30.0, {"b": 1.5, "slow": 20.0}, set())
    [(level, msg, args, extra)] = notes
    text = msg % args
    assert level == logging.WARNING and extra == {"subscription": "sub"}
    assert "consumer 'b'" in text and "min_idle=1.5 s" in text and "min_idle=9 s" in text
    assert "leased every 0.5 s" in text
    assert shorter_notes("sub", RECLAIM, 9.0, 30.0, {"b": 1.5}, {("b", 1.5)}) == []
    [(_, msg, args, _)] = shorter_notes("sub", RECLAIM, 9.0, 30.0, {"b": 1.0}, {("b", 1.5)})
    assert "min_idle=1 s" in msg % args  # restarted with another min_idle: told again
    [(_, msg, args, _)] = shorter_notes("sub", PLAIN, 0.0, 30.0, {"r": 6.0}, set())
    assert "heartbeat=30 s (Mode.PLAIN)" in msg % args
