"""A final error reply to a read does not end a reader (``_read_loop.drive``).

An error reply means the connection is fine: the reader counts it
(``read_errors``), logs it naming the subscription, waits a backoff and reads
again *on the same connection*; a lost connection is what reconnects.  The
final error here is real: the stream's key replaced by a string, so every
``XREADGROUP`` answers ``WRONGTYPE`` until the stream is back.
"""

from __future__ import annotations

import logging

import pytest
from _procs import eventually

from trio_redis_finalize import ACK, Delivery, Outcome, StreamSubscription, open_consumer
from trio_redis_finalize._transport import Client

pytestmark = pytest.mark.timeout(60)


async def _reader_ids(client: Client, consumer: str) -> list[int]:
    """The ids of the connections named as ``consumer``'s reader."""
    text = await client.execute("CLIENT", "LIST")
    text = text.decode() if isinstance(text, bytes) else text
    ids = []
    for line in text.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if fields.get("name") == f"trf:{consumer}:reader":
            ids.append(int(fields["id"]))
    return ids


async def test_a_final_error_reply_to_a_read_keeps_the_reader_on_its_connection(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[bytes] = []

    async def handler(d: Delivery) -> Outcome:
        seen.append(d.fields[b"n"])
        return ACK

    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    await client.execute("XGROUP", "CREATE", "s", "g", "$", "MKSTREAM")
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription("s", "g", block=0.05), handler)
        name = consumer.mounts[0].name
        await client.execute("XADD", "s", "*", "n", "before")
        await eventually(lambda: seen == [b"before"], timeout=10, what="the first entry")
        before = await _reader_ids(client, "c1")
        assert len(before) == 1

        # the key becomes a string: every read now answers WRONGTYPE (final)
        await client.execute("DEL", "s")
        await client.execute("SET", "s", "not a stream")
        await eventually(lambda: consumer.stats()[name]["read_errors"] >= 3, timeout=10,
                         what="WRONGTYPE reads counted")
        assert await _reader_ids(client, "c1") == before  # an error reply: same connection
        failed = [r for r in caplog.records if "read failed" in r.getMessage()]
        assert failed and "WRONGTYPE" in failed[0].getMessage()
        assert name in failed[0].getMessage()  # names the subscription (its key and group)

        # the stream is back: the reader goes on reading, still on that connection
        await client.execute("DEL", "s")
        await client.execute("XGROUP", "CREATE", "s", "g", "$", "MKSTREAM")
        await client.execute("XADD", "s", "*", "n", "after")
        await eventually(lambda: seen == [b"before", b"after"], timeout=10,
                         what="reading again after the error replies")
        assert await _reader_ids(client, "c1") == before
    assert int((await client.execute("XPENDING", "s", "g"))[0]) == 0
