"""A reliable list's counted gates, sans-IO: which removal of an element is
gated on how many copies, and what is held until its removal is answered.

A reliable list may hold several copies of one element (identical bytes),
told apart by count only.  :class:`ListGates` is a consumer's multiset
bookkeeping of what it read and has not finalized yet, and the
:class:`~._finalize.Gates` the finalizer's core calls for every batch: a
removal of an element of which several copies are held carries ``n``
(``cells.list_counted``), so that a resend after an unknown outcome never
removes a copy another handler still holds (:meth:`ListGates.prepare`,
:meth:`ListGates.resend`); answered removals are counted down, and one
whose gate was closed or that failed leaves a copy for the next rescan to
look for (:meth:`ListGates.settle`).  The reader
(``_reliable_list.ReliableListReader``) adds what it reads
(:meth:`ListGates.hold`, or ``unsent`` / ``in_hand`` updated at once) and
asks what to rescan for (``leftover``, ``rescan_wanted``).

A runtime ``retry_after`` original stays in the processing list, held, until
the scheduler sends its delayed copy: :meth:`ListGates.send_later` numbers
that script then (its ``n`` taken from what is held at that moment, as any
removal's) and gives it a receipt token (``_reliable.DELAYED_COPY``), so that
a resend after a lost reply learns whether its own first send committed;
:meth:`ListGates.later_answered` settles it from the reply, with the effect
and the writes to count.  Its due time is written beside the processing list
too (:meth:`ListGates.due_of` says where; the scheduler writes it), in the
``Backoff`` schedule, so that the original's recovery after a crash (the
rescan of a restart under the same name, another consumer's reaper) lets it
wait out the rest of its delay.
"""

from __future__ import annotations

import itertools
import operator
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import cast

from redis import exceptions as rexc

from .._batch import batch_replies, is_batched
from .._commands import Command
from .._decode import list_delivery
from .._finalize import Item
from .._recovery import schedule_key, schedule_member
from .._replies import FINAL, classify
from .._types import FAILED, GATE_CLOSED, Target
from .cells import (
    counted_removals,
    delayed_of,
    delayed_token,
    give_back_counted,
    given_back,
    list_copies,
    list_counted,
    list_removal,
    runtime_copy,
    with_counts,
)
from .liveness import dec, delayed_copy, renumbered

__all__ = ["FORGET_AT_ONCE", "ListGates"]

FORGET_AT_ONCE = 100
"""At most this many receipts of answered delayed copies are deleted by the next one."""
_ELEMENT = operator.itemgetter(3)  # the element of a plain removal: ("LREM", processing, -1, e)
_repeat = itertools.repeat


def _batch_removals(cmd: Command, r: object) -> list[tuple[bytes, int, object]]:
    """``(element, n, reply)`` of each element of a batched call of removals
    with writes answered ``r`` (``_batch.batch_replies``; a reply to the whole
    call, an error: each element's)."""
    removals = counted_removals(cmd)
    elements = batch_replies(r, len(removals))
    if elements is None:
        elements = [r] * len(removals)
    return [(x, int(n), er) for (_, x, n), er in zip(removals, elements, strict=True)]


class ListGates:
    """One consumer's counted gates on its processing list (see the module docstring).

    Attributes:
        unsent: the elements delivered whose removal was not sent yet (a multiset).
        in_hand: the elements delivered whose removal was not answered yet.
        leftover: handled elements whose removal may have left a copy.
        delayed: runtime ``retry_after`` originals whose delayed copy was
            sent and not answered yet (a multiset).
        forget: receipt tokens of delayed copies answered since the last
            one was sent (that one deletes them).
        rescan_wanted: a removal's gate was closed: the processing list is
            to be looked at.
        target: the subscription resolved (None until the reader's setup:
            the commands are then left as they are).
    """

    def __init__(self) -> None:
        # Counter: a batch read is counted in by one ``update``, in C
        self.unsent: Counter[bytes] = Counter()
        self.in_hand: Counter[bytes] = Counter()
        self.leftover: dict[bytes, int] = {}
        self.delayed: dict[bytes, int] = {}
        self.forget: list[bytes] = []
        self.rescan_wanted = False
        self.target: Target | None = None
        # elements given back unstarted (the reader's abandon) whose give-back
        # was not answered yet: still held, but no handler ran on them
        self.giving: Counter[bytes] = Counter()

    def hold(self, raw: bytes) -> None:
        """One more copy of ``raw`` delivered."""
        self.unsent[raw] = self.unsent.get(raw, 0) + 1
        self.in_hand[raw] = self.in_hand.get(raw, 0) + 1

    def take(self, e: bytes) -> int:
        """``n`` for the removal of one copy of ``e`` sent now (see ``cells.list_counted``)."""
        return max(1, dec(self.unsent, e))

    def leave(self, raw: bytes) -> None:
        """Forget one held copy of ``raw`` without its removal (left in the
        processing list for the next rescan, which delivers it again)."""
        if dec(self.in_hand, raw):
            dec(self.unsent, raw)
            self.leftover[raw] = self.leftover.get(raw, 0) + 1

    def prepare(self, commands: list[Command], fast: int = 0) -> list[Command]:
        """The finalizer calls this once per batch before it is first sent (a
        resend sends the same commands): each removal of an element of which
        this consumer holds several copies gets its ``n`` (unique elements: the
        commands as they are).

        ``fast``: the first ``fast`` commands are plain ``LREM`` s of the
        processing list (the hot path's): their elements are taken out of
        ``_unsent`` at once, in C; should one of them be held more than once
        (or twice in the batch: its first take finds ``n >= 2``), they are put
        back and numbered one by one as any other removal.
        """
        t = self.target
        if t is None:
            return commands
        unsent = self.unsent
        take = cast(Callable[[object, int], int], unsent.pop)  # 0: not held (not bytes: not a key)
        start = 0
        if fast:
            xs = list(map(_ELEMENT, commands[:fast] if fast < len(commands) else commands))
            ks = list(map(take, xs, _repeat(0)))
            if ks.count(1) != len(ks):  # identical elements (or not held): put back, numbered below
                for x, k in zip(xs, ks, strict=True):
                    if k:
                        unsent[x] = k
            elif fast == len(commands):
                return commands
            else:
                start = fast
        out: list[Command] | None = None
        for i in range(start, len(commands)):
            cmd = commands[i]
            if is_batched(cmd):  # removals with writes: each element numbered as alone
                counts = [(at, n) for at, x, _ in counted_removals(cmd) if (n := dec(unsent, x)) > 1]
                if counts:
                    if out is None:
                        out = list(commands)
                    out[i] = with_counts(cmd, counts)
                continue
            e = list_removal(t, cmd)
            if e is not None:
                n = dec(unsent, e)
                if n > 1:
                    if out is None:
                        out = list(commands)
                    out[i] = list_counted(cmd, n)
            elif given_back(t, cmd) is not None:
                if out is None:
                    out = list(commands)
                out[i] = give_back_counted(cmd, self.take)
        return commands if out is None else out

    def _settled(self, element: bytes, copies: int, r: object) -> None:
        """A removal of ``element`` gated on ``copies`` was answered ``r``: no
        longer held; one that failed, or whose counted gate was closed, may have
        left a copy that was handled (the next rescan delivers it again)."""
        dec(self.in_hand, element)
        failed = isinstance(r, rexc.RedisError)
        if failed or (not r and copies > 1):
            self.leftover[element] = self.leftover.get(element, 0) + 1
            if not failed:
                self.rescan_wanted = True

    def resend(self, commands: Sequence[Command], answered: Sequence[Command],
               answers: Sequence[object]) -> list[Command]:
        """The finalizer calls this before it sends ``commands`` again (their
        outcome was unknown, or they did not run): every removal is gated on
        the copies this consumer holds *now*.

        An identical element read since the first send (held by another
        handler) raised the number of copies in the processing list: the
        ``n`` taken at the first send would let a resend remove that copy.
        ``answered``/``answers``: this batch's commands already answered
        (their removals are discounted).
        """
        t = self.target
        if t is None:
            return list(commands)
        held = self.in_hand
        done: dict[bytes, int] = {}  # removals this batch already made
        for cmd, r in zip(answered, answers, strict=True):
            if is_batched(cmd):  # removals with writes: each element's own reply
                for x, _, er in _batch_removals(cmd, r):
                    if er and not isinstance(er, Exception):
                        done[x] = done.get(x, 0) + 1
                continue
            e = list_removal(t, cmd)
            if e is not None and r and not isinstance(r, Exception):
                done[e] = done.get(e, 0) + 1

        def copies_now(e: bytes) -> int:
            k = done.get(e, 0)
            done[e] = k + 1
            return max(1, held.get(e, 0) - k)

        out = list(commands)
        for i, cmd in enumerate(out):
            if is_batched(cmd):  # removals with writes: each element as alone
                out[i] = with_counts(cmd, [(at, copies_now(x))
                                           for at, x, _ in counted_removals(cmd)])
                continue
            e = list_removal(t, cmd)
            if e is not None:
                out[i] = list_counted(cmd, copies_now(e))
            elif given_back(t, cmd) is not None:
                out[i] = give_back_counted(cmd, copies_now)
        return out

    def settle(self, items: Sequence[Item], commands: Sequence[Command], replies: Sequence[object],
               hot: bool = False) -> None:
        """The finalizer calls this with the replies of a batch :meth:`prepare` saw.

        Answered removals are no longer held; a removal whose ``n`` gate was
        closed (or that failed) may have left a copy that was handled: the
        next rescan delivers it again as an attempt.  Runtime ``retry_after``
        originals stay held until their delayed copy is answered
        (:meth:`later_answered`).

        ``hot``: only the hot path's removals (plain ``LREM`` s, or their
        counted ``LIST_REMOVE`` calls), no plan: when each answered 1 (removed)
        their elements are taken out of ``_in_hand`` at once, in C; should one
        not have been held exactly once (identical elements, or a counted
        call, whose element is not at index 3), they are put back and settled
        one by one.
        """
        t = self.target
        if t is None:
            return
        held = self.in_hand
        take = cast(Callable[[object, int], int], held.pop)  # 0: not held (not bytes: not a key)
        if hot and replies.count(1) == len(replies):
            xs = list(map(_ELEMENT, commands))
            ns = list(map(take, xs, _repeat(0)))
            if ns.count(1) == len(ns):  # each held once (1: a small int, compared by identity)
                return  # no plan: no runtime retry_after to hold either
            for x, n in zip(xs, ns, strict=True):
                if n:
                    held[x] = n
        for cmd, r in zip(commands, replies, strict=True):
            if is_batched(cmd):  # removals with writes: each element's own reply
                for x, n, er in _batch_removals(cmd, r):
                    # (one that did not run was sent again alone: that reply settles it)
                    if not (isinstance(er, Exception) and classify(er) is not FINAL):
                        self._settled(x, n, er)
                continue
            element = list_removal(t, cmd)
            if element is None:
                back = given_back(t, cmd)
                for g in back[::2] if back is not None else ():
                    if isinstance(g, bytes):
                        dec(held, g)
                        dec(self.giving, g)
                continue
            self._settled(element, list_copies(cmd), r)

    # -- runtime retry_after copies (the scheduler's) ------------------------------
    def send_later(self, cmd: Command) -> Command:
        """The scheduler calls this before it sends ``cmd``, a step of a
        runtime ``retry_after`` copy (each time: a resend too); the command
        to send instead.

        First send (the plan's ``LIST_COPY_REMOVE`` or ``LIST_WRITES`` copy
        of an element of the processing list): a ``DELAYED_COPY`` with a
        fresh receipt token, gated on the copies held now whose removal was
        not sent (this one included, which is sent now), deleting the
        receipts of the delayed copies answered since the last one.  A
        resend (a ``DELAYED_COPY`` already; not run, or its outcome unknown):
        its receipt says whether that first send committed, and its gate is
        numbered again as if it were first sent now.  Anything else: as it is.
        """
        t = self.target
        if t is None:
            return cmd
        parts = delayed_of(t, cmd)
        if parts is not None:
            return renumbered(cmd, self.unsent.get(parts[0], 0) + 1)
        first = runtime_copy(t, cmd)
        if first is None:
            return cmd
        element, queue, copy, writes, wkeys = first
        n = max(1, dec(self.unsent, element))
        self.delayed[element] = self.delayed.get(element, 0) + 1
        forget = self.forget[:FORGET_AT_ONCE]
        del self.forget[:FORGET_AT_ONCE]
        return delayed_copy(t.processing, queue, element, copy, uuid.uuid4().bytes, n,
                            forget, writes, wkeys)

    def due_of(self, cmd: Command) -> tuple[str, bytes, int] | None:
        """Where the due time of a runtime ``retry_after`` copy the scheduler
        starts holding (``cmd``: its first step, as the plan built it) is
        written: ``(schedule key, member, the attempt that asked for it)`` in
        the ``Backoff`` schedule of this processing list
        (``_core._recovery.SCHEDULE``, by the element's digest); None when
        ``cmd`` is not such a copy of this processing list."""
        t = self.target
        first = None if t is None else runtime_copy(t, cmd)
        if t is None or first is None:
            return None
        element = first[0]
        member = schedule_member(t, None, element)
        assert member is not None
        return schedule_key(t), member, list_delivery(t, t.source, element)[0].attempt

    def later_answered(self, cmd: Command, r: object) -> tuple[str, int] | None:
        """The scheduler calls this with the reply to ``cmd`` (a command
        :meth:`send_later` returned) when it is final: a value, or an error
        reply that will not succeed if sent again.  The effect to count
        (``released``: written, by this send or, its receipt says, an
        earlier one; ``gate_closed``; ``failed``) and the writes committed;
        None when ``cmd`` is not a delayed copy of this processing list."""
        t = self.target
        parts = None if t is None else delayed_of(t, cmd)
        if parts is None:
            return None
        element, n, writes = parts
        dec(self.delayed, element)
        self._settled(element, n, r)
        if isinstance(r, Exception):
            return FAILED, 0
        if r is None or r is False:
            return GATE_CLOSED, 0
        self.forget.append(delayed_token(cmd))
        return "released", writes
