"""Prometheus metrics for one server: what `GET /metrics` renders.

`Metrics` owns a per-server `CollectorRegistry` (no module-global state, so tests and
several servers in one process never share counters). Events are counted by small
hooks that the protocol (requests), the scheduler (batches, dropped items) and the
executor (poisoned items) call when they are given a `Metrics`, or for a served model its
`ModelMetrics` (the same hooks, labelled with the model's name); state that already
lives somewhere (queue depth, queued tokens, worker state and restarts) is read at
scrape time by `StateCollector`, so nothing has to be kept in step. Every series about a
model's queue, batches or workers carries a `model` label. Event-loop lag is
measured by a small periodic task.

With several HTTP processes (`--http-processes`), each process keeps its own `Metrics`
and a scrape merges them all (`families`, `merge_families`, `render_families`):
counters and histograms are summed, gauges give their highest value, so that one
`/metrics` answer covers the whole server. This module never imports h11 or torch.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest as render_collector
from prometheus_client.utils import floatToGoString

from rawserve.shared.messages import GenerationPasses
from rawserve.shared.tallies import INTER_TOKEN_BUCKETS, WAIT_BUCKETS, Counts, Tally

DROP_REASONS = ("rejected", "expired", "disconnected", "poison")
OTHER_ROUTE = "other"  # the label of paths that are not routes (keeps cardinality bounded)
# Methods other than these are counted as "other": a client may send any token as a method.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# The classic text format, which every Prometheus reads (generate_latest writes it).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LOOP_LAG_INTERVAL = 0.5  # seconds between two event-loop lag probes

# A metric family as plain data, to cross a pipe: (name, type, documentation, unit,
# samples), a sample being (name, labels, value).
Sample = tuple[str, dict[str, str], float]
Family = tuple[str, str, str, str, list[Sample]]

# Each reaches what the server allows: a request's --max-timeout (300 s), a batch's
# --batch-timeout (120 s, a generation's sequence to its last token), and batches well
# past a GPU's usual --max-batch-size (a time past the last bound reads as that bound in
# histogram_quantile: a 111 s generation was a p99 of 30 s, its compute one of 5 s)
REQUEST_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
COMPUTE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
)  # fmt: skip
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    """The counters and histograms of one server, and the hooks that feed them."""

    def __init__(self, routes: Collection[str] = (), registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.routes = set(routes)
        r = self.registry
        self.requests = Counter(
            "rawserve_requests",
            "HTTP responses sent, by route, method and status code",
            ["route", "method", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "rawserve_request_duration_seconds",
            "Time from a request's head to its last response byte, by route",
            ["route"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "rawserve_batch_size",
            "Items per model call",
            ["model"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.batch_compute = Histogram(
            "rawserve_batch_compute_seconds",
            "Time a worker spent computing one batch",
            ["model"],
            buckets=COMPUTE_BUCKETS,
            registry=r,
        )
        self.dropped = Counter(
            "rawserve_items_dropped",
            "Items answered without a model call (rejected: queue full or workers down; "
            "expired: deadline passed while queued; disconnected: the client left; poison: "
            "crashed or hung a worker)",
            ["model", "reason"],
            registry=r,
        )
        self.stream_errors = Counter(
            "rawserve_stream_errors",
            "Token streams that ended with an error event, by model and the error's status "
            "(their head went out as 200: rawserve_requests_total counts them so)",
            ["model", "status"],
            registry=r,
        )
        self.generation_passes = Counter(
            "rawserve_generation_passes",
            "Forward passes of a continuous generation loop, by kind (prefill: joining "
            "prompts, a long prompt's chunk, prompt scoring; decode: a step of every row)",
            ["model", "kind"],
            registry=r,
        )
        self.generation_pass_tokens = Counter(
            "rawserve_generation_pass_tokens",
            "Tokens those passes ran, by kind (prefill: prompt tokens read; decode: rows "
            "stepped, a new token each): decode tokens per decode pass is the batch's rows",
            ["model", "kind"],
            registry=r,
        )
        self.connections_refused = Counter(
            "rawserve_connections_refused",
            "Connections refused past --max-connections and its probe seats (503 too many "
            "open connections, before or after their request was read; over TLS, closed)",
            registry=r,
        )
        self.latencies = TalliedHistograms(LATENCIES)
        r.register(self.latencies)
        self._state = StateCollector()
        r.register(self._state)
        self.loop_lag = Histogram(
            "rawserve_event_loop_lag_seconds",
            "How late the event loop woke up for a timer (a busy or blocked loop shows here)",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.loop_lag_last = Gauge(
            "rawserve_event_loop_lag_last_seconds",
            "The latest event-loop lag probe",
            registry=r,
        )
        self._lag_task: asyncio.Task | None = None
        # (route, method, status) -> the counter and histogram children it feeds: looking
        # them up by labels on every response costs more than the rest of the bookkeeping
        self._request_series: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}

    def count_http_processes(self, listening: Callable[[], int]) -> None:
        """With --http-processes N > 1 (the serving process's): a gauge of those listening
        now, read at each scrape. (One that could not start again, its TLS files
        unreadable, left the server serving on fewer, seen in the log and /info alone.)"""
        gauge = Gauge(
            "rawserve_http_processes_listening",
            "HTTP processes listening now (of --http-processes; one being replaced is not)",
            registry=self.registry,
        )
        gauge.set_function(lambda: float(listening()))

    # --- hooks ------------------------------------------------------------------------

    def name_routes(self, paths: Collection[str]) -> None:
        """Count requests to these paths by path; any other path counts as "other"."""
        self.routes.update(paths)

    def observe_request(self, path: str, method: str, status: int, seconds: float) -> None:
        route = path if path in self.routes else OTHER_ROUTE
        method = method if method in KNOWN_METHODS else "other"
        key = (route, method, status)
        series = self._request_series.get(key)
        if series is None:
            series = (
                self.requests.labels(route, method, str(status)),
                self.request_duration.labels(route),
            )
            self._request_series[key] = series
        count, duration = series
        count.inc()
        duration.observe(seconds)

    def observe_refused_connection(self) -> None:
        self.connections_refused.inc()

    def for_model(self, name: str) -> ModelMetrics:
        """The hooks of one served model's scheduler and executor: its series, labelled."""
        return ModelMetrics(self, name)

    # --- wiring -----------------------------------------------------------------------

    def watch(self, name: str, scheduler: QueueState, executor: WorkerPool) -> None:
        """Export a model's queue and workers, read at scrape time."""
        self._state.models.append((name, scheduler, executor))

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the event-loop lag probe."""
        loop = loop or asyncio.get_running_loop()
        self._lag_task = loop.create_task(self._probe_loop_lag(loop), name="rawserve-loop-lag")

    async def stop(self) -> None:
        if self._lag_task is not None:
            self._lag_task.cancel()
            await asyncio.gather(self._lag_task, return_exceptions=True)

    async def _probe_loop_lag(
        self, loop: asyncio.AbstractEventLoop, interval: float = LOOP_LAG_INTERVAL
    ) -> None:
        while True:
            await self.probe_loop_lag(loop, interval)

    async def probe_loop_lag(self, loop: asyncio.AbstractEventLoop, interval: float) -> float:
        """Sleep `interval` and record how much later than asked the loop woke us."""
        asked = loop.time() + interval
        await asyncio.sleep(interval)
        lag = max(0.0, loop.time() - asked)
        self.loop_lag.observe(lag)
        self.loop_lag_last.set(lag)
        return lag

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE

    async def scrape(self) -> tuple[bytes, str]:
        """What `GET /metrics` answers: this server's exposition (`render`)."""
        return self.render()

    def families(self) -> list[Family]:
        """This process's metrics as plain data, to be merged with other processes'."""
        return [
            (
                family.name,
                family.type,
                family.documentation,
                family.unit,
                [(sample.name, dict(sample.labels), sample.value) for sample in family.samples],
            )
            for family in self.registry.collect()
        ]


def merge_families(processes: Sequence[Sequence[Family]]) -> list[Family]:
    """Several processes' families as one server's: counters and histograms summed, a
    gauge's highest value, a series' creation time its earliest."""
    merged: dict[
        str, tuple[str, str, str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]
    ] = {}
    for families in processes:
        for name, kind, documentation, unit, samples in families:
            _, _, _, values = merged.setdefault(name, (kind, documentation, unit, {}))
            for sample, labels, value in samples:
                key = (sample, tuple(sorted(labels.items())))
                if key not in values:
                    values[key] = value
                elif sample.endswith("_created"):
                    values[key] = min(values[key], value)
                elif kind == "gauge":
                    values[key] = max(values[key], value)
                else:
                    values[key] += value
    return [
        (
            name,
            kind,
            documentation,
            unit,
            [(s, dict(labels), v) for (s, labels), v in values.items()],
        )
        for name, (kind, documentation, unit, values) in merged.items()
    ]


class MergedFamilies:
    """A collector that yields families given as plain data (for `render_families`)."""

    def __init__(self, families: Sequence[Family]):
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for name, kind, documentation, unit, samples in self._families:
            family = Metric(name, documentation, kind, unit)
            for sample, labels, value in samples:
                family.add_sample(sample, labels, value)
            yield family


def render_families(families: Sequence[Family]) -> bytes:
    """The Prometheus text exposition of merged families."""
    return render_collector(MergedFamilies(families))


class ModelMetrics:
    """What one served model's scheduler and executor count, labelled with its name."""

    def __init__(self, metrics: Metrics, name: str):
        self.name = name
        self._batch_size = metrics.batch_size.labels(name)
        self._batch_compute = metrics.batch_compute.labels(name)
        # every reason is exported, 0 until it happens
        self._dropped = {reason: metrics.dropped.labels(name, reason) for reason in DROP_REASONS}
        self._passes = metrics.generation_passes
        self._stream_errors = metrics.stream_errors
        self._pass_tokens = metrics.generation_pass_tokens
        self._latencies = metrics.latencies

    def observe_batch(self, size: int, compute_seconds: float) -> None:
        self._batch_size.observe(size)
        self._batch_compute.observe(compute_seconds)

    def observe_queue(self, waits: Sequence[float]) -> None:
        """How long each item of a batch leaving for a worker waited in the queue."""
        self._latencies.observe(SCHEDULER_QUEUE_SECONDS, self.name, waits)

    def drop(self, reason: str, count: int = 1) -> None:
        if count > 0:
            self._dropped[reason].inc(count)

    def stream_error(self, status: int) -> None:
        self._stream_errors.labels(self.name, str(status)).inc()

    def count_passes(self, passes: GenerationPasses) -> None:
        """A generation worker's passes and its sequences' latencies (exported once a
        model generates continuously)."""
        for kind, count, tokens in (
            ("prefill", passes.prefills, passes.prompt_tokens),
            ("decode", passes.steps, passes.rows),
        ):
            self._passes.labels(self.name, kind).inc(count)
            self._pass_tokens.labels(self.name, kind).inc(tokens)
        for name, counts in (
            (QUEUE_SECONDS, passes.queue),
            (FIRST_TOKEN_SECONDS, passes.first_token),
            (INTER_TOKEN_SECONDS, passes.inter_token),
        ):
            if counts is not None:
                self._latencies.add(name, self.name, counts)


class QueueState(Protocol):
    """What the metrics read of a scheduler at scrape time (rawserve.serving.driver.Scheduler)."""

    @property
    def core(self) -> SchedulerCoreState: ...

    @property
    def in_flight(self) -> int: ...


class SequencePaceState(Protocol):
    """A continuous worker's learned decoding step (rawserve.serving.sequences.SequencePace)."""

    @property
    def most_rows(self) -> float: ...

    @property
    def trusted(self) -> bool: ...

    def step_seconds(self, rows: float) -> float | None: ...


class AnswerLengthsState(Protocol):
    """The likely length of answers (rawserve.serving.sequences.AnswerLengths)."""

    def within(self) -> float | None: ...


class SchedulerCoreState(Protocol):
    max_queue: int
    items_per_second: float | None

    @property
    def pace(self) -> SequencePaceState: ...

    @property
    def answer_lengths(self) -> AnswerLengthsState: ...

    def __len__(self) -> int: ...

    def queued_tokens(self) -> int: ...


class WorkerView(Protocol):
    """One worker as the executor reports it (rawserve.serving.status.WorkerStatus)."""

    @property
    def index(self) -> int: ...

    @property
    def device(self) -> str: ...

    @property
    def state(self) -> enum.Enum: ...

    @property
    def restarts(self) -> int: ...

    @property
    def serving(self) -> bool:
        """Its model is loaded (idle or busy)."""
        ...


class WorkerPool(Protocol):
    """What the metrics read of an executor at scrape time (rawserve.serving.pool.WorkerPool)."""

    def status(self) -> Sequence[WorkerView]: ...


SCHEDULER_QUEUE_SECONDS = "rawserve_queue_seconds"
QUEUE_SECONDS = "rawserve_generation_queue_seconds"
FIRST_TOKEN_SECONDS = "rawserve_generation_time_to_first_token_seconds"
INTER_TOKEN_SECONDS = "rawserve_generation_inter_token_seconds"
# the scheduler's queue, and a continuous generation worker's latencies, counted there
# (rawserve.worker.token_times): name: (documentation, bucket bounds)
LATENCIES = {
    SCHEDULER_QUEUE_SECONDS: (
        "From an item's admission to its batch leaving for a worker (waiting for a free "
        "worker, or for its batch to fill)",
        WAIT_BUCKETS,
    ),
    QUEUE_SECONDS: (
        "From a generation's admission to the start of the loop step that prefilled it "
        "(the queue, the pipe to the worker, the step under way, a wait for a free row, "
        "and for company with --join-wait-steps)",
        WAIT_BUCKETS,
    ),
    FIRST_TOKEN_SECONDS: (
        "From a generation's admission to its first new token, made by the worker",
        WAIT_BUCKETS,
    ),
    INTER_TOKEN_SECONDS: (
        "Between two tokens of one generated sequence, made by the worker",
        INTER_TOKEN_BUCKETS,
    ),
}


class TalliedHistograms:
    """Histograms whose observations come already counted into buckets (a worker's
    `Counts`, rawserve.shared.tallies), labelled by model: each series is the sum of the
    counts added to it, exported from the first."""

    def __init__(self, families: dict[str, tuple[str, tuple[float, ...]]]):
        self.families = families
        # (family, model): per-bucket counts (not cumulative) and the sum, so far
        self._series: dict[tuple[str, str], tuple[list[int], list[float]]] = {}

    def add(self, family: str, model: str, counts: Counts) -> None:
        """Counts made elsewhere (a worker's), with this family's bounds."""
        buckets, total = self._series_of(family, model)
        if len(counts.buckets) != len(buckets):
            raise ValueError(f"{family}: {len(counts.buckets)} buckets for {len(buckets)}")
        for index, count in enumerate(counts.buckets):
            buckets[index] += count
        total[0] += counts.total

    def observe(self, family: str, model: str, values: Sequence[float]) -> None:
        """Observations made here, counted at once."""
        tally = Tally(self.families[family][1])
        for value in values:
            tally.observe(value)
        counts = tally.taken()
        if counts is not None:
            self.add(family, model, counts)

    def _series_of(self, family: str, model: str) -> tuple[list[int], list[float]]:
        series = self._series.get((family, model))
        if series is None:
            _, bounds = self.families[family]
            series = self._series[family, model] = ([0] * (len(bounds) + 1), [0.0])
        return series

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: its series are only known at collect time

    def collect(self) -> Iterator[Metric]:
        for name, (documentation, bounds) in self.families.items():
            family = HistogramMetricFamily(name, documentation, labels=["model"])
            edges = [floatToGoString(bound) for bound in (*bounds, float("inf"))]
            for (series, model), (buckets, total) in self._series.items():
                if series == name:
                    cumulative = itertools.accumulate(buckets)
                    family.add_metric([model], list(zip(edges, cumulative, strict=True)), total[0])
            yield family  # (with no series yet: its help and type, as prometheus_client's)


class StateCollector:
    """Reads each served model's queue and workers when Prometheus scrapes (no hooks to
    keep in step); every family carries the `model` label."""

    def __init__(self) -> None:
        self.models: list[tuple[str, QueueState, WorkerPool]] = []

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: its families are only known at collect time

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "rawserve_queue_depth", "Items waiting in the queue", labels=["model"]
        )
        limit = GaugeMetricFamily(
            "rawserve_queue_limit", "The queue bound (--max-queue)", labels=["model"]
        )
        tokens = GaugeMetricFamily(
            "rawserve_queued_tokens",
            "Estimated tokens of the items waiting in the queue",
            labels=["model"],
        )
        in_flight = GaugeMetricFamily(
            "rawserve_items_in_flight", "Items inside model calls", labels=["model"]
        )
        rate = GaugeMetricFamily(
            "rawserve_service_rate_items_per_second",
            "Items answered per second while the model had work in flight, all its workers "
            "together (smoothed): its service rate under load",
            labels=["model"],
        )
        ready = GaugeMetricFamily(
            "rawserve_worker_ready",
            "1 when the worker has its model loaded (idle or busy), else 0",
            labels=["model", "worker", "device"],
        )
        state = GaugeMetricFamily(
            "rawserve_worker_state",
            "1 for the state each worker is in",
            labels=["model", "worker", "state"],
        )
        step = GaugeMetricFamily(
            "rawserve_generation_step_seconds",
            "A decoding step's seconds as the scheduler has learned them, beside one row and "
            "beside the most rows measured (once trusted)",
            labels=["model", "rows"],
        )
        rows = GaugeMetricFamily(
            "rawserve_generation_rows_measured",
            "The most rows a sequence has run beside on average (the step's line is read no "
            "further)",
            labels=["model"],
        )
        likely = GaugeMetricFamily(
            "rawserve_generation_likely_new_tokens",
            "New tokens nine in ten answers stay within, those run to their cap or stopped "
            "counted as at least that long (+Inf: more than a tenth may run past every "
            "answer that ended on its own), once 20 answers are seen",
            labels=["model"],
        )
        restarts = CounterMetricFamily(
            "rawserve_worker_restarts",
            "Times a worker process died and was restarted",
            labels=["model", "worker"],
        )
        for name, scheduler, executor in self.models:
            core = scheduler.core
            depth.add_metric([name], len(core))
            limit.add_metric([name], core.max_queue)
            tokens.add_metric([name], core.queued_tokens())
            in_flight.add_metric([name], scheduler.in_flight)
            if core.items_per_second is not None:
                rate.add_metric([name], core.items_per_second)
            if core.pace.trusted:
                pace = core.pace
                for label, beside in (("one", 1.0), ("most", pace.most_rows)):
                    step.add_metric([name, label], pace.step_seconds(beside) or 0.0)
                rows.add_metric([name], pace.most_rows)
            within = core.answer_lengths.within()
            if within is not None:
                likely.add_metric([name], within)
            for worker in executor.status():
                index = str(worker.index)
                ready.add_metric([name, index, worker.device], float(worker.serving))
                for value in type(worker.state):
                    state.add_metric([name, index, value.value], float(value is worker.state))
                restarts.add_metric([name, index], worker.restarts)
        yield from (
            depth,
            limit,
            tokens,
            in_flight,
            rate,
            step,
            rows,
            likely,
            ready,
            state,
            restarts,
        )
