"""One trace per request through the whole mesh: the HTTP request continues the caller's
`traceparent`, and every phase, on the gateway and on each worker, is one tree under it."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from unittest import mock

import httpx
import pytest

from tests.services.gateway.mesh import start_mesh, stop_mesh
from tests.tracing.otlp_receiver import OtlpReceiver, ReceivedSpan

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def traced_mesh(tiny_demo_model, receiver):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with mock.patch.dict(os.environ, env):
        for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME"):
            os.environ.pop(name, None)
        # Every prompt through a prefill worker, and encoded by the tokenizer service (not in the
        # gateway, as a short one is by default): the trace must cross every service.
        mesh = start_mesh(tiny_demo_model, num_prefill=1, num_decode=1,
                          gateway_args=("--local-prefill-max-tokens", "0", "--local-tokenize-max-chars", "0"))
    yield mesh
    assert all(code == 0 for code in stop_mesh(mesh).values())


def one(spans: list[ReceivedSpan], name: str, service: str | None = None) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and (service is None or s.service == service)]
    assert len(found) == 1, f"{len(found)} spans named {name!r}: {sorted((s.service, s.name) for s in spans)}"
    return found[0]


def test_a_streamed_chat_is_one_tree_from_http_to_the_last_token(traced_mesh, receiver):
    with httpx.stream("POST", f"{traced_mesh.gateway.base_url}/v1/chat/completions", timeout=30,
                      headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"}, json={
                          "model": traced_mesh.model_name, "messages": [{"role": "user", "content": "a traced hello"}],
                          "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    response_id = json.loads(events[0])["id"]

    # Every span the tree is checked for, each server span with its children: a process exports a span
    # once it ends, so a parent may come in a later batch than its children (the prefill call's did).
    expected = {("baton-gateway", "POST /v1/chat/completions"), ("baton-gateway", f"chat {traced_mesh.model_name}"),
                ("baton-tokenizer", "/baton.tokenizer.v1.Tokenizer/ApplyChatTemplate"),
                ("baton-prefill", "/baton.prefill.v1.Prefill/PrefillStream"), ("baton-prefill", "prefill.queue"),
                ("baton-prefill", "prefill.chunk"), ("baton-prefill", "kv.transfer"),
                ("baton-decode", "/baton.decode.v1.Decode/Reserve"), ("baton-decode", "/baton.decode.v1.Decode/Decode"),
                ("baton-decode", "decode.queue"), ("baton-decode", "decode.first_step")}

    def complete(spans: list[ReceivedSpan]) -> bool:  # each process exports on its own schedule
        return expected <= {(s.service, s.name) for s in spans if s.trace_id == TRACE_ID}

    spans = [s for s in receiver.wait_for(complete) if s.trace_id == TRACE_ID]
    by_id = {s.span_id: s for s in spans}
    # One tree: a single root, continuing the caller's span; every other span's parent is in the trace.
    roots = [s for s in spans if s.parent_id not in by_id]
    assert [(r.name, r.parent_id) for r in roots] == [("POST /v1/chat/completions", CALLER_SPAN_ID)]
    http = roots[0]

    request = one(spans, f"chat {traced_mesh.model_name}")
    assert request.parent_id == http.span_id and request.service == "baton-gateway"
    assert request.attributes["gen_ai.operation.name"] == "chat"
    assert request.attributes["gen_ai.request.model"] == traced_mesh.model_name
    assert request.attributes["gen_ai.request.max_tokens"] == 6
    assert request.attributes["gen_ai.response.id"] == response_id
    assert request.attributes["gen_ai.usage.output_tokens"] == 6
    assert request.attributes["gen_ai.usage.input_tokens"] > 0
    assert request.attributes["gen_ai.response.finish_reasons"] == ["length"]
    (first_token,) = [time_ns for name, time_ns in request.events if name == "first_token"]

    def child_of(name: str, parent: ReceivedSpan, service: str | None = None) -> ReceivedSpan:
        span = one(spans, name, service)
        assert span.parent_id == parent.span_id, (name, by_id.get(span.parent_id))
        return span

    tokenize = child_of("tokenize", request)
    # Each call's server span is the child of the span current where the call was made.
    tokenizer_call = child_of("/baton.tokenizer.v1.Tokenizer/ApplyChatTemplate", request, "baton-tokenizer")
    assert tokenize.start_ns <= tokenizer_call.start_ns and tokenizer_call.end_ns <= tokenize.end_ns
    child_of("route", request)
    prefill_server = child_of("/baton.prefill.v1.Prefill/PrefillStream", request, "baton-prefill")
    child_of("prefill.queue", prefill_server)
    kv_transfer = child_of("kv.transfer", prefill_server)
    assert [s.parent_id for s in spans if s.name == "prefill.chunk"] == [prefill_server.span_id]
    decode_server = child_of("/baton.decode.v1.Decode/Decode", request, "baton-decode")
    child_of("/baton.decode.v1.Decode/Reserve", prefill_server, "baton-decode")
    for name in ("decode.queue", "decode.first_step"):
        child_of(name, decode_server)
    # In order on the wall clock (each host's clock is this machine's): the first token goes out
    # once computed, before the pages are written; decode starts once they are.
    computed = max(s.end_ns for s in spans if s.name == "prefill.chunk")
    assert tokenize.end_ns <= prefill_server.start_ns and computed <= first_token <= decode_server.end_ns
    assert kv_transfer.end_ns <= decode_server.start_ns
    assert request.end_ns <= http.end_ns
