"""Prometheus metrics for consumers (optional: ``pip install 'trio_redis_finalize[prometheus]'``).

The simplest way: serve a consumer's metrics from its own event loop (trio
or asyncio), which also reads the queue gauges from Redis at each scrape::

    from trio_redis_finalize.prometheus import serve

    async with open_consumer(url) as consumer, anyio.create_task_group() as tg:
        await consumer.mount(...)
        await tg.start(serve, consumer, 9108)     # http://127.0.0.1:9108/metrics

``trio-redis-finalize run MODULE:FACTORY --metrics-port 9108`` does this
(on ``127.0.0.1`` unless ``--metrics-host``).
Or register in a registry of your own and expose it as you already do::

    register(consumer)              # prometheus_client.REGISTRY; or register(consumer, my_registry)
    start_http_server(9108)
    tg.start_soon(track_backlog, consumer)   # the queue gauges, read every 5 s

:func:`register` adds a custom collector that reads the consumer's counters
when Prometheus scrapes: the consumer's hot path pays nothing more (it
keeps its plain counters either way), and the figures are the ones
``consumer.stats()`` shows.

Every series is labelled ``form`` (``stream``, ``reliable_list``, ``list``,
``channel``, ``pattern``), ``key`` (the stream, list, channels or pattern)
and ``group`` (the consumer group; empty for the other forms), plus any
extra ``labels=`` given to :func:`register`.  Names start with the prefix
(``prefix=``, default ``trf``):

* ``trf_deliveries_read_total``: deliveries read from Redis, redeliveries
  included, counted when read (not handler calls);
* ``trf_handler_outcomes_total{outcome}``: handler calls by the outcome they
  returned (``ack``, ``retry``, ``drop``, ``retry_after``, ``backoff``: a
  handler error under ``on_error=Backoff``; every one from 0);
* ``trf_handler_duration_seconds``: histogram of handler call durations;
* ``trf_effects_total{effect}``: what finalization did in Redis, every one
  from 0: ``acked``, ``dropped``, ``copied``, ``delayed``, ``held``,
  ``left_pending``, ``dead_lettered``, ``exhausted``, ``nothing``,
  ``lost_before_handling``, ``foreign_copy``, ``gate_closed``, ``failed``,
  ``backed_off``, ``refused``, ``recovered``, ``moved_from_delay_set``,
  ``held_lost``, ``released``, ``gaps``, ``trimmed``;
* ``trf_errors_total{kind}``: ``handler``, ``finalize`` and ``read`` errors,
  ``group_recreated``;
* ``trf_in_flight``: handler calls running now;
* ``trf_held_copies``: runtime ``retry_after`` copies held in process memory
  (lost if the process is killed);
* ``trf_delay_lag_seconds``: how overdue the oldest copy of the durable
  delay set was at the last read (absent while the set is empty);
* ``trf_group_lag``: messages waiting to be read (the group's ``lag`` of
  ``XINFO GROUPS``; Redis 6.2 reports none: then only 0 when the group has
  read everything; a reliable list's length), what autoscalers such as
  KEDA scale on;
* ``trf_pending``: read and not yet finalized (the group's pending entries;
  a reliable list's processing list);
* ``trf_oldest_pending_idle_seconds``: idle time of the group's longest-idle
  pending entry (among the 100 oldest).

The last three are read from Redis by :func:`refresh_backlog` (each scrape of
:func:`serve`, or every ``interval`` seconds in :func:`track_backlog`).
:func:`serve` also exposes prometheus-client's process metrics
(``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ...,
``python_info``, ``python_gc_*``), unless given a ``registry`` of yours.

Importing this module without ``prometheus-client`` installed raises
:class:`ImportError` naming the extra to install.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

try:
    from prometheus_client import (
        REGISTRY,
        CollectorRegistry,
        GCCollector,
        PlatformCollector,
        ProcessCollector,
        generate_latest,
    )
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector
except ImportError as _e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "trio_redis_finalize.prometheus needs prometheus-client: "
        "pip install '.[prometheus]' in a checkout of trio_redis_finalize (its [prometheus] extra)"
    ) from _e

import anyio
from anyio.abc import SocketStream, TaskStatus
from redis import exceptions as rexc

from ._forms import FORMS
from ._metrics import LABELS, Backlog, families, read_samples
from ._stats import DURATION_BOUNDS

if TYPE_CHECKING:
    from ._consumer import Consumer

__all__ = ["ConsumerCollector", "process_registry", "refresh_backlog", "register", "serve",
           "track_backlog"]

log = logging.getLogger("trio_redis_finalize.prometheus")

_backlogs: weakref.WeakKeyDictionary[Any, dict[str, Backlog]] = weakref.WeakKeyDictionary()
_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")


def _pairs(flat: Any) -> dict[str, Any]:
    def s(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    return {s(k): v for k, v in zip(flat[::2], flat[1::2], strict=False)}


async def _backlog_of(consumer: Consumer, mount: Any) -> Backlog | None:
    t = mount.target
    backlog = FORMS[t.form].backlog
    client = consumer.client
    if backlog == "group":
        groups = [_pairs(g) for g in await client.execute("XINFO", "GROUPS", t.source)]
        mine = [g for g in groups if (g["name"].decode() if isinstance(g["name"], bytes)
                                      else str(g["name"])) == t.group]
        if not mine:
            return Backlog(lag=None, pending=0.0, oldest_idle=0.0)
        g = mine[0]
        lag: float | None = None
        if g.get("lag") is not None:
            lag = float(g["lag"])
        else:  # Redis 6.2: no lag field; 0 when the group has read the last entry
            info = _pairs(await client.execute("XINFO", "STREAM", t.source))
            if info.get("last-generated-id") == g.get("last-delivered-id"):
                lag = 0.0
        pending = float(g["pending"])
        idle = 0.0
        if pending:
            rows = await client.execute("XPENDING", t.source, t.group, "-", "+", 100)
            idle = max((int(r[2]) for r in rows), default=0) / 1000
        return Backlog(lag=lag, pending=pending, oldest_idle=idle)
    if backlog == "queue":  # a reliable list's processing list too (a simple list has none)
        waiting = float(await client.execute("LLEN", t.source))
        processing = float(await client.execute("LLEN", t.processing)) if t.processing else None
        return Backlog(lag=waiting, pending=processing)
    return None


async def refresh_backlog(consumer: Consumer) -> None:
    """Read the queue gauges (group lag, pending, oldest pending idle) from Redis now.

    A subscription whose read fails keeps its last values (logged at debug level).
    """
    found = _backlogs.setdefault(consumer, {})
    for m in consumer.mounts:
        try:
            b = await _backlog_of(consumer, m)
        except (rexc.RedisError, OSError) as e:
            log.debug("%s: reading the backlog gauges failed: %s", m.name, e)
            continue
        if b is not None:
            found[m.name] = b


async def track_backlog(consumer: Consumer, interval: float = 5.0) -> None:
    """Run :func:`refresh_backlog` every ``interval`` seconds, forever (start it in a task group)."""
    if not interval > 0:
        raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
    while True:
        await refresh_backlog(consumer)
        await anyio.sleep(interval)


class ConsumerCollector(Collector):
    """A Prometheus collector for one or more consumers (made by :func:`register`).

    Every scrape reads the counters of each consumer still alive (consumers
    are held by weak reference).  Samples of two consumers with the same
    ``form``, ``key``, ``group`` and extra labels are added up (delay lag,
    group lag and oldest idle time: the largest).
    """

    def __init__(self, label_names: tuple[str, ...] = (), prefix: str = "trf") -> None:
        self.label_names = label_names
        self.prefix = prefix
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
        for fam in families([], self.label_names, self.prefix):
            yield _metric(fam.type, fam.name, fam.help, fam.label_names)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            pairs = [(r(), v) for r, v in self._consumers]
        sources = [(read_samples(c, _backlogs.get(c)), v) for c, v in pairs if c is not None]
        for fam in families(sources, self.label_names, self.prefix):
            metric = _metric(fam.type, fam.name, fam.help, fam.label_names)
            for labels, value in fam.samples:
                if isinstance(metric, HistogramMetricFamily):
                    cum, total = value
                    bounds = [*(repr(float(b)) for b in DURATION_BOUNDS), "+Inf"]
                    metric.add_metric(list(labels), list(zip(bounds, cum, strict=True)), total)
                elif isinstance(metric, CounterMetricFamily | GaugeMetricFamily):
                    metric.add_metric(list(labels), value)
            yield metric


def _metric(kind: str, name: str, doc: str, labels: tuple[str, ...]) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, doc, labels=labels)
    if kind == "histogram":
        return HistogramMetricFamily(name, doc, labels=labels)
    return GaugeMetricFamily(name, doc, labels=labels)


_collectors: weakref.WeakKeyDictionary[CollectorRegistry, ConsumerCollector] = weakref.WeakKeyDictionary()
_collectors_lock = threading.Lock()


def register(
    consumer: Consumer,
    registry: CollectorRegistry | None = None,
    *,
    labels: Mapping[str, str] | None = None,
    prefix: str = "trf",
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
        prefix: the start of every metric name (default ``trf``).

    Returns:
        The registry's collector; ``collector.remove(consumer)`` stops
        exposing the consumer.

    Raises:
        ValueError: ``labels`` differ in names from the consumers already
            registered, name a label of the library's own, ``prefix`` is
            not a metric name or differs from the registry's collector's,
            or the registry already has other metrics of those names.
    """
    if registry is None:
        registry = REGISTRY
    if not isinstance(prefix, str) or not _PREFIX.match(prefix):
        raise ValueError(f"prefix must be a metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), got {prefix!r}")
    label_names = tuple(sorted(labels or {}))
    for name in label_names:
        if name in (*LABELS, "outcome", "effect", "kind", "le"):
            raise ValueError(f"labels: {name!r} is a label of the library's own")
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = ConsumerCollector(label_names, prefix)
            registry.register(collector)
            _collectors[registry] = collector
        elif collector.prefix != prefix:
            raise ValueError(f"prefix: this registry's collector uses {collector.prefix!r}, got {prefix!r}")
    collector.add(consumer, labels)
    return collector


_REFRESH_TIMEOUT = 2.0


async def _answer(stream: SocketStream, consumer: Consumer, registry: CollectorRegistry) -> None:
    async with stream:
        request = b""
        with anyio.move_on_after(10):
            while b"\r\n\r\n" not in request and len(request) < 16384:
                try:
                    request += await stream.receive(4096)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
        line = request.split(b"\r\n", 1)[0].split()
        if len(line) < 2 or line[0] not in (b"GET", b"HEAD"):
            status, body, ctype = b"405 Method Not Allowed", b"only GET\n", b"text/plain"
        elif line[1].split(b"?")[0] not in (b"/metrics", b"/"):
            status, body, ctype = b"404 Not Found", b"see /metrics\n", b"text/plain"
        else:
            with anyio.move_on_after(_REFRESH_TIMEOUT):
                await refresh_backlog(consumer)
            body = await anyio.to_thread.run_sync(generate_latest, registry)
            status, ctype = b"200 OK", b"text/plain; version=0.0.4; charset=utf-8"
        head = (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n")
        try:
            await stream.send(head + (b"" if line[:1] == [b"HEAD"] else body))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass


def process_registry() -> CollectorRegistry:
    """A new registry with prometheus-client's process, platform and GC
    collectors (``process_cpu_seconds_total``, ``process_resident_memory_bytes``,
    ``process_open_fds``, ..., ``python_info``, ``python_gc_*``), as its global
    registry has them: what :func:`serve` starts from."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


async def serve(
    consumer: Consumer,
    port: int,
    *,
    host: str = "127.0.0.1",
    prefix: str = "trf",
    registry: CollectorRegistry | None = None,
    labels: Mapping[str, str] | None = None,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``consumer``'s metrics on ``http://host:port/metrics`` until cancelled.

    Runs in the caller's event loop (``await tg.start(serve, consumer, 9108)``);
    each scrape first reads the queue gauges from Redis (bounded by 2 s).

    Args:
        consumer: the consumer to expose.
        port: the TCP port (0: any free one).
        host: the address to listen on (default ``127.0.0.1``: this host
            only, as ``run --metrics-port``; ``0.0.0.0``: every interface,
            for a scraper on another host).
        prefix: the start of every metric name (default ``trf``).
        registry: where to register; default a new registry of its own
            with the process metrics (:func:`process_registry`).
        labels: extra constant labels (see :func:`register`).

    Raises:
        OSError: cannot listen on ``host:port`` (in use, say); the message
            names both.
    """
    if registry is None:
        registry = process_registry()
    register(consumer, registry, labels=labels, prefix=prefix)
    try:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    except OSError as e:
        why = e.strerror or str(e)
        raise OSError(e.errno, f"cannot serve metrics on {host}:{port}: "
                               f"{why[:1].lower() + why[1:]}") from e
    async with listener, anyio.create_task_group() as tg:
        log.info("serving metrics on http://%s:%d/metrics", host, port)
        task_status.started()

        async def handle(stream: SocketStream) -> None:
            await _answer(stream, consumer, registry)

        await listener.serve(handle, task_group=tg)

