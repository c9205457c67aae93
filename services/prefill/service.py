"""The prefill worker's service, as services/common/entrypoint.py runs it (`python -m services.prefill`:
__main__.py): its servicers, its engine loaded and warmed up while health reports NOT_SERVING, then its
place in the registry and the prefix index; on a stop, out of both, the engine stopped, its channels closed."""
from __future__ import annotations

import asyncio

import services.common.grpc_env  # noqa: F401  (first: before anything imports grpc)
import services.common.openmp_env  # noqa: F401  (first: before torch loads OpenMP)
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative import SpeculativeConfig
from protos import (
    cache_pb2_grpc,
    embed_pb2_grpc,
    lora_pb2_grpc,
    prefill_pb2_grpc,
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
from services.kvstore.layout import PageLayout
from services.prefill.config import PrefillServiceConfig
from services.prefill.servicer import SERVICE_NAME, PrefillServicer

# The sampler paths a first token can take: greedy, and seeded sampling with filters,
# penalties and logprobs.
WARMUP_PARAMS = (
    SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.1,
                   presence_penalty=0.1, frequency_penalty=0.1, seed=0, ignore_eos=True, logprobs=2),
)


def load_engine(config: PrefillServiceConfig) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(config.model_dir), device=config.device, **pool_size_options(config),
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                                  seed=config.seed, tensor_parallel_size=config.tensor_parallel_size,
                                  tokenizer=str(config.tokenizer_dir) if config.tokenizer_dir is not None else None,
                                  long_prefill_token_threshold=config.long_prefill_token_threshold,
                                  state_cache_bytes=config.state_cache_bytes,
                                  state_snapshot_interval=config.state_snapshot_interval,
                                  limit_images=config.limit_images, limit_videos=config.limit_videos,
                                  enable_mm_embeds=config.enable_mm_embeds,
                                  enable_prefix_caching=config.prefix_caching,
                                  scheduling_policy=config.scheduling_policy, dtype=config.dtype,
                                  kv_cache_dtype=config.kv_cache_dtype, logprobs_mode=config.logprobs_mode,
                                  max_logprobs=config.max_logprobs,
                                  kv_cache_metrics_sample=config.kv_cache_metrics_sample,
                                  lora_modules=config.lora_modules,
                                  max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                  max_cpu_loras=config.max_cpu_loras,
                                  hf_overrides=config.hf_overrides, speculative=prefill_drafter(config.speculative)))


def prefill_drafter(speculative: SpeculativeConfig | None) -> SpeculativeConfig | None:
    """The speculative config a prefill worker's engine takes: an EAGLE head's or MTP layer's (whose KV it computes
    into the pages it hands over); a prompt computed here is never drafted for, so any other is none."""
    return speculative if speculative is not None and speculative.method in ("eagle", "eagle3", "mtp") else None


def warmup_lengths(engine: LLMEngine) -> list[int]:
    """One token, one block and a bit, a few hundred, and a prompt longer than one step's budget
    (chunked), where they fit: the requests of one length run together and hold their pages."""
    per_request_blocks = engine.num_kv_blocks // len(WARMUP_PARAMS) - 1
    limit = min(engine.max_model_len - 3, per_request_blocks * engine.config.block_size)
    lengths = [1, engine.config.block_size + 1, 512, engine.config.max_num_batched_tokens + 1]
    return sorted({n for n in lengths if n <= limit} | {1})


async def warm_up(engine_loop: EngineLoop, lengths: list[int]) -> None:
    """Dummy prefill-only requests of several lengths, batched together, their pages released; the
    vocabulary read for guided decoding."""
    await engine_loop.prepare_guides()
    for i, n in enumerate(lengths):
        streams = []
        for j, params in enumerate(WARMUP_PARAMS):
            request_id = f"warmup-{i}-{j}"
            prompt = [(7 * k + j) % 97 + 1 for k in range(n)]
            streams.append((request_id, engine_loop.add_request(request_id, prompt, params, prefill_only=True)))
        for request_id, outputs in streams:
            await finished(outputs)
            await engine_loop.release(request_id)


class PrefillService:
    """The prefill servicer, and the engine loop it serves once loaded."""

    service_names = [SERVICE_NAME, LORA_SERVICE_NAME, EMBED_SERVICE_NAME, CACHE_SERVICE_NAME, WEIGHTS_SERVICE_NAME,
                     PROFILER_SERVICE_NAME, SCHEDULER_SERVICE_NAME]

    def __init__(self, config: PrefillServiceConfig):
        self.config = config
        self.servicer = PrefillServicer(kv_checksum=config.kv_checksum, early_kv_transfer=config.sends_pages_early,
                                        reserve_wait_s=config.kv_reserve_wait_s)
        self.port = 0  # the bound one, set by the entry point before `start`
        self.lora = LoRAAdaptersServicer(config.allow_runtime_lora_updating)
        self.embed = EmbeddingsServicer(config.max_message_bytes)
        self.cache = PrefixCacheServicer()
        self.servicers = [(prefill_pb2_grpc.add_PrefillServicer_to_server, self.servicer),
                          (lora_pb2_grpc.add_LoRAAdaptersServicer_to_server, self.lora),
                          (embed_pb2_grpc.add_EmbeddingsServicer_to_server, self.embed),
                          (cache_pb2_grpc.add_PrefixCacheServicer_to_server, self.cache),
                          (weights_pb2_grpc.add_WeightsServicer_to_server, WeightsServicer(self.cache)),
                          (profile_pb2_grpc.add_ProfilerServicer_to_server,
                           ProfilerServicer(self.cache, config.profiler_dir, "prefill")),
                          (scheduler_pb2_grpc.add_SchedulerServicer_to_server, SchedulerServicer(self.cache))]
        self.engine_loop: EngineLoop | None = None
        self.publisher: InstancePublisher | None = None
        self.kv_events: KVEventPublisher | None = None
        self.metrics = ServiceMetrics("prefill")  # the entry point's, labelled and served, replaces it

    async def start(self, stop: Stop) -> str | None:
        self.servicer.opened_ahead.end_idle_when(stop)
        thread = EngineThread()  # the engine is built on the thread that will step it
        engine = await load_in_thread(stop, load_engine, self.config, thread=thread)
        if engine is None:
            return None
        record_engine_boot(engine.boot_times)
        pool_tensor = engine.runner.kv_pool.tensor
        layout = PageLayout.of_tensor(pool_tensor, engine.fingerprint)
        lengths = warmup_lengths(engine)
        self.metrics.watch_engine(engine)
        self.servicer.attach(EngineLoop(engine, thread), pool_tensor, layout,
                             kvstore_address=self.config.kvstore_address, metrics=self.metrics,
                             num_state_blocks=engine.block_manager.num_state_blocks)
        self.engine_loop = self.servicer.engine_loop
        self.lora.engine_loop = self.embed.engine_loop = self.cache.engine_loop = self.engine_loop
        self.cache.host_tier_reset = self.servicer.reset_host_tier
        del engine
        self.engine_loop.start(sole_parallel_thread=True)
        self.engine_loop.on_failure(lambda e: stop.fail("prefill", f"its engine failed: {e!r}"))
        with self.metrics.time_warmup(), tracer().start_as_current_span("warmup"):
            await warm_up(self.engine_loop, lengths)
        self.kv_events = await publish_kv_events(self.config.kv_events, self.engine_loop, layout.block_size,
                                                 pool_tensor.is_cuda, self.metrics)
        # Only once warm: a heartbeat puts this worker into routing.
        self.publisher = publisher_for("prefill", self.config, self.port, self.engine_loop,
                                       model_key=layout.fingerprint.hex(), block_size=layout.block_size,
                                       publish_blocks=True)
        if self.publisher is not None:
            await self.publisher.start(stop)
        return (f"serving {self.config.model_dir} in {self.config.dtype}: {layout.num_blocks} local KV blocks; "
                f"warmed up on prompts of {lengths} tokens")

    async def close(self) -> None:
        if self.publisher is not None:  # first: leaving the index reads the engine's cache
            await self.publisher.close()
        if self.engine_loop is not None:
            await asyncio.to_thread(self.engine_loop.stop)
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.close)
        await self.servicer.close()

