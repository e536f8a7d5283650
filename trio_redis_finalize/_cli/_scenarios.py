"""The demo's scenarios (``trio-redis-finalize demo``): one subscription of
every form, the outcome each message's handler returns (ACK; RETRY once,
then ACK; DROP; ``retry_after`` once, then ACK; RETRY until dead-lettered),
what the handlers saw, the table the demo expects, and the producer of the
messages.  ``Form`` here is a row of the demo (a label and its subscription),
not the library's form."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._consumer import Consumer
from .._delivery import Delivery
from .._errors import AckUnsupported
from .._forms.pubsub import ChannelSubscription, PatternSubscription
from .._forms.reliable_list import ReliableListSubscription
from .._forms.simple_list import ListSubscription
from .._forms.stream import StreamSubscription
from .._outcome import ACK, DROP, RETRY, Outcome, OutcomeKind, retry_after
from .._subscription import DelayedRetry, Mode, Subscription
from .._transport import Client

BLOCK = 0.1
MIN_IDLE = 0.25
DELAY = 0.2
MAX_ATTEMPTS = 2
MSG = b"msg"

COLUMNS = [
    ("ack", "ACK"),
    ("retry", "RETRY (then ACK)"),
    ("drop", "DROP"),
    ("retry_after", f"retry_after({DELAY}) (then ACK)"),
    ("dead", f"RETRY at max_attempts={MAX_ATTEMPTS}"),
]
SCENARIOS = ("ack", "retry", "drop", "later", "poison")

PEL = "none: same id re-read from the PEL"
EXPECTED: dict[str, dict[str, str]] = {
    "stream": {"ack": "XACK", "retry": "EVALSHA(XADD, XACK)", "drop": "XACK",
               "retry_after": "EVALSHA(XACK) then EVALSHA(XADD)", "dead": "EVALSHA(XADD, XACK)"},
    "claiming stream": {"ack": "XACK", "retry": PEL, "drop": "XACK", "retry_after": PEL,
                        "dead": "EVALSHA(XADD, XACK)"},
    "stream (durable delay)": {"ack": "XACK", "retry": "EVALSHA(XADD, XACK)", "drop": "XACK",
                              "retry_after": "EVALSHA(ZADD, XACK) then EVALSHA(XADD)",
                              "dead": "EVALSHA(XADD, XACK)"},
    "reliable list": {"ack": "LREM", "retry": "EVALSHA(LPUSH, LREM)", "drop": "LREM",
                      "retry_after": "EVALSHA(LPUSH, LREM)", "dead": "EVALSHA(LPUSH, LREM)"},
    "simple list": {"ack": "refused", "retry": "refused", "drop": "refused",
                    "retry_after": "LPUSH", "dead": "-"},
    "channel": {"ack": "refused", "retry": "refused", "drop": "refused",
                "retry_after": "PUBLISH", "dead": "-"},
    "pattern": {"ack": "refused", "retry": "refused", "drop": "refused",
                "retry_after": "PUBLISH", "dead": "-"},
}


@dataclasses.dataclass
class Form:
    label: str
    sub: Subscription
    durable: bool  # stream or reliable list: must lose nothing
    source: str  # where the producer writes
    dead_letter: str | None = None
    max_attempts: int | None = None
    produced: int = 0


def _forms(run: str) -> list[Form]:
    def stream(name: str, **kw: Any) -> StreamSubscription:
        return StreamSubscription(f"{run}:{name}", "demo", block=BLOCK, max_attempts=MAX_ATTEMPTS,
                                  dead_letter=f"{run}:{name}:dead", **kw)

    s1 = stream("stream")
    s2 = stream("claiming", mode=Mode.CLAIMING, min_idle=MIN_IDLE)
    s3 = stream("durable", delayed_retry=DelayedRetry.DURABLE_ZSET)
    rl = ReliableListSubscription(f"{run}:rlist", block=BLOCK, max_attempts=MAX_ATTEMPTS,
                                  dead_letter=f"{run}:rlist:dead")
    return [
        Form("stream", s1, True, s1.stream, s1.dead_letter, MAX_ATTEMPTS),
        Form("claiming stream", s2, True, s2.stream, s2.dead_letter, MAX_ATTEMPTS),
        Form("stream (durable delay)", s3, True, s3.stream, s3.dead_letter, MAX_ATTEMPTS),
        Form("reliable list", rl, True, rl.queue, rl.dead_letter, MAX_ATTEMPTS),
        Form("simple list", ListSubscription(f"{run}:list", block=BLOCK), False, f"{run}:list"),
        Form("channel", ChannelSubscription(f"{run}:channel"), False, f"{run}:channel"),
        Form("pattern", PatternSubscription(f"{run}:pattern:*", retry_channel=f"{run}:pattern:retry"),
             False, f"{run}:pattern:events"),
    ]


def _decide(scenario: str, attempt: int) -> Outcome:
    if scenario == "ack":
        return ACK
    if scenario == "drop":
        return DROP
    if scenario == "retry":
        return RETRY if attempt == 1 else ACK
    if scenario == "later":
        return retry_after(DELAY) if attempt == 1 else ACK
    return RETRY  # poison: until max_attempts sends it to the dead letter


@dataclasses.dataclass
class Observed:
    """What the handlers saw (filled while the demo runs)."""

    outcomes: dict[tuple[str, int], tuple[int, str]] = dataclasses.field(default_factory=dict)
    ids: dict[tuple[bytes, bytes], tuple[str, int]] = dataclasses.field(default_factory=dict)
    same_id: set[tuple[int, str]] = dataclasses.field(default_factory=set)
    refused: dict[tuple[int, str], str] = dataclasses.field(default_factory=dict)
    done: set[str] = dataclasses.field(default_factory=set)
    handled: int = 0


def _column(form: Form, outcome: Outcome, attempt: int) -> str:
    kind = outcome.kind
    if kind is OutcomeKind.ACK:
        return "ack"
    if kind is OutcomeKind.DROP:
        return "drop"
    if form.max_attempts is not None and attempt >= form.max_attempts:
        return "dead"
    return "retry" if kind is OutcomeKind.RETRY else "retry_after"


def _handler(consumer: Consumer, index: int, form: Form, seen: Observed) -> Any:
    async def handle(d: Delivery) -> Outcome:
        token = (d.fields.get(MSG, b"") if d.id is not None else d.data or b"").decode()
        scenario = token.split("/")[2] if token.count("/") == 3 else "ack"
        outcome = _decide(scenario, d.attempt)
        col = _column(form, outcome, d.attempt)
        seen.handled += 1
        seen.outcomes[(token, d.attempt)] = (index, col)
        if d.id is not None:
            key = (d.source.encode(), d.id.encode())
            previous = seen.ids.get(key)
            if previous is not None and previous in seen.outcomes:
                seen.same_id.add(seen.outcomes[previous])  # re-read from the PEL
            seen.ids[key] = (token, d.attempt)
        if not form.durable and outcome.kind is not OutcomeKind.RETRY_AFTER:
            try:
                await consumer.finalize(d, outcome)  # what a no-ack form says to it
            except AckUnsupported as e:
                seen.refused[(index, col)] = str(e)
        if outcome.kind in (OutcomeKind.ACK, OutcomeKind.DROP) or (
            outcome.kind is OutcomeKind.RETRY and (not form.durable or col == "dead")
        ):
            seen.done.add(token)
        return outcome

    return handle


async def _produce(client: Client, forms: list[Form], run: str, per_cell: int) -> int:
    total = 0
    for index, form in enumerate(forms):
        commands: list[tuple[Any, ...]] = []
        for scenario in SCENARIOS:
            if scenario == "poison" and not form.durable:
                continue
            for n in range(per_cell):
                token = f"{run}/{index}/{scenario}/{n}".encode()
                if isinstance(form.sub, StreamSubscription):
                    commands.append(("XADD", form.source, "*", MSG, token))
                elif isinstance(form.sub, ReliableListSubscription | ListSubscription):
                    commands.append(("LPUSH", form.source, token))
                else:
                    commands.append(("PUBLISH", form.source, token))
        await client.pipeline(commands)
        form.produced = len(commands)
        total += len(commands)
    return total

