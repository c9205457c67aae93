"""A gateway told to stop (SIGTERM) takes no new request on either API at once, gives those in
flight its --shutdown-grace-s, and aborts the ones still running just before the grace ends: they
end as vLLM's aborted requests do (finish_reason "abort", a stream's last chunk and [DONE]), not cut
by the servers (a 500, a stream broken off, a CANCELLED call), and it exits 0."""
from __future__ import annotations

import json
import signal
import threading
import time

import grpc
import httpx

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.services.gateway.mesh import GatewayProcess

GRACE_S = 1.5
LONG = 1800  # tokens: far longer than the grace lets any of them run


def test_requests_running_at_the_end_of_the_grace_end_aborted_on_both_apis(mesh):
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--shutdown-grace-s", str(GRACE_S))
    body = {"model": mesh.model_name, "prompt": "a long story", "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True}
    whole: dict = {}
    not_streamed = threading.Thread(target=lambda: whole.update(response=httpx.post(
        f"{gateway.base_url}/v1/completions", json=body, timeout=60)))
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        grpc_call = gateway_pb2_grpc.GenerateStub(channel).Generate(gateway_pb2.GenerateRequest(
            text="a long story", sampling=common_pb2.SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True),
            stream_options=gateway_pb2.StreamOptions(stream=True)), timeout=60)
        with httpx.stream("POST", f"{gateway.base_url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as response:
            lines = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
            first = json.loads(next(lines))
            assert next(grpc_call).WhichOneof("response") == "chunk"
            not_streamed.start()
            time.sleep(0.3)  # on its way
            signaled = time.monotonic()
            gateway.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        grpc_responses = list(grpc_call)
        not_streamed.join(30)
        ended_s = time.monotonic() - signaled
    assert gateway.proc.wait(timeout=30) == 0, "".join(gateway.stderr_lines[-100:])

    assert rest[-1] == "[DONE]", rest[-3:]
    chunks = [first, *map(json.loads, rest[:-1])]
    assert not any("error" in chunk for chunk in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "abort"
    assert grpc_responses[-1].WhichOneof("response") == "complete", grpc_responses[-1]
    assert grpc_responses[-1].complete.finish_reason == common_pb2.FINISH_REASON_ABORT
    answer = whole["response"]
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "abort"
    assert 0 < answer.json()["usage"]["completion_tokens"] < LONG
    assert GRACE_S - 1.0 < ended_s < GRACE_S + 1.0  # aborted near the grace's end, not cut after it
    assert not any("Exception in ASGI application" in line for line in gateway.stderr_lines)
    mesh.assert_decode_pools_free()


def test_a_stopping_gateway_takes_no_new_request_on_either_api(mesh):
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--shutdown-grace-s", str(GRACE_S))
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        stub = gateway_pb2_grpc.GenerateStub(channel)
        held = stub.Generate(gateway_pb2.GenerateRequest(  # one in flight on the gRPC API while it stops
            text="hold the gateway open", sampling=common_pb2.SamplingParams(max_tokens=LONG, ignore_eos=True),
            stream_options=gateway_pb2.StreamOptions(stream=True)), timeout=60)
        next(held)
        gateway.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # the HTTP API stops with the gRPC one, not once the gRPC one has let its last call go
            late = httpx.post(f"{gateway.base_url}/v1/completions", timeout=5,
                              json={"model": mesh.model_name, "prompt": "late", "max_tokens": 2})
            raise AssertionError(f"served while stopping: {late.status_code} {late.text}")
        except httpx.TransportError:
            pass
        try:
            late_call = list(stub.Generate(gateway_pb2.GenerateRequest(text="late"), timeout=5))
            raise AssertionError(f"served while stopping: {late_call}")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        assert list(held)[-1].complete.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert gateway.proc.wait(timeout=30) == 0, "".join(gateway.stderr_lines[-100:])
    mesh.assert_decode_pools_free()
