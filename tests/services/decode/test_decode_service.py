"""The decode service as a real process (`python -m services.decode`) over real gRPC,
with this test process as the prefill worker: it prefills in its own engine, reserves
pages, writes them through the shared-memory pool and streams the rest from Decode.
Tokens must equal a colocated engine's; pages must come back on finish, Abort, lease
expiry and client cancellation; SIGTERM exits 0 and removes the segment."""
from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from engine.config import EngineConfig
from engine.dtypes import PAGE_DTYPES
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.converters import layout_from_proto
from services.decode.servicer import ENGINE_DEAD, SERVICE_NAME
from services.kvstore.page_copy import copy_pages
from services.kvstore.page_fence import ReservationEndedError
from services.kvstore.shared_memory import SharedKVPool
from services.kvstore.shm_transport import SharedMemoryTransport
from services.kvstore.transport import KVDestination
from tests.services.gateway.mesh import metric_value
from tests.services.service_process import (
    SLOW_FAILING_STEP_S,
    ServiceProcess,
    assert_a_call_opened_ahead_ends_unavailable_at_shutdown,
    failing_step_worker,
    metrics_address,
)

NUM_KV_BLOCKS = 128
BLOCK_SIZE = 16
WHOLE_POOL_TOKENS = NUM_KV_BLOCKS * BLOCK_SIZE - 1  # 128 blocks; the context (2048) refuses one more token
LEASE_MS = 1500
PROMPT = [(31 * j) % 1000 + 3 for j in range(53)]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)


def Service(model_dir: Path, *extra_args: str, command: list[str] | None = None) -> ServiceProcess:
    """One `python -m services.decode` process (or `command`), SERVING, with a sync stub."""
    svc = ServiceProcess("decode", SERVICE_NAME, model_dir, *extra_args, command=command)
    svc.stub = decode_pb2_grpc.DecodeStub(svc.channel)
    return svc


def _sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    proto = common_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                      ignore_eos=p.ignore_eos)
    if p.seed is not None:
        proto.seed = p.seed
    return proto


@pytest.fixture(scope="module")
def service(tiny_demo_model):
    svc = Service(tiny_demo_model, "--kv-blocks", str(NUM_KV_BLOCKS), "--lease-ms", str(LEASE_MS),
                  "--max-num-seqs", "8")
    yield svc
    assert svc.terminate() == 0


@pytest.fixture(scope="module")
def prefill_engine(tiny_demo_model):
    return LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=512))


@pytest.fixture(scope="module")
def colocated(tiny_demo_model):
    return LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=512))


def _run_to_end(engine: LLMEngine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                tokens = out.token_ids
    return tokens


_prefill_lock = threading.Lock()


def prefill_and_reserve(service: Service, engine: LLMEngine, request_id: str, params: SamplingParams
                        ) -> tuple[decode_pb2.Reservation, int]:
    """What a prefill worker does: prefill, Reserve, write the pages into the decode pool."""
    with _prefill_lock:  # the in-process engine is not thread-safe
        engine.add_request(request_id, PROMPT, params, prefill_only=True)
        first = _run_to_end(engine, request_id)[0]
        reservation = service.stub.Reserve(decode_pb2.ReserveRequest(request_id=request_id,
                                                                     num_tokens=len(PROMPT)), timeout=10)
        target = SharedKVPool.attach(reservation.shm_name, layout_from_proto(reservation.layout, num_blocks=1))
        try:
            copy_pages(engine.runner.kv_pool.tensor, engine.held_block_ids(request_id), target.tensor,
                       list(reservation.block_ids))
        finally:
            target.close()
            engine.release(request_id)
    return reservation, first


def decode_stream(service: Service, request_id: str, reservation, first: int, params: SamplingParams):
    return service.stub.Decode(decode_pb2.DecodeRequest(
        request_id=request_id, reservation_id=reservation.reservation_id, prompt_token_ids=PROMPT,
        first_token_id=first, sampling=_sampling_to_proto(params)), timeout=30)


def decode_all(service, engine, request_id: str, params: SamplingParams) -> list[int]:
    reservation, first = prefill_and_reserve(service, engine, request_id, params)
    tokens = [first]
    chunks = list(decode_stream(service, request_id, reservation, first, params))
    for chunk in chunks:
        tokens += chunk.token_ids
    assert [c.finish_reason for c in chunks[:-1]] == [common_pb2.FINISH_REASON_UNSPECIFIED] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    return tokens


def assert_whole_pool_free(service: Service, within_s: float) -> None:
    """Reserving every page succeeds (retried for `within_s`), then is aborted again."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            service.stub.Reserve(decode_pb2.ReserveRequest(request_id="probe", num_tokens=WHOLE_POOL_TOKENS),
                                 timeout=5)
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert time.monotonic() < deadline, "the pool did not become free in time"
            time.sleep(0.02)
    assert service.stub.Abort(decode_pb2.AbortRequest(request_id="probe"), timeout=5).found


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_decode_matches_colocated_engine(service, prefill_engine, colocated, params):
    rid = f"match-{params.temperature}"
    colocated.add_request(rid, PROMPT, params)
    expected = _run_to_end(colocated, rid)
    assert decode_all(service, prefill_engine, rid, params) == expected
    assert_whole_pool_free(service, within_s=1)


def test_a_preopened_call_answers_the_request_it_is_sent_later_as_decode_does(service, prefill_engine, colocated):
    """The gateway opens the call ahead (its headers come back at once) and sends the handed-off
    request when one comes: the answer is Decode's. A call half-closed without a request ends
    OK with nothing."""
    rid = "preopened"
    colocated.add_request(rid, PROMPT, GREEDY)
    expected = _run_to_end(colocated, rid)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    call = service.stub.DecodePreopened(iter(requests.get, None), timeout=30)
    headers = []
    reader = threading.Thread(target=lambda: headers.append(call.initial_metadata()), daemon=True)
    reader.start()
    reader.join(5)  # sent with the first chunk instead, they would not be here before a request
    assert headers, "the preopened call's headers did not come ahead of its request"
    reservation, first = prefill_and_reserve(service, prefill_engine, rid, GREEDY)
    requests.put(decode_pb2.DecodeRequest(request_id=rid, reservation_id=reservation.reservation_id,
                                          prompt_token_ids=PROMPT, first_token_id=first,
                                          sampling=_sampling_to_proto(GREEDY)))
    chunks = []
    for chunk in call:
        chunks.append(chunk)
        if chunk.finish_reason:
            requests.put(None)
    assert call.code() == grpc.StatusCode.OK
    assert [first] + [t for c in chunks for t in c.token_ids] == expected
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert list(service.stub.DecodePreopened(iter([]), timeout=5)) == []
    assert_whole_pool_free(service, within_s=1)


def test_a_preopened_call_still_waiting_ends_unavailable_at_shutdown_without_holding_it_up(tiny_demo_model):
    assert_a_call_opened_ahead_ends_unavailable_at_shutdown(
        Service(tiny_demo_model, "--kv-blocks", "16"),
        lambda channel, requests: decode_pb2_grpc.DecodeStub(channel).DecodePreopened(requests, timeout=30))


def test_reservation_carries_layout_and_transport(service, prefill_engine):
    reservation = service.stub.Reserve(decode_pb2.ReserveRequest(request_id="shape", num_tokens=33), timeout=5)
    assert len(reservation.block_ids) == 3
    assert reservation.lease_ms == LEASE_MS
    assert reservation.layout.model_fingerprint == prefill_engine.fingerprint
    assert reservation.layout.block_size == BLOCK_SIZE
    assert list(reservation.transports) == [common_pb2.KV_TRANSPORT_SHARED_MEMORY, common_pb2.KV_TRANSPORT_GRPC_STREAM]
    assert reservation.host_id and reservation.shm_name
    assert service.stub.Abort(decode_pb2.AbortRequest(request_id="shape"), timeout=5).found


def test_four_concurrent_streams(service, prefill_engine, colocated):
    params = [SamplingParams(max_tokens=12 + i, temperature=0.7, seed=100 + i, ignore_eos=True) for i in range(4)]
    expected = []
    for i, p in enumerate(params):
        colocated.add_request(f"conc-ref-{i}", PROMPT, p)
        expected.append(_run_to_end(colocated, f"conc-ref-{i}"))
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = decode_all(service, prefill_engine, f"conc-{i}", params[i])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert [results[i] for i in range(4)] == expected
    assert_whole_pool_free(service, within_s=1)


def reserve_waiting(service: Service, request_id: str, num_tokens: int, wait_ms: int) -> grpc.Future:
    return service.stub.Reserve.future(decode_pb2.ReserveRequest(request_id=request_id, num_tokens=num_tokens,
                                                                 wait_ms=wait_ms), timeout=wait_ms / 1000 + 10)


def test_reserves_that_may_wait_are_granted_in_turn_as_pages_free(service):
    service.stub.Reserve(decode_pb2.ReserveRequest(request_id="hog", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
    whole = reserve_waiting(service, "wait-whole", WHOLE_POOL_TOKENS, 20_000)
    time.sleep(0.3)  # queued first
    smalls = [reserve_waiting(service, f"wait-small-{i}", 16, 20_000) for i in range(4)]
    time.sleep(0.3)
    assert not any(call.done() for call in [whole, *smalls])
    assert service.stub.Abort(decode_pb2.AbortRequest(request_id="hog"), timeout=5).found
    # The whole pool's worth goes first: the small ones, though each fits any free page, wait their turn.
    assert len(whole.result(timeout=5).block_ids) == NUM_KV_BLOCKS
    time.sleep(0.3)
    assert not any(call.done() for call in smalls)
    assert service.stub.Abort(decode_pb2.AbortRequest(request_id="wait-whole"), timeout=5).found
    assert [len(call.result(timeout=5).block_ids) for call in smalls] == [1] * 4
    for i in range(4):
        assert service.stub.Abort(decode_pb2.AbortRequest(request_id=f"wait-small-{i}"), timeout=5).found
    assert_whole_pool_free(service, within_s=1)


def test_a_reserve_whose_wait_runs_out_is_resource_exhausted(service):
    service.stub.Reserve(decode_pb2.ReserveRequest(request_id="hog", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
    try:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            reserve_waiting(service, "too-late", 16, 400).result()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        assert 0.4 <= time.monotonic() - start < 3
    finally:
        service.stub.Abort(decode_pb2.AbortRequest(request_id="hog"), timeout=5)
    assert_whole_pool_free(service, within_s=1)


def test_a_waiting_reserve_whose_caller_goes_away_takes_no_pages(service):
    service.stub.Reserve(decode_pb2.ReserveRequest(request_id="hog", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
    gone = reserve_waiting(service, "gone", WHOLE_POOL_TOKENS, 20_000)
    time.sleep(0.3)
    assert gone.cancel()
    time.sleep(0.3)  # the cancellation reaches the server
    assert service.stub.Abort(decode_pb2.AbortRequest(request_id="hog"), timeout=5).found
    # Had it stayed queued, it would hold the whole pool now, until its lease ran out (1.5 s).
    assert_whole_pool_free(service, within_s=0.5)


def test_a_stopping_worker_sends_the_reserves_waiting_for_its_pages_elsewhere_at_once(tiny_demo_model):
    """UNAVAILABLE, which the gateway takes for a decode worker gone (its request moves to another), at once,
    not CANCELLED at the end of the grace."""
    stopping = Service(tiny_demo_model, "--kv-blocks", str(NUM_KV_BLOCKS), "--shutdown-grace-s", "10")
    try:
        stopping.stub.Reserve(decode_pb2.ReserveRequest(request_id="hog", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
        waiting = [reserve_waiting(stopping, f"waiting-{i}", 16, 20_000) for i in range(2)]
        time.sleep(0.3)
        signaled = time.monotonic()
        stopping.proc.send_signal(signal.SIGTERM)
        for call in waiting:
            with pytest.raises(grpc.RpcError) as e:
                call.result(timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            assert "stopping" in e.value.details()
        assert time.monotonic() - signaled < 2
    finally:
        assert stopping.terminate() == 0


def test_unclaimed_reservation_is_released_after_its_lease(service, prefill_engine):
    reservation = service.stub.Reserve(decode_pb2.ReserveRequest(request_id="lease", num_tokens=WHOLE_POOL_TOKENS),
                                       timeout=5)
    with pytest.raises(grpc.RpcError) as e:
        service.stub.Reserve(decode_pb2.ReserveRequest(request_id="other", num_tokens=1), timeout=5)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    time.sleep(LEASE_MS / 1000)
    assert_whole_pool_free(service, within_s=1)
    with pytest.raises(grpc.RpcError) as e:  # the expired reservation cannot be claimed any more
        list(decode_stream(service, "lease", reservation, 5, GREEDY))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_abort_frees_a_reservation_and_is_idempotent(service):
    service.stub.Reserve(decode_pb2.ReserveRequest(request_id="ab", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
    assert service.stub.Abort(decode_pb2.AbortRequest(request_id="ab"), timeout=5).found
    assert not service.stub.Abort(decode_pb2.AbortRequest(request_id="ab"), timeout=5).found
    assert not service.stub.Abort(decode_pb2.AbortRequest(request_id="never-seen"), timeout=5).found
    assert_whole_pool_free(service, within_s=0)


def shm_write(reservation: decode_pb2.Reservation, block_ids: list[int], value: float) -> None:
    """What a prefill process does with its computed pages: `value` into `block_ids` of the reservation's
    pool, by the shared-memory transport (raises ReservationEndedError where the reservation ended)."""
    layout = layout_from_proto(reservation.layout, num_blocks=len(block_ids))
    transport = SharedMemoryTransport(layout)
    dest = KVDestination(reservation.reservation_id, tuple(reservation.block_ids), shm_name=reservation.shm_name)
    pages = torch.full(layout.shape, value, dtype=PAGE_DTYPES[layout.dtype])
    try:
        transport.open(dest)
        asyncio.run(transport.write("writer", pages, range(len(block_ids)), dest, block_ids))
    finally:
        asyncio.run(transport.close())


def test_a_copy_after_its_reservation_ended_writes_nothing(service):
    """A prefill process stalled past the end of its reservation (aborted, or its lease out) must not write
    pages that may be another request's by then: its copy is refused, the pages keep what they hold."""
    def reserve(request_id: str) -> decode_pb2.Reservation:
        return service.stub.Reserve(decode_pb2.ReserveRequest(request_id=request_id, num_tokens=len(PROMPT)),
                                    timeout=5)

    aborted = reserve("ended-by-abort")
    assert service.stub.Abort(decode_pb2.AbortRequest(request_id="ended-by-abort"), timeout=5).found
    taker = service.stub.Reserve(decode_pb2.ReserveRequest(request_id="takes-its-pages",
                                                           num_tokens=WHOLE_POOL_TOKENS), timeout=5)
    shm_write(taker, list(aborted.block_ids), 2.0)
    with pytest.raises(ReservationEndedError):
        shm_write(aborted, list(aborted.block_ids), 1.0)
    with SharedKVPool.attach(taker.shm_name, layout_from_proto(taker.layout, num_blocks=1)) as pool:
        assert bool((pool.tensor[:, :, :, list(aborted.block_ids)] == 2.0).all())
    assert service.stub.Abort(decode_pb2.AbortRequest(request_id="takes-its-pages"), timeout=5).found
    expired = reserve("ended-by-lease")
    time.sleep(LEASE_MS / 1000 + 0.3)
    with pytest.raises(ReservationEndedError):
        shm_write(expired, list(expired.block_ids), 1.0)
    assert_whole_pool_free(service, within_s=1)


def test_pages_a_copy_still_holds_when_their_reservation_ends_are_freed_once_it_lets_go(service):
    """A prefill process frozen in the middle of a copy holds its pages' fence: ended (aborted) meanwhile,
    they are kept from other requests until it lets go, while its request id may reserve again; the gauge
    of pages so kept shows them."""
    metrics_url = f"http://{metrics_address(service)}"  # the line is read here alone, of this module's tests
    reservation = service.stub.Reserve(decode_pb2.ReserveRequest(request_id="mid-copy", num_tokens=len(PROMPT)),
                                       timeout=5)
    with SharedKVPool.attach(reservation.shm_name, layout_from_proto(reservation.layout, num_blocks=1)) as pool:
        with pool.fence.writing(reservation.reservation_id, reservation.block_ids):
            assert service.stub.Abort(decode_pb2.AbortRequest(request_id="mid-copy"), timeout=5).found
            again = service.stub.Reserve(decode_pb2.ReserveRequest(request_id="mid-copy", num_tokens=1), timeout=5)
            assert not set(again.block_ids) & set(reservation.block_ids)
            assert service.stub.Abort(decode_pb2.AbortRequest(request_id="mid-copy"), timeout=5).found
            time.sleep(0.3)  # a few of the decode worker's tries
            with pytest.raises(grpc.RpcError) as e:
                service.stub.Reserve(decode_pb2.ReserveRequest(request_id="whole", num_tokens=WHOLE_POOL_TOKENS),
                                     timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert metric_value(metrics_url, "baton_kv_pages_fenced") == len(reservation.block_ids)
    assert_whole_pool_free(service, within_s=2)
    assert metric_value(metrics_url, "baton_kv_pages_fenced") == 0


def test_abort_of_a_running_decode_ends_its_stream(service, prefill_engine):
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    reservation, first = prefill_and_reserve(service, prefill_engine, "ab-run", params)
    stream = decode_stream(service, "ab-run", reservation, first, params)
    next(stream)
    assert service.stub.Abort(decode_pb2.AbortRequest(request_id="ab-run"), timeout=5).found
    chunks = list(stream)
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert_whole_pool_free(service, within_s=1)


def test_an_abort_naming_a_finish_reason_ends_the_stream_with_it(service, prefill_engine):
    """The gateway matched a stop string: the request ends as stopped, not aborted."""
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    reservation, first = prefill_and_reserve(service, prefill_engine, "ab-stop", params)
    stream = decode_stream(service, "ab-stop", reservation, first, params)
    next(stream)
    assert service.stub.Abort(decode_pb2.AbortRequest(request_id="ab-stop",
                                                      finish_reason=common_pb2.FINISH_REASON_STOP), timeout=5).found
    chunks = list(stream)
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert sum(len(c.token_ids) for c in chunks) < params.max_tokens - 2
    assert_whole_pool_free(service, within_s=1)


def test_cancelled_stream_frees_its_pages(service, prefill_engine):
    params = SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)  # 123 of the 128 pages
    reservation, first = prefill_and_reserve(service, prefill_engine, "cancel", params)
    stream = decode_stream(service, "cancel", reservation, first, params)
    received = sum(len(next(stream).token_ids) for _ in range(3))
    stream.cancel()
    assert received < params.max_tokens - 1
    assert_whole_pool_free(service, within_s=1)


def test_bad_input(service):
    cases = [
        (lambda: service.stub.Reserve(decode_pb2.ReserveRequest(request_id="x", num_tokens=0), timeout=5),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: service.stub.Reserve(decode_pb2.ReserveRequest(request_id="", num_tokens=3), timeout=5),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: service.stub.Reserve(decode_pb2.ReserveRequest(request_id="x", num_tokens=5000), timeout=5),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: list(service.stub.Decode(decode_pb2.DecodeRequest(request_id="x", reservation_id="nope",
                                                                   prompt_token_ids=[1]), timeout=5)),
         grpc.StatusCode.NOT_FOUND),
        (lambda: list(service.stub.Decode(decode_pb2.DecodeRequest(
            request_id="x", reservation_id="nope", prompt_token_ids=[1],
            sampling=common_pb2.SamplingParams(temperature=-1)), timeout=5)),
         grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for call, code in cases:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == code, e.value.details()
    # A refused Decode (bad prompt) after a valid claim still frees the reservation.
    reservation = service.stub.Reserve(decode_pb2.ReserveRequest(request_id="badtok", num_tokens=3), timeout=5)
    with pytest.raises(grpc.RpcError) as e:
        list(service.stub.Decode(decode_pb2.DecodeRequest(
            request_id="badtok", reservation_id=reservation.reservation_id, prompt_token_ids=[1, 2, 10**6],
            first_token_id=1, sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_whole_pool_free(service, within_s=0)


def test_sigterm_exits_zero_and_removes_the_segment(tiny_demo_model):
    svc = Service(tiny_demo_model, "--kv-blocks", "16")
    reservation = svc.stub.Reserve(decode_pb2.ReserveRequest(request_id="held", num_tokens=20), timeout=5)
    segment = Path("/dev/shm") / reservation.shm_name
    assert segment.exists()
    assert svc.terminate() == 0  # with a reservation still held
    assert not segment.exists()
    assert not os.path.exists(segment)


def test_a_worker_whose_engine_fails_fails_its_request_exits_1_and_removes_the_segment(tiny_demo_model):
    """Its engine's state is unknown after a failed step: it stops (an orchestrator restarts it)
    instead of serving on, and releases its shared-memory pool as a SIGTERM would."""
    svc = Service(tiny_demo_model, "--kv-blocks", "16", command=failing_step_worker("decode"))
    reservation = svc.stub.Reserve(decode_pb2.ReserveRequest(request_id="held", num_tokens=20), timeout=5)
    segment = Path("/dev/shm") / reservation.shm_name
    assert segment.exists()
    with pytest.raises(grpc.RpcError) as e:
        list(svc.stub.GenerateLocally(decode_pb2.GenerateLocallyRequest(
            request_id="fail-1", prompt_token_ids=PROMPT, sampling=_sampling_to_proto(GREEDY)), timeout=10))
    assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
    assert svc.proc.wait(timeout=30) == 1
    assert not segment.exists()
    assert "stopping: its engine failed" in svc.stderr_text()
    svc.terminate()


def test_calls_whose_engine_work_queued_behind_a_failing_step_end_unavailable(tiny_demo_model):
    """A Reserve, an Abort and the start of a Decode or a GenerateLocally that wait for the engine
    while a step fails never ran there: the worker is stopping, so UNAVAILABLE (the gateway's
    503, another worker may take them), not a Reserve's "no free pages" (429), the INTERNAL of
    the request the step was running, or an unknown error."""
    svc = Service(tiny_demo_model, "--kv-blocks", "16", command=failing_step_worker("decode"))
    stub, sampling = svc.stub, _sampling_to_proto(GREEDY)
    claimable = stub.Reserve(decode_pb2.ReserveRequest(request_id="claimed", num_tokens=len(PROMPT)), timeout=5)
    with ThreadPoolExecutor(5) as pool:
        running = pool.submit(lambda: list(stub.GenerateLocally(decode_pb2.GenerateLocallyRequest(
            request_id="slowfail-1", prompt_token_ids=PROMPT, sampling=sampling), timeout=10)))
        time.sleep(SLOW_FAILING_STEP_S / 4)  # its step is running (and will fail)
        queued = {
            "Reserve": pool.submit(stub.Reserve, decode_pb2.ReserveRequest(request_id="more", num_tokens=4),
                                   timeout=10),
            "Abort": pool.submit(stub.Abort, decode_pb2.AbortRequest(request_id="someone"), timeout=10),
            "Decode": pool.submit(lambda: list(stub.Decode(decode_pb2.DecodeRequest(
                request_id="claimed", reservation_id=claimable.reservation_id, prompt_token_ids=PROMPT,
                first_token_id=7, sampling=sampling), timeout=10))),
            "GenerateLocally": pool.submit(lambda: list(stub.GenerateLocally(decode_pb2.GenerateLocallyRequest(
                request_id="behind", prompt_token_ids=PROMPT, sampling=sampling), timeout=10))),
        }
        with pytest.raises(grpc.RpcError) as e:
            running.result()
        assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
        for method, call in queued.items():
            with pytest.raises(grpc.RpcError) as e:
                call.result()
            assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD), method
    assert svc.proc.wait(timeout=30) == 1
    svc.terminate()
