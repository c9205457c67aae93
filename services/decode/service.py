"""The decode worker's service, as services/common/entrypoint.py runs it (`python -m services.decode`:
__main__.py): Decode and KVStore on one port, its engine loaded with its pool in shared memory (or device
memory) and warmed up while health reports NOT_SERVING, then its place in the registry and the prefix
index; on a stop, out of both, the engine stopped and the pool's segment unlinked."""
from __future__ import annotations

import asyncio
import gc
import logging

import services.common.grpc_env  # noqa: F401  (first: before anything imports grpc)
import services.common.openmp_env  # noqa: F401  (first: before torch loads OpenMP)
from engine.checkpoint import kv_fingerprint
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from protos import (
    cache_pb2_grpc,
    decode_pb2_grpc,
    embed_pb2_grpc,
    kvstore_pb2_grpc,
    lora_pb2_grpc,
    profile_pb2_grpc,
    scheduler_pb2_grpc,
    weights_pb2_grpc,
)
from services.common.cache_servicer import SERVICE_NAME as CACHE_SERVICE_NAME, PrefixCacheServicer
from services.common.embed_servicer import SERVICE_NAME as EMBED_SERVICE_NAME, EmbeddingsServicer
from services.common.engine_loop import EngineLoop
from services.common.engine_thread import EngineThread
from services.common.entrypoint import Stop, load_in_thread
from services.common.index_publisher import InstancePublisher, publisher_for
from services.common.kv_event_publisher import KVEventPublisher, publish_kv_events
from services.common.kv_pool_flags import pool_size_options
from services.common.lora_servicer import SERVICE_NAME as LORA_SERVICE_NAME, LoRAAdaptersServicer
from services.common.metrics import ServiceMetrics
from services.common.profiler_servicer import SERVICE_NAME as PROFILER_SERVICE_NAME, ProfilerServicer
from services.common.request_outputs import finished
from services.common.scheduler_servicer import SERVICE_NAME as SCHEDULER_SERVICE_NAME, SchedulerServicer
from services.common.tracing import record_engine_boot, tracer
from services.common.weights_servicer import SERVICE_NAME as WEIGHTS_SERVICE_NAME, WeightsServicer
from services.decode.config import DecodeServiceConfig
from services.decode.kv_receiver import SERVICE_NAME as KVSTORE_SERVICE_NAME, KVReceiver
from services.decode.servicer import SERVICE_NAME, DecodeServicer
from services.kvstore.cuda_pool import CudaKVPool
from services.kvstore.layout import PageLayout
from services.kvstore.shared_memory import SharedKVPool

KVPool = SharedKVPool | CudaKVPool
log = logging.getLogger("baton.decode")

# Every sampler path a request can take: greedy, and seeded sampling with filters,
# penalties and logprobs; run side by side, then alone once the short one ends.
WARMUP_PARAMS = (
    SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.1,
                   presence_penalty=0.1, frequency_penalty=0.1, seed=0, ignore_eos=True, logprobs=2),
)


def load_engine(config: DecodeServiceConfig) -> tuple[LLMEngine, KVPool]:
    """The engine, its KV pool placed where prefill workers on this host can write it: a new shared-memory
    segment (owned, unlinked on failure) on the CPU, a pool exported by its CUDA IPC handle on a GPU."""
    model_dir = config.model_dir
    fingerprint = kv_fingerprint(model_dir, config.max_model_len, config.hf_overrides)
    pools: list[KVPool] = []

    def layout(shape, dtype) -> PageLayout:
        # shape: [L, 2, Hkv, N, bs, D]
        return PageLayout(num_layers=shape[0], num_kv_heads=shape[2], num_blocks=shape[3], block_size=shape[4],
                          head_dim=shape[5], dtype=str(dtype).removeprefix("torch."), fingerprint=fingerprint)

    def device_tensor(shape, dtype, device):
        pools.append(CudaKVPool(layout(shape, dtype), device))
        return pools[-1].tensor

    def shared_tensor(shape, dtype, device):  # which the engine's other tensor-parallel ranks map too
        pools.append(SharedKVPool.create(layout(shape, dtype)))
        return pools[-1].tensor, pools[-1].pool_file

    engine_config = EngineConfig(model=str(model_dir), device=config.device, **pool_size_options(config),
                                 max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len, seed=config.seed,
                                 tokenizer=str(config.tokenizer_dir) if config.tokenizer_dir is not None else None,
                                 long_prefill_token_threshold=config.long_prefill_token_threshold,
                                 state_cache_bytes=config.state_cache_bytes,
                                 state_snapshot_interval=config.state_snapshot_interval,
                                 limit_images=config.limit_images, limit_videos=config.limit_videos,
                                 enable_mm_embeds=config.enable_mm_embeds,
                                 scheduling_policy=config.scheduling_policy, dtype=config.dtype,
                                 kv_cache_dtype=config.kv_cache_dtype, logprobs_mode=config.logprobs_mode,
                                 max_logprobs=config.max_logprobs, lora_modules=config.lora_modules,
                                 kv_cache_metrics_sample=config.kv_cache_metrics_sample,
                                 max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                 max_cpu_loras=config.max_cpu_loras,
                                 speculative=config.speculative, hf_overrides=config.hf_overrides,
                                 per_request_spec_decode_metrics=config.per_request_spec_decode_metrics,
                                 tensor_parallel_size=config.tensor_parallel_size)
    try:
        engine = (LLMEngine(engine_config, kv_shared_factory=shared_tensor) if config.device == "cpu"
                  else LLMEngine(engine_config, kv_tensor_factory=device_tensor))
    except BaseException:
        gc.collect()
        for pool in pools:
            _close_pool(pool)
        raise
    return engine, pools[0]


async def warm_up(engine_loop: EngineLoop, block_size: int, max_model_len: int, num_blocks: int) -> None:
    """Dummy requests through both ways in: reserve → add_prefilled_request → decode (the pages
    hold zeros), and, beside them, whole prompts prefilled here (GenerateLocally: chunked
    prefill mixed with decode steps), of a token, a block and a bit, and a few hundred; the vocabulary
    read for guided decoding."""
    await engine_loop.prepare_guides()
    prompt = [1] * (block_size + 1)
    streams = []
    for i, params in enumerate(WARMUP_PARAMS):
        request_id = f"warmup-{i}"
        await engine_loop.reserve(request_id, len(prompt))
        streams.append(engine_loop.start_prefilled(request_id, prompt, 1, params))
    # Every warm-up request at once must fit the pool: a small pool warms up on shorter prompts.
    longest = min(384, max_model_len - 8, num_blocks // (3 * len(WARMUP_PARAMS)) * block_size)
    for n in sorted({1, block_size + 1, longest} - {0}):
        for j, params in enumerate(WARMUP_PARAMS):
            local = [(7 * k + j) % 97 + 1 for k in range(n)]
            streams.append(engine_loop.add_request(f"warmup-local-{n}-{j}", local, params))
    for outputs in streams:
        await finished(outputs)


def _close_pool(pool: KVPool) -> None:
    try:
        pool.close()
    except BufferError as e:  # a view outlived the engine; the name is unlinked all the same
        log.warning("%s", e)


class DecodeService:
    """The decode and KV receiver servicers, and the engine loop and shared-memory pool they serve once loaded."""

    service_names = [SERVICE_NAME, KVSTORE_SERVICE_NAME, LORA_SERVICE_NAME, EMBED_SERVICE_NAME, CACHE_SERVICE_NAME,
                     WEIGHTS_SERVICE_NAME, PROFILER_SERVICE_NAME, SCHEDULER_SERVICE_NAME]

    def __init__(self, config: DecodeServiceConfig):
        self.config = config
        self.servicer = DecodeServicer(lease_ms=config.lease_ms)
        self.receiver = KVReceiver()
        self.port = 0  # the bound one, set by the entry point before `start`
        self.metrics = ServiceMetrics("decode")  # the entry point's, labelled and served, replaces it
        self.lora = LoRAAdaptersServicer(config.allow_runtime_lora_updating)
        self.embed = EmbeddingsServicer(config.max_message_bytes)
        self.cache = PrefixCacheServicer()
        self.servicers = [(decode_pb2_grpc.add_DecodeServicer_to_server, self.servicer),
                          (kvstore_pb2_grpc.add_KVStoreServicer_to_server, self.receiver),
                          (lora_pb2_grpc.add_LoRAAdaptersServicer_to_server, self.lora),
                          (embed_pb2_grpc.add_EmbeddingsServicer_to_server, self.embed),
                          (cache_pb2_grpc.add_PrefixCacheServicer_to_server, self.cache),
                          (weights_pb2_grpc.add_WeightsServicer_to_server, WeightsServicer(self.cache)),
                          (profile_pb2_grpc.add_ProfilerServicer_to_server,
                           ProfilerServicer(self.cache, config.profiler_dir, "decode")),
                          (scheduler_pb2_grpc.add_SchedulerServicer_to_server,
                           SchedulerServicer(self.cache, lambda: self.servicer.leases))]
        self.engine_loop: EngineLoop | None = None
        self.pool: KVPool | None = None
        self.publisher: InstancePublisher | None = None
        self.kv_events: KVEventPublisher | None = None

    async def start(self, stop: Stop) -> str | None:
        self.servicer.opened_ahead.end_idle_when(stop)
        self.servicer.reserves.end_when(stop)
        # Loading runs to the end even when a signal comes first, so its segment is not leaked.
        thread = EngineThread()  # the engine is built on the thread that will step it
        engine, self.pool = await load_in_thread(stop, load_engine, self.config, finish_on_stop=True, thread=thread)
        self.engine_loop = EngineLoop(engine, thread)
        self.metrics.watch_engine(engine)
        record_engine_boot(engine.boot_times)
        max_model_len = engine.max_model_len
        del engine
        self.engine_loop.start(sole_parallel_thread=True)
        self.engine_loop.on_failure(lambda e: stop.fail("decode", f"its engine failed: {e!r}"))
        if stop.is_set():
            return None
        cuda_ipc_handle = self.pool.ipc_handle if isinstance(self.pool, CudaKVPool) else b""
        self.servicer.attach(self.engine_loop, self.pool.layout, self.metrics, self.pool.fence, shm_name=self.pool.name,
                             cuda_ipc_handle=cuda_ipc_handle)
        self.receiver.attach(self.pool.tensor, self.pool.layout, self.servicer.leases)
        self.lora.engine_loop = self.embed.engine_loop = self.cache.engine_loop = self.engine_loop
        with self.metrics.time_warmup(), tracer().start_as_current_span("warmup"):
            await warm_up(self.engine_loop, self.pool.layout.block_size, max_model_len, self.pool.layout.num_blocks)
        self.kv_events = await publish_kv_events(self.config.kv_events, self.engine_loop, self.pool.layout.block_size,
                                                 self.pool.tensor.is_cuda, self.metrics)
        # Its load and free pages, and its prefix cache (prompts handed in by prefill join it):
        # the gateway weighs the part of a prompt this worker lacks when it may prefill it here.
        self.publisher = publisher_for("decode", self.config, self.port, self.engine_loop,
                                       model_key=self.pool.layout.fingerprint.hex(),
                                       block_size=self.pool.layout.block_size, publish_blocks=True)
        if self.publisher is not None:
            await self.publisher.start(stop)
        # baton up reads the segment's name off the line's end (launcher/segments.py), to remove it if this dies.
        where = (f"shared memory {self.pool.name}" if self.pool.name else
                 f"{self.config.device} memory (CUDA IPC), their fence in shared memory {self.pool.fence_segment.name}")
        return f"serving {self.config.model_dir} in {self.config.dtype}: {self.pool.num_blocks} KV blocks in {where}"

    async def close(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None  # it holds the engine loop, and so the pool's views
        self.servicer.close()
        self.receiver.close()
        if self.engine_loop is not None:
            await asyncio.to_thread(self.engine_loop.stop)
            self.servicer.engine_loop = self.lora.engine_loop = self.embed.engine_loop = self.cache.engine_loop = None
            self.engine_loop = None
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.close)
        # The engine's views of the pool must be gone before it is unmapped; some sit in reference
        # cycles, which the collector sees only in the start-up heap unfrozen (entrypoint.py), and
        # frozen again what is left is not walked once more at exit.
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        if self.pool is not None:
            _close_pool(self.pool)

