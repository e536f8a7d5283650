"""Metric families computed from ``consumer.stats()`` (backend-neutral).

Exporters (:mod:`trio_redis_finalize.prometheus`) call :func:`families` at
scrape time: nothing is counted twice and the hot path pays nothing, since
the runtime keeps its plain counters (:class:`~trio_redis_finalize._stats.MountStats`)
either way.

Families (every sample is labelled with ``subscription``, the subscription's
name as in ``consumer.stats()``):

==================================  =======  ===============================================
name                                type     what
==================================  =======  ===============================================
``trf_received_total``              counter  deliveries read and handed to the runtime
``trf_outcomes_total{outcome}``     counter  what handlers returned: ``ack``, ``retry``,
                                             ``drop``, ``retry_after``
``trf_effects_total{effect}``       counter  what finalization did in Redis: ``acked``,
                                             ``copied``, ``delayed``, ``held``,
                                             ``dead_lettered``, ``refused``,
                                             ``lost_before_handling``, ...
``trf_errors_total{kind}``          counter  ``handler``, ``finalize``, ``read`` errors and
                                             ``group_recreated``
``trf_in_flight``                   gauge    handler calls running now
``trf_held_copies``                 gauge    runtime ``retry_after`` copies held in memory
``trf_delay_lag_seconds``           gauge    how overdue the oldest copy in the durable
                                             delay set was at the last read (0 when
                                             none is due; absent while the set is
                                             empty or unused)
==================================  =======  ===============================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ._consumer import Consumer

__all__ = ["Family", "families", "read_stats"]

_ERROR_KINDS = (
    ("handler", "handler_errors"),
    ("finalize", "finalize_errors"),
    ("read", "read_errors"),
    ("group_recreated", "group_recreated"),
)


@dataclasses.dataclass(slots=True)
class Family:
    """One metric family: a name (without ``_total``), a type, help and samples."""

    name: str
    type: Literal["counter", "gauge"]
    help: str
    label_names: tuple[str, ...]
    samples: list[tuple[tuple[str, ...], float]] = dataclasses.field(default_factory=list)


def read_stats(consumer: Consumer, tries: int = 5) -> dict[str, dict[str, Any]]:
    """``consumer.stats()``, safe to call from another thread (a scrape thread).

    The counters are plain dicts mutated by the event loop's thread; a copy
    that races with a first insertion of a key is simply taken again.
    """
    for _ in range(tries - 1):
        try:
            return consumer.stats()
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return consumer.stats()


def families(
    sources: Iterable[tuple[Mapping[str, Mapping[str, Any]], tuple[str, ...]]],
    label_names: tuple[str, ...] = (),
) -> list[Family]:
    """The metric families for ``consumer.stats()`` results.

    Args:
        sources: pairs of a ``consumer.stats()`` result and the values of the
            extra labels ``label_names`` for that consumer.  Samples with the
            same labels (the same subscription name in two consumers with the
            same extra labels) are added up; for ``trf_delay_lag_seconds`` the
            largest is kept.
        label_names: extra label names, after ``subscription``.
    """
    sub = ("subscription", *label_names)
    fams = {
        "received": Family("trf_received", "counter", "Deliveries read and handed to handlers.", sub),
        "outcomes": Family("trf_outcomes", "counter", "Outcomes returned by handlers (ack, retry, "
                           "drop, retry_after).", (*sub, "outcome")),
        "effects": Family("trf_effects", "counter", "Redis effects of finalization (acked, copied, "
                          "delayed, dead_lettered, refused, lost_before_handling, ...).", (*sub, "effect")),
        "errors": Family("trf_errors", "counter", "Handler, finalization and read errors, and consumer "
                         "groups recreated.", (*sub, "kind")),
        "in_flight": Family("trf_in_flight", "gauge", "Handler calls running now.", sub),
        "held": Family("trf_held_copies", "gauge", "Runtime retry_after copies waiting in process "
                       "memory.", sub),
        "lag": Family("trf_delay_lag_seconds", "gauge", "How overdue the oldest copy in the durable "
                      "delay set was at the last read (0: none due).", sub),
    }
    acc: dict[str, dict[tuple[str, ...], float]] = {k: {} for k in fams}

    def add(family: str, labels: tuple[str, ...], value: float) -> None:
        values = acc[family]
        values[labels] = values.get(labels, 0.0) + value

    for stats, extra in sources:
        if len(extra) != len(label_names):
            raise ValueError(f"labels: expected values for {label_names!r}, got {extra!r}")
        for name, s in stats.items():
            base = (name, *extra)
            add("received", base, float(s.get("received", 0)))
            for outcome, n in s.get("outcomes", {}).items():
                add("outcomes", (*base, outcome), float(n))
            for effect, n in s.get("effects", {}).items():
                add("effects", (*base, effect), float(n))
            for kind, key in _ERROR_KINDS:
                add("errors", (*base, kind), float(s.get(key, 0)))
            add("in_flight", base, float(s.get("in_flight", 0)))
            add("held", base, float(s.get("held", 0)))
            if s.get("delay_lag") is not None:
                lag = float(s["delay_lag"])
                acc["lag"][base] = max(lag, acc["lag"].get(base, lag))
    for key, family in fams.items():
        family.samples = sorted(acc[key].items())
    return list(fams.values())
