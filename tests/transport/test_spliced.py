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
