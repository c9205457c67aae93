"""SGLang's /release_memory_occupation and /resume_memory_occupation, vLLM's /sleep, /wake_up and
/is_sleeping, on a mesh of 2 prefill and 2 decode workers: each worker gives back what is named (a
decode worker's shared-memory pool leaves the host's /dev/shm), a request arriving meanwhile waits,
and once all is back the mesh computes what it computed before. Only an idle mesh releases memory;
a worker joining meanwhile releases it too. Each test leaves the mesh awake."""
from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace
from typing import NamedTuple

import httpx
import pytest

from protos import decode_pb2, decode_pb2_grpc
from services.common.converters import layout_from_proto
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.kvstore.shared_memory import SharedKVPool, data_offset
from services.tokenizer.servicer import SERVICE_NAME as TOKENIZER_SERVICE
from tests.services.gateway.mesh import GatewayProcess
from tests.services.gateway.test_generation_pause import StreamedSample
from tests.services.gateway.test_weight_updates import greedy
from tests.services.gateway.test_worker_discovery import workers
from tests.services.service_process import ServiceProcess, stop_processes, wait_all_serving
from tests.services.waiting import wait_until


def post(mesh, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}{path}", timeout=120, **kwargs)


def released_by_worker(mesh) -> list[list[str]]:
    states = httpx.get(f"{mesh.gateway.base_url}/get_server_info", timeout=10).json()["internal_states"]
    return [state["released_memory"] for state in states]


def is_sleeping(mesh) -> bool:
    return httpx.get(f"{mesh.gateway.base_url}/is_sleeping", timeout=10).json()["is_sleeping"]


class Segment(NamedTuple):
    path: str
    header_bytes: int  # before its pool's pages: its layout and the pages' reservation tokens


def pool_segments(mesh) -> list[Segment]:
    """Each decode worker's shared-memory KV pool, as a file of /dev/shm."""
    segments = []
    for worker in mesh.decode:
        stub = decode_pb2_grpc.DecodeStub(worker.channel)
        probe = stub.Reserve(decode_pb2.ReserveRequest(request_id="segment-probe", num_tokens=1), timeout=10)
        stub.Abort(decode_pb2.AbortRequest(request_id="segment-probe"), timeout=10)
        with SharedKVPool.attach(probe.shm_name, layout_from_proto(probe.layout, num_blocks=1)) as pool:
            segments.append(Segment(f"/dev/shm/{probe.shm_name}", data_offset(pool.num_blocks)))
    return segments


@pytest.fixture
def awake(mesh):
    yield
    assert post(mesh, "/resume_memory_occupation").status_code == 200
    assert not is_sleeping(mesh)


def test_released_memory_leaves_the_workers_and_a_request_waits_until_it_is_back(mesh, awake):
    expected = greedy(mesh)
    segments = pool_segments(mesh)
    assert all(os.stat(path).st_blocks * 512 > 2**20 for path, _ in segments)
    answer = post(mesh, "/release_memory_occupation", json={"tags": ["weights", "kv_cache"]})
    assert answer.status_code == 200 and answer.json()["success"], answer.text
    assert int(answer.json()["message"].split()[0]) > sum(os.stat(path).st_size for path, _ in segments) // 2
    # The pools' pages are the host's again; the segment's header (its layout and tokens) stays.
    assert all(os.stat(path).st_blocks * 512 <= header_bytes for path, header_bytes in segments)
    assert is_sleeping(mesh)
    assert released_by_worker(mesh) == [["weights", "kv_cache"]] * 4
    arriving: dict = {}
    thread = threading.Thread(target=lambda: arriving.update(tokens=greedy(mesh)))
    thread.start()
    time.sleep(0.5)
    assert not arriving  # held at the gateway: no worker has weights to compute it with
    assert post(mesh, "/resume_memory_occupation").json()["success"]
    thread.join(timeout=60)
    assert arriving["tokens"] == expected  # the weights read again are the ones served before
    assert released_by_worker(mesh) == [[]] * 4 and not is_sleeping(mesh)


def test_vllms_sleep_levels_and_wake_up_by_tag(mesh, awake):
    expected = greedy(mesh)
    assert post(mesh, "/sleep", params={"level": 1}).status_code == 200
    assert released_by_worker(mesh) == [["kv_cache"]] * 4 and is_sleeping(mesh)
    assert post(mesh, "/wake_up").status_code == 200 and not is_sleeping(mesh)
    assert post(mesh, "/sleep", params={"level": 2}).status_code == 200
    assert post(mesh, "/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert released_by_worker(mesh) == [["weights"]] * 4 and is_sleeping(mesh)
    assert post(mesh, "/wake_up", params={"tags": "weights"}).status_code == 200
    assert not is_sleeping(mesh) and greedy(mesh) == expected


def test_an_idle_mesh_sleeps_and_the_next_request_wakes_it(mesh, awake):
    """vLLM's --sleep-idle-ttl, on a gateway of its own over the mesh's workers (the `awake` fixture
    resumes them through the mesh's gateway, should this one leave them asleep)."""
    expected = greedy(mesh)
    idle = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                          [d.address for d in mesh.decode], "--sleep-idle-ttl", "1.5", "--sleep-idle-level", "2")
    through_idle = SimpleNamespace(gateway=idle)
    try:
        wait_until(lambda: is_sleeping(through_idle), timeout_s=20)
        assert [sorted(kinds) for kinds in released_by_worker(through_idle)] == [["kv_cache", "weights"]] * 4
        assert greedy(through_idle) == expected  # it waited while the mesh woke
        assert not is_sleeping(through_idle) and released_by_worker(through_idle) == [[]] * 4
        wait_until(lambda: is_sleeping(through_idle), timeout_s=20)  # idle again
        assert post(through_idle, "/wake_up").status_code == 200  # an operator's wake ends it too
        assert not is_sleeping(through_idle) and greedy(through_idle) == expected
    finally:
        assert idle.terminate() == 0
    assert "the mesh sleeps" in "".join(idle.stderr_lines)


def test_requests_in_flight_keep_every_workers_memory_and_a_bad_tag_is_refused(mesh, awake):
    sample = StreamedSample(mesh)
    sample.wait_for_tokens(4)
    answer = post(mesh, "/release_memory_occupation")
    assert answer.status_code == 409 and "requests in flight" in answer.json()["error"]["message"], answer.text
    assert not is_sleeping(mesh) and released_by_worker(mesh) == [[]] * 4
    sample.join()
    # Pages reserved on one decode worker (as by another gateway's request): it refuses, the others take
    # back what they gave.
    held_on = decode_pb2_grpc.DecodeStub(mesh.decode[0].channel)
    held_on.Reserve(decode_pb2.ReserveRequest(request_id="held", num_tokens=8), timeout=10)
    try:
        answer = post(mesh, "/release_memory_occupation")
        assert answer.status_code == 409 and mesh.decode[0].address in answer.json()["error"]["message"], answer.text
        assert not is_sleeping(mesh) and released_by_worker(mesh) == [[]] * 4
    finally:
        held_on.Abort(decode_pb2.AbortRequest(request_id="held"), timeout=10)
    answer = post(mesh, "/release_memory_occupation", json={"tags": ["cuda_graph"]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tags.0", answer.text
    assert post(mesh, "/sleep", params={"level": 3}).status_code == 400
    assert not is_sleeping(mesh)


def test_a_worker_that_joins_while_memory_is_released_gives_it_back_before_it_is_routed_to(tiny_demo_model):
    """Decode worker B answers only after the release (paused until then, as a replica added or
    restarted later is away): the gateway releases B's memory too before routing to B, and B takes it
    back on resume, computing what A did."""
    tokenizer = ServiceProcess("tokenizer", TOKENIZER_SERVICE, tiny_demo_model, wait=False)
    first, late = (ServiceProcess("decode", DECODE_SERVICE, tiny_demo_model, "--kv-blocks", "128", wait=False)
                   for _ in range(2))
    gateway = None
    try:
        wait_all_serving([tokenizer, first, late])
        [segment] = pool_segments(SimpleNamespace(decode=[late]))
        assert os.stat(segment.path).st_blocks * 512 > 2**20  # its pool was filled when made
        late.proc.send_signal(signal.SIGSTOP)
        gateway = GatewayProcess(tiny_demo_model, tokenizer.address, [], [first.address, late.address],
                                 "--colocated")
        on_first = SimpleNamespace(gateway=gateway, decode=[first])
        expected = greedy(on_first)
        assert post(on_first, "/release_memory_occupation").status_code == 200
        late.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: workers(gateway)[("decode", "serving")] == 2, timeout_s=20)
        assert released_by_worker(on_first) == [["weights", "kv_cache"]] * 2
        assert os.stat(segment.path).st_blocks * 512 <= segment.header_bytes
        assert post(on_first, "/resume_memory_occupation").status_code == 200
        assert released_by_worker(on_first) == [[], []]
        assert first.terminate() == 0
        assert greedy(on_first) == expected  # on B alone
    finally:
        late.proc.send_signal(signal.SIGCONT)
        if gateway is not None:
            assert gateway.terminate() == 0
        stop_processes([tokenizer, first, late])
