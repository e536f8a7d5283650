"""The port between a form's reader and the runtime that mounts it: what a
reader is given and what it gives.

A reader (one per form: ``_forms/stream``, ``_forms/reliable_list``,
``_forms/simple_list.py``, ``_forms/pubsub.py``) sees a mounted subscription
only through :class:`Context`; :class:`~.._mount.Mount` implements it, and the
state-machine tests implement it with a recording stub.  The reader gives
the runtime its read steps (:class:`Steps`, run by ``_read_loop.drive``), the
hooks of a form that leaves deliveries pending (:class:`Pending`), and the
rest of :class:`Reader`.  A handler is a :data:`Handler` (or, mounted with
``batch=True``, a :data:`BatchHandler`).

Readers import this module, never the mount, the consumer or the table
``FORMS`` (``_forms/__init__.py``), so the runtime has no import cycle.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .._core._finalize import Item
from .._delivery import Delivery
from .._outcome import Outcome

if TYPE_CHECKING:
    from .._core._finalize import Gates
    from .._core._types import Plan, Target
    from .._hand_over import Lease
    from .._stats import MountStats
    from .._transport import Client

__all__ = [
    "BatchHandler",
    "C",
    "ConsumerInfo",
    "Context",
    "Handler",
    "Item",
    "Pending",
    "Reader",
    "Steps",
]

C = TypeVar("C")
"""The connection a reader's steps read on (a ``Connection``, a ``PubSub``)."""

Handler = Callable[[Delivery], Awaitable[Outcome]]
BatchHandler = Callable[[list[Delivery]], Awaitable["Outcome | Sequence[Outcome]"]]
"""A handler mounted with ``batch=True``: the deliveries of one read at once."""


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
        reader's ``abandon`` plan (see ``HandOver.deliver``, ``_hand_over``); then it raises."""
        ...

    async def send_plans(self, items: list[Item]) -> None:
        """Send precomputed plans (dead letter, lost entry) to the finalizer."""
        ...

    def disown(self, others: dict[str, str]) -> list[Delivery]:
        """Stream entries now pending for another consumer (id -> its name): the
        unstarted ones taken out of the work queue (returned), all out of ``in_hand``."""
        ...

    def drop_unstarted(self, drop: Callable[[Delivery], bool]) -> list[Delivery]:
        """Deliveries no handler started for which ``drop`` is true (a reliable
        list's elements another consumer moved back while this one stalled):
        taken out of the work queue, never started (returned)."""
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

    def leased(self) -> list[str]:
        """The stream ids whose lease is kept now: ``in_hand``; once the
        shutdown began, not those no handler started (none will start here:
        a claiming peer may take them; the rest are given back)."""
        ...


class Steps(Protocol[C]):
    """What a form's reader supplies to :func:`drive` (see the module docstring)."""

    async def setup(self, ctx: Context) -> None: ...

    def background(self, ctx: Context) -> Sequence[Callable[[], Coroutine[Any, Any, None]]]: ...

    def connection(self, ctx: Context) -> AbstractAsyncContextManager[C]: ...

    async def connected(self, ctx: Context, conn: C) -> None: ...

    async def catch_up(self, ctx: Context, conn: C) -> None: ...

    async def turn(self, ctx: Context, conn: C) -> None: ...

    def failed(self, ctx: Context, err: Exception) -> float | None:
        """An error ended a step (after ``started``): the reader's say on it.

        Return how long to wait before going on (having logged it), or None
        for the default (a warning, and a backoff).
        """
        ...

    async def closing(self, ctx: Context) -> None: ...


class Pending(Protocol):
    """What a form that leaves failed deliveries pending (streams, reliable
    lists) offers the mount for its ``Backoff`` (see ``_mount``)."""

    async def redeliver(self, ctx: Context, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Take due ``Backoff`` deliveries again as their next attempt and deliver
        them; returns those to try again a moment later; raises having delivered
        none, when it could not."""
        ...

    def leave_pending(self, ctx: Context, deliveries: Sequence[Delivery]) -> None:
        """Forget ``deliveries``: they stay pending for the ordinary recovery."""
        ...

    def hold_again(self, ctx: Context, d: Delivery) -> None:
        """Hold ``d`` again, whose finalization Redis refused for good (it is
        still pending): it waits, then ``redeliver`` takes it as if it had
        failed under a Backoff."""
        ...


class Reader(Steps[Any], Protocol):
    """What a subscription form provides: its read loop's steps, give-backs,
    its handlers' lease, and the hooks of its form (None where the form has none)."""

    @property
    def lease(self) -> Lease:
        """Until when the handlers may start what this reader read
        (``_hand_over.Lease``): the mount hands it to its work queue, whose
        handler tasks check it once per run of calls.  A reliable list's is
        its heartbeat's (past it, a handler task drops what no handler
        started); every other form's never lapses (``Lease()``: ``until`` is
        ``math.inf``)."""
        ...

    @property
    def pending(self) -> Pending | None:
        """The reader's :class:`Pending` hooks (streams, reliable lists), or None
        (simple lists, Pub/Sub: nothing stays pending)."""
        ...

    @property
    def gates(self) -> Gates | None:
        """Counted removals of identical elements (reliable lists,
        ``_core._finalize.Gates``), or None."""
        ...

    def abandon(self, deliveries: Sequence[Delivery]) -> Plan | None:
        """Commands that give back deliveries read but never started (or None)."""
        ...

    def holding(self, ctx: Context) -> Callable[[], Coroutine[Any, Any, None]] | None:
        """A task that keeps what this mount's handlers hold from other
        consumers (a stream's lease), run by the mount from its start until
        its finalizer ends (phase 4 of the shutdown): unlike ``background``,
        it outlives the reading, so a handler still running in the
        shutdown's grace keeps its entry.  None: the form needs none."""
        ...

    async def closed(self, ctx: Context) -> None:
        """After a shutdown (phase 6, ``_shutdown``): what the reader registered
        in Redis about this consumer (a stream's or reliable list's heartbeat
        and registration) removed, when nothing is left pending for it."""
        ...
