"""The mount's work queue: deliveries read and not yet taken by a handler task."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

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
    """

    __slots__ = ("_idle", "_room", "_waking", "closed", "items")

    def __init__(self) -> None:
        self.items: deque[Delivery] = deque()
        self._idle: deque[anyio.Event] = deque()  # handler tasks waiting for work
        self._waking = 0  # of those, woken and not yet running
        self._room: anyio.Event | None = None  # producers waiting for the queue to empty
        self.closed = False

    async def put(self, deliveries: Sequence[Delivery]) -> None:
        while self.items:
            room = self._room
            if room is None:
                room = self._room = anyio.Event()
            await room.wait()
        self.items.extend(deliveries)
        self._wake_one()

    def take(self) -> Delivery | None:
        """The next delivery, or None when there is none now."""
        items = self.items
        if not items:
            return None
        d = items.popleft()
        if items:
            if self._idle and not self._waking:  # _wake_one(), inline: once per delivery
                self._waking += 1
                self._idle.popleft().set()
        elif self._room is not None:
            self._room.set()
            self._room = None
        return d

    async def wait(self) -> bool:
        """Wait for work: True when there is some, False once closed and empty."""
        while not self.items:
            if self.closed:
                return False
            ev = anyio.Event()
            self._idle.append(ev)
            try:
                await ev.wait()
            except BaseException:
                if ev.is_set():
                    self._waking -= 1
                    self._wake_one()  # pass on the wake-up this task will not use
                else:
                    self._idle.remove(ev)
                raise
            self._waking -= 1
        return True

    def _wake_one(self) -> None:
        if self._idle and not self._waking:
            self._waking += 1
            self._idle.popleft().set()

    def close(self) -> None:
        """No more puts: wake every idle task (each ends once the queue is empty)."""
        self.closed = True
        while self._idle:
            self._waking += 1
            self._idle.popleft().set()

    def drain(self) -> list[Delivery]:
        """Take out every delivery no handler started."""
        items = list(self.items)
        self.items.clear()
        if self._room is not None:
            self._room.set()
            self._room = None
        return items
