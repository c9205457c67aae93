"""services/common/tracing.py in this process: off without the OTEL_* variables (nothing
installed, no interceptors), and on, spans reach a real OTLP receiver with Baton's resource."""
from __future__ import annotations

import pytest
from opentelemetry import trace

from services.common import tracing
from tests.tracing.otlp_receiver import OtlpReceiver

OTEL_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
                  "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES")


@pytest.fixture
def no_otel_env(monkeypatch):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield
    tracing.shutdown_tracing()


def test_off_without_otel_variables(no_otel_env):
    assert tracing.setup_tracing("prefill", instance="prefill-1", model="tiny") is False
    assert not tracing.is_enabled()
    assert tracing.client_interceptors() == []
    assert tracing.server_interceptors() == []
    assert tracing.record_span("prefill.queue", 1, 2) is trace.INVALID_SPAN
    with tracing.tracer().start_as_current_span("boot") as span:
        assert not span.is_recording()
    tracing.set_current_attributes({"a": 1})  # no-op
    tracing.shutdown_tracing()  # no-op, idempotent


@pytest.mark.parametrize(("endpoint", "env", "expected"), [
    (None, {}, False),
    ("collector:4317", {}, True),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, False),
    ("collector:4317", {"OTEL_TRACES_EXPORTER": "none"}, False),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "otlp"}, True),
])
def test_is_requested(endpoint, env, expected):
    assert tracing.is_requested(endpoint, env) is expected


def test_on_spans_reach_the_receiver(no_otel_env):
    receiver = OtlpReceiver().start()
    try:
        assert tracing.setup_tracing("unit", instance="unit-1", model="tiny",
                                     endpoint=f"127.0.0.1:{receiver.port}") is True
        assert tracing.is_enabled()
        assert len(tracing.client_interceptors()) == 4  # unary/stream × unary/stream
        assert len(tracing.server_interceptors()) == 1
        with tracing.tracer().start_as_current_span("boot"):
            tracing.record_engine_boot({"engine_init": (1_000, 4_000), "weights": (1_500, 2_000),
                                        "kv_pool": (2_500, 3_000)})
        with tracing.tracer().start_as_current_span("rpc"):
            tracing.set_current_attributes(tracing.request_attributes("r1", {tracing.GEN_AI_USAGE_INPUT_TOKENS: 7,
                                                                             "dropped": None}))
            queue = tracing.record_span("prefill.queue", 5_000, 6_000, {"k": "v"})
            tracing.record_span("child", 5_100, 5_200, parent=queue)
    finally:
        tracing.shutdown_tracing()  # flushes
        tracing.shutdown_tracing()
        receiver.stop()
    spans = {s.name: s for s in receiver.snapshot()}
    assert set(spans) == {"boot", "engine_init", "weights", "kv_pool", "rpc", "prefill.queue", "child"}
    assert spans["boot"].resource["service.name"] == "baton-unit"
    assert spans["boot"].resource["service.instance.id"] == "unit-1"
    assert spans["engine_init"].parent_id == spans["boot"].span_id
    assert spans["weights"].parent_id == spans["kv_pool"].parent_id == spans["engine_init"].span_id
    assert (spans["weights"].start_ns, spans["weights"].end_ns) == (1_500, 2_000)
    assert spans["prefill.queue"].parent_id == spans["rpc"].span_id
    assert spans["child"].parent_id == spans["prefill.queue"].span_id
    assert spans["rpc"].attributes == {"baton.request_id": "r1", "gen_ai.request.model": "tiny",
                                       "gen_ai.usage.input_tokens": 7}
    assert len({s.trace_id for s in spans.values()}) == 2  # boot's, and the rpc's
    assert not tracing.is_enabled() and tracing.client_interceptors() == []
