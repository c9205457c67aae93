"""Prometheus metrics, one `CollectorRegistry` per service (several services in one process do
not collide): `ServiceMetrics` (every service: labels, success and errors by reason, start-up
durations, its own `/metrics` server), `EngineCollector` (an engine's pages, load and prefix
cache, read on each scrape), `RequestMetrics` (the gateway's per-request latencies and tokens)."""
from services.common.metrics.engine import EngineCollector
from services.common.metrics.requests import RequestMetrics, RequestTimer
from services.common.metrics.service import LABELS, LATENCY_BUCKETS, ServiceMetrics

__all__ = ["LABELS", "LATENCY_BUCKETS", "EngineCollector", "RequestMetrics", "RequestTimer", "ServiceMetrics"]
