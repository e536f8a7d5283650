"""The list / Pub/Sub envelope and the delay-set member format."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_redis_finalize import ORIGIN_FIELD, RETRIES_FIELD
from trio_redis_finalize._envelope import (
    MAGIC,
    MAGIC_DELAY,
    CorruptEnvelope,
    pack_parts,
    unpack_parts,
    unwrap,
    wrap,
)

SETTINGS = settings(max_examples=300, deadline=None)
retries_st = st.integers(0, 2**32 - 1)
origins = st.text(max_size=64)


def test_constants() -> None:
    assert isinstance(RETRIES_FIELD, bytes) and isinstance(ORIGIN_FIELD, bytes)
    assert RETRIES_FIELD != ORIGIN_FIELD
    assert bytes(MAGIC) != bytes(MAGIC_DELAY) and len(MAGIC) == len(MAGIC_DELAY) == 5
    assert MAGIC[0] == MAGIC_DELAY[0] == 0xFF


@SETTINGS
@given(st.binary(), retries_st, origins)
def test_wrap_round_trip(body: bytes, retries: int, origin: str) -> None:
    env = wrap(body, retries, origin)
    assert env.startswith(MAGIC)
    assert unwrap(env) == (body, retries, origin)


@SETTINGS
@given(st.binary(), st.integers(0, 2**32 - 2), origins)
def test_wrap_twice_unwraps_once(body: bytes, retries: int, origin: str) -> None:
    inner = wrap(body, retries, origin)
    assert unwrap(wrap(inner, retries + 1, origin)) == (inner, retries + 1, origin)


@SETTINGS
@given(st.binary().filter(lambda b: not b.startswith(MAGIC)))
def test_foreign_bytes_unwrap_to_themselves(payload: bytes) -> None:
    assert unwrap(payload) == (payload, 0, None)


@SETTINGS
@given(st.text())
def test_utf8_text_is_never_an_envelope(text: str) -> None:
    payload = text.encode()
    assert not payload.startswith(MAGIC)
    assert unwrap(payload) == (payload, 0, None)


def test_short_prefixes_of_magic_are_foreign() -> None:
    for i in range(len(MAGIC)):
        assert unwrap(MAGIC[:i]) == (MAGIC[:i], 0, None)


@SETTINGS
@given(st.binary(max_size=16), retries_st, st.text(min_size=1, max_size=32), st.data())
def test_truncated_envelope_is_corrupt(body: bytes, retries: int, origin: str,
                                       data: st.DataObject) -> None:
    env = wrap(body, retries, origin)
    header_end = len(MAGIC) + 6 + len(origin.encode())
    cut = data.draw(st.integers(len(MAGIC), header_end - 1))
    with pytest.raises(CorruptEnvelope):
        unwrap(env[:cut])


def test_corrupt_envelopes() -> None:
    with pytest.raises(CorruptEnvelope, match="header"):
        unwrap(MAGIC + b"\x00\x00")
    with pytest.raises(CorruptEnvelope, match="origin"):
        unwrap(MAGIC + b"\x00\x00\x00\x01" + b"\x00\x05" + b"abc")
    with pytest.raises(CorruptEnvelope, match="utf-8"):
        unwrap(MAGIC + b"\x00\x00\x00\x01" + b"\x00\x01" + b"\xff" + b"body")
    assert issubclass(CorruptEnvelope, ValueError)


def test_envelope_layout() -> None:
    env = wrap(b"body", 3, "1-0")
    assert env == MAGIC + b"\x00\x00\x00\x03" + b"\x00\x03" + b"1-0" + b"body"
    assert unwrap(wrap(b"", 0, "")) == (b"", 0, "")


parts_st = st.lists(st.binary(max_size=300), max_size=12)


@SETTINGS
@given(parts_st)
def test_parts_round_trip(parts: list[bytes]) -> None:
    member = pack_parts(parts)
    assert member.startswith(MAGIC_DELAY)
    assert unpack_parts(member) == parts


def test_parts_long_and_binary() -> None:
    parts = [b"\x00" * 16, b"\x00\xff\r\n", b"x" * 70_000, b""]
    assert unpack_parts(pack_parts(parts)) == parts


@SETTINGS
@given(parts_st, st.data())
def test_truncated_member_is_corrupt(parts: list[bytes], data: st.DataObject) -> None:
    member = pack_parts(parts)
    cut = data.draw(st.integers(0, len(member) - 1))
    with pytest.raises(CorruptEnvelope):
        unpack_parts(member[:cut])


@SETTINGS
@given(parts_st, st.binary(min_size=1, max_size=8))
def test_member_with_trailing_bytes_is_corrupt(parts: list[bytes], extra: bytes) -> None:
    with pytest.raises(CorruptEnvelope):
        unpack_parts(pack_parts(parts) + extra)


@SETTINGS
@given(st.binary().filter(lambda b: not b.startswith(MAGIC_DELAY)))
def test_foreign_member_is_corrupt(member: bytes) -> None:
    with pytest.raises(CorruptEnvelope):
        unpack_parts(member)


def test_huge_count_with_little_data_is_corrupt_quickly() -> None:
    with pytest.raises(CorruptEnvelope):
        unpack_parts(MAGIC_DELAY + b"\xff\xff\xff\xff" + b"\x00\x00\x00\x00" * 10)
    with pytest.raises(CorruptEnvelope):
        unpack_parts(MAGIC_DELAY + b"\x00\x00\x00\x01" + b"\xff\xff\xff\xff" + b"abc")


def test_wrap_saturates_the_counter() -> None:
    assert unwrap(wrap(b"b", 2**32, "o")) == (b"b", 2**32 - 1, "o")
    assert unwrap(wrap(b"b", 2**40, "o"))[1] == 2**32 - 1
    with pytest.raises(ValueError, match="origin"):
        wrap(b"b", 1, "x" * 70_000)
