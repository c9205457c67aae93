"""What the gateway counts of pooling requests (embeddings, score, rerank, classify), whichever API
they came by: inputs, their tokens and each request's time, by endpoint."""
from __future__ import annotations

from services.common.metrics import ServiceMetrics


class PoolingMetrics:
    def __init__(self, metrics: ServiceMetrics) -> None:
        self.labels = metrics.labels
        self.inputs = metrics.counter("baton_gateway_pooling_inputs", "Inputs embedded, classified or scored (a "
                                      "pair each), by endpoint", ["endpoint"])
        self.tokens = metrics.counter("baton_gateway_pooling_tokens", "Their tokens, by endpoint", ["endpoint"])
        self.latency = metrics.histogram("baton_gateway_pooling_request_duration_seconds",
                                         "A pooling request answered: from its body read to its answer made, by "
                                         "endpoint", ["endpoint"])

    def observe(self, endpoint: str, num_inputs: int, num_tokens: int, seconds: float) -> None:
        self.latency.labels(**self.labels, endpoint=endpoint).observe(seconds)
        self.inputs.labels(**self.labels, endpoint=endpoint).inc(num_inputs)
        self.tokens.labels(**self.labels, endpoint=endpoint).inc(num_tokens)
