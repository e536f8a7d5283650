"""Exactly-once effects, sans-IO: an outcome's writes in its finalization script.

A handler may return Redis writes with its outcome
(``ACK.with_writes(("HINCRBY", "totals", "eur", 5))``, see ``_writes``).
:func:`plan_outcome` plans such an outcome as :func:`~._plan.plan` plans the
outcome alone, then turns the plan's gated step -- the one that removes the
original -- into one of the two scripts below, which

1. check the gate (the entry still pending in the group's PEL; the element
   still in the processing list, ``n`` copies of it for identical elements),
2. check the type of every key a write names (before anything is written:
   a write to a key of another type fails the whole finalization, nothing
   written),
3. run the writes, in order,
4. then the cell's own steps in the contract's order (copy, then remove).

One script is one atomic step on the server, so

* a crash before it: nothing applied, the delivery comes back and its next
  attempt's writes apply once;
* it ran and its reply was lost: the finalizer sends it again, the gate is
  closed, nothing is applied twice (counted once, as any resend);
* racing finalizers (a reclaimed entry, a claiming subscription): only the
  first passes the gate.

A script error after a write ran (a value the command refuses: an
overflow, ``HINCRBYFLOAT`` on text) leaves the writes before it applied:
Redis scripts do not roll back.  The checks before writing cover what can be
known there: every key's type, and the values Redis would certainly refuse
(``INCR`` family and ``HINCRBY`` on a value or by an increment that is no
integer, ``PFADD`` on a string that is no HyperLogLog; see
``_lua.WRITES_LUA``); the user guide (docs/guide.rst) says the rest.

A runtime ``retry_after`` on a stream carries its writes in the removal that
leaves its receipt (``stream.scripts.STREAM_REMOVE_RECEIPT``): a resend after an
unknown outcome applies and counts them only when its own first send did.

Where a plan is two ungated commands (a dead letter in another Redis Cluster
slot: the copy, then the removal), the writes go with the removal, which
stays gated: the copy may be duplicated (as without writes), the writes are
not.  In Redis Cluster every key a write names must share the source's hash
slot (:func:`check_outcome`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .._delivery import Delivery
from .._errors import AckUnsupported
from .._keys import same_slot
from .._outcome import ACK, DROP, RETRY, Outcome, WithWrites
from .._writes import Write, write_keys
from ._commands import Arg, Command
from ._plan import CELLS_OF, cells_of, plan
from ._types import REMOVED, Plan, Target

__all__ = ["WRITES", "check_outcome", "encode_writes", "plan_outcome", "plan_writes"]

WRITES = "writes"
"""The effect counted per write committed with its finalization (in ``stats()``)."""


def encode_writes(writes: tuple[Write, ...]) -> list[Arg]:
    """The writes as the scripts read them: ``nw``, then per write its count of
    values and the command (the type its key must have the script looks up
    by the command's name, see ``_lua_writes``)."""
    out: list[Arg] = [len(writes)]
    for w in writes:
        out.append(len(w))
        out += w
    return out


def check_outcome(t: Target, d: Delivery, outcome: Outcome) -> None:
    """Whether ``t`` can commit ``outcome``'s writes with the finalization of ``d``.

    Raises:
        ValueError: a form without a gate to commit them with (simple lists,
            Pub/Sub), a retry that leaves the entry pending on a claiming
            subscription (RETRY, ``retry_after`` through the PEL: nothing is
            finalized) before its last attempt, or, in Redis Cluster, a key in
            another hash slot than the source (named).
    """
    if not outcome.writes:
        return
    cells = cells_of(t)
    if not cells.gated:
        raise ValueError(f"{t.name}: {outcome!r}: a {cells.noun} has nothing to finalize, so "
                         "it cannot commit writes (streams and reliable lists can)")
    if cells.leaves_pending(t, d, outcome):
        raise ValueError(f"{t.name}: {outcome!r}: on a claiming subscription a retry leaves the "
                         "entry pending, nothing is finalized to commit the writes with; return "
                         "them with the outcome that finalizes it")
    if t.cluster:
        _check_slots(t, outcome, cells.gate_key(t))


def _check_slots(t: Target, outcome: Outcome, source: str) -> None:
    """In Redis Cluster, every key ``outcome``'s writes name in ``source``'s hash slot."""
    for key in write_keys(outcome.writes):
        if not same_slot(source, key):
            raise ValueError(
                f"{t.name}: {outcome!r}: key {key!r} is in another Redis Cluster hash slot "
                f"than {source!r}; the writes run in one script with the finalization, so "
                f"their keys must share its slot (a hash tag: '{{{t.source}}}...')")


def plan_outcome(t: Target, d: Delivery, outcome: Outcome) -> Plan:
    """:func:`~._plan.plan`, and for an outcome with writes :func:`plan_writes`."""
    if outcome.__class__ is WithWrites and outcome.writes:
        return plan_writes(t, d, outcome)
    return plan(t, d, outcome)


def plan_writes(t: Target, d: Delivery, outcome: Outcome) -> Plan:
    """The plan of ``outcome`` with its writes in its gated removal step.

    Raises:
        ValueError: see :func:`check_outcome`.
        AckUnsupported: as :func:`~._plan.plan`.
    """
    removed = _REMOVED_BY_VALUE.get(outcome.kind._value_)  # (by value: an Enum's hash is Python code)
    if removed is not None:
        # an ACK or DROP, inline: the removal as the writes script's own (an
        # ACK or DROP leaves nothing pending: check_outcome's checks but the form's)
        cells = CELLS_OF[t.form._value_]
        if cells.gated:
            if t.cluster:
                _check_slots(t, outcome, cells.gate_key(t))
            p = cells.removal_with_writes(
                t, d, removed, encode_writes(outcome.writes), write_keys(outcome.writes))
            if p is not None:
                return p
    check_outcome(t, d, outcome)
    kind = outcome.kind
    encoded = encode_writes(outcome.writes)
    keys = write_keys(outcome.writes)
    base = plan(t, d, _PLAIN[kind] if kind in _PLAIN else Outcome(kind, outcome.delay, outcome.reason))
    if base.commands:
        commands = _with_writes(t, base.commands, encoded, keys)
        return Plan(base.effect, commands, base.delay, base.later, base.gated, base.warning)
    # a reliable list's runtime retry_after: the gated copy-then-remove comes later
    later = _with_writes(t, base.later, encoded, keys)
    return Plan(base.effect, base.commands, base.delay, later, base.gated, base.warning)


_PLAIN = {o.kind: o for o in (ACK, DROP, RETRY)}
_REMOVED_BY_VALUE = {k._value_: e for k, e in REMOVED.items()}


def _with_writes(t: Target, commands: Sequence[Command], writes: list[Arg],
                 keys: list[str | bytes]) -> tuple[Command, ...]:
    """``commands`` with the step that removes the original replaced by the
    writes script doing the same after the writes (the form's cells know its
    gated steps: ``Cells.with_writes``)."""
    out = cells_of(t).with_writes(t, commands, writes, keys)
    if out is None:
        raise AckUnsupported(f"{t.name}: no step of this finalization can carry writes: {commands!r}")
    return out
