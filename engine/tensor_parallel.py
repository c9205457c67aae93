"""Tensor parallelism (vLLM's --tensor-parallel-size): one model's layers split across N ranks, as
Megatron-LM splits them. Each rank holds its share of the attention heads (q, k and v by rows,
o_proj by columns) and of the MLP's inner width (gate and up by rows, down by columns; each expert's
alike); the projections back to the hidden size end in a sum across ranks, so every rank holds the
whole hidden state between layers (where the ranks outnumber the KV heads, each holds the one its q heads attend
over, as vLLM replicates them). Norms and routers are whole on every rank; the embeddings and the LM head
are split by vocabulary, as vLLM's VocabParallelEmbedding and ParallelLMHead are: each rank holds a run of
token rows (the last padded with zeros), a token's embedding comes from the rank holding its row (the others
add zeros), and each rank's logits fill its run of columns of the whole (the others add zeros). A model whose
classifier is made of LM head rows keeps them whole.
OLMo 2's q/k norms over whole projections are split with them, their squares summed across the ranks. Multi-head
latent attention (DeepSeek's) splits its heads' q and up-projections of the latent; the latent itself, one row a
token for every head, is computed and written whole by every rank, as vLLM's ranks each hold it whole (and
DeepSeek-V3.2's indexer with it: each rank chooses the same tokens).

Which models it splits each model class says (`splits_across_ranks`). This module says what a rank holds: its
model's shape (`shard_config`), its slice of each checkpoint tensor (`checkpoint_shard`) and of each LoRA adapter
(`lora_shard`), and the sum across ranks (`RankGroup`). The processes that run the ranks are
engine/tensor_parallel_workers.py's.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import uuid
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from engine import shared_memory_sum
from engine.gemma4_config import FULL, SLIDING, Gemma4Layout
from engine.model_config import ModelConfig
from engine.models import MODEL_REGISTRY
from engine.models.mpt import STACKED_EXPERTS as DBRX_STACKED_EXPERTS

# A step's sum waits on the slowest rank's layer; a rank that died closes its connection before this.
REDUCE_TIMEOUT = datetime.timedelta(minutes=5)
SHARED_DIR = "/dev/shm"
SUMS_FILE_KEY = "shared-memory-sums"


# q, k and v fused each head's three in turn (GPT-NeoX's, BLOOM's, GPTBigCode's without multi_query; Falcon's, or
# a group of q heads and their k and v head at a time): a rank's run of rows is its heads' all three.
HEADS_FUSED_QKV = frozenset({"GPTNeoXForCausalLM", "BloomForCausalLM", "GPTBigCodeForCausalLM", "FalconForCausalLM",
                             "PersimmonForCausalLM"})
# Projections stored transposed, [in, out] (GPT-2's Conv1D's): split as their transpose is.
STORED_TRANSPOSED = frozenset({"GPT2LMHeadModel"})
# Experts stored fused for every expert (gpt-oss's, Llama 4's, Qwen3-VL-MoE's): the dimension of each that runs along
# an expert's width, as released ([E, in, out]); None: down's bias. Gate and up lie one after the other along it, or
# interleaved column by column (INTERLEAVED_GATE_UP: a rank's run of columns is then its share of both).
FUSED_EXPERTS = {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1, "down_proj_bias": None}
INTERLEAVED_GATE_UP = frozenset({"GptOssForCausalLM"})
# MLA's q_b_proj and kv_b_proj hold each head's rows in turn, a gated attention's g_proj each head's gate (or gates),
# Beam's gate_bias a number a head.
ROW_SPLIT = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "sinks", "q_b_proj",
                       "kv_b_proj", "c_fc", "g_proj", "gate_bias"})
PROJECTION_NORMS = frozenset({"q_norm", "k_norm"})  # where a model norms whole projections (OLMo 2's), not heads
COLUMN_SPLIT = frozenset({"o_proj", "down_proj", "w2", "c_proj"})
VOCABULARY_ROWS = frozenset({"model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"})  # split by token


def check_shardable(config: ModelConfig, size: int, device: str) -> None:
    """ValueError naming why `config`'s model cannot be split `size` ways on `device`."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    if not device.startswith("cpu"):
        raise ValueError("tensor parallelism runs on the CPU only so far (its ranks share one host's KV pool)")
    if not getattr(MODEL_REGISTRY.get(config.architecture), "splits_across_ranks", False):
        raise ValueError(f"tensor parallelism does not split {config.architecture} yet (README.md's Tensor "
                         "parallelism lists the models it splits)")
    unsupported = [what for what, present in (
        ("encoders", config.encoder is not None),
        ("recurrent layers (Mamba's, linear attention's, short convolutions)", config.state_shape is not None),
        # (its checkpoints name each head's weights of them: norms.{head})
        ("StableLM's q and k layer-normed a head", config.architecture == "StableLmForCausalLM"
         and config.qk_norm is not None),
        # Stored either way round, [E, in, out] or [E, out, in], their width's dimension is told by its size alone.
        ("experts stored fused as wide as the hidden size", _fused_expert_width(config) is not None
         and config.hidden_size in (_fused_expert_width(config), 2 * _fused_expert_width(config))),
    ) if present]
    if unsupported:
        raise ValueError(f"tensor parallelism does not split models with {', '.join(unsupported)} yet")
    widths = {"num_heads": config.num_heads, "intermediate_size": config.intermediate_size,
              "moe_intermediate_size": config.moe.moe_intermediate_size,
              "shared_expert_intermediate_size": config.moe.shared_expert_intermediate_size}
    # MLA's one latent row a token serves every head: whole on each rank.
    kv_widths = {} if config.mla is not None else {"num_kv_heads": config.num_kv_heads}
    if config.mimo_v2_flash is not None:
        kv_widths["full layers' num_kv_heads"] = config.mimo_v2_flash.full_kv_heads
    if config.minimax_m3 is not None:  # one a KV head
        widths["indexer's num_heads"] = config.minimax_m3.num_heads
    if config.gemma4 is not None:  # its pages' heads hold both kinds of layer's (split each kind's)
        kv_widths = {"sliding layers' num_kv_heads": config.gemma4.sliding.num_kv_heads,
                     "full layers' num_kv_heads": config.gemma4.full.num_kv_heads}
        if config.gemma4.experts is not None:
            widths["moe_intermediate_size"] = config.gemma4.experts.width
    for layer, heads in enumerate(config.layer_num_heads or ()):
        widths[f"layer {layer}'s num_heads"] = heads
    for layer, width in enumerate(config.altup.widths if config.altup is not None else ()):  # Gemma 3n's MLPs
        widths[f"layer {layer}'s intermediate_size"] = width
    for name, width in widths.items():
        if width % size:
            raise ValueError(f"tensor_parallel_size {size} must divide the model's {name} ({width})")
    refusal = kv_replication_refusal(config)
    for name, width in kv_widths.items():
        if width % size and (size % width or refusal is not None):
            raise ValueError(f"tensor_parallel_size {size} must divide the model's {name} ({width})"
                             + (" or be a multiple of it" if refusal is None else
                                f" (its KV heads are not shared by more ranks: {refusal})"))


def kv_replication_refusal(config: ModelConfig) -> str | None:
    """Why ranks outnumbering a model's KV heads may not each compute with one of them (as vLLM replicates them);
    None where they may."""
    if config.architecture in HEADS_FUSED_QKV | STORED_TRANSPOSED:
        return "its q, k and v fused a head at a time"
    if config.qk_norm in ("projection", "head_layer_norm"):  # (summed or split across the ranks)
        return "its k normed over the whole projection or by each head's weights"
    if config.mimo_v2_flash is not None or config.minimax_m3 is not None:
        return "its pages' heads laid out its own way"
    return None


def kv_heads_share(heads: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s of a layer's `heads` KV heads, (first, how many): its run of them, or where the ranks outnumber
    them, the one it computes with (as do `size // heads - 1` other ranks, each writing the same numbers)."""
    return rank * heads // size, max(heads // size, 1)


def splits_vocabulary(config: ModelConfig) -> bool:
    """Whether a split model's ranks each hold a share of its embeddings and LM head: all but a classifier made of
    LM head rows (Qwen3-Reranker's), which rank 0 reads whole."""
    return not config.classifier_tokens


def split_vocabulary_size(config: ModelConfig) -> int | None:
    """The whole vocabulary's size where a split model's ranks split it too; None where each holds it whole."""
    return config.vocab_size if splits_vocabulary(config) else None


def vocabulary_share(config: ModelConfig, size: int) -> int:
    """The token rows each of `size` ranks holds (the last's past the vocabulary zeros)."""
    return -(-config.vocab_size // size)


def shard_config(config: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The model rank `rank` of `size` runs: its share of the heads, of the MLPs' and experts' widths and of the
    vocabulary's rows."""
    moe = dataclasses.replace(config.moe, moe_intermediate_size=config.moe.moe_intermediate_size // size,
                              shared_expert_intermediate_size=config.moe.shared_expert_intermediate_size // size)
    # MLA's pages hold one latent row a token for every head (num_kv_heads 1), Gemma 4's each layer's heads in a
    # place of their own (a rank's are its run of them there): whole on every rank.
    num_kv_heads = config.num_kv_heads if config.mla is not None or config.gemma4 is not None else \
        kv_heads_share(config.num_kv_heads, rank, size)[1]
    minimax_m3 = config.minimax_m3 and dataclasses.replace(config.minimax_m3,
                                                           num_heads=config.minimax_m3.num_heads // size)
    vocab_size = vocabulary_share(config, size) if size > 1 and splits_vocabulary(config) else config.vocab_size
    layer_num_heads = None if config.layer_num_heads is None else tuple(n // size for n in config.layer_num_heads)
    mimo_v2_flash = config.mimo_v2_flash and dataclasses.replace(
        config.mimo_v2_flash, full_kv_heads=config.mimo_v2_flash.full_kv_heads // size)
    return dataclasses.replace(config, num_heads=config.num_heads // size, num_kv_heads=num_kv_heads,
                               intermediate_size=config.intermediate_size // size, moe=moe, vocab_size=vocab_size,
                               layer_num_heads=layer_num_heads, mimo_v2_flash=mimo_v2_flash,
                               gemma4=config.gemma4 and _gemma4_share(config.gemma4, rank, size),
                               altup=config.altup and dataclasses.replace(
                                   config.altup, widths=tuple(width // size for width in config.altup.widths)),
                               minimax_m3=minimax_m3)


def _gemma4_share(layout: Gemma4Layout, rank: int, size: int) -> Gemma4Layout:
    """Rank `rank`'s share of Gemma 4's layers: each kind's KV heads, where each layer's lie in the whole pages (its
    run of the layer's heads there), and the experts' width."""
    kinds = {kind: dataclasses.replace(heads, num_kv_heads=kv_heads_share(heads.num_kv_heads, rank, size)[1])
             for kind, heads in ((SLIDING, layout.sliding), (FULL, layout.full))}
    places = tuple((pool_layer, first + kv_heads_share(layout.heads(layer).num_kv_heads, rank, size)[0]
                    * layout.heads(layer).page_parts) for layer, (pool_layer, first) in enumerate(layout.kv_places))
    experts = layout.experts and dataclasses.replace(layout.experts, width=layout.experts.width // size)
    return dataclasses.replace(layout, sliding=kinds[SLIDING], full=kinds[FULL], kv_places=places, experts=experts)


def whole_pages(config: ModelConfig) -> bool:
    """Whether every rank of a split model computes in its pages' every head (each choosing its own among them)."""
    return config.mla is not None or config.gemma4 is not None or config.minimax_m3 is not None


def rank_heads(config: ModelConfig, rank: int, size: int) -> slice:
    """The KV heads of every page that rank `rank` of `size` computes with: MLA's latent rows are every rank's,
    Gemma 4's pages whole on each (each layer's heads lying in their own place), and MiniMax-M3's (its indexer's key
    head after every rank's KV heads)."""
    if whole_pages(config) or size == 1:
        return slice(None)
    first, count = kv_heads_share(config.num_kv_heads, rank, size)
    return slice(first, first + count)


def checkpoint_shard(name: str, tensor: torch.Tensor, config: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of checkpoint tensor `name` of the whole model `config`: its share of the rows (q, k, v,
    gate and up, each expert's and the shared experts' too; Phi-3's fused q/k/v and gate/up each part's, q/k/v fused a
    head at a time its heads') or of the columns (o, down), its run of the vocabulary's rows (embeddings, LM head and
    its bias), or the whole tensor (norms, routers); GPT-2's transposed projections as their transpose. A bias added
    after the sum across ranks is rank 0's alone (the others' zeros), or it would be added `size` times."""
    if name in VOCABULARY_ROWS and size > 1 and splits_vocabulary(config):
        share = vocabulary_share(config, size)
        rows = tensor[rank * share:(rank + 1) * share]
        return torch.cat((rows, rows.new_zeros(share - rows.shape[0], *rows.shape[1:]))) if rows.shape[0] < share \
            else rows
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or size == 1:
        return tensor
    if config.architecture in STORED_TRANSPOSED and tensor.dim() == 2:
        return _layer_shard(name, tensor.t(), config, rank, size).t()
    return _layer_shard(name, tensor, config, rank, size)


def _layer_shard(name: str, tensor: torch.Tensor, config: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """checkpoint_shard's of a tensor of the layers', stored as Linear's are ([out, in])."""
    parts = name.split(".")
    if parts[-2] == "experts" and parts[-1] in FUSED_EXPERTS:
        dim = FUSED_EXPERTS[parts[-1]]
        if dim is None:  # down's bias
            return tensor if rank == 0 else torch.zeros_like(tensor)
        if _fused_expert_width(config) is not None:  # Qwen3-VL-MoE's, stored either way round, or Gemma 4's
            # [E, out, in]: the dimension its width's size says
            width = _fused_expert_width(config) * (2 if parts[-1].startswith("gate_up") else 1)
            dim = _expert_width_dim(name, tensor, width)
        if parts[-1].startswith("gate_up") and config.architecture not in INTERLEAVED_GATE_UP:
            return torch.cat([_share(half, dim, rank, size) for half in tensor.chunk(2, dim=dim)], dim=dim)
        return _share(tensor, dim, rank, size)
    if parts[-2] == "experts" and parts[-1] in DBRX_STACKED_EXPERTS:  # [E * width, hidden] each, down's too
        experts = tensor.view(config.moe.num_experts, -1, tensor.shape[-1])
        return _share(experts, 1, rank, size).reshape(-1, tensor.shape[-1])
    if parts[-3] == "experts" and tensor.dim() == 3:  # stacked a projection at a time (Step-3.7's) [E, out, in]
        return _share(tensor, 2 if parts[-2] in COLUMN_SPLIT else 1, rank, size)
    if parts[-2] in ("input_linear", "output_linear"):  # Granite MoE's fused experts [E, ...] and shared MLP
        dim = tensor.dim() - (2 if parts[-2] == "input_linear" else 1)  # along their width
        if parts[-2] == "input_linear":  # gate, then up
            return torch.cat([_share(half, dim, rank, size) for half in tensor.chunk(2, dim=dim)], dim=dim)
        return _share(tensor, dim, rank, size)
    if parts[-3] == "indexer" and parts[-2] != "q_proj":  # MiniMax-M3's key projection: one head, every rank's
        return tensor
    proj = parts[-1] if parts[-1] in ("sinks", "gate_bias") else parts[-2]
    if proj == "qkv_proj" and config.architecture in HEADS_FUSED_QKV:
        return _share(tensor, 0, rank, size)
    if proj in ("k_proj", "v_proj") and kv_replication_refusal(config) is None:
        return _kv_share(tensor, _layer_kv_heads(config, name), rank, size)
    # q's and k's norms over whole projections (OLMo 2's) or of each head's own weights (Command R+'s): by heads.
    if proj in ROW_SPLIT or (proj in PROJECTION_NORMS and config.qk_norm in ("projection", "head_layer_norm")):
        return _share(tensor, 0, rank, size)
    if proj in COLUMN_SPLIT:
        if parts[-1] == "bias":
            return tensor if rank == 0 else torch.zeros_like(tensor)
        return _share(tensor, 1, rank, size)
    fused = _fused_parts(proj, config, tensor)
    if fused is not None:
        return torch.cat(_fused_shares(proj, tensor.split(fused), config, rank, size))
    return tensor


def lora_shard(module: str, a: torch.Tensor, b: torch.Tensor, config: ModelConfig, rank: int, size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s part of a LoRA adapter's A [r, in] and B [out, r] on projection `module` of the whole model
    `config`: B's share of the rows of a projection split by rows, A's share of the columns of one split by
    columns (its delta then summed across the ranks with the projection's), as the base weights are split."""
    proj = module.split(".")[-1]
    if proj in ("k_proj", "v_proj") and kv_replication_refusal(config) is None:
        return a, _kv_share(b, _layer_kv_heads(config, module), rank, size)
    if proj in ROW_SPLIT or (proj == "qkv_proj" and config.architecture in HEADS_FUSED_QKV):
        return a, _share(b, 0, rank, size)
    if proj in COLUMN_SPLIT:
        return _share(a, 1, rank, size), b
    fused = _fused_parts(proj, config, b)
    if fused is not None:
        return a, torch.cat(_fused_shares(proj, b.split(fused), config, rank, size))
    return a, b


def _fused_shares(proj: str, parts: tuple[torch.Tensor, ...], config: ModelConfig, rank: int, size: int
                  ) -> list[torch.Tensor]:
    """Rank `rank`'s rows of each part of a fused projection (`_fused_parts`'): its share of each, of fused q/k/v's k
    and v its KV heads'."""
    if proj == "qkv_proj" and kv_replication_refusal(config) is None:
        q, k, v = parts
        return [_share(q, 0, rank, size), *(_kv_share(x, config.num_kv_heads, rank, size) for x in (k, v))]
    return [_share(part, 0, rank, size) for part in parts]


def _layer_kv_heads(config: ModelConfig, name: str) -> int:
    """The KV heads of the layer whose tensor (or LoRA module) `name` is (`...layers.N...`)."""
    if config.gemma4 is None:
        return config.num_kv_heads
    names = name.split(".")
    return config.gemma4.heads(int(names[names.index("layers") + 1])).num_kv_heads


def _kv_share(tensor: torch.Tensor, heads: int, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s rows of a k or v projection (or its bias) of `heads` heads: `kv_heads_share`'s heads."""
    first, count = kv_heads_share(heads, rank, size)
    rows = tensor.shape[0] // heads
    return tensor.narrow(0, first * rows, count * rows)


def _fused_expert_width(config: ModelConfig) -> int | None:
    """The width of each expert of a model whose fused experts are not stored as gpt-oss's ([E, in, out])."""
    if config.gemma4 is not None:
        return config.gemma4.experts and config.gemma4.experts.width
    return config.moe.moe_intermediate_size if config.moe.fused_experts else None


def _expert_width_dim(name: str, tensor: torch.Tensor, width: int) -> int:
    """The dimension of fused experts' tensor `name` that is `width` long (past the experts' own)."""
    dims = [dim for dim in range(1, tensor.dim()) if tensor.shape[dim] == width]
    if len(dims) != 1:
        raise ValueError(f"tensor {name!r} of shape {tuple(tensor.shape)}: no one dimension is the experts' width "
                         f"({width}) to split")
    return dims[0]


def _fused_parts(proj: str, config: ModelConfig, tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The rows of each projection fused in `tensor`, projection `proj`'s (Phi-3's q/k/v; gate/up, a dense MLP's or
    shared experts' of their own width), each split on its own."""
    if proj == "gate_up_proj":
        return tensor.shape[0] // 2, tensor.shape[0] // 2
    return (config.q_size, config.kv_size, config.kv_size) if proj == "qkv_proj" else None


def _share(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    share = tensor.shape[dim] // size
    return tensor.narrow(dim, rank * share, share)


def checkpoint_shards(tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, rank: int, size: int
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        yield name, checkpoint_shard(name, tensor, config, rank, size)


class RankGroup:
    """The ranks of one model on this host: `all_reduce` sums a tensor across them, through shared memory
    (engine/shared_memory_sum.py) where it fits and the CPU allows, else gloo's over TCP. `check_peers`
    raises when a rank the sums wait for is gone."""

    def __init__(self, rank: int, size: int, store_port: int, store: dist.TCPStore | None = None,
                 check_peers: Callable[[], None] = lambda: None) -> None:
        self.rank, self.size = rank, size
        # Rank 0 made the store (`listening_store`); the others reach it by its port.
        self._store = store or dist.TCPStore("127.0.0.1", store_port, size, False, timeout=REDUCE_TIMEOUT)
        self._shared_sum = None
        if shared_memory_sum.is_supported():
            if rank == 0:
                path = os.path.join(SHARED_DIR, f"baton-rank-sums-{os.getpid()}-{uuid.uuid4().hex[:12]}")
                self._store.set(SUMS_FILE_KEY, path)
            path = self._store.get(SUMS_FILE_KEY).decode()
            self._shared_sum = shared_memory_sum.SharedMemorySum(path, rank, size, check_peers)
        try:
            self._group = dist.ProcessGroupGloo(self._store, rank, size, REDUCE_TIMEOUT)
        finally:
            # Every rank has joined (or it failed): each has mapped the sums' file, whose name is not needed.
            if self._shared_sum is not None and rank == 0:
                os.unlink(path)

    def close(self) -> None:
        """Lets go of gloo's group now: left to the interpreter's teardown, its threads can abort the process."""
        self._group = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed across the ranks, in place."""
        if self._shared_sum is not None and self._shared_sum.fits(tensor) and tensor.is_contiguous():
            return self._shared_sum(tensor)
        self._group.allreduce([tensor]).wait()
        return tensor


def listening_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous, on a free port of this host, for `size` ranks."""
    return dist.TCPStore("127.0.0.1", 0, size, True, timeout=REDUCE_TIMEOUT, wait_for_workers=False)
