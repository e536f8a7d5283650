"""The sans-IO core: (form, mode, outcome, attempt policy, delivery) -> Plan.

Nothing here does I/O.  :func:`plan` turns a delivery and its handler's
outcome into a :class:`~._types.Plan`: the Redis commands to send, in order,
on a pool connection, the effect to count, and for a runtime ``retry_after``
the commands to send once the delay is over.  The shell only executes plans.

The table it implements (the README's forms and outcomes, with its gated
two-step cells) is :data:`CELLS`, one row per form -- the core's half of the
form table (``_forms.FORMS`` is the runtime's):

=================  ==========  =====================  ==========  ====================
form               ACK         RETRY                  DROP        retry_after(d)
=================  ==========  =====================  ==========  ====================
stream             XACK        XADD copy, XACK        XACK        runtime / zset
claiming stream    XACK        stays in PEL           XACK        PEL (or zset)
reliable list      LREM        LPUSH copy, LREM       LREM        runtime / zset
simple list        refused     refused                refused     runtime LPUSH copy
channel / pattern  refused     refused                refused     runtime PUBLISH copy
=================  ==========  =====================  ==========  ====================

The stream's row is ``stream/cells.py``, the reliable list's
``reliable_list/cells.py``; the forms with nothing to acknowledge (simple
lists, Pub/Sub) have theirs below.  Every row answers the same questions
(``_types.Cells``): the plan of an outcome, the dead letter, the hot path's
removals, how a gated step carries an outcome's writes, and the facts the
rest of the core asks (``gated``, ``by_id``, ``counted``).

REJECT (``reject(reason)``) is the dead letter now, at any attempt
(:func:`plan_reject`): a stream's or reliable list's gated copy-then-remove to
``dead_letter`` (claiming streams too); refused where there is no dead letter
(simple lists, Pub/Sub, ``dead_letter=None``).  A RETRY or ``retry_after`` at
the last allowed attempt (``_types.exhausted``) goes to the dead letter (or
is dropped with a warning).  On a stream the finalizer sends the gated
scripts of one batch that share their keys as one batched call
(``_batch.first_round``), settled per delivery as these plans' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from .._delivery import Delivery
from .._errors import AckUnsupported
from .._outcome import Outcome, OutcomeKind
from .._subscription import Form
from ._commands import Command
from ._types import (
    Cells,
    Effect,
    Plan,
    Target,
    entry_fields,
    exhausted,
    list_copy,
)
from .reliable_list.cells import (
    RELIABLE_LIST,
    WHY_SUFFIX,
    counted_removals,
    dead_record,
    list_copies,
    list_counted,
    list_removal,
    why_key,
    with_counts,
)
from .stream.batches import gate_range
from .stream.cells import (
    RECEIPT_SUFFIX,
    STREAM,
    copy_how,
    plan_foreign,
    plan_lost,
    receipt_key,
    stream_copy_fields,
    stream_removals,
)

__all__ = [
    "BATCHED",
    "BATCHERS",
    "CELLS",
    "CELLS_OF",
    "RECEIPT_SUFFIX",
    "WHY_SUFFIX",
    "cells_of",
    "copy_how",
    "counted_removals",
    "dead_record",
    "entry_fields",
    "gate_range",
    "list_copies",
    "list_copy",
    "list_counted",
    "list_removal",
    "plain_removals",
    "plan",
    "plan_dead",
    "plan_foreign",
    "plan_lost",
    "plan_reject",
    "receipt_key",
    "removal_commands",
    "stream_copy_fields",
    "stream_removals",
    "why_key",
    "with_counts",
]


_entry_fields = entry_fields  # (its name before the split, which tests/core/test_decode.py reads)


# -- the forms with nothing to acknowledge: only retry_after, as a runtime copy ---------------------

_RETRY, _REJECT, _RETRY_AFTER = OutcomeKind.RETRY, OutcomeKind.REJECT, OutcomeKind.RETRY_AFTER


class _NoAck(Cells):
    """Simple lists and Pub/Sub: ACK, RETRY and DROP are refused (an ACK or a
    DROP is counted as done by the finalizer, which never sends them here);
    ``retry_after`` is a runtime copy (:meth:`later`), sent once the delay is
    over, not gated; no dead letter (REJECT refused, exhaustion drops)."""

    __slots__ = ()

    def later(self, t: Target, d: Delivery, copy: bytes) -> Command:
        """The command that writes ``d``'s runtime ``retry_after`` ``copy``."""
        raise NotImplementedError

    def plan(self, t: Target, d: Delivery, outcome: Outcome) -> Plan:
        kind = outcome.kind
        if kind is _REJECT:
            return self.reject(t, d, outcome)
        if kind is not _RETRY_AFTER:
            raise AckUnsupported(
                f"{t.name}: a {self.noun} has nothing to acknowledge, so {outcome!r} is refused; "
                + (
                    "use retry_after(delay) or a ReliableListSubscription to retry"
                    if kind is _RETRY
                    else "ACK and DROP are no-ops there"
                )
            )
        self.check(t)
        if exhausted(t, d.attempt):
            return self.dead(t, d, f"max_attempts={t.max_attempts} reached at attempt {d.attempt}")
        return Plan(Effect.HELD, (), delay=outcome.delay, later=(self.later(t, d, list_copy(d)),),
                    gated=False)

    def check(self, t: Target) -> None:
        """Refuse a ``retry_after`` the configuration cannot carry out, whatever the attempt."""


class _SimpleList(_NoAck):
    __slots__ = ()
    noun: ClassVar[str] = "list"

    def later(self, t: Target, d: Delivery, copy: bytes) -> Command:
        return ("LPUSH", t.source, copy)


class _Channel(_NoAck):
    __slots__ = ()
    noun: ClassVar[str] = "channel"

    def later(self, t: Target, d: Delivery, copy: bytes) -> Command:
        return ("PUBLISH", d.source, copy)


class _Pattern(_NoAck):
    __slots__ = ()
    noun: ClassVar[str] = "pattern"

    def check(self, t: Target) -> None:
        if t.retry_channel is None:
            raise AckUnsupported(
                f"{t.name}: a pattern subscription needs retry_channel= to publish "
                "retry_after copies (the pattern names no single channel)"
            )

    def later(self, t: Target, d: Delivery, copy: bytes) -> Command:
        assert t.retry_channel is not None
        return ("PUBLISH", t.retry_channel, copy)


# -- the table ------------------------------------------------------------------------------------

CELLS: dict[Form, Cells] = {
    Form.STREAM: STREAM,
    Form.RELIABLE_LIST: RELIABLE_LIST,
    Form.LIST: _SimpleList(),
    Form.CHANNEL: _Channel(),
    Form.PATTERN: _Pattern(),
}
"""Every form's row of the outcome table (the core's half of the form table)."""

CELLS_OF = {form._value_: cells for form, cells in CELLS.items()}
""":data:`CELLS` by the form's value: ``CELLS_OF[t.form._value_]`` is
:func:`cells_of` inline (by value: an Enum's hash is Python code)."""


BATCHERS = {sha: b for cells in CELLS.values() for sha, b in cells.batchers.items()}
"""Every form's gated scripts whose calls are batched, by sha (``_batch.first_round``)."""
BATCHED = {sha: b for cells in CELLS.values() for sha, b in cells.batched.items()}
"""Every form's batched scripts, by sha (``_batch.batch_singles``, ``batch_replies``)."""


def cells_of(t: Target) -> Cells:
    """``t``'s row of :data:`CELLS`."""
    return CELLS_OF[t.form._value_]


def plan(t: Target, d: Delivery, outcome: Outcome) -> Plan:
    """The plan that finalizes ``d`` with ``outcome`` on subscription ``t``.

    Raises:
        AckUnsupported: the form cannot carry out ``outcome`` (ACK, RETRY and
            DROP on simple lists and Pub/Sub; ``retry_after`` on a pattern
            subscription without ``retry_channel``).
    """
    return CELLS_OF[t.form._value_].plan(t, d, outcome)


def plan_dead(t: Target, d: Delivery, reason: str) -> Plan:
    """Send ``d`` to the dead letter (copy, then remove the original), or drop it.

    Used when ``max_attempts`` is exhausted, for a delivery that arrives past
    the limit, and for a corrupt envelope.
    """
    return CELLS_OF[t.form._value_].dead(t, d, reason)


def plan_reject(t: Target, d: Delivery, outcome: Outcome) -> Plan:
    """REJECT / ``reject(reason)``: the dead letter now, whatever the attempt
    (copy, then remove: :func:`plan_dead`'s gated step).

    Raises:
        AckUnsupported: no dead letter to send it to (simple lists, Pub/Sub,
            a stream or reliable list with ``dead_letter=None``).
    """
    return CELLS_OF[t.form._value_].reject(t, d, outcome)


def plain_removals(t: Target) -> dict[OutcomeKind, Effect]:
    """The outcome kinds a handler returns whose finalization is the plain
    removal of the original.

    For each kind ``k`` returned with effect ``e``, and every delivery ``d``
    of ``t``, finalizing ``d`` with ``Outcome(k)`` is ``Plan(e,
    removal_commands(t, [d]))``: on a stream ``plan(t, d, Outcome(k))`` is
    one ``XACK`` of the entry, on a reliable list one ``LREM`` of the element
    from the processing list; on the forms with nothing to remove (simple
    lists, Pub/Sub) ``plan()`` refuses an ACK, which the finalizer counts as
    done (:attr:`Effect.NOTHING`, no command).  The finalizer uses it to
    remove such deliveries with :func:`removal_commands`, many at once,
    without building a plan (or, on the forms with nothing to remove,
    raising and catching a refusal) for each: the hot path.
    """
    return dict(cells_of(t).removals)


def removal_commands(t: Target, deliveries: Sequence[Delivery]) -> list[Command]:
    """The commands that remove ``deliveries`` of ``t`` (see :func:`plain_removals`).

    A stream's entries go in one ``XACK`` of all their ids
    (``stream.cells.stream_removals``); a reliable list's elements need one
    ``LREM`` each; simple lists and Pub/Sub have nothing to remove (no command).
    """
    if not deliveries:
        return []
    return CELLS_OF[t.form._value_].removal_commands(t, deliveries)
