"""Derived key names share their source key's Redis Cluster hash slot."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from trio_redis_finalize._core.reliable_list import liveness as reliable
from trio_redis_finalize._core.stream import liveness as presence
from trio_redis_finalize._keys import derived, escape, has_hash_tag, named, same_slot, slot


def test_examples_from_the_contract() -> None:
    assert derived("orders", ":delayed") == "{orders}:delayed"
    assert derived("{app}.orders", ":delayed") == "{app}.orders:delayed"
    assert derived("orders", ":processing:c1") == "{orders}:processing:c1"


@pytest.mark.parametrize(
    ("key", "tagged"),
    [("orders", False), ("{app}.orders", True), ("a{b}c", True), ("{}", False), ("{}{x}", False),
     ("{", False), ("}", False), ("}{x}", True), ("x{", False), ("{{}}", True), ("a}b{", False)],
)
def test_has_hash_tag(key: str, tagged: bool) -> None:
    assert has_hash_tag(key) is tagged


@pytest.mark.parametrize(
    "key",
    ["orders", "{app}.orders", "{}", "{}orders", "a{}b{c}", "{", "orders{", "x{y", "}", "a}b",
     "x}{y", "{{}}", "{{", "}}", "", "ключ", "\x00"],
)
@pytest.mark.parametrize("suffix", [":delayed", ":processing:w{1}", ":processing:}{", ""])
def test_edge_cases_share_the_slot(key: str, suffix: str) -> None:
    d = derived(key, suffix)
    assert slot(d) == slot(key), (key, d)
    assert d.startswith(key) or d.startswith("{" + key + "}")
    assert "\n" not in d
    assert derived(key, suffix) == d  # deterministic


def test_empty_tag_and_unclosed_brace() -> None:
    # "{" never closes: the wrapping tag is the whole key
    assert derived("{", ":delayed") == "{{}:delayed"
    assert derived("x{y", ":delayed") == "{x{y}:delayed"
    # "{}" is an empty tag (the whole key hashes) and holds a "}": searched name
    d = derived("{}", ":delayed")
    assert d.startswith("{}:delayed~") and slot(d) == slot("{}")


keys = st.text(alphabet=st.sampled_from("ab{}:.é\x00"), max_size=12) | st.text(max_size=20)
suffixes = st.text(alphabet=st.sampled_from(":pd{}1"), max_size=8) | st.just(":delayed")


@settings(max_examples=300, deadline=None)
@given(keys, suffixes)
@example("{}", ":delayed")
@example("{", ":delayed")
@example("a}b", ":x{y}")
def test_derived_key_shares_the_slot(key: str, suffix: str) -> None:
    d = derived(key, suffix)
    assert slot(d) == slot(key)
    assert same_slot(key, d)
    if has_hash_tag(key):
        assert d == key + suffix
    elif key and "}" not in key:
        assert d == "{" + key + "}" + suffix


@given(st.binary(max_size=32))
def test_slot_matches_redis_py(key: bytes) -> None:
    assert slot(key) == key_slot(key)
    try:
        text = key.decode()
    except UnicodeDecodeError:
        return
    assert slot(text) == slot(key)


def test_same_slot() -> None:
    assert same_slot()
    assert same_slot("a")
    assert same_slot("{x}a", "{x}b", "x")
    assert not same_slot("orders", "dead-orders")


# -- named: the consumers' keys, one-to-one (issue 33, point 9) ------------------------

def test_named_examples() -> None:
    assert named("orders", "stream-heartbeat", "billing", "w1") == (
        "{orders}:stream-heartbeat:orders,billing,w1")
    assert named("{app}.orders", "stream-consumers", "g") == (
        "{app}.orders:stream-consumers:%7Bapp%7D.orders,g")
    assert named("jobs", "list-heartbeat", "a:b,c%") == "{jobs}:list-heartbeat:jobs,a%3Ab%2Cc%25"
    assert escape("%:,{}~x") == "%25%3A%2C%7B%7D%7Ex"


def test_the_names_that_shared_a_key_before_do_not() -> None:
    """Group ``a`` + consumer ``b:c`` and group ``a:b`` + consumer ``c``
    shared ``{s}:heartbeat:a:b:c``; a reliable list ``{s}`` + consumer ``g:c``
    and stream ``s`` + group ``g`` + consumer ``c`` shared
    ``{s}:heartbeat:g:c``; so did streams ``s`` and ``{s}``."""
    assert presence.legacy_heartbeat_key("s", "a", "b:c") == presence.legacy_heartbeat_key(
        "s", "a:b", "c")
    assert presence.heartbeat_key("s", "a", "b:c") != presence.heartbeat_key("s", "a:b", "c")
    assert reliable.legacy_heartbeat_key("{s}", "g:c") == presence.legacy_heartbeat_key(
        "s", "g", "c")
    assert reliable.heartbeat_key("{s}", "g:c") != presence.heartbeat_key("s", "g", "c")
    assert presence.heartbeat_key("s", "g", "c") != presence.heartbeat_key("{s}", "g", "c")
    assert presence.registry_key("s", "g") != presence.registry_key("{s}", "g")
    assert reliable.registry_key("s") != reliable.registry_key("{s}")
    # a list's registry and a stream's: one part against two
    assert reliable.registry_key("{s}") != presence.registry_key("s", "")
    for k in (presence.heartbeat_key("s", "a", "b:c"), reliable.heartbeat_key("{s}", "g:c")):
        assert slot(k) == slot("s")


def _unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        if text[i] == "%":
            out.append(chr(int(text[i + 1:i + 3], 16)))
            i += 3
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _read_back(name: str) -> tuple[str, list[str]]:
    """(kind, [source, part, ...]) from a name ``named`` gave: from the right,
    the escaped names (``derived``'s ``~<hex>`` cut off), then the kind."""
    _, kind, joined = name.rsplit(":", 2)
    joined = joined.split("~", 1)[0]
    return kind, [_unescape(p) for p in joined.split(",")]


names = st.text(alphabet=st.sampled_from("ab{}:,~%.é\x00"), max_size=8) | st.text(max_size=12)
kinds = st.sampled_from(["stream-heartbeat", "stream-consumers", "list-heartbeat",
                         "list-consumers"])


@settings(max_examples=300, deadline=None)
@given(kinds, names, st.lists(names, max_size=2))
@example("stream-heartbeat", "s", ["a", "b:c"])
@example("stream-heartbeat", "s", ["a:b", "c"])
@example("list-heartbeat", "{s}", ["g:c"])
@example("list-heartbeat", "a}b", ["x"])
@example("list-consumers", "", [])
def test_named_is_one_to_one_and_in_the_sources_slot(kind: str, source: str,
                                                      parts: list[str]) -> None:
    """Every name reads back as what it names (so no two share one), in the
    source's slot."""
    name = named(source, kind, *parts)
    assert _read_back(name) == (kind, [source, *parts])
    assert slot(name) == slot(source)
