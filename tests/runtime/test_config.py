"""Subscription configuration: every ValueError names its parameter; defaults of §3."""

from __future__ import annotations

import math
from typing import Any

import pytest
from _procs import assert_refused_naming

from trio_redis_finalize import (
    ChannelSubscription,
    DelayedRetry,
    ListSubscription,
    Mode,
    PatternSubscription,
    ReliableListSubscription,
    StreamSubscription,
)
from trio_redis_finalize._keys import same_slot
from trio_redis_finalize._subscription import Form

S = StreamSubscription
R = ReliableListSubscription
DZ = DelayedRetry.DURABLE_ZSET

BAD: list[tuple[str, Any, str]] = [
    # (what, factory, parameter named in the message)
    ("empty stream", lambda: S("", "g"), "stream"),
    ("stream not a str", lambda: S(b"s", "g"), "stream"),  # type: ignore[arg-type]
    ("empty group", lambda: S("s", ""), "group"),
    ("group None", lambda: S("s", None), "group"),  # type: ignore[arg-type]
    ("mode as str", lambda: S("s", "g", mode="plain"), "mode"),  # type: ignore[arg-type]
    ("negative min_idle", lambda: S("s", "g", min_idle=-1), "min_idle"),
    ("nan min_idle", lambda: S("s", "g", min_idle=math.nan), "min_idle"),
    ("inf min_idle", lambda: S("s", "g", min_idle=math.inf), "min_idle"),
    ("bool min_idle", lambda: S("s", "g", min_idle=True), "min_idle"),
    ("str min_idle", lambda: S("s", "g", min_idle="1"), "min_idle"),  # type: ignore[arg-type]
    ("zero block", lambda: S("s", "g", block=0), "block"),
    ("negative block", lambda: S("s", "g", block=-0.5), "block"),
    ("inf block", lambda: S("s", "g", block=math.inf), "block"),
    ("count 0", lambda: S("s", "g", count=0), "count"),
    ("count negative", lambda: S("s", "g", count=-3), "count"),
    ("count float", lambda: S("s", "g", count=1.5), "count"),  # type: ignore[arg-type]
    ("count bool", lambda: S("s", "g", count=True), "count"),
    ("max_attempts 0", lambda: S("s", "g", max_attempts=0), "max_attempts"),
    ("max_attempts negative", lambda: S("s", "g", max_attempts=-1), "max_attempts"),
    ("max_attempts True", lambda: S("s", "g", max_attempts=True), "max_attempts"),
    ("max_attempts float", lambda: S("s", "g", max_attempts=2.0), "max_attempts"),  # type: ignore[arg-type]
    ("dead_letter without max_attempts", lambda: S("s", "g", max_attempts=None, dead_letter="d"),
     "dead_letter"),
    ("empty dead_letter", lambda: S("s", "g", max_attempts=2, dead_letter=""), "dead_letter"),
    ("dead_letter is the stream", lambda: S("s", "g", max_attempts=2, dead_letter="s"),
     "dead_letter"),
    ("delayed_retry as str", lambda: S("s", "g", delayed_retry="runtime"),  # type: ignore[arg-type]
     "delayed_retry"),
    ("delay_key without DURABLE_ZSET", lambda: S("s", "g", delay_key="k"), "delay_key"),
    ("delay_key with RUNTIME", lambda: S("s", "g", delayed_retry=DelayedRetry.RUNTIME,
                                         delay_key="k"), "delay_key"),
    ("empty delay_key", lambda: S("s", "g", delayed_retry=DZ, delay_key=""), "delay_key"),
    ("delay_key is the stream", lambda: S("s", "g", delayed_retry=DZ, delay_key="s"), "delay_key"),
    ("empty start_id", lambda: S("s", "g", start_id=""), "start_id"),
    # reliable list
    ("empty queue", lambda: R(""), "queue"),
    ("empty processing", lambda: R("q", processing=""), "processing"),
    ("processing == queue", lambda: R("q", processing="q"), "processing"),
    ("rl delayed_retry as str", lambda: R("q", delayed_retry="x"),  # type: ignore[arg-type]
     "delayed_retry"),
    ("rl delay_key without DURABLE_ZSET", lambda: R("q", delay_key="k"), "delay_key"),
    ("rl delay_key is the queue", lambda: R("q", delayed_retry=DZ, delay_key="q"), "delay_key"),
    ("rl delay_key is processing", lambda: R("q", processing="p", delayed_retry=DZ, delay_key="p"),
     "delay_key"),
    ("rl max_attempts 0", lambda: R("q", max_attempts=0), "max_attempts"),
    ("rl max_attempts True", lambda: R("q", max_attempts=True), "max_attempts"),
    ("rl dead_letter without max_attempts", lambda: R("q", max_attempts=None, dead_letter="d"),
     "dead_letter"),
    ("rl dead_letter is the queue", lambda: R("q", max_attempts=1, dead_letter="q"), "dead_letter"),
    ("rl dead_letter is processing", lambda: R("q", processing="p", max_attempts=1,
                                               dead_letter="p"), "dead_letter"),
    ("rl zero block", lambda: R("q", block=0), "block"),
    ("rl zero heartbeat", lambda: R("q", heartbeat=0), "heartbeat"),
    # simple list
    ("empty key", lambda: ListSubscription(""), "key"),
    ("list zero block", lambda: ListSubscription("l", block=0), "block"),
    ("list max_attempts 0", lambda: ListSubscription("l", max_attempts=0), "max_attempts"),
    ("list max_attempts True", lambda: ListSubscription("l", max_attempts=True), "max_attempts"),
    # channels, patterns
    ("no channel", lambda: ChannelSubscription(), "channels"),
    ("empty channel", lambda: ChannelSubscription("a", ""), "channels"),
    ("channel not a str", lambda: ChannelSubscription(1), "channels"),  # type: ignore[arg-type]
    ("channel max_attempts 0", lambda: ChannelSubscription("a", max_attempts=0), "max_attempts"),
    ("empty pattern", lambda: PatternSubscription(""), "pattern"),
    ("empty retry_channel", lambda: PatternSubscription("p*", retry_channel=""), "retry_channel"),
    ("pattern max_attempts True", lambda: PatternSubscription("p*", max_attempts=True),
     "max_attempts"),
]


@pytest.mark.parametrize(("what", "factory", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_config_names_the_parameter(what: str, factory: Any, param: str) -> None:
    assert_refused_naming(param, factory, what)


def t_dead(sub: StreamSubscription | ReliableListSubscription) -> str | None:
    return sub.target("c1").dead_letter


def test_stream_defaults() -> None:
    s = StreamSubscription("orders", "billing")
    assert (s.mode, s.min_idle, s.delayed_retry, s.delay_key, s.max_attempts, s.dead_letter,
            s.block, s.count, s.start_id) == (
        Mode.PLAIN, 60.0, None, None, 10, "{orders}:dead", 1.0, 100, "0")
    # the defaults that end: DEFAULT_MAX_ATTEMPTS, the dead letter derived from the source
    assert t_dead(s) == "{orders}:dead"
    assert StreamSubscription("{app}.orders", "g").dead_letter == "{app}.orders:dead"
    assert StreamSubscription("orders", "g", max_attempts=None).dead_letter is None
    assert StreamSubscription("orders", "g", dead_letter=None).max_attempts == 10
    t = s.target("c1")
    assert t.form is Form.STREAM and t.source == "orders" and t.group == "billing"
    assert t.delay_key == "{orders}:delayed"
    assert t.delayed_retry is DelayedRetry.RUNTIME
    assert t.min_idle == 60.0 and not t.cluster
    assert StreamSubscription("{app}.orders", "g").target("c").delay_key == "{app}.orders:delayed"
    assert "orders" in s.name and "billing" in s.name


@pytest.mark.parametrize(
    ("mode", "delayed", "resolved"),
    [
        (Mode.PLAIN, None, DelayedRetry.RUNTIME),
        (Mode.RECLAIM, None, DelayedRetry.RUNTIME),
        (Mode.CLAIMING, None, None),
        (Mode.PLAIN, DelayedRetry.RUNTIME, DelayedRetry.RUNTIME),
        (Mode.CLAIMING, DelayedRetry.RUNTIME, DelayedRetry.RUNTIME),
        (Mode.PLAIN, DZ, DZ),
        (Mode.RECLAIM, DZ, DZ),
        (Mode.CLAIMING, DZ, DZ),
    ],
)
def test_resolved_delay(mode: Mode, delayed: DelayedRetry | None,
                        resolved: DelayedRetry | None) -> None:
    s = StreamSubscription("orders", "g", mode=mode, delayed_retry=delayed)
    assert s.resolved_delay is resolved
    assert s.target("c").delayed_retry is resolved
    assert s.target("c").mode is mode


def test_explicit_delay_key() -> None:
    s = StreamSubscription("orders", "g", delayed_retry=DZ, delay_key="my-delays")
    assert s.target("c").delay_key == "my-delays"


def test_reliable_list_defaults() -> None:
    r = ReliableListSubscription("orders")
    assert (r.processing, r.delayed_retry, r.max_attempts, r.dead_letter, r.block) == (
        None, None, 10, "{orders}:dead", 1.0)
    assert t_dead(r) == "{orders}:dead"
    assert ReliableListSubscription("orders", max_attempts=None).dead_letter is None
    assert r.processing_key("w1") == "{orders}:processing:w1"
    t = r.target("w1")
    assert t.form is Form.RELIABLE_LIST and t.source == "orders"
    assert t.processing == "{orders}:processing:w1"
    assert t.delay_key == "{orders}:delayed"
    assert t.delayed_retry is DelayedRetry.RUNTIME
    assert ReliableListSubscription("{app}.q").target("w").processing == "{app}.q:processing:w"
    assert ReliableListSubscription("q", processing="mine").target("w").processing == "mine"
    assert ReliableListSubscription("q", delayed_retry=DZ).target("w").delayed_retry is DZ


def test_valid_edges() -> None:
    StreamSubscription("s", "g", min_idle=0)
    StreamSubscription("s", "g", max_attempts=1, dead_letter="d")
    StreamSubscription("s", "g", count=1, block=0.001, start_id="$")
    ReliableListSubscription("q", max_attempts=1, dead_letter="d")
    PatternSubscription("p*", retry_channel="r", max_attempts=2)
    c = ChannelSubscription("a", "b", "a")
    assert c.channels == ("a", "b")  # duplicates dropped, order kept


def test_simple_forms_targets() -> None:
    t = ListSubscription("l", max_attempts=2).target("c")
    assert (t.form, t.source, t.max_attempts) == (Form.LIST, "l", 2)
    t = ChannelSubscription("a", "b").target("c")
    assert (t.form, t.source) == (Form.CHANNEL, "a")
    t = PatternSubscription("p*", retry_channel="r").target("c")
    assert (t.form, t.source, t.retry_channel) == (Form.PATTERN, "p*", "r")
    assert PatternSubscription("p*").target("c").retry_channel is None


def test_configs_are_immutable() -> None:
    s = StreamSubscription("s", "g")
    with pytest.raises(AttributeError):
        s.stream = "t"  # type: ignore[misc]
    r = ReliableListSubscription("q")
    with pytest.raises(AttributeError):
        r.queue = "t"  # type: ignore[misc]


# -- Redis Cluster: derived keys share the slot; explicit ones must too ----------------------

def test_cluster_defaults_share_the_slot() -> None:
    t = StreamSubscription("orders", "g", delayed_retry=DZ).target("c", cluster=True)
    assert same_slot(t.source, t.delay_key)
    t = ReliableListSubscription("jobs", delayed_retry=DZ).target("c", cluster=True)
    assert same_slot(t.source, t.processing, t.delay_key)


def test_cluster_cross_slot_keys_are_refused() -> None:
    s = StreamSubscription("orders", "g", delayed_retry=DZ, delay_key="elsewhere")
    s.target("c")  # one node: fine
    with pytest.raises(ValueError, match="delay_key"):
        s.target("c", cluster=True)
    r = ReliableListSubscription("jobs", processing="elsewhere")
    r.target("c")
    with pytest.raises(ValueError, match="processing"):
        r.target("c", cluster=True)
    r = ReliableListSubscription("jobs", delayed_retry=DZ, delay_key="elsewhere")
    with pytest.raises(ValueError, match="delay_key"):
        r.target("c", cluster=True)
    # a cross-slot dead letter is fine: copy and remove run as two commands
    StreamSubscription("orders", "g", max_attempts=1, dead_letter="dead").target("c", cluster=True)
    # runtime delays never touch the delay set
    StreamSubscription("orders", "g").target("c", cluster=True)
