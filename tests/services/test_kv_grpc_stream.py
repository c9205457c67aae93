"""KV pages over the GRPC_STREAM transport, between real processes: a decode worker
(KVStore served beside Decode) and prefill workers on "the same host" and, by
BATON_HOST_ID, on "another". Tokens must equal a colocated engine's and the
shared-memory path's; every refused chunk has its code, and its pages come back."""
from __future__ import annotations

import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import EngineConfig
from engine.dtypes import TORCH_DTYPES
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from protos import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.common.converters import layout_from_proto
from services.decode.kv_receiver import SERVICE_NAME as KVSTORE_SERVICE
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.kvstore.converters import chunk_to_proto
from services.kvstore.host_id import ENV_HOST_ID
from services.kvstore.page_chunks import plan_chunks
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from tests.services.service_process import ServiceProcess

NUM_KV_BLOCKS = 128
WHOLE_POOL_TOKENS = NUM_KV_BLOCKS * 16 - 1
LEASE_MS = 1500
PROMPT = [(13 * j) % 1000 + 2 for j in range(200)]  # 13 blocks, chunked by the prefill budget of 64
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SHM, GRPC = common_pb2.KV_TRANSPORT_SHARED_MEMORY, common_pb2.KV_TRANSPORT_GRPC_STREAM


@pytest.fixture(scope="module")
def decode(tiny_demo_model):
    svc = ServiceProcess("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", str(NUM_KV_BLOCKS),
                         "--lease-ms", str(LEASE_MS))
    svc.stub = decode_pb2_grpc.DecodeStub(svc.channel)
    svc.kv = kvstore_pb2_grpc.KVStoreStub(svc.channel)
    yield svc
    assert svc.terminate() == 0


def _prefill(model_dir, host_id: str | None, *extra_args: str) -> ServiceProcess:
    with pytest.MonkeyPatch.context() as mp:
        if host_id is not None:
            mp.setenv(ENV_HOST_ID, host_id)
        else:
            mp.delenv(ENV_HOST_ID, raising=False)
        svc = ServiceProcess("prefill", PREFILL_SERVICE, model_dir, "--kv-blocks", "64",
                             "--max-num-batched-tokens", "64", *extra_args)
    svc.stub = prefill_pb2_grpc.PrefillStub(svc.channel)
    return svc


@pytest.fixture(scope="module")
def same_host_prefill(tiny_demo_model):
    svc = _prefill(tiny_demo_model, None)
    yield svc
    assert svc.terminate() == 0


@pytest.fixture(scope="module")
def remote_prefill(tiny_demo_model):
    svc = _prefill(tiny_demo_model, "another-host", "--no-kv-checksum")  # the receiver takes unchecked chunks too
    yield svc
    assert svc.terminate() == 0


@pytest.fixture(scope="module")
def expected_tokens(tiny_demo_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=64))
    return next(out for out in engine.generate([PROMPT], GREEDY) if out.finished).token_ids


def _reserve(decode, request_id: str, num_tokens: int = len(PROMPT)) -> decode_pb2.Reservation:
    return decode.stub.Reserve(decode_pb2.ReserveRequest(request_id=request_id, num_tokens=num_tokens), timeout=5)


def _target(decode, reservation: decode_pb2.Reservation, transport: int, **overrides) -> prefill_pb2.KVTarget:
    """What the gateway sends: everything the reservation says, the transport forced or left to prefill."""
    fields = dict(decode_address=decode.address, reservation_id=reservation.reservation_id,
                  block_ids=reservation.block_ids, transport=transport, shm_name=reservation.shm_name,
                  layout=reservation.layout, decode_host_id=reservation.host_id, transports=reservation.transports)
    fields.update(overrides)
    return prefill_pb2.KVTarget(**fields)


def _generate(decode, prefill, request_id: str, transport: int, **overrides) -> tuple[list[int], int]:
    """Reserve → Prefill → Decode; the tokens and the transport prefill reports."""
    reservation = _reserve(decode, request_id)
    sampling = common_pb2.SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True)
    response = prefill.stub.Prefill(prefill_pb2.PrefillRequest(
        request_id=request_id, token_ids=PROMPT, sampling=sampling,
        target=_target(decode, reservation, transport, **overrides)), timeout=20)
    assert response.timings.kv_transfer_bytes == 13 * 2 * 2 * 2 * 16 * 16 * 4  # blocks, L, K/V, Hkv, bs, D, f32
    tokens = [response.first_token_id]
    for chunk in decode.stub.Decode(decode_pb2.DecodeRequest(
            request_id=request_id, reservation_id=reservation.reservation_id, prompt_token_ids=PROMPT,
            first_token_id=response.first_token_id, sampling=sampling), timeout=20):
        tokens += chunk.token_ids
    return tokens, response.timings.kv_transport


def assert_whole_pool_free(decode, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            _reserve(decode, "probe", WHOLE_POOL_TOKENS)
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert time.monotonic() < deadline, "the decode pool did not become free in time"
            time.sleep(0.02)
    assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="probe"), timeout=5).found


def test_decode_serves_kvstore_and_offers_the_stream(decode):
    health = health_pb2_grpc.HealthStub(decode.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service=KVSTORE_SERVICE), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    reservation = _reserve(decode, "offer")
    assert list(reservation.transports) == [SHM, GRPC]
    assert reservation.host_id
    assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="offer"), timeout=5).found


def test_forced_stream_matches_shared_memory_and_the_engine(decode, same_host_prefill, expected_tokens):
    assert _generate(decode, same_host_prefill, "forced-grpc", GRPC) == (expected_tokens, GRPC)
    assert _generate(decode, same_host_prefill, "forced-shm", SHM) == (expected_tokens, SHM)
    assert_whole_pool_free(decode, within_s=1)


def test_auto_choice_follows_the_host_ids(decode, same_host_prefill, remote_prefill, expected_tokens):
    # Same host: shared memory, and only that (no address to stream to).
    assert _generate(decode, same_host_prefill, "auto-local", common_pb2.KV_TRANSPORT_UNSPECIFIED,
                     decode_address="") == (expected_tokens, SHM)
    # Another host id: the stream, and only that (the segment name is a decoy).
    assert _generate(decode, remote_prefill, "auto-remote", common_pb2.KV_TRANSPORT_UNSPECIFIED,
                     shm_name="baton_kv_not_on_this_host") == (expected_tokens, GRPC)


def test_forced_transport_that_cannot_work_is_refused(decode, same_host_prefill):
    reservation = _reserve(decode, "cannot")
    sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0.0)
    for target in (_target(decode, reservation, GRPC, decode_address=""),
                   _target(decode, reservation, common_pb2.KV_TRANSPORT_CUDA_IPC)):
        with pytest.raises(grpc.RpcError) as e:
            same_host_prefill.stub.Prefill(prefill_pb2.PrefillRequest(
                request_id="cannot", token_ids=PROMPT, sampling=sampling, target=target), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="cannot"), timeout=5).found


def _chunks(reservation: decode_pb2.Reservation, request_id: str, **layout_overrides):
    """The reservation's pages as chunks of random data, in the reservation's layout unless overridden."""
    layout_proto = common_pb2.KVLayout()
    layout_proto.CopyFrom(reservation.layout)
    for name, value in layout_overrides.items():
        setattr(layout_proto, name, value)
    num_blocks = len(reservation.block_ids)
    layout = layout_from_proto(layout_proto, num_blocks=num_blocks)
    pool = torch.randn(layout.shape).to(TORCH_DTYPES[layout.dtype])
    blocks = list(range(num_blocks))
    return [chunk_to_proto(pool, layout, spec, blocks, request_id=request_id,
                           reservation_id=reservation.reservation_id, dst_blocks=list(reservation.block_ids))
            for spec in plan_chunks(layout, num_blocks, max_bytes=2 * 4096 * 2)]


def _write(decode, chunks) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        decode.kv.WritePages(iter(chunks), timeout=5)
    return e.value


def test_refused_chunks_and_their_pages_come_back(decode):
    reservation = _reserve(decode, "refused")
    good = _chunks(reservation, "refused")
    assert len(good) > 1
    assert decode.kv.WritePages(iter(good), timeout=5).num_chunks == len(good)

    corrupt = _chunks(reservation, "refused")
    corrupt[-1].data = bytes([corrupt[-1].data[0] ^ 0xFF]) + corrupt[-1].data[1:]
    error = _write(decode, corrupt)
    assert error.code() == grpc.StatusCode.DATA_LOSS, error.details()

    error = _write(decode, _chunks(reservation, "refused", model_fingerprint=b"another model"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "fingerprint" in error.details()
    error = _write(decode, _chunks(reservation, "refused", head_dim=32))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "head_dim" in error.details()

    short = _chunks(reservation, "refused")
    short[0].data = short[0].data[:-4]
    short[0].ClearField("checksum")
    assert _write(decode, short).code() == grpc.StatusCode.INVALID_ARGUMENT

    stray = _chunks(reservation, "refused")
    stray[0].block_ids[0] = next(b for b in range(NUM_KV_BLOCKS) if b not in reservation.block_ids)
    error = _write(decode, stray)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "not reserved" in error.details()

    unknown = _chunks(reservation, "refused")
    unknown[0].reservation_id = "no-such-reservation"
    assert _write(decode, unknown).code() == grpc.StatusCode.NOT_FOUND
    someone_else = _chunks(reservation, "another-request")
    assert _write(decode, someone_else).code() == grpc.StatusCode.NOT_FOUND

    # Aborted: its pages are free again, and the reservation is gone for later writes.
    assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="refused"), timeout=5).found
    assert _write(decode, good).code() == grpc.StatusCode.NOT_FOUND
    assert_whole_pool_free(decode, within_s=1)


def test_corrupted_stream_pages_come_back_with_the_lease(decode):
    reservation = _reserve(decode, "lease")
    corrupt = _chunks(reservation, "lease")
    corrupt[0].checksum ^= 1
    assert _write(decode, corrupt).code() == grpc.StatusCode.DATA_LOSS
    time.sleep(LEASE_MS / 1000)
    assert_whole_pool_free(decode, within_s=1)
    assert not decode.stub.Abort(decode_pb2.AbortRequest(request_id="lease"), timeout=5).found


def test_decode_is_no_host_tier(decode):
    reservation = _reserve(decode, "tier")
    with pytest.raises(grpc.RpcError) as e:
        list(decode.kv.ReadPages(kvstore_pb2.PageQuery(layout=reservation.layout, block_hashes=[7]), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    by_hash = _chunks(reservation, "tier")[0]
    num_blocks = len(by_hash.block_ids)
    by_hash.ClearField("block_ids")
    by_hash.block_hashes.extend(range(num_blocks))
    assert _write(decode, [by_hash]).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="tier"), timeout=5).found
