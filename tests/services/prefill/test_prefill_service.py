"""The prefill service and the decode service as real processes over real gRPC, with
this test process as the gateway: Reserve on decode → Prefill (pages written into the
decode pool through shared memory) → Decode from the first token. Three processes
must produce exactly a colocated engine's tokens; failures must leave no page held."""
from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, profile_pb2, profile_pb2_grpc
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.prefill.servicer import ENGINE_DEAD, SERVICE_NAME as PREFILL_SERVICE
from tests.services.service_process import (
    SLOW_FAILING_STEP_S,
    ServiceProcess as Service,
    assert_a_call_opened_ahead_ends_unavailable_at_shutdown,
    failing_step_worker,
)

DECODE_KV_BLOCKS = 128
PREFILL_KV_BLOCKS = 64
BLOCK_SIZE = 16
BIG_PROMPT_TOKENS = 60 * BLOCK_SIZE  # 60 of the prefill worker's 64 pages: fits only if the others are free
PROMPT = [(31 * j) % 1000 + 3 for j in range(53)]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def decode(tiny_demo_model):
    svc = Service("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", str(DECODE_KV_BLOCKS))
    svc.stub = decode_pb2_grpc.DecodeStub(svc.channel)
    yield svc
    shm_name = svc.stub.Reserve(decode_pb2.ReserveRequest(request_id="shm", num_tokens=1), timeout=5).shm_name
    assert svc.terminate() == 0
    assert not (Path("/dev/shm") / shm_name).exists()


@pytest.fixture(scope="module")
def prefill(tiny_demo_model):
    # A small step budget, so every prompt over 64 tokens is chunked; a prompt finding the decode pool full
    # waits half a second for pages before it is refused (the tests that fill it).
    svc = Service("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", str(PREFILL_KV_BLOCKS),
                  "--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--kv-reserve-wait-s", "0.5")
    svc.stub = prefill_pb2_grpc.PrefillStub(svc.channel)
    yield svc
    assert svc.terminate() == 0


@pytest.fixture(scope="module")
def colocated(tiny_demo_model):
    return LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=512))


def _sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    proto = common_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                      ignore_eos=p.ignore_eos)
    if p.seed is not None:
        proto.seed = p.seed
    if p.logprobs is not None:
        proto.logprobs = p.logprobs
    return proto


def _colocated_run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    engine.add_request(request_id, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                final = out if final is None else _merge(final, out)
    return final


def _merge(a, b):
    b.new_logprobs = a.new_logprobs + b.new_logprobs
    return b


def _target(reservation: decode_pb2.Reservation, **overrides) -> prefill_pb2.KVTarget:
    target = prefill_pb2.KVTarget(reservation_id=reservation.reservation_id, block_ids=reservation.block_ids,
                                  transport=common_pb2.KV_TRANSPORT_SHARED_MEMORY, shm_name=reservation.shm_name,
                                  layout=reservation.layout)
    for name, value in overrides.items():
        if name == "layout":
            target.layout.CopyFrom(value)
        elif name == "block_ids":
            target.ClearField("block_ids")
            target.block_ids.extend(value)
        else:
            setattr(target, name, value)
    return target


def reserve(decode, request_id: str, prompt: list[int]) -> decode_pb2.Reservation:
    return decode.stub.Reserve(decode_pb2.ReserveRequest(request_id=request_id, num_tokens=len(prompt)), timeout=5)


def do_prefill(prefill, request_id: str, prompt: list[int], params: SamplingParams, target
               ) -> prefill_pb2.PrefillResponse:
    return prefill.stub.Prefill(prefill_pb2.PrefillRequest(request_id=request_id, token_ids=prompt,
                                                           sampling=_sampling_to_proto(params), target=target),
                                timeout=20)


def generate(decode, prefill, request_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """What the gateway does: Reserve → Prefill → Decode."""
    reservation = reserve(decode, request_id, prompt)
    response = do_prefill(prefill, request_id, prompt, params, _target(reservation))
    assert response.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert response.timings.kv_transfer_bytes > 0
    tokens = [response.first_token_id]
    chunks = list(decode.stub.Decode(decode_pb2.DecodeRequest(
        request_id=request_id, reservation_id=reservation.reservation_id, prompt_token_ids=prompt,
        first_token_id=response.first_token_id, sampling=_sampling_to_proto(params)), timeout=20))
    for chunk in chunks:
        tokens += chunk.token_ids
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    return tokens


@pytest.mark.parametrize("prompt, params", [
    (PROMPT, GREEDY), (PROMPT, SEEDED), ([7], GREEDY), ([(13 * j) % 1000 + 2 for j in range(200)], SEEDED),
], ids=["greedy", "seeded", "one-token", "200-tokens"])
def test_three_processes_match_a_colocated_engine(decode, prefill, colocated, prompt, params):
    rid = f"match-{len(prompt)}-{params.temperature}"
    expected = _colocated_run(colocated, rid, prompt, params).token_ids
    assert generate(decode, prefill, rid, prompt, params) == expected


def test_first_token_logprobs_and_timings(decode, prefill, colocated):
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    expected = _colocated_run(colocated, "lp-ref", PROMPT, params)
    reservation = reserve(decode, "lp", PROMPT)
    response = do_prefill(prefill, "lp", PROMPT, params, _target(reservation))
    assert response.first_token_id == expected.token_ids[0]
    assert response.logprobs.sampled.token_id == expected.token_ids[0]
    assert response.logprobs.sampled.logprob == pytest.approx(expected.new_logprobs[0][expected.token_ids[0]],
                                                              abs=1e-4)
    assert len(response.logprobs.top) == 2
    timings = response.timings
    assert timings.kv_transfer_bytes == len(reservation.block_ids) * 2 * 2 * 2 * 16 * 16 * 4  # L, K/V, Hkv, bs, D, f32
    assert timings.queue_seconds >= 0 and timings.prefill_seconds > 0 and timings.kv_transfer_seconds > 0
    assert 0 < timings.admit_seconds <= timings.queue_seconds  # the engine's add_request, within the wait
    # The same prompt again comes (mostly) from the prefix cache: every full block of it.
    again = do_prefill(prefill, "lp2", PROMPT, params, _target(reservation))
    assert again.num_cached_tokens == len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE
    assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="lp"), timeout=5).found


def test_max_tokens_one_finishes_at_prefill(decode, prefill):
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    reservation = reserve(decode, "one", PROMPT)
    response = do_prefill(prefill, "one", PROMPT, params, _target(reservation))
    assert response.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert response.timings.kv_transfer_bytes == 0  # nothing held, nothing written
    assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="one"), timeout=5).found  # as the gateway does


def test_layout_mismatch_is_refused_and_holds_nothing(decode, prefill):
    reservation = reserve(decode, "mismatch", PROMPT)
    wrong = common_pb2.KVLayout()
    wrong.CopyFrom(reservation.layout)
    wrong.model_fingerprint = b"another model"
    with pytest.raises(grpc.RpcError) as e:
        do_prefill(prefill, "mismatch", PROMPT, GREEDY, _target(reservation, layout=wrong))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "fingerprint" in e.value.details()
    assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="mismatch"), timeout=5).found
    assert_prefill_pool_free(decode, prefill)


def assert_prefill_pool_free(decode, prefill) -> None:
    """Two prompts one after the other that each need nearly the whole prefill pool: the second
    would wait forever (and time out) if the first, or any earlier request, still held pages."""
    for i in range(2):
        big = [(11 * j + i) % 1000 + 1 for j in range(BIG_PROMPT_TOKENS)]
        reservation = reserve(decode, f"big-{i}", big)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        assert do_prefill(prefill, f"big-{i}", big, params, _target(reservation)).timings.kv_transfer_bytes > 0
        assert decode.stub.Abort(decode_pb2.AbortRequest(request_id=f"big-{i}"), timeout=5).found


def test_cancelled_prefill_releases_its_pages(decode, prefill):
    big = [(17 * j) % 1000 + 1 for j in range(BIG_PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i, delay_s in enumerate([0.0, 0.005, 0.02, 0.05]):  # cancelled while queued, computing or copying
        reservation = reserve(decode, f"cancel-{i}", big)
        call = prefill.stub.Prefill.future(prefill_pb2.PrefillRequest(
            request_id=f"cancel-{i}", token_ids=big, sampling=_sampling_to_proto(params), target=_target(reservation)),
            timeout=20)
        time.sleep(delay_s)
        call.cancel()
        assert decode.stub.Abort(decode_pb2.AbortRequest(request_id=f"cancel-{i}"), timeout=5).found
    assert_prefill_pool_free(decode, prefill)


def assert_decode_pool_free(decode, within_s: float = 1.0, num_tokens: int = DECODE_KV_BLOCKS * BLOCK_SIZE - 1
                            ) -> None:
    """Reserving every page of the decode pool (`num_tokens`' pages) succeeds (retried for `within_s`)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            reserve(decode, "whole-pool", [1] * num_tokens)
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, e
            time.sleep(0.02)
    assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="whole-pool"), timeout=5).found


def test_a_target_with_only_an_address_is_reserved_by_prefill(decode, prefill, colocated):
    expected = _colocated_run(colocated, "self-ref", PROMPT, GREEDY).token_ids
    target = prefill_pb2.KVTarget(decode_address=decode.address)
    response = do_prefill(prefill, "self", PROMPT, GREEDY, target)
    assert response.reservation_id and response.timings.kv_transfer_bytes > 0
    assert response.timings.kv_transport == common_pb2.KV_TRANSPORT_SHARED_MEMORY  # same host: auto picks it
    chunks = list(decode.stub.Decode(decode_pb2.DecodeRequest(
        request_id="self", reservation_id=response.reservation_id, prompt_token_ids=PROMPT,
        first_token_id=response.first_token_id, sampling=_sampling_to_proto(GREEDY)), timeout=20))
    assert [response.first_token_id] + [t for c in chunks for t in c.token_ids] == expected

    # Ended by its first token: the reservation prefill made is not handed on, and is freed.
    one = do_prefill(prefill, "self-one", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), target)
    assert one.finish_reason == common_pb2.FINISH_REASON_LENGTH and not one.reservation_id
    assert_decode_pool_free(decode)


def test_prefill_stream_sends_the_first_token_before_the_handoff(decode, prefill, colocated):
    expected = _colocated_run(colocated, "stream-ref", PROMPT, GREEDY).token_ids
    request = prefill_pb2.PrefillRequest(request_id="stream", token_ids=PROMPT, sampling=_sampling_to_proto(GREEDY),
                                         target=prefill_pb2.KVTarget(decode_address=decode.address))
    first, handoff = list(prefill.stub.PrefillStream(request, timeout=20))
    assert first.WhichOneof("event") == "first_token" and handoff.WhichOneof("event") == "handoff"
    token = first.first_token
    # The first token's answer knows no pages yet; the handoff names them and times the write.
    assert token.first_token_id == expected[0] and token.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert not token.reservation_id and token.timings.kv_transfer_bytes == 0 and token.timings.prefill_seconds > 0
    timings = handoff.handoff.timings
    assert handoff.handoff.reservation_id and timings.kv_transfer_bytes > 0 and timings.kv_transfer_seconds > 0
    assert timings.prefill_seconds == token.timings.prefill_seconds
    chunks = list(decode.stub.Decode(decode_pb2.DecodeRequest(
        request_id="stream", reservation_id=handoff.handoff.reservation_id, prompt_token_ids=PROMPT,
        first_token_id=token.first_token_id, sampling=_sampling_to_proto(GREEDY)), timeout=20))
    assert [token.first_token_id] + [t for c in chunks for t in c.token_ids] == expected

    # A first token that ends the request comes alone, and nothing stays reserved.
    request.request_id, request.sampling.max_tokens = "stream-one", 1
    (only,) = list(prefill.stub.PrefillStream(request, timeout=20))
    assert only.first_token.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert_decode_pool_free(decode)
    assert_prefill_pool_free(decode, prefill)


def test_a_preopened_call_answers_the_request_it_is_sent_later_as_prefill_stream_does(decode, prefill, colocated):
    """The gateway opens the call ahead and sends the request when one comes: the answer is
    PrefillStream's; a call half-closed without a request ends OK with nothing."""
    expected = _colocated_run(colocated, "preopened-ref", PROMPT, GREEDY).token_ids
    requests: queue.SimpleQueue = queue.SimpleQueue()
    call = prefill.stub.PrefillPreopened(iter(requests.get, None), timeout=20)
    time.sleep(0.3)  # open and idle: the worker waits for the request
    requests.put(prefill_pb2.PrefillRequest(request_id="preopened", token_ids=PROMPT,
                                            sampling=_sampling_to_proto(GREEDY),
                                            target=prefill_pb2.KVTarget(decode_address=decode.address)))
    first, handoff = next(call), next(call)
    requests.put(None)
    assert list(call) == [] and call.code() == grpc.StatusCode.OK
    assert first.first_token.first_token_id == expected[0] and handoff.handoff.timings.kv_transfer_bytes > 0
    chunks = list(decode.stub.Decode(decode_pb2.DecodeRequest(
        request_id="preopened", reservation_id=handoff.handoff.reservation_id, prompt_token_ids=PROMPT,
        first_token_id=first.first_token.first_token_id, sampling=_sampling_to_proto(GREEDY)), timeout=20))
    assert [first.first_token.first_token_id] + [t for c in chunks for t in c.token_ids] == expected

    assert list(prefill.stub.PrefillPreopened(iter([]), timeout=5)) == []
    assert_decode_pool_free(decode)
    assert_prefill_pool_free(decode, prefill)


def test_a_preopened_call_sends_its_response_headers_before_its_request(prefill):
    """Opened ahead, the call's headers go out at once: its first token later carries none."""
    requests: queue.SimpleQueue = queue.SimpleQueue()
    call = prefill.stub.PrefillPreopened(iter(requests.get, None), timeout=20)
    headers = []
    reader = threading.Thread(target=lambda: headers.append(call.initial_metadata()), daemon=True)
    reader.start()
    reader.join(5)  # before, they came with the first token: never, here
    requests.put(None)
    assert headers and list(call) == [] and call.code() == grpc.StatusCode.OK


def _reserving_nowhere(request_id: str) -> prefill_pb2.PrefillRequest:
    """PROMPT, greedy, its pages to be reserved on a decode worker that is not there: for a worker
    whose engine fails (failing_step_worker) before it would ask for them."""
    return prefill_pb2.PrefillRequest(request_id=request_id, token_ids=PROMPT, sampling=_sampling_to_proto(GREEDY),
                                      target=prefill_pb2.KVTarget(decode_address="127.0.0.1:9"))


def test_a_new_call_sends_its_response_headers_while_its_prompt_computes(tiny_demo_model):
    """Its first token then carries none. The step here takes SLOW_FAILING_STEP_S (and then
    fails): headers sent with the first message, or with the error, would come only after it."""
    svc = Service("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "16",
                  command=failing_step_worker("prefill"))
    call = prefill_pb2_grpc.PrefillStub(svc.channel).PrefillStream(_reserving_nowhere("slowfail-1"), timeout=10)
    sent = time.monotonic()
    call.initial_metadata()
    assert time.monotonic() - sent < SLOW_FAILING_STEP_S / 2
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
    assert svc.proc.wait(timeout=30) == 1
    svc.terminate()


def test_prefill_that_cannot_reserve_is_resource_exhausted_and_holds_nothing(decode, prefill):
    """Refused once the prefill worker's wait for pages (0.5 s here) is out; at once for a target that says
    so (`reserve_at_once`: the gateway's second decode worker for a request the first had no room for)."""
    reserve(decode, "hog", [1] * (DECODE_KV_BLOCKS * BLOCK_SIZE - 1))
    try:
        for request_id, at_once in (("starved", False), ("starved-at-once", True)):
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                do_prefill(prefill, request_id, PROMPT, GREEDY,
                           prefill_pb2.KVTarget(decode_address=decode.address, reserve_at_once=at_once))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (time.monotonic() - started < 0.5) == at_once
    finally:
        assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="hog"), timeout=5).found
    assert_prefill_pool_free(decode, prefill)
    with pytest.raises(grpc.RpcError) as e:
        do_prefill(prefill, "nowhere", PROMPT, GREEDY, prefill_pb2.KVTarget())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_wait_for_decode_pages_is_a_flag_or_variable_of_seconds_at_least_0(tiny_demo_model):
    from services.prefill.config import ConfigError, PrefillServiceConfig

    model = ["--model", str(tiny_demo_model)]
    assert PrefillServiceConfig.from_args(model, {}).kv_reserve_wait_s == 30.0
    assert PrefillServiceConfig.from_args([*model, "--kv-reserve-wait-s", "0"], {}).kv_reserve_wait_s == 0.0
    assert PrefillServiceConfig.from_args(model, {"BATON_PREFILL_KV_RESERVE_WAIT_S": "2.5"}).kv_reserve_wait_s == 2.5
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="--kv-reserve-wait-s must be a number of seconds >= 0"):
            PrefillServiceConfig.from_args([*model, "--kv-reserve-wait-s", bad], {})


def test_a_prefill_stream_that_cannot_reserve_ends_after_its_first_token(decode, prefill):
    reserve(decode, "hog", [1] * (DECODE_KV_BLOCKS * BLOCK_SIZE - 1))
    try:
        call = prefill.stub.PrefillStream(prefill_pb2.PrefillRequest(
            request_id="starved-stream", token_ids=PROMPT, sampling=_sampling_to_proto(GREEDY),
            target=prefill_pb2.KVTarget(decode_address=decode.address)), timeout=20)
        first = next(call)  # the first token needs no pages: it is not held back
        assert first.WhichOneof("event") == "first_token" and first.first_token.first_token_id >= 0
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="hog"), timeout=5).found
    assert_decode_pool_free(decode)
    assert_prefill_pool_free(decode, prefill)


def test_cancelled_prefill_frees_the_reservation_it_made(decode, prefill):
    """A call cancelled before it hands its reservation on aborts it itself, once its Reserve
    answered (the caller's Abort may well reach decode before that Reserve); one cancelled after
    (the response was on its way) is the caller's to abort, as the gateway does by request id."""
    big = [(19 * j) % 1000 + 1 for j in range(BIG_PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i, delay_s in enumerate([0.0, 0.002, 0.005, 0.02, 0.05]):
        call = prefill.stub.Prefill.future(prefill_pb2.PrefillRequest(
            request_id=f"self-cancel-{i}", token_ids=big, sampling=_sampling_to_proto(params),
            target=prefill_pb2.KVTarget(decode_address=decode.address)), timeout=20)
        time.sleep(delay_s)
        call.cancel()
        decode.stub.Abort(decode_pb2.AbortRequest(request_id=f"self-cancel-{i}"), timeout=5)
    assert_decode_pool_free(decode)
    assert_prefill_pool_free(decode, prefill)


def test_a_stream_cancelled_after_its_first_token_holds_nothing(decode, prefill):
    """What a client that leaves after the first token costs: the gateway cancels the stream and
    aborts on decode by request id; the write in flight finishes before its pages are released."""
    big = [(23 * j) % 1000 + 1 for j in range(BIG_PROMPT_TOKENS)]
    for i in range(3):
        call = prefill.stub.PrefillStream(prefill_pb2.PrefillRequest(
            request_id=f"stream-cancel-{i}", token_ids=big, sampling=_sampling_to_proto(GREEDY),
            target=prefill_pb2.KVTarget(decode_address=decode.address)), timeout=20)
        assert next(call).WhichOneof("event") == "first_token"
        call.cancel()
        decode.stub.Abort(decode_pb2.AbortRequest(request_id=f"stream-cancel-{i}"), timeout=5)
    assert_decode_pool_free(decode)
    assert_prefill_pool_free(decode, prefill)


def test_bad_input(decode, prefill):
    reservation = reserve(decode, "bad", PROMPT)
    ok = _target(reservation)
    cases = [
        ([], GREEDY, ok, grpc.StatusCode.INVALID_ARGUMENT),
        ([1, 2, 10**6], GREEDY, ok, grpc.StatusCode.INVALID_ARGUMENT),
        (PROMPT, SamplingParams(temperature=0.0), _target(reservation, block_ids=[1]),
         grpc.StatusCode.INVALID_ARGUMENT),
        (PROMPT, GREEDY, _target(reservation, transport=common_pb2.KV_TRANSPORT_GRPC_STREAM),  # no decode_address
         grpc.StatusCode.INVALID_ARGUMENT),
        (PROMPT, GREEDY, _target(reservation, shm_name="baton_kv_nonexistent"), grpc.StatusCode.FAILED_PRECONDITION),
    ]
    for prompt, params, target, code in cases:
        with pytest.raises(grpc.RpcError) as e:
            do_prefill(prefill, "bad", prompt, params, target)
        assert e.value.code() == code, e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # temperature < 0
        prefill.stub.Prefill(prefill_pb2.PrefillRequest(
            request_id="bad", token_ids=PROMPT, sampling=common_pb2.SamplingParams(temperature=-1), target=ok),
            timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert decode.stub.Abort(decode_pb2.AbortRequest(request_id="bad"), timeout=5).found


def test_a_preopened_call_still_waiting_ends_unavailable_at_shutdown_without_holding_it_up(tiny_demo_model):
    assert_a_call_opened_ahead_ends_unavailable_at_shutdown(
        Service("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "16"),
        lambda channel, requests: prefill_pb2_grpc.PrefillStub(channel).PrefillPreopened(requests, timeout=30))


def test_sigterm_exits_zero(tiny_demo_model):
    segments_before = {p for p in os.listdir("/dev/shm") if p.startswith("baton_kv_")}
    svc = Service("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "16")
    assert svc.terminate() == 0
    assert {p for p in os.listdir("/dev/shm") if p.startswith("baton_kv_")} <= segments_before


def test_a_worker_whose_engine_fails_fails_its_request_and_exits_1(tiny_demo_model):
    """Its engine's state is unknown after a failed step: it stops (an orchestrator restarts it)
    instead of serving on."""
    svc = Service("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "16",
                  command=failing_step_worker("prefill"))
    stub = prefill_pb2_grpc.PrefillStub(svc.channel)
    with pytest.raises(grpc.RpcError) as e:  # it fails before any decode worker is asked for pages
        list(stub.PrefillStream(_reserving_nowhere("fail-1"), timeout=10))
    assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
    assert svc.proc.wait(timeout=30) == 1
    assert "stopping: its engine failed" in svc.stderr_text()
    svc.terminate()


def test_a_prompt_queued_behind_a_failing_step_ends_unavailable(tiny_demo_model):
    """A prompt that waited for the engine while a step failed never ran: UNAVAILABLE (the worker
    is stopping; another may take it), not the INTERNAL of the prompt the step was computing."""
    svc = Service("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "16",
                  command=failing_step_worker("prefill"))
    stub = prefill_pb2_grpc.PrefillStub(svc.channel)

    def prefill(request_id: str) -> list:
        return list(stub.PrefillStream(_reserving_nowhere(request_id), timeout=10))

    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(prefill, "slowfail-1")
        time.sleep(SLOW_FAILING_STEP_S / 4)  # its step is running (and will fail)
        queued = pool.submit(prefill, "behind")
        with pytest.raises(grpc.RpcError) as e:
            running.result()
        assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            queued.result()
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD)
    assert svc.proc.wait(timeout=30) == 1
    svc.terminate()


def test_a_worker_without_a_profiler_dir_refuses_to_profile(prefill):
    """A client may not have a worker write files it was not told to write."""
    with pytest.raises(grpc.RpcError) as refused:
        profile_pb2_grpc.ProfilerStub(prefill.channel).Start(profile_pb2.StartProfileRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--profiler-dir" in refused.value.details()
