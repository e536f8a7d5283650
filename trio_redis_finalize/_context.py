"""What a reader is given and what it gives: the narrow interface between a
form's reader and the runtime that mounts it.

A reader (one module per form: ``_stream``, ``_reliable_list``, ``_list``,
``_channel``) sees a mounted subscription only through :class:`Context`;
:class:`~._mount.Mount` implements it, and the state-machine tests implement
it with a recording stub.  Readers import this module, never the mount or
the consumer, so the runtime has no import cycle.

The deadlines every part shares are here too, each defined once.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from ._core._finalize import log_extra
from ._core._replies import describe_error
from ._delivery import Delivery
from ._outcome import Backoff, Outcome

if TYPE_CHECKING:

    from ._core._plan import Plan, Target
    from ._stats import MountStats
    from ._transport import Client

__all__ = [
    "FINALIZE_TIMEOUT",
    "READ_MARGIN",
    "SETUP_PATIENCE",
    "BatchHandler",
    "ConsumerInfo",
    "Context",
    "Handler",
    "Item",
    "backoff",
    "describe_error",
    "log",
    "log_extra",
    "sole",
]

log = logging.getLogger("trio_redis_finalize")

Handler = Callable[[Delivery], Awaitable[Outcome]]
BatchHandler = Callable[[list[Delivery]], Awaitable["Outcome | Sequence[Outcome]"]]
"""A handler mounted with ``batch=True``: the deliveries of one read at once."""
Item = tuple[Delivery, "Outcome | Plan | Backoff"]
"""A delivery and what finalizes it: the handler's outcome, a precomputed
plan (dead letter, lost entry, give-back) or a :class:`Backoff`."""

FINALIZE_TIMEOUT = 5.0
"""Seconds one finalization round trip (or any other non-blocking command of
the runtime) may take before it counts as failed."""
SETUP_PATIENCE = 15.0
"""Seconds ``mount()`` keeps trying a set-up the server refused for now (OOM, BUSY, LOADING ...)."""
READ_MARGIN = 1.0
"""Seconds a blocking read may exceed its ``block`` before it counts as lost."""


def backoff(attempt: int, *, base: float = 0.05, cap: float = 2.0) -> float:
    """Capped exponential backoff with full jitter."""
    return float(random.uniform(0, min(cap, base * 2 ** min(attempt, 16))))


def sole(exc: BaseException) -> BaseException:
    """The one exception inside nested one-member groups, else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class ConsumerInfo(Protocol):
    """What a reader knows of the consumer it runs in."""

    @property
    def name(self) -> str: ...

    @property
    def shutdown_grace(self) -> float: ...

    @property
    def token(self) -> str:
        """This process's token in the heartbeats it holds (``_core._identity``)."""
        ...


class Context(Protocol):
    """What a reader needs of the mounted subscription it reads for.

    ``name`` (for logs), ``target`` (the plan table's view of the
    subscription), ``client`` (the pool: set-up and side commands; the
    reader's blocking reads go on a connection of its own), ``consumer``
    (its name and ``shutdown_grace``), ``in_hand`` (stream ids read and not
    finalized yet), ``stats``, ``takeover`` (take the consumer name over
    from another live process, ``_core._identity``); and the hand-over calls.
    """

    name: str
    target: Target
    client: Client
    consumer: ConsumerInfo
    in_hand: set[str]
    stats: MountStats
    takeover: bool

    async def deliver(self, ready: Sequence[Delivery], direct: Sequence[Item] = (), *,
                      give_back: bool = False) -> None:
        """The one hand-over: ``direct`` (deliveries with a precomputed plan:
        dead letter, lost or foreign entry) to the finalizer first, then
        ``ready`` to the handlers (waits while they are busy; all or nothing).
        ``give_back``: cut midway (shutdown), what was not handed over goes to
        the finalizer, shielded: ``direct`` if not sent yet, ``ready`` with the
        reader's ``abandon`` plan (see ``Mount.deliver``); then it raises."""
        ...

    async def send_plans(self, items: list[Item]) -> None:
        """Send precomputed plans (dead letter, lost entry) to the finalizer."""
        ...

    def disown(self, others: dict[str, str]) -> list[Delivery]:
        """Stream entries now pending for another consumer (id -> its name): the
        unstarted ones taken out of the work queue (returned), all out of ``in_hand``."""
        ...

    def defer(self, d: Delivery, delay: float) -> bool:
        """A recovered delivery whose Backoff is due ``delay`` seconds from now:
        held, and delivered again as its next attempt then (the reader's
        ``redeliver``); False when it cannot wait (deliver it now)."""
        ...

    def handling(self) -> bool:
        """Whether a delivery read is in hand (neither finalized nor waiting for a backoff)."""
        ...

    def backing_off(self) -> list[Delivery]:
        """The deliveries waiting for their Backoff now (their schedule is in
        Redis: a stop leaves them pending, not handed back)."""
        ...

