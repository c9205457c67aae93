"""The prefill service's settings: one frozen dataclass, built from CLI flags and
`BATON_*` environment variables in one place (`from_args`).

The flags and checks every service shares (model, host, port, context override,
message limit) come from services/common/settings.py; host, port and engine sizes
carry the service's name (`BATON_PREFILL_PORT`).
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import DEFAULT_MAX_LOGPROBS
from engine.speculative import SpeculativeConfig
from services.common.device_flag import add_device_flag, resolved_device
from services.common.kv_cache_metrics_flags import add_kv_cache_metrics_flags, kv_cache_metrics_sample
from services.common.kv_events_config import KVEventsConfig, add_kv_events_flag
from services.common.kv_pool_flags import (
    DEFAULT_STATE_CACHE_BYTES,
    DEFAULT_STATE_SNAPSHOT_INTERVAL,
    add_kv_memory_flag,
    add_state_cache_flags,
    check_memory_shares,
    check_state_cache,
)
from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES
from services.common.logprobs_flag import (
    add_logprobs_mode_flag,
    add_max_logprobs_flag,
    check_logprobs_mode,
    check_max_logprobs,
)
from services.common.lora_flags import add_lora_flag, add_lora_limit_flags, check_lora_limits, lora_modules
from services.common.mm_limits import add_limit_mm_flag, add_mm_embeds_flag, image_limit, video_limit
from services.common.settings import (
    DEFAULT_SHUTDOWN_GRACE_S,
    ENV_MAX_MESSAGE_BYTES as ENV_MAX_MESSAGE_BYTES,
    ENV_MAX_MODEL_LEN as ENV_MAX_MODEL_LEN,
    ENV_MODEL as ENV_MODEL,
    ENV_REDIS_URL as ENV_REDIS_URL,
    ConfigError as ConfigError,
    add_bind_flags,
    add_dtype_flag,
    add_limit_flags,
    add_long_prefill_flag,
    add_metrics_flag,
    add_profiler_flag,
    add_registry_flags,
    add_scheduling_flag,
    add_seed_flag,
    add_tensor_parallel_flag,
    add_tracing_flag,
    check_bind,
    check_kv_cache_dtype,
    check_limits,
    check_long_prefill,
    check_metrics_port,
    check_model_dir,
    check_positive,
    check_registry,
    check_scheduling_policy,
    check_tensor_parallel_size,
    env_float,
    env_int,
    hf_overrides,
    model_arg,
    new_parser,
    resolved_dtype,
)
from services.common.speculative_flag import speculative_config
from services.common.tokenizer_dir_flag import add_tokenizer_dir_flag, tokenizer_dir

ENV_HOST = "BATON_PREFILL_HOST"
ENV_PORT = "BATON_PREFILL_PORT"
ENV_INSTANCE_ID = "BATON_PREFILL_INSTANCE_ID"
ENV_KV_BLOCKS = "BATON_PREFILL_KV_BLOCKS"
ENV_KV_CACHE_MEMORY_BYTES = "BATON_PREFILL_KV_CACHE_MEMORY_BYTES"
ENV_KV_MEMORY_FRACTION = "BATON_PREFILL_KV_MEMORY_FRACTION"
ENV_GPU_MEMORY_UTILIZATION = "BATON_PREFILL_GPU_MEMORY_UTILIZATION"
ENV_MAX_NUM_BATCHED_TOKENS = "BATON_PREFILL_MAX_NUM_BATCHED_TOKENS"
ENV_MAX_NUM_SEQS = "BATON_PREFILL_MAX_NUM_SEQS"
ENV_SCHEDULING_POLICY = "BATON_PREFILL_SCHEDULING_POLICY"
ENV_LOGPROBS_MODE = "BATON_PREFILL_LOGPROBS_MODE"
ENV_KV_EVENTS_CONFIG = "BATON_PREFILL_KV_EVENTS_CONFIG"
ENV_MAX_LOGPROBS = "BATON_PREFILL_MAX_LOGPROBS"
ENV_KV_CHECKSUM = "BATON_PREFILL_KV_CHECKSUM"
ENV_EARLY_KV_TRANSFER = "BATON_PREFILL_EARLY_KV_TRANSFER"
EARLY_KV_TRANSFER = ("auto", "on", "off")
ENV_PREFIX_CACHING = "BATON_PREFILL_PREFIX_CACHING"
ENV_KVSTORE = "BATON_PREFILL_KVSTORE"
ENV_METRICS_PORT = "BATON_PREFILL_METRICS_PORT"
ENV_SPECULATIVE_CONFIG = "BATON_PREFILL_SPECULATIVE_CONFIG"
ENV_KV_RESERVE_WAIT_S = "BATON_PREFILL_KV_RESERVE_WAIT_S"

DEFAULT_KV_BLOCKS = 1024
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # the token budget of one step: longer prompts are chunked
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_RESERVE_WAIT_S = 30.0  # a prompt's most wait for its decode worker's pages (--kv-reserve-wait-s)


@dataclass(frozen=True)
class PrefillServiceConfig:
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (the listening line says which)
    num_kv_blocks: int = DEFAULT_KV_BLOCKS  # the local pool: prompts in flight plus the prefix cache
    kv_cache_memory_bytes: int | None = None  # the pool's size in bytes instead (kv_pool_flags.py)
    kv_memory_fraction: float | None = None  # or its share of the memory free after the weights load
    gpu_memory_utilization: float | None = None  # on a GPU: its share of the device's memory, weights and pool
    seed: int | None = None  # the engine's random generator seeded at start (vLLM's --seed)
    tensor_parallel_size: int = 1  # the model split across this many processes (engine/tensor_parallel.py)
    long_prefill_token_threshold: int = 0  # a step's most tokens for one prompt; 0: no cap
    # A hybrid model's recurrent states kept for its prefix cache: their bytes, and tokens between them in a chunk.
    state_cache_bytes: int = DEFAULT_STATE_CACHE_BYTES
    state_snapshot_interval: int = DEFAULT_STATE_SNAPSHOT_INTERVAL
    limit_images: int | None = None  # a prompt's most images (--limit-mm-per-prompt); 0: text only; None: any
    limit_videos: int | None = None  # its videos' (0 where images are)
    enable_mm_embeds: bool = False  # images may come as their encoder's rows (vLLM's --enable-mm-embeds)
    tokenizer_dir: Path | None = None  # where the tokenizer is, when not in model_dir (vLLM's --tokenizer)
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    scheduling_policy: str = "fcfs"  # engine/config.py's: fcfs or priority
    device: str = "auto"  # where the engine computes and keeps its KV pool (device_flag.py; auto resolved)
    # The engine's compute dtype and its KV pages' (engine/config.py's DTYPES; auto resolved; None: float32 on
    # the CPU, auto on a GPU).
    dtype: str | None = None
    kv_cache_dtype: str = "auto"  # what the KV pages hold: engine/config.py's KV_CACHE_DTYPES
    logprobs_mode: str = "raw_logprobs"  # what reported logprobs are of (engine/sampled_logprobs.py)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # top logprobs a request may ask for per token; -1: the vocabulary
    kv_cache_metrics_sample: float = 0.0  # vLLM's --kv-cache-metrics(-sample): blocks' residency measured; 0: none
    kv_events: KVEventsConfig | None = None  # vLLM's --kv-events-config: its prefix cache's changes published
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT adapter directory), served beside the model
    allow_runtime_lora_updating: bool = False  # the LoRAAdapters service loads and unloads adapters
    max_loras: int | None = None  # most adapters in a step's batch; None: no limit
    max_lora_rank: int | None = None  # adapters of a higher rank refused; None: any
    max_cpu_loras: int | None = None  # served adapters kept loaded at most; None: all
    max_model_len: int | None = None  # None: the model's own context length
    hf_overrides: dict[str, Any] | None = None  # config.json keys replaced (vLLM's --hf-overrides)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    kv_checksum: bool = True  # CRC-32 on every page chunk sent over GRPC_STREAM
    # How long a prompt waits for its decode worker to free pages, queued there, when too few are free
    # (then RESOURCE_EXHAUSTED: the client's 429); 0: refused at once.
    kv_reserve_wait_s: float = DEFAULT_RESERVE_WAIT_S
    # A long prompt's pages sent by GRPC_STREAM as its chunks compute: on, off, or auto (on where the
    # engine is on a GPU: on a CPU the sending takes the cores the prompt computes on).
    early_kv_transfer: str = "auto"
    # The decode workers' speculative config, where their EAGLE head's (or MTP layer's) KV is in every page: this
    # worker computes the head's KV of each prompt into its pages (engine/eagle.py). None: none.
    speculative: SpeculativeConfig | None = None
    prefix_caching: bool = True  # off: every prompt computed whole (for measuring what the cache saves)
    kvstore_address: str = ""  # host:port of the kvstore node reused prefix blocks are stored on; "": none
    metrics_port: int = 0  # Prometheus /metrics; 0: any free port (printed), -1: none
    redis_url: str = ""  # "": no Redis, nothing heartbeated or published
    instance_id: str = ""  # "": KIND-HOST-PORT once bound
    registry_ttl_s: float = 3.0  # heartbeat every third of it; silent longer: out of routing
    index_ttl_s: float = 30.0  # prefix-index entries, refreshed every third of it while held
    grace_s: float = DEFAULT_SHUTDOWN_GRACE_S  # after SIGTERM, how long in-flight calls may finish
    otlp_endpoint: str = ""  # OTLP gRPC collector for trace spans; "": as the OTEL_* variables say
    profiler_dir: str = ""  # where torch profiler traces go at /start_profile; "": profiling refused

    @property
    def sends_pages_early(self) -> bool:
        return self.early_kv_transfer == "on" or (self.early_kv_transfer == "auto" and self.device.startswith("cuda"))

    def __post_init__(self):
        object.__setattr__(self, "model_dir", check_model_dir(self.model_dir, "config.json"))
        object.__setattr__(self, "tokenizer_dir", tokenizer_dir(self.tokenizer_dir))
        object.__setattr__(self, "device", resolved_device(self.device))
        object.__setattr__(self, "dtype", resolved_dtype(self.dtype, self.model_dir, self.hf_overrides, self.device))
        check_bind(self.host, self.port, ENV_HOST)
        check_positive("--kv-blocks", self.num_kv_blocks)
        if self.kv_cache_memory_bytes is not None:
            check_positive("--kv-cache-memory-bytes", self.kv_cache_memory_bytes)
        check_memory_shares(self.kv_memory_fraction, self.gpu_memory_utilization)
        check_long_prefill(self.long_prefill_token_threshold)
        check_state_cache(self.state_cache_bytes, self.state_snapshot_interval)
        if self.early_kv_transfer not in EARLY_KV_TRANSFER:
            raise ConfigError(f"--early-kv-transfer must be one of {', '.join(EARLY_KV_TRANSFER)}, "
                              f"got {self.early_kv_transfer!r}")
        if not (math.isfinite(self.kv_reserve_wait_s) and self.kv_reserve_wait_s >= 0):
            raise ConfigError(f"--kv-reserve-wait-s must be a number of seconds >= 0, got {self.kv_reserve_wait_s}")
        check_positive("--max-num-batched-tokens", self.max_num_batched_tokens)
        check_positive("--max-num-seqs", self.max_num_seqs)
        check_tensor_parallel_size(self.tensor_parallel_size)
        check_scheduling_policy(self.scheduling_policy)
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_logprobs_mode(self.logprobs_mode)
        check_max_logprobs(self.max_logprobs)
        check_lora_limits(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        check_limits(self.max_model_len, self.max_message_bytes, self.grace_s)
        check_registry(self.redis_url, self.registry_ttl_s, self.index_ttl_s)
        check_metrics_port(self.metrics_port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
                  ) -> PrefillServiceConfig:
        """Parse `argv` (default: sys.argv[1:]) over `env` (default: os.environ).
        Raises ConfigError for a missing or invalid setting; argparse exits on a malformed flag."""
        env = os.environ if env is None else env
        parser = new_parser("prefill")
        add_bind_flags(parser, env, env_host=ENV_HOST, env_port=ENV_PORT)
        parser.add_argument("--kv-blocks", type=int, default=env_int(env, ENV_KV_BLOCKS, DEFAULT_KV_BLOCKS),
                            help=f"local KV pool size in pages (${ENV_KV_BLOCKS})")
        add_kv_memory_flag(parser, env, env_var=ENV_KV_CACHE_MEMORY_BYTES, fraction_env_var=ENV_KV_MEMORY_FRACTION,
                           utilization_env_var=ENV_GPU_MEMORY_UTILIZATION)
        parser.add_argument("--max-num-batched-tokens", type=int,
                            default=env_int(env, ENV_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_BATCHED_TOKENS),
                            help=f"tokens per step; longer prompts are chunked (${ENV_MAX_NUM_BATCHED_TOKENS})")
        parser.add_argument("--max-num-seqs", type=int, default=env_int(env, ENV_MAX_NUM_SEQS, DEFAULT_MAX_NUM_SEQS),
                            help=f"most prompts in one batch (${ENV_MAX_NUM_SEQS})")
        parser.add_argument("--no-kv-checksum", dest="kv_checksum", action="store_false",
                            default=env.get(ENV_KV_CHECKSUM, "1") != "0",
                            help=f"send GRPC_STREAM page chunks without a CRC-32 (${ENV_KV_CHECKSUM}=0)")
        parser.add_argument("--kv-reserve-wait-s", type=float, metavar="S",
                            default=env_float(env, ENV_KV_RESERVE_WAIT_S, DEFAULT_RESERVE_WAIT_S),
                            help="how long a prompt waits, queued on its decode worker, for pages to free when too "
                                 f"few are (then a 429); 0: refused at once (default {DEFAULT_RESERVE_WAIT_S:g})")
        parser.add_argument("--early-kv-transfer", choices=EARLY_KV_TRANSFER,
                            default=env.get(ENV_EARLY_KV_TRANSFER) or "auto",
                            help=f"send a long prompt's pages by GRPC_STREAM chunk by chunk as it computes (on), "
                                 f"or all once it is computed (off); auto, the default: on where the engine is on "
                                 f"a GPU, off on a CPU, where sending takes the cores the prompt computes on "
                                 f"(${ENV_EARLY_KV_TRANSFER})")
        parser.add_argument("--speculative-config", metavar="JSON", default=env.get(ENV_SPECULATIVE_CONFIG) or None,
                            help="the decode workers' --speculative-config, where they draft with an EAGLE head or a "
                                 "checkpoint's MTP layer whose KV is in every page: this worker computes the head's KV "
                                 "of each prompt into the pages it hands over (their layouts must agree); n-gram and "
                                 f"draft-model configs change nothing here (${ENV_SPECULATIVE_CONFIG})")
        parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                            default=env.get(ENV_PREFIX_CACHING, "1") != "0",
                            help=f"compute every prompt whole, reusing no cached prefix (${ENV_PREFIX_CACHING}=0)")
        parser.add_argument("--kvstore", default=env.get(ENV_KVSTORE, ""), metavar="HOST:PORT",
                            help="kvstore node to store the prefixes this worker reuses on, for other "
                                 f"workers to read instead of computing (${ENV_KVSTORE}; default: none)")
        add_scheduling_flag(parser, env, env_var=ENV_SCHEDULING_POLICY)
        add_device_flag(parser, env)
        add_dtype_flag(parser, env)
        add_logprobs_mode_flag(parser, env, env_var=ENV_LOGPROBS_MODE)
        add_max_logprobs_flag(parser, env, env_var=ENV_MAX_LOGPROBS)
        add_kv_events_flag(parser, env, env_var=ENV_KV_EVENTS_CONFIG)
        add_kv_cache_metrics_flags(parser)
        add_lora_flag(parser, env)
        add_lora_limit_flags(parser)
        add_limit_flags(parser, env)
        add_registry_flags(parser, env, env_instance_id=ENV_INSTANCE_ID)
        add_metrics_flag(parser, env, env_metrics_port=ENV_METRICS_PORT)
        add_tracing_flag(parser)
        add_seed_flag(parser)
        add_tensor_parallel_flag(parser, env)
        add_long_prefill_flag(parser)
        add_state_cache_flags(parser)
        add_limit_mm_flag(parser)
        add_mm_embeds_flag(parser)
        add_tokenizer_dir_flag(parser, env)
        add_profiler_flag(parser, env)
        args = parser.parse_args(argv)
        return cls(model_dir=model_arg(args), host=args.host, port=args.port,
                   num_kv_blocks=args.kv_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                   kv_memory_fraction=args.kv_memory_fraction,
                   gpu_memory_utilization=args.gpu_memory_utilization,
                   seed=args.seed, tensor_parallel_size=args.tensor_parallel_size, tokenizer_dir=args.tokenizer_dir,
                   long_prefill_token_threshold=args.long_prefill_token_threshold,
                   state_cache_bytes=args.state_cache_bytes, state_snapshot_interval=args.state_snapshot_interval,
                   limit_images=image_limit(args.limit_mm_per_prompt),
                   limit_videos=video_limit(args.limit_mm_per_prompt), enable_mm_embeds=args.enable_mm_embeds,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                   hf_overrides=hf_overrides(args.hf_overrides),
                   scheduling_policy=args.scheduling_policy, device=args.device, dtype=args.dtype,
                   kv_cache_dtype=args.kv_cache_dtype,
                   logprobs_mode=args.logprobs_mode, max_logprobs=args.max_logprobs,
                   kv_cache_metrics_sample=kv_cache_metrics_sample(args),
                   kv_events=KVEventsConfig.from_json(args.kv_events_config,
                                                      f"--kv-events-config (or ${ENV_KV_EVENTS_CONFIG})"),
                   lora_modules=lora_modules(args.lora_modules),
                   allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                   max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                   max_message_bytes=args.max_message_bytes, grace_s=args.shutdown_grace_s,
                   redis_url=args.redis, instance_id=args.instance_id, kv_checksum=args.kv_checksum,
                   kv_reserve_wait_s=args.kv_reserve_wait_s,
                   early_kv_transfer=args.early_kv_transfer,
                   speculative=speculative_config(args.speculative_config,
                                                  f"--speculative-config (or ${ENV_SPECULATIVE_CONFIG})"),
                   prefix_caching=args.prefix_caching, kvstore_address=args.kvstore,
                   metrics_port=args.metrics_port, otlp_endpoint=args.otlp_endpoint,
                   profiler_dir=args.profiler_dir)
