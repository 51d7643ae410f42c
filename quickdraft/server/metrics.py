"""Prometheus metrics of the server: latencies as clients see them, and speculation at work.

Latencies start when the request arrives (queueing included): time to first token, inter-token
latency (a step that emits n tokens after a gap dt counts n gaps of dt / n, as a client reading
the stream sees them on average) and end to end. tau = tokens emitted per target pass.
Each app has its own registry, so several apps (tests) never share counters.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from quickdraft.engine import RequestStats
from quickdraft.prefix_cache import PrefixCache

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """The server's metrics in a registry of their own; ``prefix``: the prefix cache to report."""

    def __init__(self, prefix: PrefixCache | None = None) -> None:
        """One declaration per metric, in a flat list (longer than 60 lines, and simplest so)."""
        r = self.registry = CollectorRegistry()
        p = "quickdraft_"
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time between output tokens",
            buckets=_ITL,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds", "Arrival to last token", buckets=_E2E, registry=r
        )
        self.requests = Counter(
            p + "requests", "Finished generations", ["finish_reason"], registry=r
        )
        self.cancelled = Counter(
            p + "requests_cancelled", "Generations stopped because the client left", registry=r
        )
        self.failed = Counter(p + "requests_failed", "Generations that raised an error", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of requests", registry=r)
        self.cached_tokens = Counter(
            p + "prompt_tokens_cached", "Prompt tokens reused from the prefix cache (not computed)", registry=r
        )
        self.cache_hit_rate = Gauge(
            p + "prefix_cache_hit_rate", "Share of prompt tokens reused from the prefix cache", registry=r
        )
        self.cache_bytes = Gauge(p + "prefix_cache_bytes", "Host bytes of stored prefix-cache copies", registry=r)
        self.cache_entries = Gauge(p + "prefix_cache_entries", "Sequences stored in the prefix cache", registry=r)
        self.prefix = prefix
        self.generation_tokens = Counter(
            p + "generation_tokens", "Output tokens generated", registry=r
        )
        self.drafted = Counter(
            p + "spec_drafted_tokens", "Tokens proposed by the drafter", registry=r
        )
        self.accepted = Counter(
            p + "spec_accepted_tokens", "Drafted tokens the target accepted", registry=r
        )
        self.passes = Counter(
            p + "spec_target_passes", "Target verify/decode passes after prefill", registry=r
        )
        self.tau = Gauge(
            p + "spec_tau", "Tokens emitted per target pass, over all requests", registry=r
        )
        self.running = Gauge(p + "requests_running", "Generations running at once", registry=r)
        self.max_running = Gauge(p + "requests_running_max", "Generations the engine can run at once (--max-concurrency)",
                                 registry=r)
        self.batch_sequences = Histogram(
            p + "batch_sequences", "Generations sharing an engine pass", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
            registry=r,
        )
        self.batch_rows = Histogram(
            p + "batch_rows", "Rows of an engine pass (prompt chunks, last tokens and drafts of every generation)",
            buckets=(1, 2, 4, 8, 16, 24, 32, 48, 64), registry=r,
        )
        self.waiting = Gauge(p + "requests_waiting", "Requests queued for the engine", registry=r)
        self._lock = threading.Lock()
        self._emitted = 0  # accepted + passes, for tau
        self._passes = 0

    def request_timer(self, arrived: float) -> RequestTimer:
        return RequestTimer(self, arrived)

    def record_stats(self, stats: RequestStats, finish_reason: str | None) -> None:
        self.requests.labels(finish_reason or "cancelled").inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.generation_tokens.inc(stats.output_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.passes.inc(stats.target_passes)
        with self._lock:
            self._emitted += stats.accepted + stats.target_passes
            self._passes += stats.target_passes
            if self._passes:
                self.tau.set(self._emitted / self._passes)
        if self.prefix is not None:  # the engine thread: the cache is not changing now
            pc = self.prefix.stats
            self.cache_hit_rate.set(pc.cached_tokens / pc.prompt_tokens if pc.prompt_tokens else 0.0)
            self.cache_bytes.set(self.prefix.nbytes)
            self.cache_entries.set(len(self.prefix.entries))


class RequestTimer:
    """Latency observations for one request, fed by the engine thread step by step."""

    def __init__(self, metrics: ServerMetrics, arrived: float) -> None:
        self.metrics = metrics
        self.arrived = arrived
        self.last: float | None = None

    def step(self, num_tokens: int) -> None:
        now = time.perf_counter()
        if num_tokens == 0:
            return
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrived)
            gaps, dt = num_tokens - 1, 0.0  # tokens that came with the first one: no wait
        else:
            gaps, dt = num_tokens, (now - self.last) / num_tokens
        for _ in range(gaps):
            self.metrics.itl.observe(dt)
        self.last = now

    def finish(self, stats: RequestStats, finish_reason: str | None) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrived)
        self.metrics.record_stats(stats, finish_reason)
