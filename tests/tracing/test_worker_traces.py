"""Real prefill and decode worker processes export their spans to an in-test OTLP receiver (named
by vLLM's --otlp-traces-endpoint to one, --otlp-endpoint to the other; test_request_trace.py's mesh
finds it by OTEL_EXPORTER_OTLP_ENDPOINT): a Prefill then a Decode sent under one client span form one
trace, every worker phase parented to the server span of its call; each worker exports its
boot phases; GenerateLocally's local prefill is traced and timed too."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.propagate import inject
from opentelemetry.sdk.trace import TracerProvider

from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from tests.services.service_process import ServiceProcess
from tests.tracing.otlp_receiver import OtlpReceiver, ReceivedSpan

CHUNK_TOKENS = 32  # the prefill worker's step budget: the prompt takes three forward passes
PROMPT = [(31 * j) % 1000 + 3 for j in range(80)]
LOCAL_PROMPT = [(17 * j) % 1000 + 7 for j in range(20)]  # shares no block with PROMPT
SAMPLING = common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BOOT_PHASES = {"boot", "engine_init", "weights", "kv_pool", "warmup"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def workers(tiny_demo_model, receiver):
    """Decode and prefill processes (started side by side), tracing to `receiver`."""
    with pytest.MonkeyPatch.context() as mp:  # the children inherit it
        for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_ENDPOINT",
                     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            mp.delenv(name, raising=False)
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        started: dict[str, ServiceProcess] = {}
        args = {"decode": (DECODE_SERVICE, "--kv-blocks", "64", "--otlp-endpoint", receiver.endpoint),
                "prefill": (PREFILL_SERVICE, "--kv-blocks", "64", "--max-num-batched-tokens", str(CHUNK_TOKENS),
                            "--otlp-traces-endpoint", receiver.endpoint)}
        threads = [threading.Thread(target=lambda n=n: started.__setitem__(
            n, ServiceProcess(n, args[n][0], tiny_demo_model, *args[n][1:]))) for n in args]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert set(started) == {"decode", "prefill"}, "a worker did not start"
    yield started["prefill"], started["decode"]
    for svc in started.values():
        assert svc.terminate() == 0


def client_span_metadata(name: str):
    """A client span of this test's own (not exported) and the call metadata carrying it."""
    span = TracerProvider().get_tracer("test").start_span(name)
    carrier: dict[str, str] = {}
    inject(carrier, context=trace.set_span_in_context(span))
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", list(carrier.items())


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = by_name(spans, name)
    assert len(found) == 1, f"{len(found)} spans named {name!r}: {sorted(s.name for s in spans)}"
    return found[0]


def test_boot_phases_are_exported_by_each_worker(workers, receiver):
    def booted(spans):
        return all(BOOT_PHASES <= {s.name for s in spans if s.service == f"baton-{w}"} for w in ("prefill", "decode"))

    spans = receiver.wait_for(booted)
    for worker in ("prefill", "decode"):
        mine = [s for s in spans if s.service == f"baton-{worker}" and s.name in BOOT_PHASES]
        boot = one(mine, "boot")
        assert boot.parent_id == ""
        assert boot.attributes["baton.instance_id"].startswith(f"{worker}-127.0.0.1-")
        init = one(mine, "engine_init")
        assert init.parent_id == one(mine, "warmup").parent_id == boot.span_id
        assert one(mine, "weights").parent_id == one(mine, "kv_pool").parent_id == init.span_id
        assert boot.start_ns <= init.start_ns <= init.end_ns <= boot.end_ns


def test_prefill_then_decode_is_one_tree(workers, receiver):
    prefill, decode = workers
    trace_id, client_span_id, metadata = client_span_metadata("gateway")
    response = prefill_pb2_grpc.PrefillStub(prefill.channel).Prefill(prefill_pb2.PrefillRequest(
        request_id="traced-1", token_ids=PROMPT, sampling=SAMPLING,
        target=prefill_pb2.KVTarget(decode_address=decode.address)), metadata=metadata, timeout=30)
    assert response.reservation_id
    chunks = list(decode_pb2_grpc.DecodeStub(decode.channel).Decode(decode_pb2.DecodeRequest(
        request_id="traced-1", reservation_id=response.reservation_id, prompt_token_ids=PROMPT,
        first_token_id=response.first_token_id, sampling=SAMPLING), metadata=metadata, timeout=30))
    assert chunks[0].HasField("timings") and chunks[0].timings.queue_seconds > 0
    assert chunks[0].timings.prefill_seconds == 0
    assert not any(c.HasField("timings") for c in chunks[1:])

    def complete(spans):
        names = [s.name for s in spans if s.trace_id == trace_id]
        return (names.count("prefill.chunk") == 3 and names.count("/baton.decode.v1.Decode/Reserve") == 1
                and {"/baton.prefill.v1.Prefill/Prefill", "/baton.decode.v1.Decode/Decode", "prefill.queue",
                     "kv.transfer", "decode.queue", "decode.first_step"} <= set(names))

    spans = [s for s in receiver.wait_for(complete) if s.trace_id == trace_id]
    server = one([s for s in spans if s.service == "baton-prefill"], "/baton.prefill.v1.Prefill/Prefill")
    assert server.parent_id == client_span_id
    assert server.attributes["baton.request_id"] == "traced-1"
    assert server.attributes["gen_ai.request.model"] == "tiny"
    assert server.attributes["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert server.attributes["gen_ai.request.max_tokens"] == SAMPLING.max_tokens
    queue, transfer = one(spans, "prefill.queue"), one(spans, "kv.transfer")
    prompt_chunks = by_name(spans, "prefill.chunk")
    for span in (queue, transfer, *prompt_chunks):
        assert span.parent_id == server.span_id, span.name
    assert [c.attributes["baton.chunk.num_tokens"] for c in sorted(prompt_chunks, key=lambda c: c.start_ns)] \
        == [32, 32, 16]
    assert queue.end_ns <= min(c.start_ns for c in prompt_chunks)
    assert transfer.attributes["baton.kv.transport"] == "SHARED_MEMORY"
    assert transfer.attributes["baton.kv.bytes"] > 0

    # Prefill reserved the pages on decode itself, while its own server span was current.
    reserve = one([s for s in spans if s.service == "baton-decode"], "/baton.decode.v1.Decode/Reserve")
    assert reserve.parent_id == server.span_id
    assert reserve.attributes["rpc.system"] == "grpc" and reserve.attributes["rpc.method"] == "Reserve"

    decode_server = one([s for s in spans if s.service == "baton-decode"], "/baton.decode.v1.Decode/Decode")
    assert decode_server.parent_id == client_span_id
    assert decode_server.attributes["gen_ai.usage.output_tokens"] == SAMPLING.max_tokens
    assert decode_server.attributes["gen_ai.response.finish_reasons"] == ["length"]
    for name in ("decode.queue", "decode.first_step"):
        assert one(spans, name).parent_id == decode_server.span_id, name
    assert one(spans, "decode.queue").end_ns <= one(spans, "decode.first_step").start_ns


def test_generate_locally_traces_its_prefill(workers, receiver):
    _, decode = workers
    trace_id, client_span_id, metadata = client_span_metadata("gateway")
    chunks = list(decode_pb2_grpc.DecodeStub(decode.channel).GenerateLocally(decode_pb2.GenerateLocallyRequest(
        request_id="traced-local", prompt_token_ids=LOCAL_PROMPT, sampling=SAMPLING), metadata=metadata, timeout=30))
    assert chunks[0].timings.queue_seconds > 0 and chunks[0].timings.prefill_seconds > 0

    def complete(spans):  # the server span ends, and is exported, last
        return {"prefill.chunk", "/baton.decode.v1.Decode/GenerateLocally"} <= \
            {s.name for s in spans if s.trace_id == trace_id}

    spans = [s for s in receiver.wait_for(complete) if s.trace_id == trace_id]
    server = one(spans, "/baton.decode.v1.Decode/GenerateLocally")
    assert server.parent_id == client_span_id
    assert one(spans, "decode.queue").parent_id == one(spans, "decode.prefill").parent_id == server.span_id
    assert one(spans, "prefill.chunk").parent_id == one(spans, "decode.prefill").span_id
    assert one(spans, "prefill.chunk").attributes["baton.chunk.num_tokens"] == len(LOCAL_PROMPT)
    assert server.attributes["gen_ai.usage.input_tokens"] == len(LOCAL_PROMPT)
