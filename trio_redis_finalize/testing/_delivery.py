"""A delivery without a server (``trio_redis_finalize.testing``): :func:`make_delivery`.

What a consumer would hand a handler, to unit-test the handler alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from .._delivery import Delivery

__all__ = ["make_delivery"]

_Value = bytes | str | int | float
_ENTRY_ID = re.compile(r"\A[0-9]+-[0-9]+\Z")
_RESERVED = (b"trf-", b"traceparent", b"tracestate")


def _as_bytes(value: object, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()
    raise ValueError(f"{what} must be bytes, str, int or float, got {type(value).__name__}")


def make_delivery(
    fields: Mapping[bytes | str, _Value] | Sequence[tuple[bytes | str, _Value]] | None = None,
    *,
    data: _Value | None = None,
    source: str | None = None,
    id: str | None = None,
    attempt: int = 1,
    origin_id: str | None = None,
) -> Delivery:
    """A :class:`~trio_redis_finalize.Delivery` as a consumer hands it to a
    handler, built without a server: to unit-test a handler alone.

    With ``fields`` (or neither ``fields`` nor ``data``): a stream entry,
    ``delivery.fields`` and ``delivery.field_list`` as the consumer shows
    them.  With ``data``: a list element or a Pub/Sub message (``id`` is
    None, ``fields`` empty).  For the server-backed tests use the
    ``redis_url`` fixture and :func:`~trio_redis_finalize.pytest_plugin.consume_until`.

    Args:
        fields: the entry's fields, a mapping or ``(name, value)`` pairs (a
            name may repeat: ``fields`` keeps its last value, ``field_list``
            them all); names and values bytes or str (UTF-8), values also
            int or float (their ``repr``), as the publisher writes them.
        data: the element or payload (str: UTF-8; int or float: its
            ``repr``, as the publisher's ``push`` writes it); not with ``fields``.
        source: ``delivery.source`` (default ``"stream"`` for an entry,
            ``"list"`` for an element).
        id: the entry id (default ``"1-0"``); entries only.
        attempt: 1 for a first delivery; more for a delivery handled again.
        origin_id: default the entry id, or for an element a digest of its
            bytes (as for elements a foreign producer wrote).

    Raises:
        ValueError: a bad argument (the message names it); a field name of
            the library's own headers (``trf-*``, ``traceparent``,
            ``tracestate``: a consumer never shows them).
    """
    from .._core._types import content_origin

    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise ValueError(f"attempt must be an int >= 1, got {attempt!r}")
    if source is not None and (not isinstance(source, str) or not source):
        raise ValueError(f"source must be a non-empty string, got {source!r}")
    if origin_id is not None and (not isinstance(origin_id, str) or not origin_id):
        raise ValueError(f"origin_id must be a non-empty string, got {origin_id!r}")
    retries = attempt - 1
    if data is not None:
        if fields is not None:
            raise ValueError("fields and data: give one (fields: a stream entry; data: a list "
                             "element or a message)")
        if id is not None:
            raise ValueError(f"id: only a stream entry has one, got {id!r} with data")
        body = _as_bytes(data, "data")
        return Delivery(source or "list", None, {}, body, attempt,
                        origin_id or content_origin(body), body, retries)
    entry_id = "1-0" if id is None else id
    if not isinstance(entry_id, str) or not _ENTRY_ID.match(entry_id):
        raise ValueError(f"id must be a stream entry id ('<ms>-<seq>'), got {id!r}")
    pairs = list(fields.items()) if isinstance(fields, Mapping) else list(fields or ())
    flat: list[bytes] = []
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"fields: expected (name, value) pairs, got {pair!r}")
        name = _as_bytes(pair[0], "fields names")
        if name.startswith(_RESERVED):
            raise ValueError(f"fields: {name!r} is a header field of the library's own "
                             "(a consumer never shows it to a handler)")
        flat += [name, _as_bytes(pair[1], f"fields[{pair[0]!r}]")]
    it = iter(flat)
    return Delivery(source or "stream", entry_id, dict(zip(it, it, strict=True)), None, attempt,
                    origin_id or entry_id, None, retries, flat=flat)
