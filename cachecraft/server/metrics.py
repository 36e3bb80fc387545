"""Prometheus metrics of one server, in its own CollectorRegistry (never the global one).

Request counters and TTFT/latency histograms are updated by the app; store bytes, variants,
hits, misses and evictions and the engine's queue are read live at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cachecraft.engine.engine import Engine
from cachecraft.engine.report import RequestReport
from cachecraft.store.base import ChunkStore

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _LiveCollector:
    """Reads the store's and the engine's state when Prometheus scrapes."""

    def __init__(self, engine: Engine, store: ChunkStore) -> None:
        self.engine = engine
        self.store = store

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        queue = GaugeMetricFamily("cachecraft_queue_length", "Requests waiting to be scheduled")
        queue.add_metric([], e.num_waiting)
        yield queue
        running = GaugeMetricFamily("cachecraft_running_requests", "Requests holding a KV cache")
        running.add_metric([], e.num_running)
        yield running
        st = self.store.stats()
        nbytes = GaugeMetricFamily(
            "cachecraft_store_bytes", "Bytes stored per tier", labels=["tier"]
        )
        count = GaugeMetricFamily("cachecraft_store_variants", "Variants per tier", labels=["tier"])
        for tier, n in st.nbytes.items():
            nbytes.add_metric([tier], n)
        for tier, n in st.num_variants.items():
            count.add_metric([tier], n)
        yield nbytes
        yield count
        hits = CounterMetricFamily(
            "cachecraft_store_loads", "Variant loads served per tier", labels=["tier"]
        )
        for tier, n in st.hits.items():
            hits.add_metric([tier], n)
        yield hits
        evictions = CounterMetricFamily(
            "cachecraft_store_evictions", "Variants evicted", labels=["tier", "reason"]
        )
        for key, n in st.evictions.items():
            tier, _, reason = key.partition(":")
            evictions.add_metric([tier, reason], n)
        yield evictions
        rejected = CounterMetricFamily(
            "cachecraft_store_rejected", "Variant offers not stored", labels=["reason"]
        )
        for reason, n in st.rejected.items():
            rejected.add_metric([reason], n)
        yield rejected
        yield GaugeMetricFamily(
            "cachecraft_store_pending_writes",
            "Variants whose disk and Redis writes wait on the store's writer thread",
            value=st.pending_writes,
        )


class ServerMetrics:
    def __init__(self, engine: Engine, store: ChunkStore) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "cachecraft_requests", "HTTP requests", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "cachecraft_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "cachecraft_request_latency_seconds",
            "End-to-end generation latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens_computed = Counter(
            "cachecraft_prompt_tokens_computed", "Prompt tokens computed fresh", registry=r
        )
        self.tokens_reused = Counter(
            "cachecraft_prompt_tokens_reused", "Prompt tokens reused from caches", registry=r
        )
        self.completion_tokens = Counter(
            "cachecraft_completion_tokens", "Tokens generated", registry=r
        )
        self.chunk_hits = Counter(
            "cachecraft_chunk_hits", "Chunks served from a chunk-cache", registry=r
        )
        self.chunk_misses = Counter(
            "cachecraft_chunk_misses", "Chunks computed in full", registry=r
        )
        self.aborted = Counter(
            "cachecraft_requests_aborted", "Requests freed after the client left", registry=r
        )
        r.register(_LiveCollector(engine, store))

    def observe(self, report: RequestReport | None, completion_tokens: int, latency_s: float):
        self.latency.observe(latency_s)
        self.completion_tokens.inc(completion_tokens)
        if report is None:
            return
        self.ttft.observe(report.ttft_ms / 1000)
        self.tokens_computed.inc(report.tokens_computed)
        self.tokens_reused.inc(report.tokens_reused)
        hits = sum(1 for c in report.chunks if c.is_hit)
        self.chunk_hits.inc(hits)
        self.chunk_misses.inc(len(report.chunks) - hits)

    def render(self) -> bytes:
        return generate_latest(self.registry)
