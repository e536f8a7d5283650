"""The counted-gates port: what the finalizer core asks of a reader's gates.

A reliable list may hold several copies of one element, so its removals are
gated on a count the reader keeps (``_core/reliable_list/gates.py``'s
``ListGates`` implements this port; the reader hands it to the mount, the
mount to :class:`~._finalize.FinalizerCore`).  The core calls it at three
points of a batch's life (``_finalize``): before the first send, before each
resend, and once the batch is done.  Other forms have no gates (None).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .._delivery import Delivery
from .._outcome import Backoff, Outcome
from ._commands import Command
from ._types import Plan

__all__ = ["Gates", "Item"]

Item = tuple[Delivery, "Outcome | Plan | Backoff"]
"""A delivery and what finalizes it: the handler's outcome, a precomputed
plan (dead letter, lost entry, give-back) or a :class:`Backoff`."""


class Gates(Protocol):
    """Counted gates for removals of identical elements (the reliable list reader).

    A reliable list may hold several copies of one element; a removal of
    element ``e`` is gated on the number of copies the consumer holds (see
    ``_plan.list_counted``).  The core calls, for every batch:
    """

    def prepare(self, commands: list[Command], fast: int = 0) -> list[Command]:
        """Once, before the first send, with every command of the batch (the
        first round's, then the later steps'): the same commands, removals
        numbered.  ``fast``: the first ``fast`` commands are the hot path's
        plain ``LREM`` s (``removal_commands``)."""
        ...

    def resend(self, commands: Sequence[Command], answered: Sequence[Command],
               answers: Sequence[object]) -> list[Command]:
        """Before ``commands`` are sent again (not run, or outcome unknown):
        removals renumbered on what is held now; ``answered``/``answers``:
        the batch's commands answered so far and their replies."""
        ...

    def settle(self, items: Sequence[Item], commands: Sequence[Command],
               replies: Sequence[object], hot: bool = False) -> None:
        """Once the batch is done: every command answered, and its reply.
        ``hot``: the batch was the hot path's removals only (no plan, nothing
        refused), each answered once: ``commands`` are those removals, as
        prepared (or renumbered for a resend)."""
        ...
