"""A spliced command (``_core._commands.Spliced``: segments of arguments,
some the same object again) is packed segment by segment, each distinct
one once: the bytes must be those of the command's arguments, whatever
the segments, and a server must run it as it runs the plain tuple."""

from __future__ import annotations

import anyio
from hypothesis import given
from hypothesis import strategies as st

from trio_redis_finalize._core._commands import Arg, Spliced, splice
from trio_redis_finalize._transport import open_client, pack_command

ARG = st.one_of(st.binary(max_size=20), st.text(max_size=10), st.integers(-10**12, 10**12))


@given(st.lists(st.lists(ARG, max_size=5), min_size=1, max_size=8),
       st.lists(st.integers(0, 7), max_size=30))
def test_a_spliced_command_packs_as_its_arguments(pool: list[list[Arg]],
                                                  picks: list[int]) -> None:
    # segments drawn from a pool: the same list object again and again
    segments: list[list[Arg]] = [["RPUSH", "k"], *(pool[i % len(pool)] for i in picks)]
    c = splice(segments)
    assert isinstance(c, Spliced) and isinstance(c, tuple)
    assert list(c) == [a for s in segments for a in s]
    assert c.packed(pack_command) == pack_command(tuple(c))


async def test_a_server_runs_a_spliced_command_as_its_tuple(redis_url: str) -> None:
    shared: list[Arg] = [b"x\r\n", 7, "\u00e9"]
    c = splice([("RPUSH", "spliced"), shared, (b"\x00",), shared])
    with anyio.fail_after(10):
        async with open_client(redis_url) as client:
            await client.execute("DEL", "spliced")
            (n, same) = await client.pipeline([c, ("LRANGE", "spliced", 0, -1)])
    assert n == 7
    assert same == [b"x\r\n", b"7", "\u00e9".encode(), b"\x00", b"x\r\n", b"7", "\u00e9".encode()]


@given(st.lists(st.tuples(st.integers(0, 2**48), st.integers(0, 2**20)), min_size=1, max_size=40),
       st.lists(ARG, max_size=8))
def test_a_keyed_batch_packs_as_its_arguments(ids: list[tuple[int, int]], part: list[Arg]) -> None:
    """A batch of one outcome for every stream id: every id packed at once,
    cut at its line ends, the part's bytes put between (``splice_keyed``)."""
    from trio_redis_finalize._core._commands import splice_keyed

    texts = [f"{ms}-{seq}" for ms, seq in ids]
    c = splice_keyed((b"EVALSHA", "sha", 1, "s", "g"), texts, part)
    assert list(c) == [b"EVALSHA", "sha", 1, "s", "g", *(a for t in texts for a in (t, *part))]
    assert c.packed(pack_command) == pack_command(tuple(c))


_CELL = st.one_of(st.sampled_from(["HSET", "k", "%d", "é", "", "x\r\n"]),
                  st.sampled_from([b"v", b"%s", b"\r\n"]), st.integers(-2, 2))


@given(st.integers(0, 4).flatmap(lambda w: st.lists(st.lists(_CELL, min_size=w, max_size=w),
                                                    min_size=2, max_size=6)))
def test_parts_of_one_width_pack_as_their_arguments(rows: list[list[Arg]]) -> None:
    """A batch's parts of one width (``splice_rows``: an outcome built per
    message) are packed as a template, each column of one value once, the
    others substituted: the bytes of the arguments whatever the values (a
    ``%``, a line end, ``str``, ``bytes`` and ``int`` in one column)."""
    from trio_redis_finalize._core._commands import splice_rows

    c = splice_rows((b"EVALSHA", "sha", 1, "s"), rows)
    assert list(c) == [b"EVALSHA", "sha", 1, "s", *(a for r in rows for a in r)]
    assert c.packed(pack_command) == pack_command(tuple(c))


def test_a_value_of_a_subclass_is_sent_as_its_text() -> None:
    """Equal values of a batch's parts are packed once: a value of a
    subclass of ``str`` claiming to equal another is made its own text in
    the script's layout (``checked_writes``), so it is sent as it is."""
    from trio_redis_finalize import ACK
    from trio_redis_finalize._core._commands import splice_rows

    class Same(str):  # equal to every string
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = str.__hash__

    parts = [ACK.with_writes(("SADD", "k", Same(v))).write_parts for v in ("a", "b", "c")]
    assert {type(v) for p in parts for v in p} == {int, str}
    c = splice_rows((b"EVALSHA", "sha", 1, "k"), parts)
    assert c.packed(pack_command) == pack_command(tuple(c))
    assert b"$1\r\nb\r\n" in c.packed(pack_command)
