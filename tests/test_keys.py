"""Derived key names share their source key's Redis Cluster hash slot."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from trio_redis_finalize._keys import derived, has_hash_tag, same_slot, slot


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
