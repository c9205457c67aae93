"""The host page tier between prefill workers, as real processes: worker A computes a
prompt, and once the prompt is used again stores its reused blocks on a kvstore node (a
prompt used once is never stored); worker B, told by the request
that the node holds the prefix, reads those blocks instead of computing them, and the
tokens decoded from B's KV equal a colocated engine's."""
from __future__ import annotations

import time

import grpc
import pytest

from engine.block_hash import hash_block_chain
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2, decode_pb2_grpc, kvstore_pb2, prefill_pb2, prefill_pb2_grpc
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from tests.services.prefill.test_prefill_service import _colocated_run, _sampling_to_proto, _target
from tests.services.service_process import ServiceProcess as Service, stop_processes, wait_all_serving
from tests.services.test_kvstore_node import KVStoreProcess

BLOCK_SIZE = 16
PROMPT = [(37 * j) % 1000 + 5 for j in range(10 * BLOCK_SIZE + 7)]  # 10 full blocks and a partial one
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def kvstore():
    node = KVStoreProcess("--capacity-bytes", "64M")
    yield node
    assert node.terminate() == 0


@pytest.fixture(scope="module")
def decode(tiny_demo_model):
    svc = Service("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", "128")
    svc.stub = decode_pb2_grpc.DecodeStub(svc.channel)
    yield svc
    assert svc.terminate() == 0


@pytest.fixture(scope="module")
def workers(tiny_demo_model, kvstore):
    a, b = (Service("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "64", "--kvstore", kvstore.address,
                    wait=False) for _ in range(2))
    wait_all_serving([a, b])
    for svc in (a, b):
        svc.stub = prefill_pb2_grpc.PrefillStub(svc.channel)
    yield a, b
    assert stop_processes([a, b]) == [0, 0]


@pytest.fixture(scope="module")
def colocated_tokens(tiny_demo_model):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=128))
    return _colocated_run(engine, "ref", PROMPT, GREEDY).token_ids


def generate(decode, prefill, request_id: str, prompt: list[int], host_tier=None, cache_salt: str | None = None
             ) -> tuple[prefill_pb2.PrefillResponse, list[int]]:
    reservation = decode.stub.Reserve(decode_pb2.ReserveRequest(request_id=request_id, num_tokens=len(prompt)),
                                      timeout=5)
    sampling = _sampling_to_proto(GREEDY)
    if cache_salt is not None:
        sampling.cache_salt = cache_salt
    request = prefill_pb2.PrefillRequest(request_id=request_id, token_ids=prompt, sampling=sampling,
                                         target=_target(reservation))
    if host_tier is not None:
        request.host_tier.CopyFrom(host_tier)
    response = prefill.stub.Prefill(request, timeout=20)
    tokens = [response.first_token_id]
    for chunk in decode.stub.Decode(decode_pb2.DecodeRequest(
            request_id=request_id, reservation_id=reservation.reservation_id, prompt_token_ids=prompt,
            first_token_id=response.first_token_id, sampling=sampling), timeout=20):
        tokens += chunk.token_ids
    return response, tokens


def stored_blocks(kvstore, layout, hashes: list[int]) -> int:
    """How many leading blocks of `hashes` the node holds."""
    chunks = kvstore.channel.unary_stream("/baton.kvstore.v1.KVStore/ReadPages",
                                          request_serializer=kvstore_pb2.PageQuery.SerializeToString,
                                          response_deserializer=kvstore_pb2.PageChunk.FromString)(
        kvstore_pb2.PageQuery(request_id="probe", layout=layout, block_hashes=hashes, layer_end=1), timeout=5)
    return len({h for c in chunks for h in c.block_hashes})


def test_a_prefix_computed_by_one_worker_is_read_by_another(decode, workers, kvstore, colocated_tokens):
    a, b = workers
    layout = decode.stub.Reserve(decode_pb2.ReserveRequest(request_id="probe", num_tokens=1), timeout=5).layout
    decode.stub.Abort(decode_pb2.AbortRequest(request_id="probe"), timeout=5)
    hashes = hash_block_chain(PROMPT, BLOCK_SIZE, layout.model_fingerprint)
    assert len(hashes) == 10

    response, tokens = generate(decode, a, "on-a", PROMPT)
    assert tokens == colocated_tokens
    assert response.num_host_tier_tokens == 0 and response.num_cached_tokens == 0
    time.sleep(0.3)
    assert stored_blocks(kvstore, layout, hashes) == 0  # used once: not stored
    response, tokens = generate(decode, a, "on-a-again", PROMPT)  # reused from A's cache: now stored
    assert response.num_cached_tokens == 10 * BLOCK_SIZE and tokens == colocated_tokens
    deadline = time.monotonic() + 5
    while stored_blocks(kvstore, layout, hashes) < len(hashes):  # stored after the handoff, in the background
        assert time.monotonic() < deadline, "worker A never stored the prompt's blocks"
        time.sleep(0.05)

    source = prefill_pb2.HostTierSource(address=kvstore.address, num_blocks=len(hashes))
    response, tokens = generate(decode, b, "on-b", PROMPT, source)
    assert response.num_host_tier_tokens == 10 * BLOCK_SIZE
    assert response.num_cached_tokens == 10 * BLOCK_SIZE
    assert response.timings.host_tier_read_seconds > 0
    assert tokens == colocated_tokens

    # B holds the prefix now: the same hint reads nothing more.
    response, tokens = generate(decode, b, "on-b-again", PROMPT, source)
    assert response.num_host_tier_tokens == 0 and response.num_cached_tokens == 10 * BLOCK_SIZE
    assert tokens == colocated_tokens


def test_a_salted_prefix_is_stored_and_read_under_its_salt_only(decode, workers, kvstore, tiny_demo_model):
    """A tenant's salted prefix goes to the tier under hashes its salt is in: another worker reads it
    for a request giving the same salt, and one giving another salt (or none) finds nothing there."""
    from engine.block_hash import request_extra

    a, b = workers
    layout = decode.stub.Reserve(decode_pb2.ReserveRequest(request_id="probe-salt", num_tokens=1), timeout=5).layout
    decode.stub.Abort(decode_pb2.AbortRequest(request_id="probe-salt"), timeout=5)
    prompt = [(53 * j) % 1000 + 3 for j in range(6 * BLOCK_SIZE + 3)]  # 6 full blocks
    salted = hash_block_chain(prompt, BLOCK_SIZE, request_extra(layout.model_fingerprint, None, "tenant-1"))
    _, tokens = generate(decode, a, "salted-a", prompt, cache_salt="tenant-1")
    response, again = generate(decode, a, "salted-a-again", prompt, cache_salt="tenant-1")  # reused: stored
    assert response.num_cached_tokens == 6 * BLOCK_SIZE and again == tokens
    deadline = time.monotonic() + 5
    while stored_blocks(kvstore, layout, salted) < len(salted):
        assert time.monotonic() < deadline, "worker A never stored the salted prompt's blocks"
        time.sleep(0.05)
    assert stored_blocks(kvstore, layout, hash_block_chain(prompt, BLOCK_SIZE, layout.model_fingerprint)) == 0

    source = prefill_pb2.HostTierSource(address=kvstore.address, num_blocks=len(salted))
    response, _ = generate(decode, b, "other-salt-b", prompt, source, cache_salt="tenant-2")
    assert response.num_host_tier_tokens == 0 and response.num_cached_tokens == 0
    response, read = generate(decode, b, "salted-b", prompt, source, cache_salt="tenant-1")
    assert response.num_host_tier_tokens == 6 * BLOCK_SIZE and read == tokens


def test_a_tier_that_cannot_answer_costs_a_recomputation_not_the_request(decode, workers, colocated_tokens):
    _, b = workers
    prompt = [t + 1 for t in PROMPT]  # a prefix nobody holds
    gone = prefill_pb2.HostTierSource(address="127.0.0.1:1", num_blocks=10)
    response, tokens = generate(decode, b, "tier-gone", prompt, gone)
    assert response.num_host_tier_tokens == 0 and response.num_cached_tokens == 0
    assert len(tokens) == GREEDY.max_tokens


def test_pools_are_whole_after_tier_traffic(decode, workers):
    """Every prefill page is released (after the background stores end) and no decode page is held."""
    for worker in workers:
        for i in range(2):  # 60 of 64 pages each: fits only when nothing else is held
            big = [(19 * j + i) % 1000 + 1 for j in range(60 * BLOCK_SIZE)]
            deadline = time.monotonic() + 5
            while True:
                try:
                    reservation = decode.stub.Reserve(
                        decode_pb2.ReserveRequest(request_id=f"big-{i}", num_tokens=len(big)), timeout=5)
                    response = worker.stub.Prefill(prefill_pb2.PrefillRequest(
                        request_id=f"big-{i}", token_ids=big, target=_target(reservation),
                        sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True)), timeout=5)
                    break
                except grpc.RpcError as e:
                    decode.stub.Abort(decode_pb2.AbortRequest(request_id=f"big-{i}"), timeout=5)
                    assert time.monotonic() < deadline, e
                    time.sleep(0.1)
            assert response.timings.kv_transfer_bytes > 0
            assert decode.stub.Abort(decode_pb2.AbortRequest(request_id=f"big-{i}"), timeout=5).found
