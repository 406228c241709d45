"""Prometheus metrics and the periodic stats log line of the server.

Metric names follow vLLM's with an ``engine:`` prefix, each labelled with ``model_name``; the
engine cores' gauges and counters also carry an ``engine`` label (the data-parallel rank), as
vLLM's do (speculative decoding adds vLLM's ``spec_decode_*`` counters, the per-position one
labelled with ``position`` too, and its "SpecDecoding metrics" line to the periodic log). Two
sources feed them:

* per-request latency histograms and the success counter are observed by the front end that
  served the request, as its outputs come back (``ServerMetrics`` implements
  ``async_engine.EngineObserver``);
* gauges and token counters are the engine cores' own cumulative ``EngineStats``, read at
  scrape time (a custom collector) from the latest stats every core sent, so nothing is
  double-counted.

One front end: every app has its own ``CollectorRegistry`` (several servers can live in one
process, as in tests). Several front ends (``--api-server-count``): prometheus-client's
multiprocess mode, with ``PROMETHEUS_MULTIPROC_DIR`` set by the parent before the front ends
start; each front end's observations go to files there and a scrape of any front end sums
them all (``MultiProcessCollector``). Every front end receives every core's stats, so the
engine metrics are rendered once, not summed across front ends.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.engine_core.client import sum_stats

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

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_mode() -> bool:
    """Whether this process writes its metrics for a multiprocess scrape."""
    return bool(os.environ.get(MULTIPROC_ENV))


class _EngineStatsCollector:
    """Exposes the latest ``EngineStats`` of every engine core as gauges and counters."""

    def __init__(self, model_name: str, snapshot_source: Any) -> None:
        self._model_name = model_name
        self._source = snapshot_source  # a callable returning {engine index: EngineStats}

    def describe(self) -> list:
        return []  # values only exist once the engine runs; nothing to check at registration

    def collect(self):
        by_engine = self._source()
        if not by_engine:
            return
        names = ["model_name", "engine"]
        rows = [([self._model_name, str(i)], by_engine[i]) for i in sorted(by_engine)]

        def family(kind: Any, name: str, doc: str, field: str) -> Any:
            f = kind(name, doc, labels=names)
            for labels, stats in rows:
                f.add_metric(labels, getattr(stats, field))
            return f

        g, c = GaugeMetricFamily, CounterMetricFamily
        yield family(g, "engine:num_requests_running", "Requests in the running batch.",
                     "num_running")  # fmt: skip
        yield family(g, "engine:num_requests_waiting", "Requests waiting to be scheduled.",
                     "num_waiting")  # fmt: skip
        yield family(g, "engine:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                     "kv_cache_usage")  # fmt: skip
        yield family(c, "engine:prompt_tokens", "Prompt tokens processed.",
                     "prompt_tokens_total")  # fmt: skip
        yield family(c, "engine:generation_tokens", "Tokens generated.",
                     "generation_tokens_total")  # fmt: skip
        yield family(c, "engine:prefix_cache_queries",
                     "Prompt tokens looked up in the prefix cache.",
                     "prefix_cache_queries")  # fmt: skip
        yield family(c, "engine:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     "prefix_cache_hits")  # fmt: skip
        yield family(c, "engine:num_preemptions", "Requests preempted (KV cache full).",
                     "num_preemptions")  # fmt: skip
        specs = [(labels, stats.spec_decoding) for labels, stats in rows if stats.spec_decoding]
        if specs:  # speculative decoding: vLLM's spec_decode_* counters
            for name, doc, field in (
                ("engine:spec_decode_num_drafts",
                 "Drafts verified (one per request and step that verified any).", "num_drafts"),
                ("engine:spec_decode_num_draft_tokens", "Draft tokens verified.",
                 "num_draft_tokens"),
                ("engine:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 "num_accepted_tokens"),
            ):  # fmt: skip
                f = c(name, doc, labels=names)
                for labels, spec in specs:
                    f.add_metric(labels, getattr(spec, field))
                yield f
            per_pos = c(
                "engine:spec_decode_num_accepted_tokens_per_pos",
                "Drafts whose token at this position was accepted.",
                labels=[*names, "position"],
            )
            for labels, spec in specs:
                for pos, value in enumerate(spec.num_accepted_tokens_per_pos):
                    per_pos.add_metric([*labels, str(pos)], value)
            yield per_pos


def observe_many(histogram: Any, pairs: list[tuple[float, int]]) -> None:
    """``count`` observations of ``value`` for each pair, at the cost of one per pair.

    The front end reports inter-token latencies once per core step, grouped (a decode batch
    mostly shares one interval), so this is one bucket increment per group, not one observe
    per token. It adds to the histogram's own bucket and sum values (what ``observe`` does),
    which works in both the single-process and the multiprocess mode."""
    bounds = histogram._upper_bounds
    buckets = histogram._buckets
    total = histogram._sum
    for value, count in pairs:
        total.inc(value * count)
        buckets[bisect.bisect_left(bounds, value)].inc(count)


class ServerMetrics:
    """The metrics of one server app; an ``EngineObserver``."""

    def __init__(self, model_name: str, log_stats_interval_s: float = 10.0) -> None:
        self.model_name = model_name
        self.multiprocess = multiprocess_mode()
        # Multiprocess: the metrics live in the shared files, a scrape gathers them.
        self.registry = CollectorRegistry(auto_describe=False)
        metric_registry = None if self.multiprocess else self.registry
        self._latest_stats: dict[int, Any] = {}
        self._engine_collector = _EngineStatsCollector(model_name, lambda: self._latest_stats)
        self.registry.register(self._engine_collector)
        label = ["model_name"]
        self._ttft = Histogram(
            "engine:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            label,
            buckets=_TTFT_BUCKETS,
            registry=metric_registry,
        ).labels(model_name)
        self._itl = Histogram(
            "engine:inter_token_latency_seconds",
            "Time between two generated tokens of a request.",
            label,
            buckets=_ITL_BUCKETS,
            registry=metric_registry,
        ).labels(model_name)
        self._e2e = Histogram(
            "engine:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            label,
            buckets=_E2E_BUCKETS,
            registry=metric_registry,
        ).labels(model_name)
        self._success = Counter(
            "engine:request_success",
            "Completions finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=metric_registry,
        )
        self._success_by_reason: dict[str, Any] = {}
        self.stats_logger = StatsLogger(log_stats_interval_s)

    # EngineObserver (the event loop's thread)
    def on_first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def on_inter_tokens(self, intervals: list[tuple[float, int]]) -> None:
        observe_many(self._itl, intervals)

    def on_finished(self, e2e_s: float, finish_reasons: list[str | None]) -> None:
        self._e2e.observe(e2e_s)
        for reason in finish_reasons:
            reason = reason or "unknown"
            child = self._success_by_reason.get(reason)
            if child is None:
                child = self._success.labels(self.model_name, reason)
                self._success_by_reason[reason] = child
            child.inc()

    def on_stats(self, stats: dict[int, Any], now: float) -> None:
        self._latest_stats = stats
        self.stats_logger.update(sum_stats([stats[i] for i in sorted(stats)]), now)

    def render(self) -> bytes:
        """The Prometheus text exposition of this server's metrics."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(registry)
        registry.register(self._engine_collector)
        return generate_latest(registry)


class StatsLogger:
    """Logs one line of engine throughput and load every ``interval_s`` while it is busy."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last: Any = None
        self._latest: Any = None

    def update(self, stats: Any, now: float) -> None:
        """New stats from the engine cores (logged if the interval elapsed)."""
        self._latest = stats
        self.maybe_log(stats, now)

    def tick(self, now: float) -> None:
        """A timer's call: log the latest stats if the interval elapsed (the cores send none
        while idle, so this gives a busy period its last line)."""
        if self._latest is not None:
            self.maybe_log(self._latest, now)

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
