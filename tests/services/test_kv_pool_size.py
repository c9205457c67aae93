"""A worker's KV pool sized in bytes (vLLM's --kv-cache-memory-bytes, read as vLLM reads sizes):
as many pages as the bytes hold for the model's layout and KV dtype, replacing --kv-blocks; a size
that holds no page, or that is not a size, is refused. Or sized as a share of the memory free once
the weights are loaded (--kv-memory-fraction), which a size replaces. The kvstore node's capacity is
read as a size too."""
from __future__ import annotations

import argparse

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_pool import kv_block_bytes
from engine.llm_engine import LLMEngine
from engine.model_config_loader import load_model_config
from protos import scheduler_pb2, scheduler_pb2_grpc
from services.common.kv_pool_flags import byte_count
from services.common.settings import ConfigError
from services.decode.config import DecodeServiceConfig
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.kvstore.config import DEFAULT_CAPACITY_BYTES, KVStoreNodeConfig
from services.prefill.config import PrefillServiceConfig
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from tests.cuda import needs_cuda
from tests.services.service_process import ServiceProcess, stop_processes, wait_all_serving


@pytest.mark.parametrize(("given", "size"), [
    ("4096", 4096), ("1K", 1024), ("2M", 2 * 2**20), ("3G", 3 * 2**30), ("1T", 2**40),
    ("25.6k", 25_600), ("1.5m", 1_500_000), ("2g", 2 * 10**9), (" 8G ", 8 * 2**30)])
def test_sizes_are_read_as_vllm_reads_them(given, size):
    assert byte_count(given) == size


@pytest.mark.parametrize("given", ["1.5G", "G", "-1", "4 GiB", "1e9", ""])
def test_what_is_not_a_size_is_refused(given):
    with pytest.raises(argparse.ArgumentTypeError):
        byte_count(given)


def block_bytes(model_dir, dtype=torch.float32) -> int:
    return kv_block_bytes(load_model_config(model_dir), 16, dtype)


def test_the_engine_holds_as_many_pages_as_the_bytes_hold(tiny_demo_model):
    one = block_bytes(tiny_demo_model)
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=4, kv_cache_memory_bytes=37 * one + 5))
    assert engine.num_kv_blocks == 37
    assert engine.block_manager.num_free_blocks == 37
    with pytest.raises(ValueError, match="holds no block"):
        LLMEngine(EngineConfig(model=str(tiny_demo_model), kv_cache_memory_bytes=one - 1))


@pytest.mark.parametrize("config", [PrefillServiceConfig, DecodeServiceConfig])
def test_the_flag_and_its_variable(tiny_demo_model, config):
    kind = "PREFILL" if config is PrefillServiceConfig else "DECODE"
    parsed = config.from_args(["--model", str(tiny_demo_model), "--kv-cache-memory-bytes", "64M"], {})
    assert parsed.kv_cache_memory_bytes == 64 * 2**20
    from_env = config.from_args(["--model", str(tiny_demo_model)], {f"BATON_{kind}_KV_CACHE_MEMORY_BYTES": "1g"})
    assert from_env.kv_cache_memory_bytes == 10**9
    assert config.from_args(["--model", str(tiny_demo_model)], {}).kv_cache_memory_bytes is None
    with pytest.raises(ConfigError, match="--kv-cache-memory-bytes"):
        config(model_dir=tiny_demo_model, kv_cache_memory_bytes=0)


def test_the_kvstore_nodes_capacity_is_a_size_too():
    assert KVStoreNodeConfig.from_args(["--capacity-bytes", "4G"], {}).capacity_bytes == 4 * 2**30
    assert KVStoreNodeConfig.from_args([], {"BATON_KVSTORE_CAPACITY_BYTES": "1.5g"}).capacity_bytes == 15 * 10**8
    assert KVStoreNodeConfig.from_args(["--capacity-bytes", "1073741824"], {}).capacity_bytes == 2**30
    assert KVStoreNodeConfig.from_args([], {}).capacity_bytes == DEFAULT_CAPACITY_BYTES
    with pytest.raises(SystemExit):
        KVStoreNodeConfig.from_args(["--capacity-bytes", "1.5G"], {})


def test_workers_size_their_pools_by_it(tiny_demo_model):
    one = block_bytes(tiny_demo_model)
    size = 2**20
    workers = [ServiceProcess(name, service, tiny_demo_model, "--kv-blocks", "16", "--kv-cache-memory-bytes", "1M",
                              wait=False)
               for name, service in (("prefill", PREFILL_SERVICE), ("decode", DECODE_SERVICE))]
    try:
        wait_all_serving(workers)
        for worker in workers:
            info = scheduler_pb2_grpc.SchedulerStub(worker.channel).Describe(scheduler_pb2.DescribeRequest(),
                                                                            timeout=10)
            assert info.num_kv_blocks == size // one > 16, worker.name
    finally:
        assert stop_processes(workers) == [0, 0]


@pytest.mark.parametrize("config", [PrefillServiceConfig, DecodeServiceConfig])
def test_the_fraction_flag_and_its_variable(tiny_demo_model, config):
    kind = "PREFILL" if config is PrefillServiceConfig else "DECODE"
    model = ["--model", str(tiny_demo_model)]
    assert config.from_args([*model, "--kv-memory-fraction", "0.5"], {}).kv_memory_fraction == 0.5
    assert config.from_args(model, {f"BATON_{kind}_KV_MEMORY_FRACTION": "0.25"}).kv_memory_fraction == 0.25
    assert config.from_args(model, {}).kv_memory_fraction is None
    for wrong in ("0", "0.96", "-0.1"):
        with pytest.raises(ConfigError, match=r"--kv-memory-fraction must be in \(0, 0.95\]"):
            config.from_args([*model, "--kv-memory-fraction", wrong], {})


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def test_workers_size_their_pools_by_a_share_of_free_memory_and_a_size_wins_over_it(tiny_demo_model):
    one, fraction = block_bytes(tiny_demo_model), 0.002
    before = available_bytes()
    shared = [ServiceProcess(name, service, tiny_demo_model, "--kv-blocks", "16", "--kv-memory-fraction",
                             str(fraction), wait=False)
              for name, service in (("prefill", PREFILL_SERVICE), ("decode", DECODE_SERVICE))]
    sized = ServiceProcess("decode", DECODE_SERVICE, tiny_demo_model, "--kv-memory-fraction", str(fraction),
                           "--kv-cache-memory-bytes", "1M", wait=False)
    workers = [*shared, sized]
    try:
        wait_all_serving(workers)
        after = available_bytes()

        def num_blocks(worker) -> int:
            return scheduler_pb2_grpc.SchedulerStub(worker.channel).Describe(scheduler_pb2.DescribeRequest(),
                                                                             timeout=10).num_kv_blocks
        # The memory free when each carved its pool lies between what was free before they started and
        # after (other tenants of this machine move it too: a tenth either way).
        for worker in shared:
            assert 0.9 * fraction * after // one <= num_blocks(worker) <= 1.1 * fraction * before // one, worker.name
            assert num_blocks(worker) > 16
        assert num_blocks(sized) == 2**20 // one
    finally:
        assert stop_processes(workers) == [0, 0, 0]


def test_a_share_of_the_gpu_leaves_the_weights_theirs_and_refuses_what_does_not_fit(tiny_demo_model):
    from engine.kv_pool import utilization_pool_bytes

    gib = 2**30
    # An 80 GiB device, 16 GiB of weights, 70 GiB free: 0.9 leaves 0.9 x 80 - 16 GiB for pages.
    assert utilization_pool_bytes(0.9, 80 * gib, 16 * gib, 70 * gib) == int(0.9 * 80 * gib) - 16 * gib
    with pytest.raises(ValueError, match=r"gives this worker 8.00 GiB of the device's 80.00 GiB and its weights "
                                         r"take 16.00 GiB: no room is left"):
        utilization_pool_bytes(0.1, 80 * gib, 16 * gib, 70 * gib)
    # Another process holds 40 GiB: 56 GiB of pages are more than the 24 GiB free.
    with pytest.raises(ValueError, match=r"asks for 56.00 GiB of KV pages .* but 24.00 GiB of the device's "
                                         r"80.00 GiB is free"):
        utilization_pool_bytes(0.9, 80 * gib, 16 * gib, 24 * gib)
    for wrong in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
            EngineConfig(model=str(tiny_demo_model), gpu_memory_utilization=wrong)


@pytest.mark.parametrize("config", [PrefillServiceConfig, DecodeServiceConfig])
def test_the_gpu_share_flag_its_sglang_name_and_its_variable(tiny_demo_model, config):
    kind = "PREFILL" if config is PrefillServiceConfig else "DECODE"
    model = ["--model", str(tiny_demo_model)]
    assert config.from_args([*model, "--gpu-memory-utilization", "0.9"], {}).gpu_memory_utilization == 0.9
    assert config.from_args([*model, "--mem-fraction-static", "0.8"], {}).gpu_memory_utilization == 0.8
    assert config.from_args(model, {f"BATON_{kind}_GPU_MEMORY_UTILIZATION": "0.5"}).gpu_memory_utilization == 0.5
    assert config.from_args(model, {}).gpu_memory_utilization is None
    for wrong in ("0", "1.01", "-0.5"):
        with pytest.raises(ConfigError, match=r"--gpu-memory-utilization must be in \(0, 1\]"):
            config.from_args([*model, "--gpu-memory-utilization", wrong], {})


def test_a_cpu_engine_sizes_its_pool_as_if_no_gpu_share_were_given(tiny_demo_model):
    """As vLLM's CPU backend: the share is of a GPU's memory, and there is none."""
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=24, gpu_memory_utilization=0.9))
    assert engine.num_kv_blocks == 24


@needs_cuda
def test_a_cuda_engine_takes_its_share_of_the_device_for_weights_and_pages_cuda(tiny_demo_model):
    torch.cuda.empty_cache()  # earlier tests' cached blocks would count as this process's
    free, total = torch.cuda.mem_get_info()
    share = min(0.05, 0.5 * free / total)  # a small one: the device may have other tenants
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), device="cuda", gpu_memory_utilization=share))
    config = load_model_config(tiny_demo_model)
    pages = engine.num_kv_blocks * kv_block_bytes(config, engine.config.block_size, engine.runner.kv_pool.tensor.dtype)
    held = torch.cuda.memory_reserved()
    assert share * total - 2 * kv_block_bytes(config, 16, torch.float32) - 2**26 <= held <= share * total + 2**26
    assert pages >= 0.5 * share * total  # the tiny model's weights are a sliver of the share


@pytest.mark.parametrize("config", [PrefillServiceConfig, DecodeServiceConfig])
def test_a_hybrid_models_state_cache_flags(tiny_demo_model, config):
    """--state-cache-bytes (a size, as the pool's) and --state-snapshot-interval; bad ones refused."""
    parsed = config.from_args(["--model", str(tiny_demo_model), "--state-cache-bytes", "512M",
                               "--state-snapshot-interval", "1024"], {})
    assert (parsed.state_cache_bytes, parsed.state_snapshot_interval) == (512 * 2**20, 1024)
    defaults = config.from_args(["--model", str(tiny_demo_model)], {})
    assert (defaults.state_cache_bytes, defaults.state_snapshot_interval) == (EngineConfig.state_cache_bytes,
                                                                              EngineConfig.state_snapshot_interval)
    with pytest.raises(ConfigError, match="--state-snapshot-interval must be at least 1"):
        config.from_args(["--model", str(tiny_demo_model), "--state-snapshot-interval", "0"], {})
