"""A small publisher that writes what consumers read (optional: producers may use any client).

::

    async with open_publisher("redis://127.0.0.1:6379/0") as pub:
        entry_id = await pub.add("orders", {b"n": b"1"}, maxlen=100_000)  # XADD MAXLEN ~
        await pub.push("jobs", b"payload")                                # LPUSH, enveloped
        await pub.publish("news", b"payload")                             # PUBLISH, enveloped

What it writes:

* streams: the fields as given, plus ``traceparent`` (and ``tracestate``)
  of the current OpenTelemetry span when there is one.  The entry's own id
  is its origin id (as for any producer's entries).
* lists and channels: the payload in the library's envelope with retry
  counter 0 and a fresh origin id, so every message has its own idempotency
  key (a foreign element's origin id is a digest of its bytes: two equal
  payloads share it).  The origin id is 32 hex digits, followed by
  ``;<traceparent>`` when a span is current: the envelope carries the trace
  context, and every copy (retries keep the origin id) keeps it.

With ``opentelemetry-api`` installed and a span current, each write runs in
a ``send <destination>`` span (kind ``PRODUCER``) whose context is the one
written, so consumer spans (:func:`trio_redis_finalize.otel.instrument_handler`)
become its children.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from ._envelope import ORIGIN_FIELD, RETRIES_FIELD, TRACEPARENT_FIELD, TRACESTATE_FIELD, wrap
from ._transport import Client, open_client

__all__ = ["TRACEPARENT_FIELD", "TRACESTATE_FIELD", "Publisher", "open_publisher", "trace_context"]

_TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}\Z")

FieldValue = bytes | str | int | float
Payload = bytes | bytearray | memoryview | str | int | float
"""What :meth:`Publisher.push` and :meth:`Publisher.publish` take (a str: UTF-8)."""


def _bytes(value: Any, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()
    raise ValueError(f"{what} must be bytes, str, int or float, got {type(value).__name__}")


def _key(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def trace_context(origin_id: str | None = None, fields: Mapping[bytes, bytes] | None = None
                  ) -> dict[str, str]:
    """The W3C trace context a message carries (``{"traceparent": ...}`` or ``{}``).

    From a stream entry's ``traceparent`` / ``tracestate`` fields, else from
    an origin id written by :meth:`Publisher.push` / :meth:`Publisher.publish`.
    """
    if fields:
        tp = fields.get(TRACEPARENT_FIELD)
        if tp is not None:
            out = {"traceparent": tp.decode("ascii", "replace")}
            ts = fields.get(TRACESTATE_FIELD)
            if ts is not None:
                out["tracestate"] = ts.decode("ascii", "replace")
            return out
    if origin_id:
        _, sep, tp_text = origin_id.partition(";")
        if sep and _TRACEPARENT.match(tp_text):
            return {"traceparent": tp_text}
    return {}


@contextlib.contextmanager
def _send_span(operation: str, destination: str, client_id: str) -> Iterator[dict[str, str]]:
    """A producer span when OpenTelemetry is there and a span is current; yields its context."""
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        yield {}
        return
    if not trace.get_current_span().get_span_context().is_valid:
        yield {}
        return
    from ._version import __version__

    tracer = trace.get_tracer("trio_redis_finalize", __version__)
    attributes = {
        "messaging.system": "redis",
        "messaging.operation.name": operation,
        "messaging.operation.type": "send",
        "messaging.destination.name": destination,
        "messaging.client.id": client_id,
    }
    with tracer.start_as_current_span(f"send {destination}", kind=trace.SpanKind.PRODUCER,
                                      attributes=attributes):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # the API alone (no SDK): the current context as it is
        yield {k: v for k, v in carrier.items() if k in ("traceparent", "tracestate")}


class Publisher:
    """Writes messages as consumers of this library read them (see :func:`open_publisher`)."""

    def __init__(self, client: Client, name: str) -> None:
        self.client = client
        self.name = name

    async def add(self, stream: str, fields: Mapping[bytes | str, FieldValue], *,
                  maxlen: int | None = None) -> str:
        """``XADD stream [MAXLEN ~ maxlen] * field value ...``; returns the entry id.

        Args:
            stream: the stream key.
            fields: the entry's fields (bytes, str, int or float values); not
                empty, and without the library's header fields.
            maxlen: cap the stream at about this many entries (``MAXLEN ~``).

        Raises:
            ValueError: an empty ``fields``, a header field, a bad ``maxlen``.
        """
        _key("stream", stream)
        if not fields:
            raise ValueError("fields must not be empty (a stream entry needs a field)")
        flat: list[bytes] = []
        for k, v in fields.items():
            kb = _bytes(k, "fields keys")
            if kb in (RETRIES_FIELD, ORIGIN_FIELD) or kb.startswith(b"trf-"):
                raise ValueError(f"fields: {kb!r} is a header field of the library's own")
            flat += [kb, _bytes(v, f"fields[{k!r}]")]
        if maxlen is not None and (isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 1):
            raise ValueError(f"maxlen must be an int >= 1 or None, got {maxlen!r}")
        cap: list[Any] = [] if maxlen is None else ["MAXLEN", "~", maxlen]
        with _send_span("add", stream, self.name) as ctx:
            if ctx and TRACEPARENT_FIELD not in flat[::2]:
                for k, v in ctx.items():
                    flat += [k.encode(), v.encode()]
            entry_id = await self.client.execute("XADD", stream, *cap, "*", *flat)
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    def envelope(self, payload: Payload, ctx: Mapping[str, str]) -> tuple[bytes, str]:
        """``(element, origin id)``: ``payload`` wrapped with a fresh origin id.

        ``payload``: bytes (or a bytearray / memoryview), a str (UTF-8), an
        int or a float (its ``repr``), as :meth:`add` takes field values.
        """
        body = (bytes(payload) if isinstance(payload, bytearray | memoryview)
                else _bytes(payload, "payload"))
        origin = uuid.uuid4().hex
        tp = ctx.get("traceparent")
        if tp and _TRACEPARENT.match(tp):
            origin += ";" + tp
        return wrap(body, 0, origin), origin

    async def push(self, key: str, payload: Payload) -> str:
        """``LPUSH key <envelope(payload)>``; returns the message's origin id.

        Read by :class:`~trio_redis_finalize.ReliableListSubscription` and
        :class:`~trio_redis_finalize.ListSubscription` as ``delivery.data ==
        payload`` (bytes: a str is written UTF-8 encoded, an int or a float
        as its ``repr``, as :meth:`add` writes field values), attempt 1,
        ``delivery.origin_id`` the id returned.

        Raises:
            ValueError: an empty ``key``, a ``payload`` of another type.
        """
        _key("key", key)
        with _send_span("push", key, self.name) as ctx:
            element, origin = self.envelope(payload, ctx)
            await self.client.execute("LPUSH", key, element)
        return origin

    async def publish(self, channel: str, payload: Payload) -> int:
        """``PUBLISH channel <envelope(payload)>``; returns how many subscribers got it.

        Read by :class:`~trio_redis_finalize.ChannelSubscription` and
        :class:`~trio_redis_finalize.PatternSubscription` as ``delivery.data
        == payload`` (a str UTF-8 encoded, as for :meth:`push`); on Redis
        Cluster, classic Pub/Sub is broadcast to every node, so any node
        takes it.

        Raises:
            ValueError: an empty ``channel``, a ``payload`` of another type.
        """
        _key("channel", channel)
        with _send_span("publish", channel, self.name) as ctx:
            message, _ = self.envelope(payload, ctx)
            n = await self.client.execute("PUBLISH", channel, message)
        return int(n)


@contextlib.asynccontextmanager
async def open_publisher(url_or_client: str | Client, *, name: str | None = None
                         ) -> AsyncIterator[Publisher]:
    """A :class:`Publisher` on ``url_or_client`` (the same URL forms as :func:`open_consumer`).

    Args:
        url_or_client: ``redis://``, ``rediss://``, ``unix://``,
            ``redis+cluster://`` or ``redis+sentinel://`` URL, or a transport
            client to share (left open on exit).
        name: the connection name (``CLIENT SETNAME``) and the spans'
            ``messaging.client.id``; default ``trf-publisher``.

    Raises:
        ValueError: the URL is not understood.
        redis.exceptions.ConnectionError: the server cannot be reached.
    """
    name = name or "trf-publisher"
    if isinstance(url_or_client, str):
        async with open_client(url_or_client, name=name) as client:
            yield Publisher(client, name)
    else:
        yield Publisher(url_or_client, name)

