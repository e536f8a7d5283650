"""Spliced commands: a batched script call made of segments of arguments,
some of them the same object again, packed without packing those twice.

The values here are plain (:data:`Arg`, :data:`Command`: re-exported by
``_commands``, where scripts and commands are described); the transport
packs a :class:`Spliced` by its :meth:`~Spliced.packed`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate, chain, repeat
from operator import is_, itemgetter
from typing import Any

__all__ = ["Arg", "Command", "Spliced", "splice", "splice_batches", "splice_keyed", "splice_rows"]

Arg = bytes | str | int | float
Command = Sequence[Arg]


class Spliced(tuple):  # type: ignore[type-arg]
    """A command made of segments of arguments, some of them the same object
    again (one outcome's encoded writes in the part of every delivery that
    returned it, in a batched call): a tuple of all its arguments, as any
    command, that the transport packs segment by segment, each distinct
    segment object once (:meth:`packed`; packing is most of what a write
    costs the client).  Made by :func:`splice` only: its arguments are its
    segments' in order."""

    segments: Sequence[Sequence[Arg]]

    def packed(self, pack: Callable[[tuple[Arg, ...]], bytes]) -> bytes:
        """The command's RESP bytes, ``pack`` (``hiredis.pack_command``)
        packing each distinct segment: the same bytes ``pack(self)`` gives."""
        keyed = self.__dict__.get("keyed")
        if keyed is not None:  # (see splice_keyed)
            head, ids, part = keyed
            h, p, e = pack(tuple(head)), pack(tuple(ids)), pack(tuple(part))
            lines = p.split(b"\r\n")  # "*n", then "$len", id for each id, ""
            body = b"\r\n".join(chain.from_iterable(
                zip(lines[1:-1:2], lines[2:-1:2], repeat(e[e.index(b"\n") + 1:-2]))))
            return b"".join((b"*%d\r\n" % len(self), h[h.index(b"\n") + 1:], body, b"\r\n"))
        segments = self.segments
        rows = segments[1:]
        if self.__dict__.get("rows") and len(set(map(len, rows))) == 1:
            # a part of one width per delivery (the common batch of an outcome
            # built per message): packed as a template (see _columns)
            made = _columns(rows, pack)
            if made is not None:
                h = pack(tuple(segments[0]))
                return b"".join((b"*%d\r\n" % len(self), h[h.index(b"\n") + 1:], made))
        done: dict[int, bytes] = {}
        out = [b"*%d\r\n" % len(self)]
        for seg in segments:
            if not seg:
                continue
            b = done.get(id(seg))
            if b is None:
                p = pack(tuple(seg))
                b = done[id(seg)] = p[p.index(b"\n") + 1:]  # without its "*<n>" line
            out.append(b)
        return b"".join(out)


def _columns(rows: Sequence[Sequence[Arg]], pack: Callable[[tuple[Arg, ...]], bytes]) -> bytes | None:
    """The RESP bytes of ``rows`` (sequences of arguments, all of one length,
    more than one, each ``str``, ``bytes`` or ``int`` exactly: equal values
    are the same bytes) one after the other, packed as a template: the
    columns whose values are all equal (a write's name, its key: a handler's
    constants) packed once, the others substituted in each row.  None when
    a column holds two of those classes (pack them another way)."""
    n = len(rows)
    row: list[bytes] = []
    args: list[Any] = []  # each column substituted: its values' sizes, then the values
    run: list[Arg] = []  # the columns of one value since the last one substituted
    made: list[tuple[tuple[Arg, ...], list[bytes], list[int]]] = []  # columns substituted
    for col in zip(*rows, strict=True):
        c0 = col[0]
        if col.count(c0) == n:  # (equal values of one class: the same bytes)
            run.append(c0)
            continue
        if run:
            p = pack(tuple(run))
            row.append(p[p.index(b"\n") + 1:].replace(b"%", b"%%"))
            run = []
        # (a column again: the id in each write of a message's outcome)
        known = next((m for m in made if m[0] == col), None)
        if known is None:
            try:
                values = ([*map(str.encode, col)] if c0.__class__ is str else
                          [*map(b"%d".__mod__, col)] if c0.__class__ is int else
                          [*map(b"%b".__mod__, col)])
            except TypeError:
                return None
            known = (col, values, [*map(len, values)])
            made.append(known)
        row.append(b"$%d\r\n%b\r\n")
        args.append(known[2])
        args.append(known[1])
    if run:
        p = pack(tuple(run))
        row.append(p[p.index(b"\n") + 1:].replace(b"%", b"%%"))
    return b"".join(row) * n % tuple(chain.from_iterable(zip(*args, strict=True)))


_EXACT = {str, bytes, int}


def splice(segments: Sequence[Sequence[Arg]]) -> Spliced:
    """The command of ``segments`` (not empty), in order (see :class:`Spliced`)."""
    flat: list[Arg] = []
    for seg in segments:  # (a list extended: each segment copied in C)
        flat += seg
    c = Spliced(flat)
    c.segments = segments
    return c


def splice_rows(head: Command, rows: Sequence[Sequence[Arg]]) -> Spliced:
    """``head``, then ``rows``: a batch's parts, one per delivery, each
    ``str``, ``bytes`` or ``int`` exactly (its id, an outcome's
    ``write_parts``: ``_writes.checked_writes``).  Parts of one width (more
    than one) are packed as a template, a column of one value once
    (:meth:`Spliced.packed`); others segment by segment."""
    c = splice([head, *rows])
    if len(rows) > 1:
        c.rows = True  # type: ignore[attr-defined]
    return c


def splice_keyed(head: Command, ids: Sequence[str], part: Sequence[Arg]) -> Spliced:
    """``head``, then for each of ``ids`` the id and ``part`` (the same
    values): a batch of deliveries known by id that all returned one outcome.
    Packed with every id at once (:meth:`Spliced.packed` cuts their packing
    at its line ends: the ids are a stream's, ``ms-seq``, never a CR or LF)."""
    c = splice([head, *chain.from_iterable(zip(zip(ids), repeat(part)))])
    if part:  # (no part: packed segment by segment)
        c.keyed = (head, ids, part)  # type: ignore[attr-defined]
    return c


def splice_batches(
    items: Sequence[tuple[object, object]], prefixes: Sequence[Sequence[Arg]],
    encode: Callable[[Any], tuple[Sequence[Arg], Sequence[Arg]]],
    head: Callable[[Sequence[Arg], int, int], Command], cap: int, room: int,
    ids: Sequence[str] | None = None, same: Arg | None = None,
) -> list[tuple[Command, int]]:
    """Batched script calls of ``items`` (deliveries and their outcomes), each
    delivery's part its ``prefixes[i]`` then its outcome's encoded writes
    (``encode(outcome)``: those and the keys they name, once per outcome
    object in a row): ``(call, how many deliveries it carries)``, in order.

    A call carries at most ``cap`` deliveries and about ``room`` values (one
    delivery at least), as ``_batch.first_round`` batches parts;
    ``head(keys, i, j)``: the call up to the parts, for ``items[i:j]`` and
    the keys their writes name (each once).  The calls are :class:`Spliced`:
    one outcome's writes, the same list object, packed once; parts of an
    outcome each (:func:`splice_rows`, the encoded writes ``str``, ``bytes``
    and ``int`` exactly, as ``_writes.checked_writes`` makes them) packed as
    a template.  ``ids``: the
    prefixes are these stream ids alone (:func:`splice_keyed`, when every
    delivery returned one outcome object).  ``same``: in place of the writes
    of an outcome that is the object before it in the call (None: in full).
    """
    out: list[tuple[Command, int]] = []
    n = len(items)
    outs = [*map(_SECOND, items)]
    repeats = [*map(is_, outs, outs[1:])]  # (each outcome the object before it, or not)
    one_width = len(set(map(len, prefixes))) == 1  # (prefixes of one width)
    if n and False not in repeats and one_width:
        # one outcome object for all, prefixes of one width (the common batch):
        # its writes encoded once, the parts interleaved in C
        enc, names = encode(items[0][1])
        once = list(dict.fromkeys(names))
        per = max(1, min(cap, room // (len(prefixes[0]) + len(enc))))
        part = enc if same is None else (same,)  # (the deliveries' after the first)
        for i in range(0, n, per):
            j = min(n, i + per)
            first = (*head(once, i, j), *prefixes[i], *enc)  # (the first delivery's in full)
            out.append((splice_keyed(first, ids[i + 1:j], part) if ids and j - i > 1 else
                        splice([first, *chain.from_iterable(zip(prefixes[i + 1:j], repeat(part)))]),
                        j - i))
        return out
    if n > 1 and True not in repeats and one_width:
        # an outcome object each (the common batch of outcomes built per
        # message): the calls cut where the loop below cuts them, in C
        encoded = [*map(encode, outs)]
        encs = [*map(_FIRST, encoded)]
        acc = [0, *accumulate(map(len(prefixes[0]).__add__, map(len, encs)))]
        exact = {*map(type, chain.from_iterable(prefixes) if ids is None else ids)} <= _EXACT
        i = 0
        while i < n:
            j = min(n, i + cap, max(i + 1, bisect_right(acc, acc[i] + room) - 1))
            call = head(list(dict.fromkeys(chain.from_iterable(map(_SECOND, encoded[i:j])))), i, j)
            each = [[*p, *e] for p, e in zip(prefixes[i:j], encs[i:j], strict=True)]
            out.append((splice_rows(call, each) if exact else splice([call, *each]), j - i))
            i = j
        return out
    i = 0
    last: object = None
    w: tuple[Sequence[Arg], Sequence[Arg]] = ((), ())
    while i < n:
        segments: list[Sequence[Arg]] = [()]
        keys: dict[Arg, None] = {}
        size = 0
        j = i
        end = min(n, i + cap)
        new = rows = True  # rows: no outcome object twice in a row
        while j < end:
            o = items[j][1]
            again = o is last
            if again:
                rows = False
            else:
                w = encode(o)
                last = o
                new = True
            enc = w[0]
            width = len(prefixes[j]) + len(enc)
            if size + width > room and j > i:
                break
            if again and same is not None and j > i:  # (the first of a call: in full)
                segments.append([*prefixes[j], same])
            elif again:  # the writes packed once for the run of this outcome
                segments.append(prefixes[j])
                segments.append(enc)
            else:  # (one segment: one packing less for an outcome seen once)
                segments.append([*prefixes[j], *enc])
            if new:  # (the writes of one outcome object: their keys once)
                keys.update(dict.fromkeys(w[1]))
                new = False
            size += width
            j += 1
        call = head(list(keys), i, j)
        if rows and {*map(type, chain.from_iterable(prefixes[i:j]))} <= _EXACT:
            out.append((splice_rows(call, segments[1:]), j - i))
        else:
            segments[0] = call
            out.append((splice(segments), j - i))
        i = j
    return out


_FIRST = itemgetter(0)
_SECOND = itemgetter(1)
