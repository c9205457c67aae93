"""`ServiceMetrics`: one service's Prometheus registry, the labels every metric carries, and what
every service counts (requests finished, errors by reason, start-up durations).

Every name starts `baton_`; every metric carries `model`, `service` and `instance` (a
worker's instance id, `KIND-HOST-PORT` by default, as in the instance registry). A gRPC
worker serves its registry on its own port (`serve_http`, prometheus-client's WSGI app on a
threading server of a daemon thread); the gateway serves it on its HTTP port beside the router's.
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, make_wsgi_app

from services.common.metrics.engine import EngineCollector

LABELS = ("model", "service", "instance")
STOP_POLL_S = 0.02  # how often a worker's /metrics server looks for its stop
# Seconds, 1-2-5 per decade from 1 ms to a minute: an inter-token latency of a few
# milliseconds lands in its own bucket, and so does a long request end to end.
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class ServiceMetrics:
    """A service's registry and the labels of its metrics. A metric family is registered once
    per registry: make one `ServiceMetrics` per service, and hand it to what counts."""

    def __init__(self, service: str, model: str = "", instance: str = "") -> None:
        self.registry = CollectorRegistry()
        self.labels: Mapping[str, str] = {"model": model, "service": service, "instance": instance}
        self._success = Counter("baton_request_success", "Requests finished, by finish reason",
                                [*LABELS, "finish_reason"], registry=self.registry)
        self._errors = Counter("baton_request_errors", "Requests that failed or were refused, by reason",
                               [*LABELS, "reason"], registry=self.registry)
        # Set once per process; no sample until set (a tokenizer has no engine).
        self._engine_init = self.gauge("baton_engine_init_duration_seconds",
                                       "Building the engine: model, weights and KV pool")
        self._weight_loading = self.gauge("baton_weight_loading_duration_seconds",
                                          "Reading the checkpoint into the model")
        self._warmup = self.gauge("baton_warmup_duration_seconds", "Warming up the engine with dummy requests")
        self._http: WSGIServer | None = None

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        """A gauge with this service's labels (then `labelnames`), in its registry;
        `.labels(**metrics.labels, ...)` gives the child."""
        return Gauge(name, documentation, [*LABELS, *labelnames], registry=self.registry)

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        """A counter with this service's labels (then `labelnames`), in its registry."""
        return Counter(name, documentation, [*LABELS, *labelnames], registry=self.registry)

    def histogram(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Histogram:
        """A latency histogram (LATENCY_BUCKETS) with this service's labels (then `labelnames`), in its registry."""
        return Histogram(name, documentation, [*LABELS, *labelnames], buckets=LATENCY_BUCKETS, registry=self.registry)

    def count_success(self, finish_reason: str) -> None:
        self._success.labels(**self.labels, finish_reason=finish_reason).inc()

    def count_error(self, reason: str) -> None:
        self._errors.labels(**self.labels, reason=reason).inc()

    def watch_engine(self, engine: Any) -> None:
        """Export an `LLMEngine`'s start-up durations, and from now on its pages, running and
        waiting requests and prefix-cache counters (read on each scrape, not each step).
        Holds the scheduler and block manager only: never a view of the KV pool."""
        self._engine_init.labels(**self.labels).set(engine.init_seconds)
        self._weight_loading.labels(**self.labels).set(engine.runner.weight_loading_seconds)
        cache_config = {"block_size": str(engine.config.block_size), "cache_dtype": engine.config.kv_cache_dtype,
                        "num_gpu_blocks": str(engine.num_kv_blocks),  # vLLM's name, wherever the pool lives
                        "enable_prefix_caching": str(engine.block_manager.prefix_cache.is_enabled)}
        self.registry.register(EngineCollector(engine.scheduler, engine.block_manager, self.labels, cache_config,
                                               engine.config.max_loras))

    def time_warmup(self) -> AbstractContextManager:
        """`with metrics.time_warmup(): await warm_up(...)` sets `baton_warmup_duration_seconds`."""
        return self._warmup.labels(**self.labels).time()

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

    def serve_http(self, host: str, port: int) -> int:
        """Serve `/metrics` on `host:port` (0: any free port) from a daemon thread; returns the
        bound port. Raises OSError when it cannot bind."""
        server_class = type("MetricsServer", (ThreadingMixIn, WSGIServer), {
            "daemon_threads": True, "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
        self._http = make_server(host, port, make_wsgi_app(self.registry), server_class, handler_class=_QuietHandler)
        # prometheus-client's own server looks for its stop every half second: each worker's exit waited 0.25 s
        # for it on average.
        threading.Thread(target=self._http.serve_forever, args=(STOP_POLL_S,), name="metrics-http",
                         daemon=True).start()
        return self._http.server_port

    def close(self) -> None:
        """Stop the HTTP server, if one runs (waits up to its poll, STOP_POLL_S)."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per scrape."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass
