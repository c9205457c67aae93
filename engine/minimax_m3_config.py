"""MiniMax-M3's text model (MiniMaxM3VLForCausalLM, as transformers holds it), read from its config.json: MiniMax-M2's
routing with shared experts and clamped GLUs (gpt-oss's, gate and up not interleaved), dense MLPs in the layers
`mlp_layer_types` calls dense, Gemma's norms (scaled by 1 + weight) and per-head q/k norms, and block-sparse attention
in the layers `layer_types` calls `minimax_m3_sparse` (engine/models/minimax_m3.py):

- its indexer (`index_n_heads` heads, one a KV head, and one key a token, `index_head_dim` wide, normed and turned by
  RoPE) scores each earlier key for each query; a block of `index_block_size` keys scores its best key's score. Each
  query attends, in each KV head's group, to the keys of the `index_topk_blocks` blocks that head scores best, the
  `index_local_blocks` blocks ending at its own always among them. The indexer's key of each token is kept in the
  pages as one more KV head (ModelConfig.page_kv_heads).
"""
from __future__ import annotations

from dataclasses import dataclass

MINIMAX_M3 = "MiniMaxM3VLForCausalLM"
SPARSE = "minimax_m3_sparse"
# Its checkpoint's older names of the indexer's settings, under sparse_attention_config (transformers reads them so).
LEGACY_INDEX_KEYS = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                     "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
                     "index_local_blocks": "sparse_local_block"}
INDEX_DEFAULTS = {"index_n_heads": 4, "index_head_dim": 128, "index_block_size": 128, "index_topk_blocks": 16,
                  "index_local_blocks": 1}


@dataclass(frozen=True)
class BlockSparseIndexer:
    num_heads: int  # one a KV head: each chooses its group's blocks
    head_dim: int
    block_size: int
    num_chosen_blocks: int
    num_local_blocks: int  # those ending at the query's own, always chosen
    sparse_layers: frozenset[int]


def minimax_m3_keys(cfg: dict) -> dict:
    """`cfg` with its layers' kinds and the indexer's settings as transformers reads them (older names, defaults),
    its dense MLPs' width as intermediate_size and its experts' as moe_intermediate_size. ValueError for a layout
    transformers would refuse or compute otherwise."""
    num_layers = int(cfg["num_hidden_layers"])
    legacy = cfg.get("sparse_attention_config") or {}
    given = {key: legacy.get(old, cfg.get(key, INDEX_DEFAULTS[key])) for key, old in LEGACY_INDEX_KEYS.items()}
    layer_types = cfg.get("layer_types")
    if layer_types is None and "sparse_attention_freq" in legacy:
        layer_types = [SPARSE if f else "full_attention" for f in legacy["sparse_attention_freq"]]
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None and cfg.get("moe_layer_freq") is not None:
        mlp_types = ["sparse" if f else "dense" for f in cfg["moe_layer_freq"]]
    layer_types = layer_types or ["full_attention"] * num_layers
    mlp_types = mlp_types or ["sparse"] * num_layers
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", SPARSE}:
        raise ValueError(f"layer_types must name 'full_attention' or {SPARSE!r} for each of {num_layers} layers")
    if len(mlp_types) != num_layers or not set(mlp_types) <= {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of {num_layers} layers")
    return {**cfg, **given, "layer_types": layer_types, "mlp_layer_types": mlp_types,
            "moe_intermediate_size": cfg.get("intermediate_size", 3072),
            "intermediate_size": cfg.get("dense_intermediate_size", 12288), "hidden_act": "silu"}


def read_block_sparse_indexer(cfg: dict, num_kv_heads: int, head_dim: int, rotary_dim: int) -> BlockSparseIndexer:
    """`cfg` as minimax_m3_keys gives it. ValueError for settings Baton does not serve."""
    indexer = BlockSparseIndexer(
        num_heads=int(cfg["index_n_heads"]), head_dim=int(cfg["index_head_dim"]),
        block_size=int(cfg["index_block_size"]), num_chosen_blocks=int(cfg["index_topk_blocks"]),
        num_local_blocks=int(cfg["index_local_blocks"]),
        sparse_layers=frozenset(i for i, kind in enumerate(cfg["layer_types"]) if kind == SPARSE))
    if indexer.num_heads != num_kv_heads:
        raise ValueError(f"MiniMax-M3's indexer has a head a KV head: index_n_heads {indexer.num_heads}, "
                         f"num_key_value_heads {num_kv_heads}")
    if min(indexer.head_dim, indexer.block_size, indexer.num_chosen_blocks) < 1 or indexer.num_local_blocks < 0:
        raise ValueError("MiniMax-M3's indexer settings must be positive")
    if indexer.num_local_blocks > indexer.num_chosen_blocks:
        raise ValueError(f"index_local_blocks {indexer.num_local_blocks} more than index_topk_blocks "
                         f"{indexer.num_chosen_blocks} is not supported")
    if not rotary_dim <= indexer.head_dim <= head_dim:  # its key is kept in the pages as one more KV head
        raise ValueError(f"index_head_dim {indexer.head_dim} must hold RoPE's {rotary_dim} dimensions and fit an "
                         f"attention head ({head_dim})")
    return indexer
