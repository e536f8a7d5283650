"""Stream consumers' presence, sans-IO (``_core._presence``): keys, the
registry's values, the lease period, who is dead, what the reaper takes and
what is warned about.  No server: the scripts themselves run against one in
``tests/forms/stream/test_recovery.py``."""

from __future__ import annotations

import logging

from trio_redis_finalize._core._identity import RENEW
from trio_redis_finalize._core.stream.decode import parse_reap
from trio_redis_finalize._core.stream.liveness import beat, lease_every, stop_probe, stopped_value
from trio_redis_finalize._core.stream.survey import (
    Heartbeat,
    Registration,
    consumer_rows,
    heartbeat_key,
    peers,
    registration,
    registry,
    registry_key,
    survey,
    warnings,
    watch_notes,
)
from trio_redis_finalize._keys import same_slot
from trio_redis_finalize._subscription import Mode

PLAIN, RECLAIM, CLAIMING = Mode.PLAIN, Mode.RECLAIM, Mode.CLAIMING


def test_keys_share_the_streams_slot() -> None:
    assert registry_key("orders", "billing") == "{orders}:stream-consumers:orders,billing"
    assert heartbeat_key("orders", "billing", "c1") == "{orders}:stream-heartbeat:orders,billing,c1"
    assert heartbeat_key("{app}.orders", "g", "c") == (
        "{app}.orders:stream-heartbeat:%7Bapp%7D.orders,g,c")
    for stream in ("orders", "{app}.orders", "a}b", ""):
        assert same_slot(stream, registry_key(stream, "g"), heartbeat_key(stream, "g", "c"))


def test_a_beat_sets_the_key_with_its_ttl_and_registers() -> None:
    assert beat("orders", "billing", "c1", "h/1/ab", 30.0, PLAIN, 41.5) == RENEW.command(
        ("{orders}:stream-heartbeat:orders,billing,c1", "{orders}:stream-consumers:orders,billing"),
        ("h/1/ab 30000", 41500, "c1", "30000 plain"))


def test_registration_values_read_back_and_unknown_parts_are_none() -> None:
    assert registration(b"30000 plain") == Registration(30.0, PLAIN)
    assert registration("250 claiming") == Registration(0.25, CLAIMING)
    assert registration(b"{jobs}:processing:x") == Registration(None, None)
    assert registration(b"100") == Registration(0.1, None)
    assert registration(b"30000 plain 1733360000123") == Registration(30.0, PLAIN, 1733360000.123)
    assert registration(b"30000 plain 1733360000123 stopped") == Registration(
        30.0, PLAIN, 1733360000.123, stopped=True)
    assert registration(stopped_value(0.5, RECLAIM, 12.0)) == Registration(0.5, RECLAIM, 12.0, True)


def test_a_stopped_consumer_is_told_from_a_lapsed_one_and_taken_over_at_once() -> None:
    """The stopped mark (a clean stop handed its entries back): STOPPED, not
    LAPSED; the reaper takes its entries at the next look, logged as a hand-back
    (INFO, no crash), a dead one's with the time its heartbeat lapsed."""
    reg = {"gone": Registration(30.0, PLAIN, 1000.0, stopped=True),
           "dead": Registration(30.0, PLAIN, 1000.0)}
    found = peers([("gone", 3, 10), ("dead", 2, 5000)], reg, {"gone": -2, "dead": -2})
    by = {p.name: p.heartbeat for p in found}
    assert by == {"gone": Heartbeat.STOPPED, "dead": Heartbeat.LAPSED}
    s = survey("me", PLAIN, 30.0, 100, found)
    assert {r.peer.name: r.page for r in s.reap} == {"gone": 100, "dead": 100}
    texts = {msg % args: level for level, msg, args, _ in warnings("sub", PLAIN, 60.0, s, ())}
    [(stopped, lvl)] = [(t, lvl) for t, lvl in texts.items() if "'gone'" in t]
    assert lvl == logging.INFO and "stopped cleanly at 00:16:40.000 UTC" in stopped
    assert "taking them over now" in stopped
    [(dead, lvl)] = [(t, lvl) for t, lvl in texts.items() if "'dead'" in t]
    assert lvl == logging.WARNING
    assert "2 entries of consumer 'dead', heartbeat lapsed at 00:17:10.000 UTC" in dead
    assert "taken over in about 25.0 s" in dead


def test_the_stop_probe_names_new_stopped_marks_only() -> None:
    flat = [b"me", b"30000 plain 5 stopped", b"a", b"30000 plain 7 stopped", b"b", b"30000 plain 7"]
    assert stop_probe(registry(flat), "me", set()) == [("a", 0.007)]
    assert stop_probe(registry(flat), "me", {("a", 0.007)}) == []


def test_the_lease_is_a_third_of_the_shortest_takeover_idle() -> None:
    assert lease_every(PLAIN, 60.0, 30.0) == 10.0  # the reaper's guard: heartbeat
    assert lease_every(RECLAIM, 60.0, 30.0) == 10.0  # the reaper's, shorter than min_idle
    assert lease_every(RECLAIM, 3.0, 30.0) == 1.0  # XAUTOCLAIM's
    assert lease_every(CLAIMING, 3.0, 0.3) == 1.0  # no reaper claims there


def _rows() -> list[list[object]]:
    return [
        [b"name", b"me", b"pending", 1, b"idle", 10],
        [b"name", b"alive", b"pending", 2, b"idle", 20],
        [b"name", b"dead", b"pending", 3, b"idle", 40_000],
        [b"name", b"empty", b"pending", 0, b"idle", 50_000, b"inactive", 50_000],  # 7.2+
        [b"name", b"foreign", b"pending", 4, b"idle", 90_000],
        [b"name", b"idle-foreign", b"pending", 0, b"idle", 5],
    ]


def _registry() -> dict[str, Registration]:
    return registry([b"me", b"30000 plain", b"alive", b"30000 plain", b"dead", b"1000 plain",
                     b"empty", b"30000 plain", b"ghost", b"30000 reclaim"])


def _found() -> list:  # type: ignore[type-arg]
    ttls = {"me": 29_000, "alive": 12_500, "dead": -2, "empty": -2, "ghost": -2}
    return peers(consumer_rows(_rows()), _registry(), ttls)


def test_peers_sort_consumers_by_heartbeat() -> None:
    by = {p.name: p for p in _found()}
    assert [p.name for p in _found()] == ["me", "alive", "dead", "empty", "foreign",
                                          "idle-foreign", "ghost"]
    assert by["alive"].heartbeat is Heartbeat.ALIVE and by["alive"].ttl == 12.5
    assert by["dead"].heartbeat is Heartbeat.LAPSED and by["dead"].ttl is None
    assert by["foreign"].heartbeat is Heartbeat.NONE and by["foreign"].idle == 90.0
    assert by["ghost"].heartbeat is Heartbeat.LAPSED and by["ghost"].idle is None  # not in the group
    assert [p.name for p in _found() if p.stranded] == ["dead", "foreign"]


def test_survey_reaps_the_dead_and_counts_the_stranded() -> None:
    s = survey("me", PLAIN, 30.0, 100, _found())
    assert "me" not in [p.name for p in s.peers]
    # dead (entries: taken once idle its own heartbeat, 1 s), empty and ghost (deleted)
    assert [(r.peer.name, r.page, r.min_idle) for r in s.reap] == [
        ("dead", 100, 1.0), ("empty", 0, 30.0), ("ghost", 0, 30.0)]
    assert s.reap[0].candidates("orders", "billing") == (
        "XPENDING", "orders", "billing", "IDLE", 1000, "-", "+", 100, "dead")
    assert s.reap[0].args("billing", "me", [b"1-1"]) == ["billing", "dead", "me", 1000, 100, b"1-1"]
    assert s.reap[1].args("billing", "me") == ["billing", "empty", "me", 30000, 0]
    assert s.stranded == 3 + 4  # the dead one's and the foreign one's
    assert s.wake == 12.5  # when "alive" would lapse


def test_claiming_takes_nothing_and_nobody_takes_a_claiming_consumers_pel() -> None:
    assert [r.page for r in survey("me", CLAIMING, 30.0, 100, _found()).reap] == [0, 0, 0]
    found = peers([("dead", 3, 1)], {"dead": Registration(1.0, CLAIMING)}, {"dead": -2})
    assert [r.page for r in survey("me", PLAIN, 30.0, 100, found).reap] == [0]
    assert [r.page for r in survey("me", RECLAIM, 30.0, 100, found).reap] == [0]


def test_an_unreadable_registration_is_reaped_with_the_own_heartbeat() -> None:
    found = peers([("dead", 3, 1)], {"dead": Registration(None, None)}, {"dead": -2})
    [r] = survey("me", PLAIN, 7.0, 10, found).reap
    assert (r.page, r.min_idle) == (10, 7.0)


def test_a_heartbeat_key_without_expiry_is_alive_and_plans_no_wake() -> None:
    found = peers([], {"x": Registration(1.0, PLAIN)}, {"x": -1})
    s = survey("me", PLAIN, 1.0, 10, found)
    assert found[0].heartbeat is Heartbeat.ALIVE and s.reap == () and s.wake is None


def test_parse_reap() -> None:
    reply = [[[b"1-1", [b"a", b"b"], 3]], [b"1-2"], 250, 0]
    got = parse_reap(reply)
    assert got is not None
    assert got.entries == [(b"1-1", [b"a", b"b"])] and got.counts == {b"1-1": 3}
    assert got.gone == [b"1-2"] and got.wait == 0.25 and not got.forgotten
    done = parse_reap([[], [], -1, 1])
    assert done is not None and done.wait is None and done.forgotten and done.entries == []
    assert parse_reap(-1) is None  # its heartbeat came back


def test_warnings_name_the_stranded_and_say_how_to_recover() -> None:
    s = survey("me", PLAIN, 30.0, 100, _found())
    records = warnings("sub", PLAIN, 60.0, s, warned=())
    texts = {name: (level, msg % args) for level, msg, args, _ in records
             for name in ("dead", "foreign") if f"consumer {name!r}" in msg % args}
    assert set(texts) == {"dead", "foreign"}
    level, text = texts["foreign"]
    assert level == logging.WARNING
    assert "4 entries pending for consumer 'foreign' (idle 90.0 s)" in text
    assert "Mode.RECLAIM" in text and "XCLAIM" in text and "name=" in text
    level, text = texts["dead"]
    assert level == logging.WARNING and "taken over now" in text  # idle 40 s >= 1 s
    assert all(extra == {"subscription": "sub"} for *_, extra in records)
    # once per consumer
    assert warnings("sub", PLAIN, 60.0, s, warned={"dead", "foreign"}) == []


def test_warnings_in_reclaim_say_the_foreign_entries_are_claimed() -> None:
    s = survey("me", RECLAIM, 30.0, 100, _found())
    [foreign] = [r for r in warnings("sub", RECLAIM, 60.0, s, warned={"dead"})]
    level, msg, args, _ = foreign
    assert level == logging.INFO and "once idle min_idle=60 s" in msg % args


def test_a_dead_consumer_not_idle_long_enough_is_taken_over_later() -> None:
    found = peers([("dead", 2, 400)], {"dead": Registration(1.0, PLAIN)}, {"dead": -2})
    [(level, msg, args, _)] = warnings("sub", PLAIN, 60.0, survey("me", PLAIN, 30.0, 10, found), ())
    assert level == logging.WARNING
    assert "in about 0.6 s (once idle heartbeat=1 s)" in msg % args


def test_at_mount_a_live_consumer_holding_entries_is_noted_with_its_lapse() -> None:
    """A consumer killed moments ago still looks alive: the note at mount says
    when its entries would be taken over should it be dead."""
    found = peers([("busy", 3, 100), ("idle", 0, 100)],
                  {"busy": Registration(30.0, PLAIN), "idle": Registration(30.0, PLAIN)},
                  {"busy": 12_500, "idle": 20_000})
    [(level, msg, args, _)] = watch_notes("sub", survey("me", PLAIN, 30.0, 10, found), 1000.0)
    assert level == logging.INFO
    assert msg % args == ("sub: 3 entries of consumer 'busy', heartbeat alive until "
                          "00:16:52.500 UTC: should it be dead (killed just now), taken over "
                          "in about 12.5 s")
