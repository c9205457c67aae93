"""Qwen4-Exp's text model (Qwen4ExpForCausalLM), read from its config.json: Qwen3.5's hybrid of Gated DeltaNet
and gated attention layers, all of them MoE (engine/linear_attention_config.py, engine/moe_config.py), and what
sets it apart (engine/models/qwen4_exp.py):

- Hyper-connections: the residual is `hc_count` streams of the hidden size. Before each attention and MoE block a
  learnt mix of the normed streams makes the block's input; its output is added into each stream by a weight of
  the token's own. A last mix of the streams makes the final hidden state (no final norm).
- Block-indexed attention (transformers' QSA indexer): each full-attention layer's query attends to the tokens of
  the `indexer_budget / indexer_compress_ratio` blocks of `indexer_compress_ratio` tokens its indexer scores best
  among the complete blocks before it, and to the tokens after the last complete block. A block's key is the mean
  of its tokens' indexer keys (one head), normed and turned by RoPE at the block's first position; its score is
  the sum over the indexer's query heads of their ReLU'd dot products with it. The indexer's key of each token is
  kept in the layer's pages as one more KV head (ModelConfig.page_kv_heads), so it is cached and handed over with
  the rest.
- Per-layer n-gram embeddings (PLE, `ple_layer_ids`): not served yet, refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.linear_attention_config import FULL, LINEAR

QWEN4_EXP = "Qwen4ExpForCausalLM"
INDEXED = "indexed_attention"  # transformers' name of a full-attention layer with its indexer


@dataclass(frozen=True)
class BlockIndexer:
    num_heads: int  # its query heads; its key has one
    head_dim: int
    budget: int  # the most tokens chosen from complete blocks
    block_size: int  # tokens a block (indexer_compress_ratio)

    @property
    def num_chosen_blocks(self) -> int:
        return self.budget // self.block_size


@dataclass(frozen=True)
class Qwen4ExpLayout:
    num_streams: int  # hc_count
    mixer_rank: int  # hc_lowrank: of the learnt mix's low-rank projection
    indexer: BlockIndexer


def qwen4_exp_layer_types(cfg: dict) -> list[str]:
    """Its layers as Qwen3.5's kinds: transformers' defaults (every fourth layer attends, through its indexer), and
    its checkpoints' `full_attention` read as the indexed attention transformers makes of it."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = int(cfg.get("full_attention_interval", 4))
        return [LINEAR if (i + 1) % interval else FULL for i in range(int(cfg["num_hidden_layers"]))]
    return [FULL if kind in (INDEXED, FULL) else kind for kind in kinds]


def qwen4_exp_output_gate(cfg: dict) -> str:
    """What gates its Gated DeltaNet layers' normed output: output_gate_type, else hidden_act (SiLU or a sigmoid)."""
    gate = cfg.get("output_gate_type") or cfg.get("hidden_act") or "silu"
    if gate not in ("silu", "sigmoid"):
        raise ValueError(f"Qwen4-Exp's output gate is SiLU or a sigmoid, got {gate!r}")
    return gate


def read_qwen4_exp(cfg: dict, head_dim: int, rotary_dim: int) -> Qwen4ExpLayout:
    """ValueError for what transformers refuses of it, and for what Baton does not serve of it yet. `head_dim`,
    `rotary_dim`: its attention heads' width and the part of it RoPE turns."""
    if cfg.get("ple_layer_ids"):
        raise ValueError("Qwen4-Exp's per-layer n-gram embeddings (ple_layer_ids) are not supported yet")
    fields = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    missing = [name for name in fields if cfg.get(name) is None]
    if missing:
        raise ValueError(f"Qwen4-Exp's attention layers need their indexer's settings: {', '.join(missing)} missing")
    heads, key_heads, index_dim, budget, block = (int(cfg[name]) for name in fields)
    if min(heads, index_dim, budget, block) <= 0:
        raise ValueError("Qwen4-Exp's indexer settings must be positive")
    if key_heads != 1:
        raise ValueError(f"Qwen4-Exp's indexer has one key head (indexer_kv_heads 1), got {key_heads}")
    if budget % block:
        raise ValueError(f"indexer_budget {budget} must be a multiple of indexer_compress_ratio {block}")
    if rotary_dim > index_dim:
        raise ValueError(f"RoPE turns {rotary_dim} dimensions of a head, more than the indexer's head "
                         f"(indexer_head_dim {index_dim})")
    if index_dim > head_dim:  # its key is kept in the pages as one more KV head
        raise ValueError(f"indexer_head_dim {index_dim} wider than an attention head ({head_dim}) is not supported")
    streams = int(cfg.get("hc_count", 4))
    if streams < 2:
        raise ValueError(f"Qwen4-Exp's hyper-connections need at least two streams (hc_count), got {streams}")
    return Qwen4ExpLayout(num_streams=streams, mixer_rank=int(cfg.get("hc_lowrank", 320)),
                          indexer=BlockIndexer(heads, index_dim, budget, block))
