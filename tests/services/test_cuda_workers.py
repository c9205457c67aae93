"""Prefill and decode workers on a CUDA device (--device cuda), as real processes over real gRPC:
the decode pool offered by its CUDA IPC handle, prefill writing pages into it device to device, and
the tokens an engine on the same device makes; and the mixed pairs, a GPU prefill into a CPU decode
worker's shared memory and a CPU prefill into a GPU decode worker by the gRPC stream.
Skipped where torch sees no CUDA device (CI); run on a GPU machine."""
from __future__ import annotations

import grpc
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from protos import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.prefill.converters import reserved_target
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from tests.cuda import needs_cuda
from tests.services.prefill.test_prefill_service import _colocated_run, _sampling_to_proto, do_prefill, reserve
from tests.services.service_process import ServiceProcess as Service

pytestmark = needs_cuda

PROMPT = [(29 * j) % 1000 + 3 for j in range(75)]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)


def _worker(name: str, service: str, stub_class, model_dir, device: str):
    svc = Service(name, service, model_dir, "--kv-blocks", "128", "--device", device)
    svc.stub = stub_class(svc.channel)
    return svc


@pytest.fixture(scope="module")
def workers(tiny_demo_model):
    """(kind, device) -> a running worker, started when first asked for and stopped at the end."""
    started: dict[tuple[str, str], Service] = {}

    def get(kind: str, device: str) -> Service:
        if (kind, device) not in started:
            service, stub = ((PREFILL_SERVICE, prefill_pb2_grpc.PrefillStub) if kind == "prefill"
                             else (DECODE_SERVICE, decode_pb2_grpc.DecodeStub))
            started[kind, device] = _worker(kind, service, stub, tiny_demo_model, device)
        return started[kind, device]

    yield get
    for svc in started.values():
        assert svc.terminate() == 0, svc.stderr_text()


@pytest.fixture(scope="module")
def engine_on_cuda(tiny_demo_model):
    return LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=256, device="cuda"))


def test_a_gpu_decode_worker_offers_its_pool_by_its_cuda_ipc_handle(workers):
    decode = workers("decode", "cuda")
    reservation = reserve(decode, "offer", PROMPT)
    assert reservation.cuda_ipc_handle and not reservation.shm_name
    assert list(reservation.transports) == [common_pb2.KV_TRANSPORT_CUDA_IPC, common_pb2.KV_TRANSPORT_GRPC_STREAM]
    assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="offer"), timeout=5).found


@pytest.mark.parametrize("prefill_device, decode_device, transport", [
    ("cuda", "cuda", common_pb2.KV_TRANSPORT_CUDA_IPC),
    ("cuda", "cpu", common_pb2.KV_TRANSPORT_SHARED_MEMORY),
    ("cpu", "cuda", common_pb2.KV_TRANSPORT_GRPC_STREAM),
])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prompt_handed_over_continues_as_on_one_engine(workers, engine_on_cuda, prefill_device, decode_device,
                                                          transport, params):
    prefill, decode = workers("prefill", prefill_device), workers("decode", decode_device)
    rid = f"{prefill_device}-{decode_device}-{params.temperature}"
    expected = _colocated_run(engine_on_cuda, rid, PROMPT, params).token_ids
    reservation = reserve(decode, rid, PROMPT)
    # Only the decode worker's address and what its reservation offers: prefill picks the transport.
    target = reserved_target(prefill_pb2.KVTarget(decode_address=decode.address), reservation)
    response = do_prefill(prefill, rid, PROMPT, params, target)
    assert response.timings.kv_transport == transport
    assert response.timings.kv_transfer_bytes > 0
    chunks = list(decode.stub.Decode(decode_pb2.DecodeRequest(
        request_id=rid, reservation_id=reservation.reservation_id, prompt_token_ids=PROMPT,
        first_token_id=response.first_token_id, sampling=_sampling_to_proto(params)), timeout=30))
    assert [response.first_token_id] + [t for c in chunks for t in c.token_ids] == expected
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_gpu_worker_refuses_to_release_its_memory_and_goes_on_serving(workers):
    """Releasing memory gives host pages back (engine/memory_release.py); on a GPU it is refused
    as a precondition, with nothing released, and the worker serves on."""
    decode = workers("decode", "cuda")
    with pytest.raises(grpc.RpcError) as refused:
        scheduler_pb2_grpc.SchedulerStub(decode.channel).ReleaseMemory(scheduler_pb2.MemoryRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "only host memory is released" in refused.value.details()
    reservation = reserve(decode, "after-refusal", PROMPT)
    assert reservation.cuda_ipc_handle
    assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="after-refusal"), timeout=5).found
