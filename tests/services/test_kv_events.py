"""vLLM's KV events from real prefill and decode workers (--kv-events-config), read as a KV-aware
router written for vLLM reads them: a ZeroMQ SUB socket getting (topic, sequence number, msgpack
batch), and the replay socket for what it missed. A prompt's blocks arrive as one BlockStored under
the hashes the prefix index knows them by; evictions as BlockRemoved; a cache reset as AllBlocksCleared."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from engine.block_hash import hash_block_chain
from engine.checkpoint import model_fingerprint
from protos import cache_pb2, cache_pb2_grpc, common_pb2, decode_pb2
from services.common.kv_events_config import KVEventsConfig
from services.common.settings import ConfigError
from services.decode.config import DecodeServiceConfig
from services.decode.servicer import SERVICE_NAME
from services.kvstore.shared_memory import NAME_PREFIX
from services.prefill.config import PrefillServiceConfig
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from tests.conftest import port_outside_ephemeral_range
from tests.services.decode.test_decode_service import Service
from tests.services.service_process import REPO_ROOT, ServiceProcess

BLOCK_SIZE = 16
PROMPT = [(31 * j) % 1000 + 3 for j in range(53)]  # three full blocks and a bit
GREEDY = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class Router:
    """What a router holds of one worker: a SUB socket, and every batch it got, in order."""

    def __init__(self, port: int, replay_port: int, topic: bytes) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.replay_address = f"tcp://127.0.0.1:{replay_port}"
        self.topic = topic
        self.batches: dict[int, dict] = {}  # sequence number -> decoded batch

    def replay(self, first: int) -> None:
        asker = self.context.socket(zmq.DEALER)  # one request, many replies
        asker.connect(self.replay_address)
        asker.send_multipart((b"", first.to_bytes(8, "big")))
        while True:
            assert asker.poll(10_000), "no answer from the replay socket"
            empty, seq, payload = asker.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            self.batches[int.from_bytes(seq, "big")] = msgspec.msgpack.decode(payload)
        asker.close(linger=0)

    def receive_until(self, done, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while not done(self.events()):
            assert time.monotonic() < deadline, f"events so far: {self.events()}"
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == self.topic
                self.batches[int.from_bytes(seq, "big")] = msgspec.msgpack.decode(payload)

    def events(self) -> list[dict]:
        return [event for _, batch in sorted(self.batches.items()) for event in batch["events"]]

    def close(self) -> None:
        self.context.destroy(linger=0)


@pytest.fixture(scope="module")
def worker(tiny_demo_model):
    port, replay_port = port_outside_ephemeral_range(), port_outside_ephemeral_range()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv@decode-0"}
    svc = Service(tiny_demo_model, "--kv-blocks", "48", "--kv-events-config", json.dumps(config))
    svc.ports = port, replay_port
    yield svc
    assert svc.terminate() == 0


def generate(worker, request_id: str, prompt: list[int]) -> None:
    chunks = list(worker.stub.GenerateLocally(decode_pb2.GenerateLocallyRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=GREEDY), timeout=30))
    assert chunks[-1].finish_reason


def test_a_router_follows_the_workers_cache_by_its_events(worker, tiny_demo_model):
    router = Router(*worker.ports, b"kv@decode-0")
    try:
        time.sleep(0.3)  # a SUB socket hears only what is sent once it is connected
        router.replay(0)  # what came before: the cache as it was when publishing began
        (first_seq, first), *_ = sorted(router.batches.items())
        assert first_seq == 0 and first["events"][0] == {"type": "AllBlocksCleared"}
        assert first["data_parallel_rank"] == 0 and abs(first["ts"] - time.time()) < 600
        num_before = len(router.batches)

        generate(worker, "kv-1", PROMPT)
        hashes = hash_block_chain(PROMPT, BLOCK_SIZE, model_fingerprint(tiny_demo_model))
        router.receive_until(lambda events: any(e.get("block_hashes") == hashes for e in events))
        stored = next(e for e in router.events() if e.get("block_hashes") == hashes)
        assert stored == {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                          "token_ids": PROMPT[:48], "block_size": BLOCK_SIZE, "lora_id": None, "medium": "CPU",
                          "lora_name": None}
        assert sorted(router.batches) == list(range(len(router.batches))) and len(router.batches) > num_before

        for i in range(3):  # 45 blocks of other prompts in a pool of 48: the first prompt's go
            generate(worker, f"kv-other-{i}", [(97 * j + 13 * i) % 1000 + 20 for j in range(15 * BLOCK_SIZE)])
        router.receive_until(lambda events: {h for e in events if e["type"] == "BlockRemoved"
                                             for h in e["block_hashes"]} >= set(hashes))

        reset = cache_pb2_grpc.PrefixCacheStub(worker.channel).Reset(cache_pb2.ResetPrefixCacheRequest(), timeout=10)
        assert reset.reset
        router.receive_until(lambda events: events[-1] == {"type": "AllBlocksCleared"})
        # Its /metrics count every batch it sent: the router got them all, numbered from 0.
        address = worker.proc.stdout.readline().removeprefix("decode metrics on ").strip()

        def scraped() -> dict[str, float]:
            text = httpx.get(f"http://{address}/metrics", timeout=10).text
            return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

        deadline = time.monotonic() + 5  # counted just after each is sent
        while scraped()["baton_kv_events_batches_sent_total"] < len(router.batches):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        samples = scraped()
        assert samples["baton_kv_events_batches_sent_total"] == len(router.batches) == max(router.batches) + 1
        assert samples["baton_kv_events_batches_dropped_total"] == 0
    finally:
        router.close()


def test_baton_kv_events_prints_every_batch_once_in_order(worker, tiny_demo_model):
    """`baton kv-events`: from batch 0 by the replay socket, then live, each batch one JSON line."""
    port, replay_port = worker.ports
    watch = subprocess.Popen([sys.executable, "-m", "cli", "kv-events", "--endpoint", f"tcp://127.0.0.1:{port}",
                              "--replay", f"tcp://127.0.0.1:{replay_port}", "--idle-timeout", "3"],
                             cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    time.sleep(1.5)  # replayed what came before; now live
    watched = [(29 * j) % 1000 + 9 for j in range(3 * BLOCK_SIZE + 1)]
    generate(worker, "watched", watched)
    out, _ = watch.communicate(timeout=30)
    assert watch.returncode == 0
    batches = [json.loads(line) for line in out.splitlines()]
    assert [b["seq"] for b in batches] == list(range(len(batches)))
    assert batches[0]["events"][0] == {"type": "AllBlocksCleared"}
    hashes = hash_block_chain(watched, BLOCK_SIZE, model_fingerprint(tiny_demo_model))
    assert any(e.get("block_hashes") == hashes for e in batches[-1]["events"])  # the last, heard live


def test_a_prefill_worker_publishes_what_its_warm_up_cached(tiny_demo_model):
    port, replay_port = port_outside_ephemeral_range(), port_outside_ephemeral_range()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}"}
    worker = ServiceProcess("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "64", "--kv-events-config",
                            json.dumps(config))
    router = Router(port, replay_port, b"")
    try:
        router.replay(0)
        events = router.events()
        assert events[0] == {"type": "AllBlocksCleared"} and len(events) > 1
        for stored in events[1:]:  # its warm-up prompts' blocks, each chain after its parent
            assert stored["type"] == "BlockStored" and stored["medium"] == "CPU" and stored["block_size"] == BLOCK_SIZE
            assert len(stored["token_ids"]) == BLOCK_SIZE * len(stored["block_hashes"])
    finally:
        router.close()
        assert worker.terminate() == 0


def test_a_second_worker_on_the_same_endpoint_fails_to_start(worker, tiny_demo_model):
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{worker.ports[0]}"})
    segments = set(Path("/dev/shm").glob(f"{NAME_PREFIX}*"))
    second = ServiceProcess("decode", SERVICE_NAME, tiny_demo_model, "--kv-blocks", "48", "--kv-events-config",
                            config, wait=False)
    assert second.proc.wait(timeout=60) == 2
    assert f"--kv-events-config: cannot open tcp://*:{worker.ports[0]}" in second.stderr_text()
    assert set(Path("/dev/shm").glob(f"{NAME_PREFIX}*")) == segments  # its pool went with it


@pytest.mark.parametrize("given, message", [
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be one of null, zmq"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "endpoint must be a ZeroMQ address"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
    ('{"enable_kv_events": true}', "unknown keys ['enable_kv_events']"),
    ('[1]', "must be a JSON object"),
])
def test_a_bad_kv_events_config_is_refused(tiny_demo_model, given, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DecodeServiceConfig.from_args(["--model", str(tiny_demo_model), "--kv-events-config", given], env={})


def test_vllms_defaults_and_the_environment(tiny_demo_model):
    assert KVEventsConfig().publisher == "null" and not KVEventsConfig().publishes
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").publishes
    for kind, config_type in (("DECODE", DecodeServiceConfig), ("PREFILL", PrefillServiceConfig)):
        config = config_type.from_args(["--model", str(tiny_demo_model)], env={
            f"BATON_{kind}_KV_EVENTS_CONFIG": '{"enable_kv_cache_events": true, "topic": "t"}'})
        assert config.kv_events == KVEventsConfig(enable_kv_cache_events=True, topic="t")
        assert config_type.from_args(["--model", str(tiny_demo_model)], env={}).kv_events is None


def test_an_adapters_blocks_carry_its_name_and_its_id(tiny_demo_model, tmp_path):
    """vLLM numbers its adapters from 1 in the order they are served; a router keys their blocks apart
    from the base model's by it. The base model's blocks carry neither."""
    transformers = pytest.importorskip("transformers")
    from tests.lora_adapters import make_adapter

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_demo_model)
    for i, name in enumerate(("first", "second")):
        make_adapter(tmp_path / name, base, ("self_attn.q_proj",), 2, 2.0, False, seed=i)
    port, replay_port = port_outside_ephemeral_range(), port_outside_ephemeral_range()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}"}
    worker = Service(tiny_demo_model, "--kv-blocks", "48", "--kv-events-config", json.dumps(config),
                     "--lora-modules", f"first={tmp_path / 'first'}", f"second={tmp_path / 'second'}")
    router = Router(port, replay_port, b"")
    try:
        router.replay(0)
        for lora_name in ("second", None):
            sampling = common_pb2.SamplingParams()
            sampling.CopyFrom(GREEDY)
            if lora_name is not None:
                sampling.lora_name = lora_name
            chunks = list(worker.stub.GenerateLocally(decode_pb2.GenerateLocallyRequest(
                request_id=f"lora-{lora_name}", prompt_token_ids=PROMPT, sampling=sampling), timeout=30))
            assert chunks[-1].finish_reason

        def prompts_stored(events: list[dict]) -> list[dict]:
            return [e for e in events if e["type"] == "BlockStored" and e["token_ids"][:BLOCK_SIZE] == PROMPT[:16]]
        router.receive_until(lambda events: len(prompts_stored(events)) == 2)
        adapted, plain = prompts_stored(router.events())
        assert (adapted["lora_name"], adapted["lora_id"]) == ("second", 2)
        assert (plain["lora_name"], plain["lora_id"]) == (None, None)
        assert adapted["block_hashes"] != plain["block_hashes"]  # the adapter's KV is its own
    finally:
        router.close()
        assert worker.terminate() == 0
