"""Exactly-once effects: an outcome's Redis writes committed with its finalization.

* the writes an outcome may carry, checked and normalised (``_writes``);
* their plans, sans-IO: every cell's gated removal step becomes the writes
  script doing the same after the writes (``_core._writes``);
* the scripts against real servers (the default one and Redis 6.2): gate
  first, key types checked before anything is written, writes, then the cell;
* consumers end to end: each message's writes applied exactly once, whatever
  its outcome, a resend or a racing finalization.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from _batch_writes import assert_batch_is_its_singles, pending_six, send
from _paths import ROOT
from _procs import always
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from redis import exceptions as rexc

from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    DelayedRetry,
    Delivery,
    ListSubscription,
    Mode,
    Outcome,
    ReliableListSubscription,
    Retention,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core._caps import Capabilities
from trio_redis_finalize._core._plan import plan
from trio_redis_finalize._core._types import Effect, Target
from trio_redis_finalize._core._writes import check_outcome, encode_writes, plan_outcome, plan_writes
from trio_redis_finalize._core.reliable_list import scripts as list_scripts
from trio_redis_finalize._core.reliable_list.scripts import LIST_WRITES
from trio_redis_finalize._core.stream import scripts as stream_scripts
from trio_redis_finalize._core.stream.scripts import STREAM_REMOVE_RECEIPT, STREAM_WRITES
from trio_redis_finalize._envelope import wrap
from trio_redis_finalize._subscription import Form
from trio_redis_finalize._transport import Client, open_client
from trio_redis_finalize._writes import MAX_WRITES, WRITE_COMMANDS, check_writes, write_keys
from trio_redis_finalize.pytest_plugin import sync_command
from trio_redis_finalize.testing import RedisServer

S, G = "{o}orders", "billing"
Q = "{o}jobs"
TOTALS = "{o}totals"
INCR = ("HINCRBY", TOTALS, "n", 1)


# -- what an outcome may carry ------------------------------------------------------------

def test_with_writes_normalises_and_keeps_the_outcome() -> None:
    o = ACK.with_writes(("hincrby", "t", b"f", 5), ("SADD", "s", 1.5))
    assert o.kind is ACK.kind and o.writes == (("HINCRBY", "t", b"f", "5"), ("SADD", "s", "1.5"))
    assert isinstance(o, Outcome) and o != ACK and ACK.writes == ()
    assert o == ACK.with_writes(("HINCRBY", "t", b"f", 5), ("SADD", "s", 1.5))
    more = o.with_writes(("DEL", "a", "b"))
    assert more.writes[-1] == ("DEL", "a", "b") and len(more.writes) == 3
    assert retry_after(2).with_writes(INCR).delay == 2.0
    assert repr(DROP.with_writes(("INCR", "x"))) == "DROP.with_writes(('INCR', 'x'))"


@pytest.mark.parametrize("bad, words", [
    (("EVAL", "return 1", 0), "not a write an outcome may carry"),
    (("SPOP", "s"), "not a write an outcome may carry"),
    (("RENAME", "a", "b"), "not a write an outcome may carry"),
    (("INCR",), "INCR takes 2 values"),
    (("HINCRBY", "h", "f"), "HINCRBY takes 4 values"),
    (("HSET", "h", "f", "v", "g"), "field value pairs"),
    (("SET", "k", None), "must be bytes, str, int or float"),
    (("SET", "k", True), "must be bytes, str, int or float"),
    (("INCRBYFLOAT", "k", float("nan")), "finite"),
    ("INCR x", "as a tuple"),
    ((), "as a tuple"),
])
def test_writes_that_are_refused_name_why(bad: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ACK.with_writes(bad)


def test_writes_have_bounds() -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_WRITES} writes"):
        check_writes([("INCR", "k")] * (MAX_WRITES + 1))
    with pytest.raises(ValueError, match="values per outcome"):
        check_writes([("SADD", "k", *range(1000))] * 5)
    with pytest.raises(ValueError, match="bytes per outcome"):
        check_writes([("SET", "k", b"x" * (1 << 20))])


def test_the_guide_lists_every_write_an_outcome_may_carry() -> None:

    text = (ROOT / "docs" / "guide.rst").read_text()
    section = text.split("* **What**: deterministic writes", 1)[1].split("* **Refusals**", 1)[0]
    listed = {w for w in section.replace("``", " ").split() if w.isupper() and w.isalpha()}
    assert set(WRITE_COMMANDS) <= listed and listed - set(WRITE_COMMANDS) <= {"MIB"}, listed


def test_write_keys_in_order_each_once() -> None:
    w = check_writes([("HINCRBY", "a", "f", 1), ("DEL", "b", "a", "c"), ("SET", "b", "v")])
    assert write_keys(w) == ["a", "b", "c"]


# -- plans (sans-IO) ----------------------------------------------------------------------

def _stream_target(**kw: Any) -> Target:
    return StreamSubscription(S, G, **kw).target("c1", cluster=kw.pop("cluster", False))


def _list_target(**kw: Any) -> Target:
    return ReliableListSubscription(Q, **kw).target("c1")


def _entry(attempt: int = 1, eid: str = "5-0") -> Delivery:
    return Delivery(source=S, id=eid, fields={b"f": b"v"}, data=None, attempt=attempt,
                    origin_id=eid, flat=(b"f", b"v"))


def _element(attempt: int = 1) -> Delivery:
    raw = wrap(b"job", attempt - 1, "o1")
    return Delivery(source=Q, id=None, fields={}, data=b"job", attempt=attempt, origin_id="o1",
                    raw=raw, retries=attempt - 1)


def _script_op(cmd: Any, script: Any) -> str:
    assert cmd[0] == b"EVALSHA" and cmd[1] == script.sha
    nkeys = cmd[2]
    return str(cmd[3 + nkeys + (2 if script is STREAM_WRITES else 1)])


STREAM_CELLS = [
    ("ack", {}, ACK, 1, "ack", Effect.ACKED),
    ("drop", {}, DROP, 1, "ack", Effect.DROPPED),
    ("retry", {}, RETRY, 1, "copy", Effect.COPIED),
    ("dead", {"max_attempts": 2, "dead_letter": "{o}dead"}, RETRY, 2, "copy", Effect.DEAD_LETTERED),
    ("exhausted", {"max_attempts": 1, "dead_letter": None}, RETRY, 1, "ack", Effect.EXHAUSTED),
    ("durable", {"delayed_retry": DelayedRetry.DURABLE_ZSET}, retry_after(3), 1, "zadd",
     Effect.DELAYED),
    ("runtime", {}, retry_after(3), 1, "receipt", Effect.HELD),
    ("delete-ack", {"retention": Retention.DELETE_ON_FINALIZE}, ACK, 1, "ack", Effect.ACKED),
    ("delete-retry", {"retention": Retention.DELETE_ON_FINALIZE, "copy_maxlen": 9}, RETRY, 1,
     "copy", Effect.COPIED),
    ("claiming-ack", {"mode": Mode.CLAIMING}, ACK, 1, "ack", Effect.ACKED),
    ("claiming-dead", {"mode": Mode.CLAIMING, "max_attempts": 1, "dead_letter": None}, RETRY, 1, "ack",
     Effect.EXHAUSTED),
]


@pytest.mark.parametrize("name, sub, outcome, attempt, op, effect", STREAM_CELLS,
                         ids=[c[0] for c in STREAM_CELLS])
def test_stream_plans_carry_the_writes_in_the_gated_removal(
    name: str, sub: dict[str, Any], outcome: Outcome, attempt: int, op: str, effect: Effect,
) -> None:
    t = _stream_target(**sub)
    d = _entry(attempt)
    base = plan(t, d, outcome)
    p = plan_writes(t, d, outcome.with_writes(INCR))
    assert p.effect is base.effect is effect
    assert (p.delay, p.gated) == (base.delay, base.gated)
    assert [c[:2] for c in p.later] == [c[:2] for c in base.later]  # (a runtime copy: its own marker)
    (cmd,) = p.commands
    nkeys = cmd[2]
    if op == "receipt":  # a runtime retry_after: its receipt's removal carries the writes
        assert cmd[1] == STREAM_REMOVE_RECEIPT.sha and cmd[3] == S and cmd[5:3 + nkeys] == (TOTALS,)
        assert p.later[0][4] == cmd[4]  # the copy gated on the same receipt
        args = list(cmd[3 + nkeys:])
        assert args[3:3 + 6] == encode_writes(check_writes([INCR])) and args[2] == "0"
        return
    assert _script_op(cmd, STREAM_WRITES) == op
    assert cmd[3] == S and TOTALS in cmd[5:3 + nkeys]
    args = list(cmd[3 + nkeys:])
    assert args[5:5 + 6] == encode_writes(check_writes([INCR]))  # (nw, argc, the command)
    assert args[3] == ("1" if t.deletes else "0")
    plain = plan_outcome(t, d, outcome)  # no writes: the plain plan
    assert plain.effect is base.effect and [c[:2] for c in plain.commands] == [c[:2] for c in base.commands]


NATIVE = Capabilities(xackdel=True, acked_trim=True)
NATIVE_CELLS = [
    ("ack", {}, ACK, 1, "ack"),
    ("retry", {"copy_maxlen": 9}, RETRY, 1, "copy"),
    ("dead", {"max_attempts": 1, "dead_letter": "{o}dead"}, RETRY, 1, "copy"),
    ("durable", {"delayed_retry": DelayedRetry.DURABLE_ZSET}, retry_after(3), 1, "zadd"),
    ("runtime", {}, retry_after(3), 1, "receipt"),
]


@pytest.mark.parametrize("name, sub, outcome, attempt, op", NATIVE_CELLS,
                         ids=[c[0] for c in NATIVE_CELLS])
def test_on_redis_82_the_writes_script_removes_with_xackdel(
    name: str, sub: dict[str, Any], outcome: Outcome, attempt: int, op: str,
) -> None:
    """Retention.DELETE_ON_FINALIZE where the server has XACKDEL: the writes
    script removes the original as the plan would (``x``: one XACKDEL ACKED)."""
    t = dataclasses.replace(_stream_target(retention=Retention.DELETE_ON_FINALIZE, **sub), caps=NATIVE)
    p = plan_writes(t, _entry(attempt), outcome.with_writes(INCR))
    (cmd,) = p.commands
    if op == "receipt":  # STREAM_REMOVE_RECEIPT: group, id, how, writes
        assert cmd[1] == STREAM_REMOVE_RECEIPT.sha and cmd[3 + cmd[2] + 2] == "x"
        return
    assert _script_op(cmd, STREAM_WRITES) == op
    assert cmd[3 + cmd[2] + 3] == "x"


@pytest.mark.parametrize("retention", [None, Retention.DELETE_ON_FINALIZE])
@pytest.mark.parametrize("caps", [None, NATIVE], ids=["scripts", "native"])
@pytest.mark.parametrize("mode", [Mode.PLAIN, Mode.CLAIMING])
@pytest.mark.parametrize("outcome", [ACK, DROP], ids=["ack", "drop"])
def test_a_stream_ack_or_drop_with_writes_is_its_removal_in_the_writes_script(
    retention: Retention | None, caps: Capabilities | None, mode: Mode, outcome: Outcome,
) -> None:
    """plan_writes' inline plan of an ACK or DROP is plan()'s removal as
    _with_writes turns it into the writes script (the general way)."""
    from trio_redis_finalize._core._writes import _with_writes

    t = _stream_target(retention=retention, mode=mode)
    if caps is not None:
        t = dataclasses.replace(t, caps=caps)
    d = _entry()
    for writes in ([INCR], [INCR, ("SADD", "{o}seen", "x")], [("DEL", "{o}a", "{o}b"), INCR]):
        o = outcome.with_writes(*writes)
        base = plan(t, d, outcome)
        checked = check_writes(writes)
        expected = _with_writes(t, base.commands, encode_writes(checked), write_keys(checked))
        assert plan_writes(t, d, o) == dataclasses.replace(base, commands=expected)


@pytest.mark.parametrize("outcome", [ACK, DROP], ids=["ack", "drop"])
@pytest.mark.parametrize("sub", [{}, {"max_attempts": 2, "dead_letter": "{o}dead"},
                                 {"delayed_retry": DelayedRetry.DURABLE_ZSET}],
                         ids=["plain", "dead-letter", "durable"])
def test_a_list_ack_or_drop_with_writes_is_its_removal_in_the_writes_script(
    outcome: Outcome, sub: dict[str, Any],
) -> None:
    """plan_writes' inline plan of a reliable list's ACK or DROP is plan()'s
    LREM as _with_writes turns it into the writes script (the general way)."""
    from trio_redis_finalize._core._writes import _with_writes

    t = _list_target(**sub)
    for d in (_element(), _element(2)):
        for writes in ([INCR], [INCR, ("SADD", "{o}seen", "x")]):
            base = plan(t, d, outcome)
            checked = check_writes(writes)
            expected = _with_writes(t, base.commands, encode_writes(checked), write_keys(checked))
            assert plan_writes(t, d, outcome.with_writes(*writes)) == dataclasses.replace(
                base, commands=expected)


LIST_CELLS = [
    ("ack", {}, ACK, 1, "remove", Effect.ACKED),
    ("drop", {}, DROP, 1, "remove", Effect.DROPPED),
    ("retry", {}, RETRY, 1, "copy", Effect.COPIED),
    ("dead", {"max_attempts": 2, "dead_letter": "{o}dead"}, RETRY, 2, "dead", Effect.DEAD_LETTERED),
    ("durable", {"delayed_retry": DelayedRetry.DURABLE_ZSET}, retry_after(3), 1, "zadd",
     Effect.DELAYED),
]


@pytest.mark.parametrize("name, sub, outcome, attempt, op, effect", LIST_CELLS,
                         ids=[c[0] for c in LIST_CELLS])
def test_list_plans_carry_the_writes_in_the_gated_removal(
    name: str, sub: dict[str, Any], outcome: Outcome, attempt: int, op: str, effect: Effect,
) -> None:
    t = _list_target(**sub)
    d = _element(attempt)
    p = plan_writes(t, d, outcome.with_writes(INCR))
    assert p.effect is effect
    (cmd,) = p.commands
    assert _script_op(cmd, LIST_WRITES) == op
    assert cmd[3] == t.processing and cmd[-1] == 1  # the counted gate's n, last


def test_list_runtime_retry_after_carries_the_writes_in_its_later_copy() -> None:
    t = _list_target()
    p = plan_writes(t, _element(), retry_after(2).with_writes(INCR))
    assert p.effect is Effect.HELD and p.commands == () and p.delay == 2
    (cmd,) = p.later
    assert _script_op(cmd, LIST_WRITES) == "copy"


def test_cross_slot_dead_letter_keeps_its_copy_first_and_gates_the_writes() -> None:
    t = StreamSubscription(S, G, max_attempts=1, dead_letter="elsewhere").target("c1", cluster=True)
    p = plan_writes(t, _entry(), RETRY.with_writes(INCR))
    assert p.gated is False and p.effect is Effect.DEAD_LETTERED
    copy, removal = p.commands
    assert copy[:2] == (b"EVALSHA", stream_scripts.STREAM_XADD.sha) and copy[3] == "elsewhere"
    assert _script_op(removal, STREAM_WRITES) == "ack"


def test_the_list_gates_count_identical_elements_in_the_writes_script() -> None:
    from trio_redis_finalize._core._plan import list_copies, list_counted, list_removal
    t = _list_target()
    d = _element()
    (cmd,) = plan_writes(t, d, ACK.with_writes(INCR)).commands
    assert list_removal(t, cmd) == d.raw and list_copies(cmd) == 1
    counted = list_counted(cmd, 3)
    assert list_copies(counted) == 3 and len(counted) == len(cmd) and counted[:-1] == cmd[:-1]


@pytest.mark.parametrize("target, outcome, words", [
    (ListSubscription("l").target("c1"), ACK, "nothing to finalize"),
    (StreamSubscription(S, G, mode=Mode.CLAIMING).target("c1"), RETRY, "claiming"),
    (StreamSubscription(S, G, mode=Mode.CLAIMING).target("c1"), retry_after(1), "claiming"),
    (StreamSubscription(S, G).target("c1", cluster=True), ACK, "another Redis Cluster hash slot"),
])
def test_writes_a_subscription_cannot_commit_are_a_value_error(
    target: Target, outcome: Outcome, words: str,
) -> None:
    o = outcome.with_writes(("INCR", "elsewhere"))
    d = _entry() if target.form is Form.STREAM else _element()
    with pytest.raises(ValueError, match=words):
        check_outcome(target, d, o)
    with pytest.raises(ValueError, match=words):
        plan_writes(target, d, o)


def test_a_claiming_retry_at_its_last_attempt_carries_writes_to_its_dead_letter() -> None:
    t = StreamSubscription(S, G, mode=Mode.CLAIMING, max_attempts=2, dead_letter="{o}dead").target("c1")
    check_outcome(t, _entry(2), RETRY.with_writes(INCR))
    assert plan_writes(t, _entry(2), RETRY.with_writes(INCR)).effect is Effect.DEAD_LETTERED


# -- the scripts on real servers ----------------------------------------------------------

@pytest.fixture(params=["default", "6.2"])
def server(request: pytest.FixtureRequest, redis_server: RedisServer) -> RedisServer:
    s: RedisServer = redis_server if request.param == "default" else request.getfixturevalue("redis62")
    sync_command(s, "FLUSHALL")
    return s


@pytest.fixture
async def client(server: RedisServer) -> AsyncIterator[Client]:
    async with open_client(server.url) as c:
        yield c


async def run(client: Client, cmd: Any) -> Any:
    """One command through the pipeline (which loads the library's scripts)."""
    (reply,) = await client.pipeline([cmd])
    return reply


async def _pending(client: Client) -> Delivery:
    try:
        await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    except rexc.ResponseError:
        pass
    await client.execute("XADD", S, "*", "f", "v")
    reply = await client.execute("XREADGROUP", "GROUP", G, "c1", "COUNT", 1, "STREAMS", S, ">")
    eid = reply[0][1][0][0].decode()
    return Delivery(source=S, id=eid, fields={b"f": b"v"}, data=None, attempt=1, origin_id=eid,
                    flat=(b"f", b"v"))


async def test_stream_script_writes_then_acks_once(client: Client) -> None:
    d = await _pending(client)
    t = _stream_target()
    (cmd,) = plan_writes(t, d, ACK.with_writes(INCR, ("SADD", "{o}seen", d.origin_id))).commands
    assert await run(client, cmd) == 1
    assert await client.execute("HGET", TOTALS, "n") == b"1"
    assert await client.execute("XPENDING", S, G) == [0, None, None, None]
    # sent again (a lost reply): the gate is closed, nothing applied twice
    assert await run(client, cmd) is None
    assert await client.execute("HGET", TOTALS, "n") == b"1"
    assert await client.execute("SMEMBERS", "{o}seen") == [d.origin_id.encode()]


async def test_stream_script_checks_key_types_before_writing(client: Client) -> None:
    d = await _pending(client)
    await client.execute("SET", "{o}str", "x")
    t = _stream_target()
    o = RETRY.with_writes(INCR, ("SADD", "{o}str", "m"))
    (cmd,) = plan_writes(t, d, o).commands
    with pytest.raises(rexc.ResponseError, match=r"^WRONGTYPE write 2 .*holds a string.*nothing written"):
        await run(client, cmd)
    assert await client.execute("HGET", TOTALS, "n") is None  # the first write did not run
    assert int((await client.execute("XPENDING", S, G))[0]) == 1  # still pending
    assert await client.execute("XLEN", S) == 1  # no copy


# one write of each command an outcome may carry, on the key "{o}k"
_EACH = {
    "SET": ("v",), "SETNX": ("v",), "APPEND": ("v",), "INCR": (), "INCRBY": (1,),
    "INCRBYFLOAT": (1.5,), "DECR": (), "DECRBY": (1,), "SETBIT": (1, 1), "PFADD": ("a",),
    "HSET": ("f", "v"), "HSETNX": ("f", "v"), "HINCRBY": ("f", 1), "HINCRBYFLOAT": ("f", 1.5),
    "HDEL": ("f",), "SADD": ("m",), "SREM": ("m",), "ZADD": (1, "m"), "ZINCRBY": (1, "m"),
    "ZREM": ("m",), "LPUSH": ("e",), "RPUSH": ("e",), "LTRIM": (0, 1), "XADD": ("*", "f", "v"),
    "DEL": (), "UNLINK": (), "EXPIRE": (60,), "PEXPIRE": (60_000,), "EXPIREAT": (4_000_000_000,),
    "PEXPIREAT": (4_000_000_000_000,), "PERSIST": (),
}


@pytest.mark.parametrize("how", ["single", "batched", "batched later"])
async def test_the_scripts_know_the_type_each_write_wants(client: Client, how: str) -> None:
    """The type a write's key must have is the scripts' own, made from
    WRITE_COMMANDS (the client sends none): every command on a key of another
    type is refused by name and the type it wants, or runs (any type) -- in a
    single script (comparisons of the name) and in a batched call (its
    lookups ``WKIND``, first writes, and ``WKINDN``, later writes: the
    command as an outcome's second write, after a ``PERSIST``)."""
    from trio_redis_finalize._core._batch import batch_replies, first_round

    assert set(_EACH) == set(WRITE_COMMANDS)
    t = _stream_target()
    refused = {}
    at = 2 if how == "batched later" else 1
    for name, args in _EACH.items():
        want = WRITE_COMMANDS[name][0]
        await client.execute("DEL", "{o}k")
        await client.execute(*(("HSET", "{o}k", "f", "v") if want == "string" else ("SET", "{o}k", "1")))
        d = await _pending(client)
        writes = [("PERSIST", "{o}other")] * (at - 1) + [(name, "{o}k", *args)]
        plans = [plan_writes(t, d, ACK.with_writes(*writes))]
        if how != "single":  # a second delivery: a batched call
            pad = await _pending(client)
            plans.append(plan_writes(t, pad, ACK.with_writes(("HINCRBY", "{o}pad", "n", 1))))
        if how == "single":
            (cmd,) = plans[0].commands
        else:
            (cmd,), _, _ = first_round((), plans)
            assert cmd[1] == stream_scripts.STREAM_WRITES_ACK_BATCH.sha
        try:
            reply = await run(client, cmd)
        except rexc.ResponseError as e:
            reply = e
        if how != "single":
            elements = batch_replies(reply, len(plans))
            assert elements is not None and elements[1] == 1, (name, reply)
            reply = elements[0]
        if isinstance(reply, rexc.ResponseError):
            refused[name] = str(reply)
        else:
            assert reply == 1, (name, reply)
    assert set(refused) == {n for n, spec in WRITE_COMMANDS.items() if spec[0]}
    for name, message in refused.items():
        other = "hash" if WRITE_COMMANDS[name][0] == "string" else "string"
        assert message.startswith(f"WRONGTYPE write {at} of the outcome ({name} {{o}}k): the key "
                                  f"holds a {other}, not a {WRITE_COMMANDS[name][0]}; nothing "
                                  "written"), message


async def _pending_entries(client: Client, n: int) -> list[Delivery]:
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    for _ in range(n):
        await client.execute("XADD", S, "*", "f", "v")
    reply = await client.execute("XREADGROUP", "GROUP", G, "c1", "COUNT", n, "STREAMS", S, ">")
    return [Delivery(source=S, id=e[0].decode(), fields={b"f": b"v"}, data=None, attempt=1,
                     origin_id=e[0].decode(), flat=(b"f", b"v")) for e in reply[0][1]]


@pytest.mark.parametrize("retention", [None, Retention.DELETE_ON_FINALIZE])
async def test_acks_with_writes_go_in_one_batched_call_each_as_its_single_script(
    client: Client, retention: Retention | None
) -> None:
    """One STREAM_WRITES_ACK_BATCH call for the ACKs and DROPs carrying writes
    of a batch: each delivery as its own script -- written and removed; its
    gate closed (nothing written); a key of another type (nothing of it
    written, still pending); a write refused at run time (the writes before
    it applied, as its script leaves them; still pending) -- and the call
    goes on past each; sent again, it applies nothing twice."""
    from trio_redis_finalize._core._batch import batch_replies, batch_singles, first_round

    a, b, c, d, e = await _pending_entries(client, 5)
    await client.execute("XACK", S, G, b.id)  # b: finalized already
    await client.execute("SET", "{o}str", "x")
    await client.execute("HSET", "{o}h", "text", "abc")
    t = _stream_target(retention=retention)
    outcomes = [
        ACK.with_writes(INCR, ("SADD", "{o}seen", "a")),
        ACK.with_writes(INCR),
        DROP.with_writes(INCR, ("SADD", "{o}str", "m")),  # WRONGTYPE: refused before writing
        # refused at run time (HINCRBY on text is refused before writing: a float
        # is not checked)
        ACK.with_writes(INCR, ("HINCRBYFLOAT", "{o}h", "text", 1)),
        ACK.with_writes(("SADD", "{o}seen", "e"), INCR),
    ]
    plans = [plan_writes(t, x, o) for x, o in zip((a, b, c, d, e), outcomes, strict=True)]
    commands, owners, _ = first_round((), plans)
    assert len(commands) == 1 and owners == [(0, 1, 2, 3, 4)]
    (call,) = commands
    assert call[1] == stream_scripts.STREAM_WRITES_ACK_BATCH.sha
    assert batch_singles(call) == [p.commands[0] for p in plans]
    assert set(call[4:call[2] + 3]) == {TOTALS, "{o}seen", "{o}str", "{o}h"}  # declared, once
    elements = batch_replies(await run(client, call), 5)
    assert elements is not None
    assert elements[0] == 1 and elements[1] is None and elements[4] == 1
    assert isinstance(elements[2], rexc.ResponseError) and "WRONGTYPE write 2" in str(elements[2])
    assert isinstance(elements[3], rexc.ResponseError) and "float" in str(elements[3])
    # a: 1, d: 1 (its first write ran), e: 1
    assert await client.execute("HGET", TOTALS, "n") == b"3"
    assert sorted(await client.execute("SMEMBERS", "{o}seen")) == [b"a", b"e"]
    assert await client.execute("HGET", "{o}h", "text") == b"abc"
    pending = await client.execute("XPENDING", S, G, "-", "+", 10)
    assert sorted(p[0].decode() for p in pending) == sorted([c.id, d.id])
    kept = 5 if retention is None else 3  # a and e deleted
    assert await client.execute("XLEN", S) == kept
    # sent again (a lost reply): a and e find their gates closed; c and d as before
    again = batch_replies(await run(client, call), 5)
    assert again is not None and again[0] is None and again[4] is None
    assert await client.execute("HGET", TOTALS, "n") == b"4"  # d's first write, once more
    assert sorted(await client.execute("SMEMBERS", "{o}seen")) == [b"a", b"e"]


@pytest.mark.parametrize("outcome", [RETRY, retry_after(5)], ids=["retry", "durable"])
async def test_stream_script_copies_after_the_writes(client: Client, outcome: Outcome) -> None:
    d = await _pending(client)
    t = _stream_target(delayed_retry=DelayedRetry.DURABLE_ZSET)
    (cmd,) = plan_writes(t, d, outcome.with_writes(INCR)).commands
    assert await run(client, cmd) not in (None, False)
    assert await client.execute("HGET", TOTALS, "n") == b"1"
    if outcome is RETRY:
        assert await client.execute("XLEN", S) == 2
    else:
        assert await client.execute("ZCARD", t.delay_key) == 1


async def test_list_script_removes_once_and_dead_letters_with_its_reason(client: Client) -> None:
    t = _list_target(max_attempts=1, dead_letter="{o}dead")
    d = _element()
    assert d.raw is not None
    await client.execute("LPUSH", t.processing, d.raw)
    (cmd,) = plan_writes(t, d, RETRY.with_writes(INCR)).commands
    assert await run(client, cmd) == 1
    assert await run(client, cmd) is None  # the gate is closed now
    assert await client.execute("HGET", TOTALS, "n") == b"1"
    assert await client.execute("LRANGE", "{o}dead", 0, -1) == [d.raw]
    assert await client.execute("LLEN", t.processing) == 0
    assert await client.execute("HLEN", "{o}dead:why") == 1


# -- consumers end to end -----------------------------------------------------------------

@pytest.fixture
def url(redis_server: RedisServer) -> str:
    """The session server's URL, flushed."""
    sync_command(redis_server, "FLUSHALL")
    return redis_server.url


async def test_every_stream_outcome_commits_its_writes_once(url: str) -> None:
    """RETRY (with writes) then ACK (with writes) per message, concurrent
    handlers: each message's two finalizations each add once."""
    n = 20
    async with open_client(url) as c:
        for i in range(n):
            await c.execute("XADD", S, "*", "i", i)

    async def handle(d: Delivery) -> Outcome:
        w = ("HINCRBY", TOTALS, d.origin_id, 1)
        return (RETRY if d.attempt == 1 else ACK).with_writes(w)

    async with open_consumer(url) as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05), handle, concurrency=4)
        async with open_client(url) as c:
            with trio.fail_after(20):
                while int(await c.execute("HLEN", TOTALS)) < n or any(
                        v != b"2" for v in (await c.execute("HGETALL", TOTALS))[1::2]):
                    await trio.sleep(0.05)
        stats = consumer.stats()[StreamSubscription(S, G).name]
    assert stats["effects"]["writes"] == 2 * n
    async with open_client(url) as c:
        totals = await c.execute("HGETALL", TOTALS)
        assert sorted(totals[1::2]) == [b"2"] * n
        assert int((await c.execute("XPENDING", S, G))[0]) == 0


async def test_delete_on_finalize_commits_the_writes_and_deletes_once(url: str) -> None:
    """DELETE_ON_FINALIZE (XACKDEL on Redis 8.2, XACK + XDEL elsewhere): each
    message's write applied once, every original deleted."""
    n = 10
    async with open_client(url) as c:
        for i in range(n):
            await c.execute("XADD", S, "*", "i", i)

    async def handle(d: Delivery) -> Outcome:
        return (RETRY if d.attempt == 1 else ACK).with_writes(("HINCRBY", TOTALS, d.origin_id, 1))

    sub = StreamSubscription(S, G, block=0.05, retention=Retention.DELETE_ON_FINALIZE)
    async with open_consumer(url) as consumer:
        await consumer.mount(sub, handle, concurrency=2)
        async with open_client(url) as c:
            with trio.fail_after(20):
                while (await c.execute("HGETALL", TOTALS))[1::2] != [b"2"] * n or await c.execute(
                        "XLEN", S):
                    await trio.sleep(0.05)
        assert consumer.stats()[sub.name]["effects"]["writes"] == 2 * n


async def test_a_racing_finalization_applies_the_writes_once(url: str) -> None:
    async with open_client(url) as c:
        await c.execute("XADD", S, "*", "f", "v")
    done = trio.Event()
    seen: list[Delivery] = []

    async def handle(d: Delivery) -> Outcome:
        seen.append(d)
        done.set()
        await trio.sleep_forever()
        raise AssertionError  # pragma: no cover

    async with open_consumer(url, shutdown_grace=0.2) as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05), handle)
        with trio.fail_after(10):
            await done.wait()
        o = ACK.with_writes(INCR)
        await consumer.finalize(seen[0], o)
        await consumer.finalize(seen[0], o)  # a second finalizer: the gate is closed
        stats = consumer.stats()[StreamSubscription(S, G).name]
        assert stats["effects"]["writes"] == 1 and stats["effects"]["gate_closed"] == 1
    async with open_client(url) as c:
        assert await c.execute("HGET", TOTALS, "n") == b"1"


async def test_a_reliable_list_commits_its_writes_once(url: str) -> None:
    n = 10
    async with open_client(url) as c:
        for i in range(n):
            await c.execute("LPUSH", Q, f"job{i}")

    async def handle(d: Delivery) -> Outcome:
        assert d.data is not None
        w = ("HINCRBY", TOTALS, d.data, 1)
        return (RETRY if d.attempt == 1 else ACK).with_writes(w)

    async with open_consumer(url) as consumer:
        await consumer.mount(ReliableListSubscription(Q, block=0.05), handle, concurrency=3)
        async with open_client(url) as c:
            with trio.fail_after(20):
                while await c.execute("HLEN", TOTALS) < n or any(
                        v != b"2" for v in (await c.execute("HGETALL", TOTALS))[1::2]):
                    await trio.sleep(0.05)
        stats = consumer.stats()[ReliableListSubscription(Q).name]
    assert stats["effects"]["writes"] == 2 * n


@pytest.mark.parametrize("batch", [False, True], ids=["per-message", "batch-handler"])
async def test_identical_elements_commit_their_writes_once_each_in_batched_calls(
    url: str, batch: bool
) -> None:
    """Identical elements (the same bytes, several copies in the processing
    list) each ACKed with a write: their removals go in batched calls, each
    element's counted gate numbered as alone; every copy's write applies once
    and the processing list ends empty."""
    copies = 30
    async with open_client(url) as c:
        await c.execute("LPUSH", Q, *[b"same"] * copies, *[b"other"] * 5)
        await c.execute("SCRIPT", "FLUSH")  # the batched script loaded by the finalizer

    async def handle(d: Delivery) -> Outcome:
        assert d.data is not None
        return ACK.with_writes(("HINCRBY", TOTALS, d.data, 1))

    async def handle_all(ds: list[Delivery]) -> list[Outcome]:
        return [await handle(d) for d in ds]

    sub = ReliableListSubscription(Q, block=0.05)
    async with open_consumer(url) as consumer:
        await consumer.mount(sub, handle_all if batch else handle, batch=batch)
        async with open_client(url) as c:
            with trio.fail_after(20):
                while (await c.execute("HGET", TOTALS, "other")) != b"5" or (
                        await c.execute("HGET", TOTALS, "same")) != str(copies).encode():
                    await trio.sleep(0.05)
            (mount,) = consumer.mounts
            assert await c.execute("LLEN", mount.target.processing) == 0
            await trio.sleep(0.2)  # nothing applied twice afterwards
            totals = await c.execute("HGETALL", TOTALS)
            assert dict(zip(totals[::2], totals[1::2], strict=True)) == {
                b"same": str(copies).encode(), b"other": b"5"}
            # the removals went in batched calls (the script was loaded to send them)
            assert await c.execute("SCRIPT", "EXISTS",
                                   list_scripts.LIST_WRITES_REMOVE_BATCH.sha) == [1]
        stats = consumer.stats()[sub.name]
    assert stats["effects"]["writes"] == copies + 5 and stats["effects"]["acked"] == copies + 5


async def test_writes_to_a_key_of_another_type_fail_the_finalization_whole(url: str) -> None:
    """WRONGTYPE is final: the outcome fails as a whole (nothing written, the
    entry stays pending), logged and counted ``failed``."""
    async with open_client(url) as c:
        await c.execute("SET", "{o}str", "x")
        await c.execute("XADD", S, "*", "f", "v")
    calls = 0

    async def handle(d: Delivery) -> Outcome:
        nonlocal calls
        calls += 1
        return ACK.with_writes(INCR, ("SADD", "{o}str", "m"))

    async with open_consumer(url, shutdown_grace=0.2) as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05), handle)
        with trio.fail_after(10):
            while not consumer.stats()[StreamSubscription(S, G).name]["effects"].get("failed"):
                await trio.sleep(0.02)
    async with open_client(url) as c:
        assert await c.execute("HGET", TOTALS, "n") is None
        assert int((await c.execute("XPENDING", S, G))[0]) == 1


async def test_writes_a_subscription_cannot_commit_are_a_handler_error(url: str) -> None:
    """On a claiming subscription a RETRY finalizes nothing: its writes are a
    ValueError in the handler's place, and ``on_error`` (DROP here) applies."""
    async with open_client(url) as c:
        await c.execute("XADD", S, "*", "f", "v")

    async with open_consumer(url) as consumer:
        sub = StreamSubscription(S, G, mode=Mode.CLAIMING, block=0.05, min_idle=0.5)
        await consumer.mount(sub, always(RETRY.with_writes(INCR)), on_error=DROP)
        with trio.fail_after(10):
            while not consumer.stats()[sub.name]["effects"].get("dropped"):
                await trio.sleep(0.02)
        assert consumer.stats()[sub.name]["handler_errors"] == 1
    async with open_client(url) as c:
        assert await c.execute("HGET", TOTALS, "n") is None


# -- racing consumers: a state machine against a real server -------------------------------

MACHINE_CONSUMERS = ("w1", "w2")
EFFECTS = "{o}effects"


class RacingWrites(RuleBasedStateMachine):
    """Two consumers read, claim each other's entries (a lapsed lease), and
    finalize what they hold with outcomes carrying a write (``HINCRBY`` of the
    delivery's entry id), some finalizations sent again (a lost reply) or
    raced by the other consumer.  The model: a finalization applies exactly
    when its entry is pending at that moment.  After every step each entry's
    counter equals the number of finalizations that applied to it -- 0 or 1
    -- and a message's counters (its original and its copies) never exceed
    the finalizations its line of copies made.

    hypothesis-trio does not work with current Hypothesis: each rule is one
    ``trio.run`` with a fresh connection, against a server started once."""

    url = ""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, list[Delivery]] = {c: [] for c in MACHINE_CONSUMERS}
        self.sent: list[Any] = []  # finalization commands sent (resent later)
        self.applied: dict[str, int] = {}  # entry id -> finalizations that applied
        self.sub = StreamSubscription(S, G)
        self.run(self._reset)

    def run(self, fn: Any, *args: Any) -> Any:
        async def go() -> Any:
            async with open_client(self.url) as c:
                return await fn(c, *args)

        return trio.run(go)

    @staticmethod
    async def _reset(c: Client) -> None:
        await c.execute("FLUSHALL")
        await c.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")

    @rule(n=st.integers(1, 3))
    def produce(self, n: int) -> None:
        async def go(c: Client) -> None:
            for i in range(n):
                await c.execute("XADD", S, "*", "n", i)

        self.run(go)

    def _take(self, consumer: str, reply: Any) -> None:
        for eid, flat in reply:
            if flat is None:
                continue
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            origin = fields.get(b"trf-origin", eid).decode()
            retries = int(fields.get(b"trf-retries", b"0"))
            self.held[consumer].append(Delivery(
                source=S, id=eid.decode(), fields={}, data=None, attempt=retries + 1,
                origin_id=origin, retries=retries, flat=tuple(flat)))

    @rule(c=st.sampled_from(MACHINE_CONSUMERS))
    def read(self, c: str) -> None:
        reply = self.run(lambda cl: cl.execute(
            "XREADGROUP", "GROUP", G, c, "COUNT", 2, "STREAMS", S, ">"))
        if reply:
            self._take(c, reply[0][1])

    @rule(c=st.sampled_from(MACHINE_CONSUMERS))
    def claim(self, c: str) -> None:
        """The other consumer's lease lapsed: c claims everything pending
        (both now hold those entries: their finalizations race)."""
        reply = self.run(lambda cl: cl.execute("XAUTOCLAIM", S, G, c, 0, "0", "COUNT", 10))
        self._take(c, [e for e in reply[1] if e[1] is not None])

    @rule(data=st.data(), c=st.sampled_from(MACHINE_CONSUMERS),
          kind=st.sampled_from(["ack", "drop", "retry"]), lose=st.booleans())
    def finalize(self, data: st.DataObject, c: str, kind: str, lose: bool) -> None:
        held = self.held[c]
        if not held:
            return
        d = held.pop(data.draw(st.integers(0, len(held) - 1)))
        outcome = {"ack": ACK, "drop": DROP, "retry": RETRY}[kind]
        p = plan_writes(self.sub.target(c), d, outcome.with_writes(("HINCRBY", EFFECTS, d.id, 1)))
        (cmd,) = p.commands
        if lose:  # sent later instead (as after a lost reply, or by a racing party)
            self.sent.append((d.id, cmd))
            return
        self._send(d.id, cmd)

    @rule(data=st.data())
    def resend(self, data: st.DataObject) -> None:
        if self.sent:
            eid, cmd = self.sent[data.draw(st.integers(0, len(self.sent) - 1))]
            self._send(eid, cmd)

    def _send(self, eid: Any, cmd: Any) -> None:
        async def go(c: Client) -> tuple[bool, Any]:
            pending = bool(await c.execute("XPENDING", S, G, eid, eid, 1))
            (reply,) = await c.pipeline([cmd])
            return pending, reply

        pending, reply = self.run(go)
        assert (reply is not None) == pending, (pending, reply)  # the gate is the PEL
        if pending:
            self.applied[eid] = self.applied.get(eid, 0) + 1

    @invariant()
    def writes_applied_once_per_finalization(self) -> None:
        got = self.run(lambda c: c.execute("HGETALL", EFFECTS))
        counts = {k.decode(): int(v) for k, v in zip(got[::2], got[1::2], strict=True)}
        assert counts == self.applied
        assert all(n == 1 for n in counts.values())


@pytest.mark.timeout(600)
def test_racing_consumers_apply_each_write_once(redis_server: RedisServer) -> None:
    RacingWrites.url = redis_server.url
    run_state_machine_as_test(RacingWrites, settings=settings(
        max_examples=25, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]))


# -- a batched writes call against its singles ---------------------------------------------

_BATCH_WRITES = st.sampled_from([
    ("HINCRBY", "{o}t", "n", 1),
    ("HSET", "{o}t", "last", "x"),
    ("SADD", "{o}s", "m"),
    ("HINCRBY", "{o}h", "text", 1),  # the field holds text: refused before anything is written
    ("HINCRBYFLOAT", "{o}h", "text", 1),  # refused at run time (floats are not checked first)
    ("SADD", "{o}str", "m"),  # the key holds a string: refused before anything is written
])


_BATCH_PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.timeout(300)
@_BATCH_PROPERTY
@given(
    picks=st.lists(st.tuples(st.integers(0, 5), st.booleans(),
                             st.lists(_BATCH_WRITES, min_size=1, max_size=3)),
                   min_size=2, max_size=8),
    closed=st.sets(st.integers(0, 5)),
    deletes=st.booleans(),
)
def test_a_batched_writes_call_does_what_its_singles_do_in_order(
    redis_server: RedisServer, picks: list[tuple[int, bool, list[tuple[Any, ...]]]],
    closed: set[int], deletes: bool,
) -> None:
    """ACKs and DROPs carrying writes -- entries pending or not (``closed``), one
    entry finalized twice in the batch, writes applied, refused before writing
    (WRONGTYPE) or at run time -- sent as the finalizer sends them (one
    ``STREAM_WRITES_ACK_BATCH`` call) leave Redis as their single scripts sent
    one after the other do, and answer each delivery as its single script does
    (the same element, or an error of the same class and message)."""
    t = _stream_target(retention=Retention.DELETE_ON_FINALIZE if deletes else None)
    plans = [plan_writes(t, _entry(eid=f"1-{k}"), (ACK if ack else DROP).with_writes(*ws))
             for k, ack, ws in picks]

    async def state(c: Client) -> list[Any]:
        return [await c.execute("HGETALL", "{o}t"), sorted(await c.execute("SMEMBERS", "{o}s")),
                await c.execute("HGETALL", "{o}h"),
                [p[0] for p in await c.execute("XPENDING", S, G, "-", "+", 10)],
                [e[0] for e in await c.execute("XRANGE", S, "-", "+")]]

    async def go(batched: bool) -> tuple[list[Any], list[Any]]:
        async with open_client(redis_server.url) as c:
            await pending_six(c, S, G, closed)
            await c.execute("SET", "{o}str", "x")
            await c.execute("HSET", "{o}h", "text", "abc")
            answers = await send(c, plans, batched)
            return answers, await state(c)

    assert_batch_is_its_singles(go)


@pytest.mark.timeout(300)
@_BATCH_PROPERTY
@given(
    picks=st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c"]), st.integers(1, 3),
                             st.booleans(), st.lists(_BATCH_WRITES, min_size=1, max_size=3)),
                   min_size=2, max_size=8),
    present=st.lists(st.sampled_from([b"a", b"b", b"c", b"x"]), max_size=6),
)
def test_a_batched_list_writes_call_does_what_its_singles_do_in_order(
    redis_server: RedisServer, picks: list[tuple[bytes, int, bool, list[tuple[Any, ...]]]],
    present: list[bytes],
) -> None:
    """A reliable list's ACKs and DROPs carrying writes -- identical elements,
    counted gates (``n``) open or closed, writes applied, refused before
    writing or at run time -- sent as one ``LIST_WRITES_REMOVE_BATCH`` call
    leave Redis as their single ``list_writes`` calls one after the other do,
    and answer each element as they do."""
    from trio_redis_finalize._core._batch import (
        batch_singles,
        counted_removals,
        first_round,
        with_counts,
    )
    from trio_redis_finalize._core._plan import list_counted

    t = _list_target()
    plans = []
    for raw, n, ack, ws in picks:
        d = Delivery(source=Q, id=None, fields={}, data=raw, attempt=1, origin_id="o", raw=raw)
        (single,) = plan_writes(t, d, (ACK if ack else DROP).with_writes(*ws)).commands
        plans.append(dataclasses.replace(plan_writes(t, d, ACK.with_writes(*ws)),
                                         commands=(list_counted(single, n),)))
    commands, owners, _ = first_round((), plans)
    assert len(commands) == 1 and owners == [tuple(range(len(plans)))]
    (call,) = commands
    assert call[1] == list_scripts.LIST_WRITES_REMOVE_BATCH.sha
    assert batch_singles(call) == [p.commands[0] for p in plans]
    assert with_counts(call, [(at, n) for at, _, n in counted_removals(call)]) == call

    async def go(batched: bool) -> tuple[list[Any], list[Any]]:
        async with open_client(redis_server.url) as c:
            await c.execute("FLUSHALL")
            if present:
                await c.execute("RPUSH", t.processing, *present)
            await c.execute("SET", "{o}str", "x")
            await c.execute("HSET", "{o}h", "text", "abc")
            answers = await send(c, plans, batched, [call])
            state = [await c.execute("HGETALL", "{o}t"), sorted(await c.execute("SMEMBERS", "{o}s")),
                     await c.execute("HGETALL", "{o}h"),
                     # (as a multiset: the batched call takes a copy counted 1 out first
                     # and puts it back at the tail when its writes are refused)
                     sorted(await c.execute("LRANGE", t.processing, 0, -1))]
            return answers, state

    assert_batch_is_its_singles(go)
