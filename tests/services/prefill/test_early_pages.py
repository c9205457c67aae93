"""A long prompt's pages sent by the gRPC stream while it computes (services/prefill/early_pages.py),
between real prefill and decode processes: the decode worker gets the colocated engine's tokens, the
handoff counts the bytes sent early, and nothing stays reserved when the call ends early. Short
prompts, other transports, a first token that ends the request and --early-kv-transfer off send
nothing early; auto, the default, sends early where the engine is on a GPU."""
from __future__ import annotations

import threading

import grpc
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.common.settings import ConfigError
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.prefill.config import PrefillServiceConfig
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from tests.cuda import needs_cuda
from tests.services.prefill.test_prefill_service import (
    BLOCK_SIZE,
    DECODE_KV_BLOCKS,
    _colocated_run,
    _sampling_to_proto,
    assert_decode_pool_free,
)
from tests.services.service_process import ServiceProcess as Service

CHUNK_TOKENS = 64
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def long_prompt(k: int) -> list[int]:
    """The `k`th of prompts that share no first page: the prefill worker has cached none of it."""
    return [(37 * j + 11 * k) % 1000 + 3 for j in range(20 * CHUNK_TOKENS + 5)]  # 81 pages over 21 chunks

GRPC = common_pb2.KV_TRANSPORT_GRPC_STREAM


@pytest.fixture(scope="module")
def decode(tiny_demo_model):
    svc = Service("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", str(DECODE_KV_BLOCKS))
    svc.stub = decode_pb2_grpc.DecodeStub(svc.channel)
    yield svc
    assert svc.terminate() == 0


def prefill_worker(model_dir, *flags: str):
    svc = Service("prefill", PREFILL_SERVICE, model_dir, "--kv-blocks", "128",
                  "--max-num-batched-tokens", str(CHUNK_TOKENS), *flags)
    svc.stub = prefill_pb2_grpc.PrefillStub(svc.channel)
    return svc


@pytest.fixture(scope="module")
def prefill(tiny_demo_model):
    svc = prefill_worker(tiny_demo_model, "--early-kv-transfer", "on")  # auto: on a GPU only
    yield svc
    assert svc.terminate() == 0


@pytest.fixture(scope="module")
def colocated(tiny_demo_model):
    return LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=256))


def prefill_stream(prefill, request_id: str, prompt: list[int], target: prefill_pb2.KVTarget,
                   params: SamplingParams = GREEDY) -> list[prefill_pb2.PrefillEvent]:
    return list(prefill.stub.PrefillStream(prefill_pb2.PrefillRequest(
        request_id=request_id, token_ids=prompt, sampling=_sampling_to_proto(params), target=target), timeout=60))


def decoded(decode, request_id: str, prompt: list[int], first: prefill_pb2.PrefillEvent,
            handoff: prefill_pb2.PrefillEvent) -> list[int]:
    chunks = decode.stub.Decode(decode_pb2.DecodeRequest(
        request_id=request_id, reservation_id=handoff.handoff.reservation_id, prompt_token_ids=prompt,
        first_token_id=first.first_token.first_token_id, sampling=_sampling_to_proto(GREEDY)), timeout=60)
    return [first.first_token.first_token_id] + [t for c in chunks for t in c.token_ids]


def page_bytes(decode) -> int:
    layout = decode.stub.Reserve(decode_pb2.ReserveRequest(request_id="layout", num_tokens=1), timeout=5).layout
    decode.stub.Abort(decode_pb2.AbortRequest(request_id="layout"), timeout=5)
    return 2 * layout.num_layers * layout.num_kv_heads * layout.block_size * layout.head_dim * 4  # float32


def test_a_long_prompts_pages_go_out_while_it_computes_and_decode_continues_it(decode, prefill, colocated):
    for request_id in ("long", "given"):  # reserved by prefill, then by the caller
        prompt = long_prompt(1 if request_id == "given" else 0)
        expected = _colocated_run(colocated, f"{request_id}-ref", prompt, GREEDY).token_ids
        target = prefill_pb2.KVTarget(decode_address=decode.address, transport=GRPC) if request_id == "long" \
            else reserved_target(decode, request_id, prompt)
        first, handoff = prefill_stream(prefill, request_id, prompt, target)
        timings = handoff.handoff.timings
        num_pages = -(-len(prompt) // BLOCK_SIZE)
        assert timings.kv_transport == GRPC and timings.kv_transfer_bytes == num_pages * page_bytes(decode)
        # Every chunk's whole pages but the last few's went before the first token.
        assert 0.5 * timings.kv_transfer_bytes <= timings.kv_transfer_early_bytes < timings.kv_transfer_bytes
        assert first.first_token.timings.kv_transfer_early_bytes == 0  # the first token waits for none of it
        assert decoded(decode, request_id, prompt, first, handoff) == expected
    assert_decode_pool_free(decode)


def reserved_target(decode, request_id: str, prompt: list[int]) -> prefill_pb2.KVTarget:
    made = decode.stub.Reserve(decode_pb2.ReserveRequest(request_id=request_id, num_tokens=len(prompt)), timeout=5)
    return prefill_pb2.KVTarget(reservation_id=made.reservation_id, block_ids=made.block_ids, transport=GRPC,
                                decode_address=decode.address, layout=made.layout)


def test_nothing_goes_early_for_one_chunk_another_transport_or_a_first_token_that_ends_it(decode, prefill):
    short = long_prompt(2)[:CHUNK_TOKENS - 8]
    by_stream = prefill_pb2.KVTarget(decode_address=decode.address, transport=GRPC)
    by_shm = prefill_pb2.KVTarget(decode_address=decode.address, transport=common_pb2.KV_TRANSPORT_SHARED_MEMORY)
    for request_id, prompt, target in (("short", short, by_stream), ("shm", long_prompt(3), by_shm)):
        first, handoff = prefill_stream(prefill, request_id, prompt, target)
        assert handoff.handoff.timings.kv_transfer_early_bytes == 0 < handoff.handoff.timings.kv_transfer_bytes
        decode.stub.Abort(decode_pb2.AbortRequest(request_id=request_id), timeout=5)
    (only,) = prefill_stream(prefill, "one", long_prompt(4), by_stream, SamplingParams(max_tokens=1, temperature=0.0))
    assert only.first_token.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert_decode_pool_free(decode)


def test_without_early_transfer_the_pages_all_go_after_the_first_token(decode, tiny_demo_model, colocated):
    late = prefill_worker(tiny_demo_model, "--early-kv-transfer", "off")
    try:
        target = prefill_pb2.KVTarget(decode_address=decode.address, transport=GRPC)
        first, handoff = prefill_stream(late, "late", long_prompt(5), target)
        assert handoff.handoff.timings.kv_transfer_early_bytes == 0 < handoff.handoff.timings.kv_transfer_bytes
        assert decoded(decode, "late", long_prompt(5), first, handoff) == \
            _colocated_run(colocated, "late-ref", long_prompt(5), GREEDY).token_ids
    finally:
        assert late.terminate() == 0
    assert_decode_pool_free(decode)


def test_a_call_cancelled_while_its_pages_go_out_leaves_nothing_reserved(decode, prefill):
    target = prefill_pb2.KVTarget(decode_address=decode.address, transport=GRPC)
    num_cancelled = 0
    for i, delay_s in enumerate([0.01, 0.03, 0.06, 0.1]):  # while it computes and its pages go out
        call = prefill.stub.PrefillStream(prefill_pb2.PrefillRequest(
            request_id=f"cancelled-{i}", token_ids=long_prompt(6 + i), sampling=_sampling_to_proto(GREEDY),
            target=target), timeout=60)
        threading.Timer(delay_s, call.cancel).start()
        try:
            list(call)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED
            num_cancelled += 1
        else:  # handed over first (a fast machine): what the gateway does with a reply it no longer wants
            decode.stub.Abort(decode_pb2.AbortRequest(request_id=f"cancelled-{i}"), timeout=5)
        # Each call's pages freed before the next reserves its own: a cancelled call's reservation is aborted
        # once its Reserve has answered, which a loaded machine may not have done by the next call's (a CI
        # run's next call was refused 81 pages with 47 free, and one loaded by other tests beside it still after 3 s).
        assert_decode_pool_free(decode, within_s=10.0)
    assert num_cancelled >= 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", id="cuda", marks=needs_cuda)])
def test_early_transfer_by_default_only_where_the_prompt_computes_on_a_gpu(tiny_demo_model, device):
    model = ["--model", str(tiny_demo_model), "--device", device]
    assert PrefillServiceConfig.from_args(model, {}).sends_pages_early == (device == "cuda")
    assert PrefillServiceConfig.from_args([*model, "--early-kv-transfer", "on"], {}).sends_pages_early
    assert not PrefillServiceConfig.from_args(model, {"BATON_PREFILL_EARLY_KV_TRANSFER": "off"}).sends_pages_early
    with pytest.raises(ConfigError, match="--early-kv-transfer must be one of auto, on, off, got 'yes'"):
        PrefillServiceConfig.from_args(model, {"BATON_PREFILL_EARLY_KV_TRANSFER": "yes"})


def test_a_prefill_worker_takes_the_decode_workers_eagle_head_to_compute_its_kv_into_the_pages(tiny_demo_model):
    """--speculative-config (or its variable): an EAGLE head's or MTP layer's, whose KV the engine computes into the
    pages it hands over; an n-gram or draft-model config gives its engine none (it never drafts)."""
    from services.prefill.service import prefill_drafter

    model = ["--model", str(tiny_demo_model)]
    eagle = '{"method": "eagle", "model": "/heads/eagle", "num_speculative_tokens": 3}'
    config = PrefillServiceConfig.from_args([*model, "--speculative-config", eagle], {})
    assert prefill_drafter(config.speculative).method == "eagle"
    config = PrefillServiceConfig.from_args(model, {"BATON_PREFILL_SPECULATIVE_CONFIG": eagle})
    assert config.speculative.model == "/heads/eagle"
    ngram = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert prefill_drafter(PrefillServiceConfig.from_args([*model, "--speculative-config", ngram], {}).speculative) \
        is None
    with pytest.raises(ConfigError, match=r"--speculative-config \(or \$BATON_PREFILL_SPECULATIVE_CONFIG\)"):
        PrefillServiceConfig.from_args([*model, "--speculative-config", '{"method": "eagle"}'], {})


def test_a_hybrid_models_token_pages_go_early_and_its_state_pages_after_the_first_token(tmp_path):
    """Qwen3.5's full-attention pages of each chunk go while the rest computes; its recurrent states, final only at
    the prompt's end, go with the last pages after the first token; the decode worker continues from both."""
    from tests.parity.conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "qwen3.5", "qwen3.5")
    prompt = [token % 500 + 3 for token in long_prompt(9)[:10 * CHUNK_TOKENS + 5]]  # 512 tokens, a context of 1024
    colocated = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=256))
    expected = _colocated_run(colocated, "ref", prompt, GREEDY).token_ids
    num_states = colocated.block_manager.num_state_blocks
    decode = Service("decode", DECODE_SERVICE, model, "--kv-blocks", "64")  # pages for one context
    decode.stub = decode_pb2_grpc.DecodeStub(decode.channel)
    prefill = prefill_worker(model, "--early-kv-transfer", "on")
    try:
        first, handoff = prefill_stream(prefill, "hybrid", prompt,
                                        prefill_pb2.KVTarget(decode_address=decode.address, transport=GRPC))
        timings = handoff.handoff.timings
        num_pages = -(-len(prompt) // BLOCK_SIZE) + num_states
        assert timings.kv_transfer_bytes == num_pages * page_bytes(decode)
        assert 0.5 * timings.kv_transfer_bytes <= timings.kv_transfer_early_bytes < timings.kv_transfer_bytes
        assert decoded(decode, "hybrid", prompt, first, handoff) == expected
        assert_decode_pool_free(decode, num_tokens=(64 - num_states) * BLOCK_SIZE - 1)
    finally:
        assert prefill.terminate() == 0
        assert decode.terminate() == 0
