"""The hand-over: what a reader read, handed to the mount's handler tasks.

:class:`HandOver` is the one way in (the reader's ``Context.deliver``):
precomputed plans to the finalizer first, then the deliveries into the
:class:`WorkQueue`, all or nothing; cut by the shutdown, what it did not hand
over is given back (:meth:`HandOver.give_back`, also the handler pool's
give-back of what no handler started).  The handler tasks take from the
queue (``_handlers``), as long as the reader's :class:`Lease` holds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio

from ._deadlines import log
from ._delivery import Delivery
from ._shutdown import FINALIZE_GRACE, cleanup

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream as Send

    from ._core._finalize import Item
    from ._core._types import Plan
    from ._stats import MountStats

__all__ = ["HandOver", "Lease", "WorkQueue"]


def _nothing() -> None:
    return None


class Lease:
    """Until when the deliveries a reader read are still its own to start
    (every reader has one, ``Reader.lease``; the mount hands it to its
    :class:`WorkQueue`).

    ``until``: on the ``time.monotonic`` clock; a handler task starts no
    delivery at or past it (``HandlerPool._handler_loop`` compares it with
    the time it reads anyway, once per run of calls).  ``lapsed``: called by
    a handler task that found it past, must take every delivery no handler
    started out of the work queue (a reliable list's drop,
    ``ReliableListReader._stalled``).  A reliable list's is its heartbeat's
    (``ListLiveness``: the last heartbeat that went through, sent at ``t``,
    keeps the key at least until ``t + heartbeat``; past that a live
    consumer's reaper may have moved the processing list back onto the queue
    and be handling it).  Other forms: ``Lease()`` as made, which never
    lapses (``until`` is ``math.inf``; their lease is another: a stream's
    entries stay this consumer's until a peer claims them)."""

    __slots__ = ("lapsed", "until")

    def __init__(self) -> None:
        self.until = math.inf
        self.lapsed: Callable[[], object] = _nothing


class WorkQueue:
    """Deliveries read and not yet taken by a handler task (work sharing).

    :meth:`put` waits until the queue is empty, then adds a whole batch at once,
    so a cancelled ``put`` hands over nothing (producers -- the reader, the
    redeliverer -- share one wake-up, each waits its turn).  Handler tasks :meth:`take`
    one delivery at a time.  A task that takes one while more wait wakes one
    idle task, unless one is already woken and has not run yet: slow
    deliveries spread over the tasks one by one (none idles behind another's
    slow delivery), and a handler that never blocks drains a whole batch in
    one task, with a single other task woken in vain.

    ``HandlerPool._handler_loop`` (``_handlers``) takes deliveries with
    :meth:`take` inlined (a call per delivery less): ``items.popleft()``, then, while more wait,
    :meth:`wake_one` when ``idle`` and no task is ``waking``, or, once the
    queue is empty, :meth:`emptied` when a producer waits for ``room``.
    """

    __slots__ = ("closed", "idle", "items", "lease", "room", "waking")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease  # the reader's (``Reader.lease``): handlers start nothing past it
        self.items: deque[Delivery] = deque()
        self.idle: deque[anyio.Event] = deque()  # handler tasks waiting for work
        self.waking = 0  # of those, woken and not yet running
        self.room: anyio.Event | None = None  # producers waiting for the queue to empty
        self.closed = False

    async def put(self, deliveries: Sequence[Delivery]) -> None:
        while self.items:
            room = self.room
            if room is None:
                room = self.room = anyio.Event()
            await room.wait()
        self.items.extend(deliveries)
        self.wake_one()

    def take(self) -> Delivery | None:
        """The next delivery, or None when there is none now."""
        items = self.items
        if not items:
            return None
        d = items.popleft()
        if items:
            if self.idle and not self.waking:
                self.wake_one()
        elif self.room is not None:
            self.emptied()
        return d

    async def wait(self) -> bool:
        """Wait for work: True when there is some, False once closed and empty."""
        while not self.items:
            if self.closed:
                return False
            ev = anyio.Event()
            self.idle.append(ev)
            try:
                await ev.wait()
            except BaseException:
                if ev.is_set():
                    self.waking -= 1
                    self.wake_one()  # pass on the wake-up this task will not use
                else:
                    self.idle.remove(ev)
                raise
            self.waking -= 1
        return True

    def wake_one(self) -> None:
        """Wake an idle task, unless one is woken already (and has not run yet)."""
        if self.idle and not self.waking:
            self.waking += 1
            self.idle.popleft().set()

    def emptied(self) -> None:
        """The queue is empty: the producers waiting for room go on."""
        if self.room is not None:
            self.room.set()
            self.room = None

    def close(self) -> None:
        """No more puts: wake every idle task (each ends once the queue is empty)."""
        self.closed = True
        while self.idle:
            self.waking += 1
            self.idle.popleft().set()

    def remove(self, ids: set[str]) -> list[Delivery]:
        """Take out the deliveries no handler started whose stream id is in ``ids``."""
        return self.remove_where(lambda d: d.id in ids)

    def remove_where(self, drop: Callable[[Delivery], bool]) -> list[Delivery]:
        """Take out the deliveries no handler started for which ``drop`` is true
        (called once per delivery, in order)."""
        items = self.items
        out: list[Delivery] = []
        keep: list[Delivery] = []
        for d in items:
            (out if drop(d) else keep).append(d)
        if out:
            items.clear()
            items.extend(keep)
            if not items:
                self.emptied()
        return out

    def drain(self) -> list[Delivery]:
        """Take out every delivery no handler started."""
        items = list(self.items)
        self.items.clear()
        self.emptied()
        return items


class HandOver:
    """The one hand-over of what a reader read (see the module): the reader's
    ``Context.deliver`` and ``send_plans``, and the give-back of deliveries
    read and never started.

    ``queue``: where the deliveries go; ``in_hand``: the stream ids read and
    not yet finalized (``by_id``: the form's deliveries carry one); ``send``:
    the reader's outcome sender, set when the mount runs; ``abandon``: the
    reader's plan for deliveries given back."""

    __slots__ = ("_abandon", "_by_id", "in_hand", "name", "queue", "send", "stats")

    send: Send[list[Item]]

    def __init__(self, name: str, queue: WorkQueue, in_hand: set[str], stats: MountStats, *,
                 by_id: bool, abandon: Callable[[Sequence[Delivery]], Plan | None]) -> None:
        self.name = name
        self.queue = queue
        self.in_hand = in_hand
        self.stats = stats
        self._by_id = by_id
        self._abandon = abandon

    async def deliver(self, ready: Sequence[Delivery], direct: Sequence[Item] = (), *,
                      give_back: bool = False) -> None:
        """``direct`` (deliveries finalized without a handler, each with its
        precomputed plan: dead letter, lost or foreign entry) to the finalizer
        first, then ``ready`` to the handlers, all or nothing (waits while they
        are busy; cancelled meanwhile, none of ``ready`` reached a handler).

        ``give_back``: should the hand-over end early (the shutdown cancels
        the reader), what it did not hand over goes to the finalizer at once,
        shielded (:meth:`give_back`): ``direct``'s plans if not sent yet, and
        ``ready`` with the reader's ``abandon`` plan -- the shutdown's own
        give-back (phase 3, ``_shutdown``): so its NOT_RUN retries, a reliable
        list's counted gates and its error logs apply.  The exception goes on.
        """
        sent = not direct
        self.stats.received += len(ready)  # read: counted before any wait (a drop un-counts)
        try:
            if direct:
                await self.send.send(list(direct))
                sent = True
            if ready:
                if self._by_id:  # stream entries (other forms have no id: nothing held by id)
                    self.in_hand.update([d.id for d in ready])  # type: ignore[misc]  # it has its id
                # all or nothing: cancelled while waiting, nothing was handed over
                await self.queue.put(ready)
        except BaseException:
            if give_back:
                await self.give_back(self.send, ready, () if sent else direct)
            raise

    async def send_plans(self, items: list[Item]) -> None:
        """Send precomputed plans (dead letter, lost entry) to the finalizer."""
        if items:
            await self.send.send(items)

    async def give_back(self, send: Send[list[Item]], unstarted: Sequence[Delivery],
                        direct: Sequence[Item] = ()) -> None:
        """Give back deliveries read and never started (the reader's ``abandon``
        plan: stream, delivery counts set back; reliable list, back to the
        queue; simple list, ``RPUSH`` back; Pub/Sub, logged and gone), with
        ``direct``'s plans not sent yet: handed to the finalizer on ``send``,
        shielded, within ``FINALIZE_GRACE``; should that fail (the finalizer
        gone) they stay where they are (pending; a simple list's are lost),
        logged.  Streams and reliable lists finish it at their readers'
        ``closed`` step (the stop, after the finalizer ended: a stream's counts
        set back there, a reliable list's hand-back does not count them), also
        when the finalizer took the give-back but never sent it."""
        items = list(direct)
        plan = self._abandon(unstarted) if unstarted else None
        if plan is not None:
            items.append((unstarted[0], plan))
        if not items:
            return
        with cleanup(FINALIZE_GRACE) as scope:
            try:
                await send.send(items)
                return
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        log.error("%s: could not give back %d deliveries read and not handled%s", self.name,
                  len(unstarted) + len(direct),
                  f" within {FINALIZE_GRACE:g} s" if scope.cancelled_caught else "",
                  extra={"subscription": self.name})
