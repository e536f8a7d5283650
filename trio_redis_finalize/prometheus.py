"""Prometheus metrics for consumers (optional: ``pip install 'trio_redis_finalize[prometheus]'``).

::

    from prometheus_client import start_http_server
    from trio_redis_finalize.prometheus import register

    async with open_consumer(url) as consumer:
        register(consumer)          # the default registry; or register(consumer, my_registry)
        start_http_server(9108)
        ...

:func:`register` adds a custom collector that reads ``consumer.stats()``
when Prometheus scrapes: the consumer's hot path pays nothing (it keeps its
plain counters either way), and the figures are the ones ``stats()`` shows.

Families (label ``subscription`` is the subscription's name as in
``consumer.stats()``, plus any extra ``labels=`` given to :func:`register`):

* ``trf_received_total{subscription}``: deliveries read and handed to handlers;
* ``trf_outcomes_total{subscription,outcome}``: what handlers returned
  (``ack``, ``retry``, ``drop``, ``retry_after``);
* ``trf_effects_total{subscription,effect}``: what finalization did in Redis
  (``acked``, ``copied``, ``delayed``, ``held``, ``left_pending``,
  ``dead_lettered``, ``exhausted``, ``refused``, ``lost_before_handling``, ...);
* ``trf_errors_total{subscription,kind}``: ``handler``, ``finalize`` and
  ``read`` errors, ``group_recreated``;
* ``trf_in_flight{subscription}``: handler calls running now;
* ``trf_held_copies{subscription}``: runtime ``retry_after`` copies held in
  process memory (lost if the process is killed);
* ``trf_delay_lag_seconds{subscription}``: how overdue the oldest copy of the
  durable delay set was at the last read (absent while the set is empty).

Importing this module without ``prometheus-client`` installed raises
:class:`ImportError` naming the extra to install.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

try:
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as _e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "trio_redis_finalize.prometheus needs prometheus-client: "
        "pip install 'trio_redis_finalize[prometheus]'"
    ) from _e

from ._metrics import families, read_stats

if TYPE_CHECKING:
    from ._consumer import Consumer

__all__ = ["ConsumerCollector", "register"]


class ConsumerCollector(Collector):
    """A Prometheus collector for one or more consumers (made by :func:`register`).

    Every scrape reads ``consumer.stats()`` of each consumer still alive
    (consumers are held by weak reference).  Samples of two consumers with
    the same subscription name and the same extra labels are added up
    (``trf_delay_lag_seconds``: the largest).
    """

    def __init__(self, label_names: tuple[str, ...] = ()) -> None:
        self.label_names = label_names
        self._lock = threading.Lock()
        self._consumers: list[tuple[weakref.ref[Consumer], tuple[str, ...]]] = []

    def add(self, consumer: Consumer, labels: Mapping[str, str] | None = None) -> None:
        """Collect ``consumer`` too, with the extra ``labels`` (same names as the others).

        Raises:
            ValueError: ``labels`` names other labels than the consumers
                already collected here, or the consumer is already here.
        """
        labels = dict(labels or {})
        if tuple(sorted(labels)) != self.label_names:
            raise ValueError(
                f"labels: this registry's trio_redis_finalize collector uses the extra labels "
                f"{list(self.label_names)!r}, got {sorted(labels)!r}"
            )
        values = tuple(str(labels[k]) for k in self.label_names)
        with self._lock:
            if any(ref() is consumer for ref, _ in self._consumers):
                raise ValueError(f"consumer {consumer.name!r} is already registered")
            self._consumers.append((weakref.ref(consumer), values))

    def remove(self, consumer: Consumer) -> None:
        """Stop collecting ``consumer`` (its series disappear from the next scrape)."""
        with self._lock:
            self._consumers = [(r, v) for r, v in self._consumers if r() is not consumer and r() is not None]

    def consumers(self) -> list[Consumer]:
        """The consumers collected now."""
        with self._lock:
            alive = [r() for r, _ in self._consumers]
        return [c for c in alive if c is not None]

    def describe(self) -> Iterator[Metric]:
        for fam in families([], self.label_names):
            yield _empty(fam.type, fam.name, fam.help)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            pairs = [(r(), v) for r, v in self._consumers]
        sources = [(read_stats(c), v) for c, v in pairs if c is not None]
        for fam in families(sources, self.label_names):
            metric: CounterMetricFamily | GaugeMetricFamily
            if fam.type == "counter":
                metric = CounterMetricFamily(fam.name, fam.help, labels=fam.label_names)
            else:
                metric = GaugeMetricFamily(fam.name, fam.help, labels=fam.label_names)
            for labels, value in fam.samples:
                metric.add_metric(labels, value)
            yield metric


def _empty(kind: str, name: str, doc: str) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, doc)
    return GaugeMetricFamily(name, doc)


_collectors: weakref.WeakKeyDictionary[CollectorRegistry, ConsumerCollector] = weakref.WeakKeyDictionary()
_collectors_lock = threading.Lock()


def register(
    consumer: Consumer,
    registry: CollectorRegistry | None = None,
    *,
    labels: Mapping[str, str] | None = None,
) -> ConsumerCollector:
    """Expose ``consumer``'s counters in ``registry`` (default: prometheus-client's global one).

    One collector serves every consumer registered in the same registry, so
    a process with several consumers calls :func:`register` once for each.

    Args:
        consumer: the :class:`~trio_redis_finalize.Consumer` from
            :func:`~trio_redis_finalize.open_consumer`.
        registry: a ``prometheus_client.CollectorRegistry``; default
            ``prometheus_client.REGISTRY``.
        labels: extra constant labels for this consumer's series, e.g.
            ``{"worker": "billing"}``; every consumer of one registry must
            use the same label names.

    Returns:
        The registry's collector; ``collector.remove(consumer)`` stops
        exposing the consumer.

    Raises:
        ValueError: ``labels`` differ in names from the consumers already
            registered, or the registry already has other metrics named
            ``trf_*``.
    """
    if registry is None:
        registry = REGISTRY
    label_names = tuple(sorted(labels or {}))
    for name in label_names:
        if name in ("subscription", "outcome", "effect", "kind"):
            raise ValueError(f"labels: {name!r} is a label of the library's own")
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = ConsumerCollector(label_names)
            registry.register(collector)
            _collectors[registry] = collector
    collector.add(consumer, labels)
    return collector
