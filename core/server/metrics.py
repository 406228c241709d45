"""Prometheus metrics and the periodic stats log line of the server.

Metric names follow vLLM's with an ``engine:`` prefix, each labelled with ``model_name``
(speculative decoding adds vLLM's ``spec_decode_*`` counters, the per-position one labelled
with ``position`` too, and its "SpecDecoding metrics" line to the periodic log). Every
app gets its own ``CollectorRegistry`` (no process-global state), so several servers can live in
one process (tests) without clashing.

Two sources feed the metrics:

* latency histograms and the success counter are observed by the engine thread as requests
  progress (``ServerMetrics`` implements ``async_engine.EngineObserver``);
* gauges and token counters are read from the engine's cumulative ``EngineStats`` snapshot when
  Prometheus scrapes (a custom collector), so nothing is double-counted.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

logger = logging.getLogger("engine.server.stats")

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _EngineStatsCollector:
    """Exposes the latest ``EngineStats`` snapshot as gauges and counters at scrape time."""

    def __init__(self, model_name: str, snapshot_source: Any) -> None:
        self._model_name = model_name
        self._source = snapshot_source  # a callable returning EngineStats or None

    def describe(self) -> list:
        return []  # values only exist once the engine runs; nothing to check at registration

    def collect(self):
        stats = self._source()
        if stats is None:
            return
        labels = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("engine:num_requests_running", "Requests in the running batch.",
                    stats.num_running)  # fmt: skip
        yield gauge("engine:num_requests_waiting", "Requests waiting to be scheduled.",
                    stats.num_waiting)  # fmt: skip
        yield gauge("engine:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                    stats.kv_cache_usage)  # fmt: skip
        yield counter("engine:prompt_tokens", "Prompt tokens processed.",
                      stats.prompt_tokens_total)  # fmt: skip
        yield counter("engine:generation_tokens", "Tokens generated.",
                      stats.generation_tokens_total)  # fmt: skip
        yield counter("engine:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)  # fmt: skip
        yield counter("engine:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_cache_hits)  # fmt: skip
        yield counter("engine:num_preemptions", "Requests preempted (KV cache full).",
                      stats.num_preemptions)  # fmt: skip
        spec = getattr(stats, "spec_decoding", None)
        if spec is not None:  # speculative decoding: vLLM's spec_decode_* counters
            yield counter("engine:spec_decode_num_drafts",
                          "Drafts verified (one per request and step that verified any).",
                          spec.num_drafts)  # fmt: skip
            yield counter("engine:spec_decode_num_draft_tokens", "Draft tokens verified.",
                          spec.num_draft_tokens)  # fmt: skip
            yield counter("engine:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          spec.num_accepted_tokens)  # fmt: skip
            per_pos = CounterMetricFamily(
                "engine:spec_decode_num_accepted_tokens_per_pos",
                "Drafts whose token at this position was accepted.",
                labels=["model_name", "position"],
            )
            for pos, value in enumerate(spec.num_accepted_tokens_per_pos):
                per_pos.add_metric([self._model_name, str(pos)], value)
            yield per_pos


class _BulkHistogram:
    """A Prometheus histogram that takes ``count`` equal observations in one call.

    The engine thread reports inter-token latencies once per step, grouped (a decode batch
    mostly shares one interval), so observing costs one lock per step, not one per token.
    """

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model_name: str) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe_many(self, pairs: list[tuple[float, int]]) -> None:
        with self._lock:
            for value, count in pairs:
                self.counts[bisect.bisect_left(self.bounds, value)] += count
                self.sum += value * count

    def describe(self) -> list:
        return []

    def collect(self):
        with self._lock:
            counts, total_sum = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, float("inf")], counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        family.add_metric([self.model_name], buckets, sum_value=total_sum)
        yield family


class ServerMetrics:
    """The metrics of one server app, in their own registry; an ``EngineObserver``."""

    def __init__(self, model_name: str, log_stats_interval_s: float = 10.0) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self._latest_stats: Any = None
        self.registry.register(_EngineStatsCollector(model_name, lambda: self._latest_stats))
        label = ["model_name"]
        self._ttft = Histogram(
            "engine:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            label,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._itl = _BulkHistogram(
            "engine:inter_token_latency_seconds",
            "Time between two generated tokens of a request.",
            _ITL_BUCKETS,
            model_name,
        )
        self.registry.register(self._itl)
        self._e2e = Histogram(
            "engine:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            label,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._success = Counter(
            "engine:request_success",
            "Completions finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._success_by_reason: dict[str, Any] = {}
        self.stats_logger = StatsLogger(log_stats_interval_s)

    # EngineObserver (engine thread)
    def on_first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def on_inter_tokens(self, intervals: list[tuple[float, int]]) -> None:
        self._itl.observe_many(intervals)

    def on_finished(self, e2e_s: float, finish_reasons: list[str | None]) -> None:
        self._e2e.observe(e2e_s)
        for reason in finish_reasons:
            reason = reason or "unknown"
            child = self._success_by_reason.get(reason)
            if child is None:
                child = self._success.labels(self.model_name, reason)
                self._success_by_reason[reason] = child
            child.inc()

    def on_stats(self, stats: Any, now: float) -> None:
        self._latest_stats = stats
        self.stats_logger.maybe_log(stats, now)

    def render(self) -> bytes:
        """The Prometheus text exposition of this app's metrics."""
        return generate_latest(self.registry)


class StatsLogger:
    """Logs one line of engine throughput and load every ``interval_s`` while it is busy."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last: Any = None

    def maybe_log(self, stats: Any, now: float) -> str | None:
        """Log (and return) a stats line when the interval elapsed and anything happened."""
        if self.interval_s <= 0:
            return None
        if self._last is None:
            self._last, self._last_time = stats, now
            return None
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return None
        last = self._last
        prompt = stats.prompt_tokens_total - last.prompt_tokens_total
        gen = stats.generation_tokens_total - last.generation_tokens_total
        self._last, self._last_time = stats, now
        busy = prompt or gen or stats.num_running or stats.num_waiting
        if not busy:
            return None
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        hit_rate = 100.0 * hits / queries if queries else 0.0
        line = (
            f"prompt throughput: {prompt / elapsed:.1f} tokens/s, "
            f"generation throughput: {gen / elapsed:.1f} tokens/s, "
            f"running: {stats.num_running} reqs, waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, "
            f"prefix cache hit rate: {hit_rate:.1f}%, "
            f"preemptions: {stats.num_preemptions - last.num_preemptions}"
        )
        logger.info(line)
        spec, spec_last = (
            getattr(stats, "spec_decoding", None),
            getattr(last, "spec_decoding", None),
        )
        if spec is not None and spec_last is not None:
            from engine.spec_decode.stats import log_line

            spec_line = log_line(spec, spec_last, elapsed)
            if spec_line is not None:
                logger.info(spec_line)
                line += "\n" + spec_line
        return line
