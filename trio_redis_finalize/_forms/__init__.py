"""The forms, and ``FORMS``: the one registration table, a row per form.

A form (stream, reliable list, simple list, Pub/Sub channel or pattern) has
its home here: ``_forms/stream/``, ``_forms/reliable_list/``,
``_forms/simple_list.py``, ``_forms/pubsub.py`` (I/O: its subscription, its
reader), beside ``_core/<form>/`` (sans-IO).  What the rest of the runtime
needs to know of a form it asks this table, never ``target.form is
Form.X``: the consumer, the mount, the metrics, Prometheus, OpenTelemetry,
the history and the CLI look up ``FORMS[target.form]`` and read a field of
its :class:`FormSpec` (anyio's ``BACKENDS``, h11's ``READERS``).  The
sans-IO core cannot import this package: it keeps its half of the table
(the outcome cells, ``CELLS``) in ``_core``.

Readers do not import this module (it imports them): they import the port,
``_port.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from .._subscription import Form, Subscription
from ._port import Reader
from .pubsub import ChannelSubscription, PatternSubscription, PubSubReader
from .reliable_list import ReliableListSubscription
from .reliable_list.reader import ReliableListReader
from .simple_list import ListReader, ListSubscription
from .stream import StreamSubscription
from .stream.reader import StreamReader

__all__ = ["FORMS", "FormSpec"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FormSpec:
    """What the runtime needs to know of one form: its row in :data:`FORMS`.

    Each field answers one question the runtime used to answer by testing
    the form (the branch it replaces in parentheses).  The defaults are an
    at-most-once form's (a simple list, Pub/Sub): a row names what its form has.
    """

    form: Form
    subscription: type[Subscription]
    """The subscription class users mount."""
    reader: Callable[[Any], Reader]
    """Makes the reader of a subscription of this form (``_consumer._READERS``)."""
    name: str
    """The form in words, for log lines: ``stream``, ``reliable list``,
    ``list``, ``channel``, ``pattern`` (the enum's value, ``form.value``)."""
    label: str
    """The ``form`` label of metrics, Prometheus and OpenTelemetry: ``name``
    with ``_`` for spaces (``str(t.form.value).replace(" ", "_")``)."""
    cut_fate: str
    """What becomes of deliveries whose handler the shutdown cut, for
    ``HandlerPool.log_cut``: a ``str.format`` template of ``names`` (the ids),
    ``group``, ``consumer`` and ``processing``."""
    leaves_pending: bool = False
    """A failed delivery can stay pending (a stream's PEL, a reliable list's
    processing list), so a ``Backoff`` waits; else (at-most-once forms) a
    ``Backoff`` drops it (``Mount``'s ``no_ack``)."""
    by_id: bool = False
    """Deliveries carry the server's id (stream entries): kept in ``in_hand``
    until finalized (``Mount._ids``, ``FinalizerCore._stream``)."""
    counted: bool = False
    """Removals of identical elements are counted (a reliable list's ``LREM``
    per element: ``FinalizerCore._lists``, the reader's ``gates``)."""
    gated: bool = False
    """An outcome may carry writes (``Outcome.with_writes``), committed in the
    gated step that finalizes it (``check_outcome``'s form test)."""
    dead_letters: bool = False
    """A delivery past ``max_attempts`` may go to a dead letter (``OnError.error_text``)."""
    uses_caps: bool = False
    """Plans choose native commands from the server's capabilities, asked at
    mount (``if target.form is Form.STREAM`` in ``Consumer.mount``)."""
    has_modes: bool = False
    """The subscription has a ``Mode`` (``PLAIN``, ``RECLAIM``, ``CLAIMING``)."""
    keyed: bool = False
    """Messages wait in Redis keys: the consumer's ``maxmemory-policy``
    warning (``Consumer.mount``) and the per-minute history (``History.of``)
    concern it; Pub/Sub keeps nothing."""
    backlog: Literal["group", "queue"] | None = None
    """Where the queue gauges are read (``prometheus._backlog_of``): a
    consumer group (``XINFO GROUPS``, ``XPENDING``), a list (``LLEN`` of the
    queue and of the processing list, if any), or nowhere."""
    templated: bool = False
    """The source is a pattern: OpenTelemetry's
    ``messaging.destination.template`` (``t.form.value == "pattern"``)."""


def _at_most_once(form: str) -> str:
    return f"messages {{names}} (origin ids): gone (a {form} is at-most-once)"


FORMS: dict[Form, FormSpec] = {
    spec.form: spec for spec in (
        FormSpec(
            form=Form.STREAM, subscription=StreamSubscription, reader=StreamReader,
            name="stream", label="stream",
            cut_fate=("entries {names}: left pending in the PEL of group {group!r} (consumer "
                      "{consumer!r}), handed back at the stop (the group's live consumers take "
                      "them at once; this attempt counts)"),
            leaves_pending=True, by_id=True, gated=True, dead_letters=True, uses_caps=True,
            has_modes=True, keyed=True, backlog="group",
        ),
        FormSpec(
            form=Form.RELIABLE_LIST, subscription=ReliableListSubscription,
            reader=ReliableListReader, name="reliable list", label="reliable_list",
            cut_fate=("elements {names} (origin ids): left in the processing list "
                      "{processing!r}, handed back onto the queue at the stop (this attempt "
                      "counts)"),
            leaves_pending=True, counted=True, gated=True, dead_letters=True, keyed=True,
            backlog="queue",
        ),
        FormSpec(form=Form.LIST, subscription=ListSubscription, reader=ListReader, name="list",
                 label="list", cut_fate=_at_most_once("list"), keyed=True, backlog="queue"),
        FormSpec(form=Form.CHANNEL, subscription=ChannelSubscription, reader=PubSubReader,
                 name="channel", label="channel", cut_fate=_at_most_once("channel")),
        FormSpec(form=Form.PATTERN, subscription=PatternSubscription, reader=PubSubReader,
                 name="pattern", label="pattern", cut_fate=_at_most_once("pattern"),
                 templated=True),
    )
}
"""Every form's row: ``FORMS[target.form]`` (``FORMS[subscription.form]``)."""
