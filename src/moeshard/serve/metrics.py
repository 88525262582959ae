"""Prometheus metrics at /metrics: vLLM's names under `moeshard:`, plus what an expert-parallel
engine can say — MoE steps by communication method and the routed tokens each EP rank received.

Request metrics are counted by the server as requests arrive, stream and finish. Engine state
(queues, KV usage, preemptions, MoE counters) is read from the engine when Prometheus scrapes, on
the engine's own thread between two steps, so a scrape never sees a step half-done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moeshard.engine.core import EngineStats

PREFIX = "moeshard:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineCollector:
    """Gauges and engine-side counters, from an `EngineStats` taken for this scrape."""

    def __init__(self, model: str):
        self.model = model
        self.stats: EngineStats | None = None

    def collect(self):
        s = self.stats
        if s is None:
            return
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric([self.model], value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", s.running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (new or preempted).", s.waiting)
        yield gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use (0 to 1), all DP groups.", s.kv_usage)
        steps = CounterMetricFamily(PREFIX + "moe_steps", "Engine steps by the MoE communication method they ran.",
                                    labels=[*labels, "method"])
        for method, count in sorted(s.moe_steps.items()):
            steps.add_metric([self.model, method], count)
        yield steps
        for name, doc, value in (
            ("num_preemptions", "Preemptions (by recompute).", s.preemptions),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
        ):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            counter.add_metric([self.model], value)
            yield counter
        routed = CounterMetricFamily(
            PREFIX + "moe_routed_tokens",
            "Routed (token, expert) assignments received by each expert-parallel rank's experts, all MoE layers.",
            labels=[*labels, "ep_rank"],
        )
        for rank, count in enumerate(s.routed_per_ep_rank):
            routed.add_metric([self.model, str(rank)], count)
        yield routed


class ServerMetrics:
    def __init__(self, model: str):
        disable_created_metrics()  # the *_created series vLLM does not export either
        self.model = model
        self.registry = CollectorRegistry()
        self.engine = EngineCollector(model)
        self.registry.register(self.engine)
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens processed.", **kw)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", **kw)
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.",
            labelnames=["model_name", "finished_reason"], registry=self.registry,
        )
        self.paused = Gauge(PREFIX + "engine_paused", "1 while generation is paused (pause_generation), else 0.", **kw)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS, **kw)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between tokens.", buckets=LATENCY_BUCKETS, **kw)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             buckets=LATENCY_BUCKETS, **kw)

    def track(self, prompt_tokens: int) -> "RequestTimer":
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        return RequestTimer(self)


@dataclass
class RequestTimer:
    """One engine request's latencies, fed as its deltas arrive."""

    metrics: ServerMetrics
    arrival: float = field(default_factory=time.perf_counter)
    last: float | None = None

    def on_delta(self, new_tokens: int, finish_reason: str | None) -> None:
        m, now = self.metrics, time.perf_counter()
        if new_tokens:
            m.generation_tokens.labels(m.model).inc(new_tokens)
            gap = 0.0 if self.last is None else now - self.last
            if self.last is None:
                m.ttft.labels(m.model).observe(now - self.arrival)
                new_tokens -= 1
            for _ in range(new_tokens):  # a delta's tokens arrived together: its gap is shared among them
                m.itl.labels(m.model).observe(gap / new_tokens)
            self.last = now
        if finish_reason is not None:
            m.request_success.labels(m.model, finish_reason).inc()
            m.e2e.labels(m.model).observe(now - self.arrival)
