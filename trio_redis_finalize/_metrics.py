"""Metric families computed from the consumers' counters (backend-neutral).

Exporters (:mod:`trio_redis_finalize.prometheus`) call :func:`families` at
scrape time: nothing is counted twice and the hot path pays nothing more
than the runtime's plain counters (:class:`~trio_redis_finalize._stats.MountStats`).

Every sample is labelled ``form`` (``stream``, ``reliable_list``, ``list``,
``channel``, ``pattern``), ``key`` (the stream, list, channel(s) or
pattern) and ``group`` (the consumer group; empty for the other forms).
Names below use the default prefix ``trf``:

=======================================  =========  ==========================================
name                                     type       what
=======================================  =========  ==========================================
``trf_deliveries_read_total``            counter    deliveries read from Redis (redeliveries
                                                    included), counted when read, before any
                                                    handler call
``trf_handler_outcomes_total{outcome}``  counter    handler calls by what they returned:
                                                    ``ack``, ``retry``, ``drop``,
                                                    ``retry_after``, ``backoff`` (a raise
                                                    counts as the ``on_error`` outcome)
``trf_handler_duration_seconds``         histogram  how long handler calls took
``trf_effects_total{effect}``            counter    what finalization did, as Redis confirmed
``trf_errors_total{kind}``               counter    ``handler``, ``finalize``, ``read`` errors,
                                                    ``group_recreated``
``trf_in_flight``                        gauge      handler calls running now
``trf_held_copies``                      gauge      runtime ``retry_after`` copies in memory
``trf_delay_lag_seconds``                gauge      how overdue the oldest copy of the durable
                                                    delay set was at the last read
``trf_group_lag``                        gauge      entries not yet delivered to the group
                                                    (stream) / elements waiting (list)
``trf_pending``                          gauge      delivered, not yet finalized: the group's
                                                    PEL / the processing list
``trf_oldest_pending_idle_seconds``      gauge      idle time of the longest-idle pending
                                                    entry of the group
=======================================  =========  ==========================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ._core._types import FAILED, GATE_CLOSED, Effect
from ._forms import FORMS
from ._stats import DURATION_BOUNDS

if TYPE_CHECKING:
    from ._consumer import Consumer

__all__ = ["EFFECTS", "OUTCOMES", "Backlog", "Family", "MountSample", "families", "read_samples"]

_ERROR_KINDS = (
    ("handler", "handler_errors"),
    ("finalize", "finalize_errors"),
    ("read", "read_errors"),
    ("group_recreated", "group_recreated"),
)
OUTCOMES = ("ack", "retry", "drop", "retry_after", "reject", "backoff")
"""Every outcome counted (``backoff``: a handler error under ``on_error=Backoff``);
each series is exported from zero."""
EFFECTS = (
    *(e.value for e in Effect),  # what plans do: acked, copied, ..., foreign_copy
    GATE_CLOSED, FAILED,  # what Redis answered instead
    # counted by the runtime itself
    "backed_off", "refused", "recovered", "moved_from_delay_set", "held_lost", "released",
    "gaps", "trimmed", "handed_back",
)
"""Every effect the runtime counts; each series is exported from zero
(``tests/api/test_metrics.py`` checks the package counts no other)."""
LABELS = ("form", "key", "group")


@dataclasses.dataclass(slots=True)
class Backlog:
    """What Redis says about a subscription's queue (read by a refresh, not the hot path)."""

    lag: float | None = None
    pending: float | None = None
    oldest_idle: float | None = None


@dataclasses.dataclass(slots=True)
class MountSample:
    """One mounted subscription's labels and counters at one instant."""

    form: str
    key: str
    group: str
    stats: Mapping[str, Any]
    buckets: Sequence[int] = ()
    duration_sum: float = 0.0
    backlog: Backlog | None = None

    @property
    def labels(self) -> tuple[str, str, str]:
        return (self.form, self.key, self.group)


@dataclasses.dataclass(slots=True)
class Family:
    """One metric family: a name (without ``_total``), a type, help and samples.

    For a histogram, each sample's value is ``(cumulative bucket counts, sum)``
    with the buckets of :data:`~trio_redis_finalize._stats.DURATION_BOUNDS`
    and ``+Inf`` last.
    """

    name: str
    type: Literal["counter", "gauge", "histogram"]
    help: str
    label_names: tuple[str, ...]
    samples: list[tuple[tuple[str, ...], Any]] = dataclasses.field(default_factory=list)


def labels_of(mount: Any) -> tuple[str, str, str]:
    """``(form, key, group)`` of a mounted subscription."""
    t = mount.target
    form = FORMS[t.form].label
    channels = getattr(mount.subscription, "channels", None)
    key = ",".join(channels) if channels else str(t.source)
    return form, key, str(t.group)


def read_samples(consumer: Consumer, backlogs: Mapping[str, Backlog] | None = None,
                 tries: int = 5) -> list[MountSample]:
    """The consumer's subscriptions now; safe to call from another thread (a scrape thread).

    The counters are plain dicts mutated by the event loop's thread; a copy
    that races with a first insertion of a key is simply taken again.
    """
    for attempt in range(tries):
        try:
            out = []
            for m in consumer.mounts:
                snap = m.stats.snapshot()
                snap["held"] = consumer.scheduler.held_by(m)
                form, key, group = labels_of(m)
                d = m.stats.durations
                out.append(MountSample(form, key, group, snap, list(d.counts), d.sum,
                                       (backlogs or {}).get(m.name)))
            return out
        except RuntimeError:  # "dictionary changed size during iteration"
            if attempt == tries - 1:
                raise
    return []  # pragma: no cover


_Kind = Literal["counter", "gauge", "histogram"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Spec:
    """A metric family as :func:`families` builds it."""

    name: str
    """After the prefix (``trf_`` + ``effects`` is ``trf_effects_total``)."""
    kind: _Kind
    labels: tuple[str, ...] = ()
    """The labels after the base ones (``LABELS``, the exporter's)."""


_FAMILIES: dict[str, _Spec] = {
    "read": _Spec("deliveries_read", "counter"),
    "outcomes": _Spec("handler_outcomes", "counter", ("outcome",)),
    "duration": _Spec("handler_duration_seconds", "histogram"),
    "effects": _Spec("effects", "counter", ("effect",)),
    "errors": _Spec("errors", "counter", ("kind",)),
    "in_flight": _Spec("in_flight", "gauge"),
    "held": _Spec("held_copies", "gauge"),
    "delay_lag": _Spec("delay_lag_seconds", "gauge"),
    "lag": _Spec("group_lag", "gauge"),
    "pending": _Spec("pending", "gauge"),
    "idle": _Spec("oldest_pending_idle_seconds", "gauge"),
}
"""The metric families :func:`families` builds, in their order, by the key
their samples are added up under (their help texts: :data:`_HELP`)."""
_HELP: dict[str, str] = {
    "read": "Deliveries read from Redis, counted when read (redeliveries included), before any "
            "handler call; not handler calls.",
    "outcomes": "Handler calls by the outcome they returned (ack, retry, drop, retry_after); a "
                "raise counts as the on_error outcome (backoff under on_error=Backoff).",
    "duration": "Seconds each handler call took.",
    "effects": "What finalization did in Redis, counted once Redis confirmed it (acked, copied, "
               "delayed, dead_lettered, refused, lost_before_handling, ...).",
    "errors": "Errors by kind: handler raised or returned no outcome, finalization and read "
              "errors; and consumer groups recreated.",
    "in_flight": "Handler calls running now.",
    "held": "Runtime retry_after copies in process memory, waiting or being sent (lost if the "
            "process is killed).",
    "delay_lag": "How overdue the oldest copy in the durable delay set was at the last read (0: "
                 "none due).",
    "lag": "Messages waiting to be read: entries not yet delivered to the consumer group "
           "(stream), elements in the queue (reliable list).",
    "pending": "Messages read and not yet finalized: the group's pending entries (stream), this "
               "consumer's processing list (reliable list).",
    "idle": "Idle seconds of the group's longest-idle pending entry (0: none pending).",
}
"""Each family's help text, as the exporters show it."""
assert _HELP.keys() == _FAMILIES.keys()


def families(
    sources: Iterable[tuple[Sequence[MountSample], tuple[str, ...]]],
    label_names: tuple[str, ...] = (),
    prefix: str = "trf",
) -> list[Family]:
    """The metric families for the consumers' samples.

    Args:
        sources: pairs of a consumer's :func:`read_samples` and the values of
            the extra labels ``label_names`` for that consumer.  Samples with
            the same labels are added up; for the delay lag and the oldest
            pending idle time the largest is kept, for the group lag too
            (two consumers of one group see the same lag).
        label_names: extra label names, after ``form``, ``key``, ``group``.
        prefix: the start of every name (``trf`` gives ``trf_effects_total``).
    """
    base_names = (*LABELS, *label_names)
    fams = {key: Family(f"{prefix}_{spec.name}", spec.kind, _HELP[key], (*base_names, *spec.labels))
            for key, spec in _FAMILIES.items()}
    acc: dict[str, dict[tuple[str, ...], Any]] = {k: {} for k in fams}

    def add(family: str, labels: tuple[str, ...], value: float) -> None:
        values = acc[family]
        values[labels] = values.get(labels, 0.0) + value

    def most(family: str, labels: tuple[str, ...], value: float) -> None:
        values = acc[family]
        values[labels] = max(value, values.get(labels, value))

    for samples, extra in sources:
        if len(extra) != len(label_names):
            raise ValueError(f"labels: expected values for {label_names!r}, got {extra!r}")
        for m in samples:
            s = m.stats
            base = (*m.labels, *extra)
            add("read", base, float(s.get("received", 0)))
            got = s.get("outcomes", {})
            for outcome in (*OUTCOMES, *(o for o in got if o not in OUTCOMES)):
                add("outcomes", (*base, outcome), float(got.get(outcome, 0)))
            got = s.get("effects", {})
            for effect in (*EFFECTS, *(e for e in got if e not in EFFECTS)):
                add("effects", (*base, effect), float(got.get(effect, 0)))
            for kind, key in _ERROR_KINDS:
                add("errors", (*base, kind), float(s.get(key, 0)))
            add("in_flight", base, float(s.get("in_flight", 0)))
            add("held", base, float(s.get("held", 0)))
            if s.get("delay_lag") is not None:
                most("delay_lag", base, float(s["delay_lag"]))
            buckets = list(m.buckets) or [0] * (len(DURATION_BOUNDS) + 1)
            old = acc["duration"].get(base)
            if old is not None:
                buckets = [a + b for a, b in zip(old[0], buckets, strict=True)]
                total = old[1] + m.duration_sum
            else:
                total = m.duration_sum
            acc["duration"][base] = (buckets, total)
            b = m.backlog
            if b is not None:
                if b.lag is not None:
                    most("lag", base, b.lag)
                if b.pending is not None:
                    (most if m.group else add)("pending", base, b.pending)
                if b.oldest_idle is not None:
                    most("idle", base, b.oldest_idle)
    for key, family in fams.items():
        if key == "duration":
            cumulative = []
            for labels, (buckets, total) in acc[key].items():
                running, cum = 0, []
                for n in buckets:
                    running += n
                    cum.append(running)
                cumulative.append((labels, (cum, total)))
            family.samples = sorted(cumulative)
        else:
            family.samples = sorted(acc[key].items())
    return list(fams.values())
