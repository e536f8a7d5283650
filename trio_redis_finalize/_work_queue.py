"""The mount's work queue: deliveries read and not yet taken by a handler task."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import anyio

from ._delivery import Delivery

__all__ = ["WorkQueue"]


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

    __slots__ = ("closed", "idle", "items", "room", "waking")

    def __init__(self) -> None:
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
