"""Engine configuration: what the user asks for, validated once. Without torch: the gateway reads it
too (its default block size); engine/dtypes.py turns a dtype's name into torch's."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from engine.spec_decode_stats import PER_REQUEST_SPEC_DECODE_METRICS

if TYPE_CHECKING:  # the gateway reads this module and loads no numpy: the engine's speculative.py does
    from engine.speculative import SpeculativeConfig

DType = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(DType)
SCHEDULING_POLICIES = ("fcfs", "priority")
# What the KV pages hold (vLLM's --kv-cache-dtype): auto, the compute dtype; fp8 (= fp8_e4m3) or
# fp8_e5m2, one byte a number, cast without scales (vLLM's default scale of 1).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DEFAULT_MAX_LOGPROBS = 20  # vLLM's (and OpenAI's top_logprobs bound)
# What reported logprobs are of (vLLM's --logprobs-mode; engine/sampled_logprobs.py), the default first.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


def stored_dtype(model_config: dict) -> str | None:
    """The dtype a checkpoint's config.json says its weights are stored in (transformers 4 names it
    torch_dtype, 5 dtype); None when it does not say."""
    return model_config.get("torch_dtype") or model_config.get("dtype")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs a model directory.

    The KV pool is sized once: to `kv_cache_memory_bytes` when given (vLLM's --kv-cache-memory-bytes),
    else on a GPU to what `gpu_memory_utilization` of the device's memory leaves beside the weights
    (engine/kv_pool.py), else `num_kv_blocks` when given, otherwise `kv_memory_fraction` of the memory
    that is free at start-up.
    """

    model: str
    dtype: DType = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_memory_fraction: float = 0.3
    gpu_memory_utilization: float | None = None  # a CUDA engine's share of its device's memory; ignored on the CPU
    # The process's random generator seeded at start (vLLM's --seed): unseeded requests then draw the
    # same tokens run after run, given the same requests in the same order. None: not seeded.
    seed: int | None = None
    tokenizer: str | None = None  # the tokenizer's directory, when not the model's (vLLM's --tokenizer)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # vLLM's long_prefill_token_threshold: no prompt computes more than this many tokens a step (0: no
    # cap), so that a long one leaves room in the step for short ones. An encoder's prompt goes whole.
    long_prefill_token_threshold: int = 0
    # vLLM's --limit-mm-per-prompt's images: the most a prompt may hold (None: no limit); 0 serves a
    # multimodal model's text only, its image encoder never loaded.
    limit_images: int | None = None
    # Its videos' (None: no limit): encoded by the image encoder, so none where limit_images is 0.
    limit_videos: int | None = None
    # vLLM's --enable-mm-embeds: images may come as their encoder's rows (engine/prompt_images.py's ImageRows); with
    # limit_images 0, only so, the image encoder never loaded.
    enable_mm_embeds: bool = False
    # fcfs: requests are scheduled as they came; priority: by SamplingParams.priority, then as they
    # came (vLLM's two policies). Preemption takes the last in that order.
    scheduling_policy: str = "fcfs"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # A hybrid model's recurrent states kept at the ends of cached prefixes (engine/state_snapshots.py), in host
    # memory: at most this many bytes.
    state_cache_bytes: int = 2 * 2**30  # 0: none kept
    # ... kept also every this many tokens inside a prompt's chunk (rounded up to whole blocks), beside each chunk's
    # and each sequence's last block end: where prompts sharing a long prefix continue from.
    state_snapshot_interval: int = 512
    show_progress: bool = False
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default (split between ranks)
    # vLLM's --tensor-parallel-size: the model's heads and MLP width split across this many processes on
    # this host (engine/tensor_parallel.py), the first this one.
    tensor_parallel_size: int = 1
    # On the CPU, keep freed host memory for the next step instead of faulting it in again
    # (engine/host_memory.py); it sets the process's malloc.
    retain_freed_host_memory: bool = True
    # LoRA adapters served beside the model (engine/lora.py): (name, PEFT adapter directory) pairs,
    # vLLM's --lora-modules; a request names one by SamplingParams.lora_name.
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int | None = None  # most adapters in one step's batch (vLLM's --max-loras); None: no limit
    max_lora_rank: int | None = None  # an adapter of a higher rank is refused (vLLM's --max-lora-rank); None: any
    # Served adapters' weights kept in memory at most, the least recently asked for let go and read again
    # when asked for (vLLM's --max-cpu-loras; engine/lora_manager.py); None: all of them.
    max_cpu_loras: int | None = None
    # Speculative decoding (engine/speculative.py: n-gram or a draft model's drafts, vLLM's --speculative-config);
    # None: none.
    speculative: SpeculativeConfig | None = None
    # What each request keeps of its speculative steps, for its reply (vLLM's --per-request-spec-decode-metrics:
    # none, summary or detailed; engine/spec_decode_stats.py).
    per_request_spec_decode_metrics: str = "none"
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    logprobs_mode: str = "raw_logprobs"  # what reported logprobs are of: one of LOGPROBS_MODES
    # vLLM's --max-logprobs: the most top logprobs a request may ask for per token (and per prompt token);
    # -1: the whole vocabulary.
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # vLLM's --hf-overrides: config.json keys replaced (engine/checkpoint.read_model_config); in the
    # KV fingerprint, so workers that disagree refuse each other's pages.
    hf_overrides: Mapping[str, Any] | None = None
    # vLLM's --kv-cache-metrics-sample: the fraction of cached blocks whose lifetime, idle time before
    # eviction and reuse gaps are measured (engine/kv_block_residency.py); 0: none.
    kv_cache_metrics_sample: float = 0.0

    def __post_init__(self) -> None:
        if not os.path.isdir(self.model):
            raise ValueError(f"model directory not found: {self.model}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if not 0 < self.kv_memory_fraction <= 0.95:
            raise ValueError(f"kv_memory_fraction must be in (0, 0.95], got {self.kv_memory_fraction}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.limit_images is not None and self.limit_images < 0:
            raise ValueError(f"limit_images must be >= 0 (0: text only), got {self.limit_images}")
        if self.limit_videos is not None and self.limit_videos < 0:
            raise ValueError(f"limit_videos must be >= 0, got {self.limit_videos}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.per_request_spec_decode_metrics not in PER_REQUEST_SPEC_DECODE_METRICS:
            raise ValueError(f"per_request_spec_decode_metrics must be one of {PER_REQUEST_SPEC_DECODE_METRICS}, "
                             f"got {self.per_request_spec_decode_metrics!r}")
        if not 0 <= self.kv_cache_metrics_sample <= 1:
            raise ValueError(f"kv_cache_metrics_sample must be in [0, 1], got {self.kv_cache_metrics_sample}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1 (-1: the vocabulary), got {self.max_logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens must be >= block_size ({self.block_size}), "
                f"got {self.max_num_batched_tokens}"
            )
