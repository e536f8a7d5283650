"""The finalizer's hot path for ACKs and DROPs carrying writes, sans-IO.

An ACK (or DROP) carrying writes on a stream is planned, by
:func:`~._writes.plan_writes`, as one ``STREAM_WRITES`` call per delivery,
which the first round (:func:`~._batch.first_round`) takes apart again to put
the deliveries in ``STREAM_WRITES_ACK_BATCH`` calls, whose replies are then
read back per plan.  That is a plan, a command and its parsing, a batch
part and a settlement per delivery: three times what the write itself costs
a raw client.  Here the same batched calls are built directly from the
deliveries (the form's ``Cells.ack_writes_calls``; one encoding per outcome
object), and a call answered ``[k]`` -- every delivery written and removed,
the common reply -- settles all its deliveries at once.

Any other answer (a delivery listed: a closed gate, a refused write; an
error reply to the call; a reply that is no batched reply) *materializes*
the call: its deliveries get the plans the slow path would have given them
(``plan_writes``, the same commands), appended to the batch's plans, and the
reply is read as the slow path reads a batched call's
(:func:`~._settlement.batched_elements`): every later round, resend and
settlement is the slow path's, unchanged.  A round trip that failed sends
the same round again, these calls included, and their reply is read the
same way then (the batch is *unsure*: a closed gate of a materialized
delivery counts as done by the earlier send, ``_types.settle``).

So the hot path decides nothing the slow path does not: it is the slow
path's first round and its all-clear reply, computed without a plan per
delivery (``tests/core/test_hot_writes.py`` holds the two together).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter
from typing import Any

from redis import exceptions as rexc

from .._delivery import Delivery
from .._outcome import OutcomeKind, WithWrites
from ._batch import batch_replies, fast_owner
from ._commands import Arg, Command
from ._replies import FINAL, classify, describe_error
from ._settlement import Record, batched_elements, log_extra
from ._types import REMOVED, Cells, Plan, Target
from ._writes import WRITES, plan_writes

__all__ = ["HotWrites", "effect_of", "encode"]

_DEBUG = 10
_ERROR = 40
_CALL = itemgetter(0)
_OUTCOME = itemgetter(1)
_KIND = attrgetter("kind")
_WRITES_OF = attrgetter("writes")
_WITH_WRITES = {WithWrites}
_EFFECTS = tuple((k, k._value_, e._value_) for k, e in REMOVED.items())
_EFFECT_OF = {k._value_: e._value_ for k, e in REMOVED.items()}


encode: Callable[[WithWrites], tuple[Sequence[Arg], Sequence[str | bytes]]] = attrgetter(
    "write_parts", "write_keys")
"""An outcome's writes as a script reads them (their count first), and the
keys they name: made with the outcome (``_writes.checked_writes``; in C)."""


class HotWrites:
    """One batch's ACKs and DROPs carrying writes on the hot path.

    ``calls``: the batched calls to send in the first round (after the
    plain removals), each with how many of ``items`` it carries, in order:
    ``(call, n)`` pairs.
    """

    __slots__ = ("calls", "done", "items")

    def __init__(self, t: Target, cells: Cells, items: list[tuple[Delivery, WithWrites]],
                 outcomes: dict[str, int]) -> None:
        self.items = items
        kinds = [*map(_KIND, map(_OUTCOME, items))]
        for k, key, _ in _EFFECTS:  # counted (no set of kinds: an Enum's hash is Python code)
            if n := kinds.count(k):
                outcomes[key] = outcomes.get(key, 0) + n
        built = cells.ack_writes_calls(t, items, encode)
        if built is None:
            raise ValueError(f"{t.name}: this form has no hot path for writes")
        self.calls = built
        self.done: list[tuple[Delivery, WithWrites]] = []
        """The deliveries whose call answered every one written and removed."""

    @staticmethod
    def applies(cells: Cells, t: Target) -> bool:
        """Whether a subscription's ACKs and DROPs carrying writes take the
        hot path: where its form builds their batched calls, not in Redis
        Cluster (``plan_writes`` checks each write's hash slot there).  A
        reliable list's counted gates number its calls as the slow path's
        (``ListGates.prepare``, ``resend``) and learn what they answered."""
        return cells.writes_calls and not t.cluster

    @staticmethod
    def every(items: Sequence[tuple[Delivery, object]], removable: tuple[OutcomeKind, ...]) -> bool:
        """Whether every outcome of ``items`` is an ACK or DROP (of
        ``removable``) carrying writes: told in C, no loop in Python."""
        outs = [*map(_OUTCOME, items)]
        return (set(map(type, outs)) == _WITH_WRITES and all(map(_WRITES_OF, outs))
                and sum(map([*map(_KIND, outs)].count, removable)) == len(outs))

    def place(self, commands: list[Command], owners: list[tuple[int, ...]] | None, k: int
              ) -> tuple[list[Command], list[tuple[int, ...]]]:
        """The first round with :attr:`calls` after its ``k`` plain removals
        (whose replies come first), their owners ``()``: no plan's."""
        if owners is None:  # plain removals only: each its own (``_batch.fast_owner``)
            owners = [(fast_owner(i),) for i in range(k)]
        calls = self.calls
        return ([*commands[:k], *map(_CALL, calls), *commands[k:]],
                [*owners[:k], *[()] * len(calls), *owners[k:]])

    def receive(self, t: Target, calls: Sequence[Command], replies: Sequence[Any],
                plans: list[tuple[Delivery, Plan]], returned: list[Any], got: list[list[Any]],
                rest: list[list[Command]], again: list[Command],
                again_owners: list[tuple[int, ...]], records: list[Record],
                answered: tuple[list[Command], list[Any]] | None) -> tuple[int, str]:
        """The replies to :attr:`calls` as sent (``calls``: a reliable list's
        counted gates may have numbered them): those of one delivery each
        settled now, the others' deliveries materialized into ``plans`` (with
        ``returned``, ``got`` and ``rest``) and read as the slow path reads a
        batched call; ``(errors, deferred)`` as ``batched_elements``.
        ``answered``: where the calls answered go, and their replies, as the
        slow path records them for the counted gates (None: no gates)."""
        name = t.name
        items = self.items
        errors = 0
        deferred = ""
        at = 0
        for cmd, r, (_, n) in zip(calls, replies, self.calls, strict=True):
            mine = items[at:at + n]
            at += n
            if r.__class__ is list and len(r) == 1 and r[0] == n:
                self.done += mine  # every one written and removed
                if answered is not None:
                    answered[0].append(cmd)
                    answered[1].append(r)
                continue
            js = tuple(range(len(plans), len(plans) + n))
            for d, o in mine:
                plans.append((d, plan_writes(t, d, o)))
                returned.append(o)
                got.append([])
                rest.append([])
            elements = batch_replies(r, n)
            if elements is not None:
                if answered is not None:
                    answered[0].append(cmd)
                    answered[1].append(r)
                e, first = batched_elements(name, elements, js, plans, got, again, again_owners,
                                            records)
                errors += e
                deferred = deferred or first
                continue
            if not isinstance(r, Exception):
                r = rexc.ResponseError(f"a batched script answered {r!r:.200} to {n} deliveries")
            if classify(r) is not FINAL:  # did not run: the call again (one: its own script)
                if not again:
                    deferred = describe_error(r, cmd)
                if n == 1:
                    again.append(plans[js[0]][1].commands[0])
                else:
                    again.append(cmd)
                again_owners.append(js)
                continue
            errors += 1
            records.append((_ERROR, "%s: finalization command failed: %s",
                            (name, describe_error(r, cmd)), {"subscription": name}))
            if answered is not None:  # (a call that did not run is not answered)
                answered[0].append(cmd)
                answered[1].append(r)
            for j in js:
                got[j].append(r)
        return errors, deferred

    def settle(self, name: str, debug: bool, effects: dict[str, int],
               records: list[Record]) -> list[tuple[Delivery, WithWrites]]:
        """The effects of :attr:`done` counted into ``effects`` (their
        writes too), with a debug record each when ``debug``; :attr:`done`
        (each delivery's effect: :func:`effect_of`)."""
        done = self.done
        if not done:
            return done
        outs = [*map(_OUTCOME, done)]
        kinds = [*map(_KIND, outs)]
        for k, _, e in _EFFECTS:
            if n := kinds.count(k):
                effects[e] = effects.get(e, 0) + n
        effects[WRITES] = effects.get(WRITES, 0) + sum(map(len, map(_WRITES_OF, outs)))
        if debug:
            for d, o in done:
                e = effect_of(o)
                records.append((_DEBUG, "%s: %s (attempt %d) finalized: %s",
                                (name, d.id or d.origin_id, d.attempt, e), log_extra(name, d, o, e)))
        return done


def effect_of(outcome: WithWrites) -> str:
    """The effect of a hot-path delivery written and removed (``acked``, ``dropped``)."""
    return _EFFECT_OF[outcome.kind._value_]
