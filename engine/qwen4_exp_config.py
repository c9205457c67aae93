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
- Per-layer n-gram embeddings (PLE, `ple_layer_ids`, some of its linear-attention layers): before such a layer,
  each token's n-grams (it and up to `ngram_size - 1` tokens before it, none across an EOS token) are hashed into
  tables of a prime size each, `heads_per_ngram` a length; their rows, side by side, make a value and a key a
  stream, and each stream gets the value by a gate of its key against the stream, then a dilated causal convolution
  of what the streams got (engine/models/ngram_embedding.py). The convolution's last inputs and the last tokens are
  a sequence's state, beside its Gated DeltaNet layers' (StateShape's side layers).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from engine.linear_attention_config import FULL, LINEAR
from engine.state_shape import StateShape

# transformers' constants for the n-gram hashes' multipliers (SplitMix64) and each PLE layer's seed.
MASK64 = (1 << 64) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
LAYER_SEED_STEP = 10007

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
class NGramEmbeddings:
    layers: tuple[int, ...]  # the layers with them (0-based), in order
    embed_dim: int  # ple_embed_dim: every head's rows side by side
    ngram_size: int  # the longest n-gram; also the convolution's dilation
    heads_per_ngram: int
    conv_kernel: int
    vocab_base: int  # ngram_vocab_size_base: each head's table a prime above it, the next head's the next prime
    vocab_divisor: int  # the tables' rows together padded to a multiple of it
    seed: int
    num_shards: int  # split_ngram_parts: checkpoint tensors a layer's tables are stored in, split by rows
    eos_token_id: int  # no n-gram spans it; a sequence's start reads as it
    vocab_size: int  # the model's

    @property
    def num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def context(self) -> int:
        """The tokens before a token its n-grams read."""
        return self.ngram_size - 1

    @property
    def conv_width(self) -> int:
        return (self.conv_kernel - 1) * self.ngram_size

    def head_sizes(self, index: int) -> list[int]:
        """The `index`-th layer's (among `layers`) tables' sizes, a head each: the primes above vocab_base - 1, the
        layers' heads in turn taking them one after the other."""
        primes = _primes_after(self.vocab_base - 1, len(self.layers) * self.num_heads)
        return list(primes[index * self.num_heads:(index + 1) * self.num_heads])

    def num_rows(self, index: int) -> int:
        """Rows of the `index`-th layer's tables together, padded."""
        return math.ceil(sum(self.head_sizes(index)) / self.vocab_divisor) * self.vocab_divisor

    def multipliers(self, index: int) -> list[int]:
        """What the `index`-th layer multiplies a token by at each place of an n-gram before the places are XORed:
        odd, and small enough that no token's product passes 2 ** 63."""
        half_bound = max(1, ((1 << 63) - 1) // max(self.vocab_size, 1) // 2)
        seed = self.seed + LAYER_SEED_STEP * index
        return [2 * (_splitmix64((seed + SPLITMIX_GAMMA * (place + 1)) & MASK64) % half_bound) + 1
                for place in range(self.ngram_size)]

    def with_states(self, shape: StateShape, hidden_size: int, num_streams: int) -> StateShape:
        return dataclasses.replace(shape, side_layers=len(self.layers), side_conv_dim=num_streams * hidden_size,
                                   side_conv_width=self.conv_width, side_tokens=self.context)


@dataclass(frozen=True)
class Qwen4ExpLayout:
    num_streams: int  # hc_count
    mixer_rank: int  # hc_lowrank: of the learnt mix's low-rank projection
    indexer: BlockIndexer
    ngrams: NGramEmbeddings | None = None  # None: no per-layer n-gram embeddings


def _splitmix64(value: int) -> int:
    value = (value + SPLITMIX_GAMMA) & MASK64
    value = ((value ^ (value >> 30)) * SPLITMIX_MULTIPLIERS[0]) & MASK64
    value = ((value ^ (value >> 27)) * SPLITMIX_MULTIPLIERS[1]) & MASK64
    return (value ^ (value >> 31)) & MASK64


@functools.cache
def _primes_after(start: int, count: int) -> tuple[int, ...]:
    primes, candidate = [], start
    while len(primes) < count:
        candidate += 1
        if _is_prime(candidate):
            primes.append(candidate)
    return tuple(primes)


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % divisor for divisor in range(3, math.isqrt(value) + 1, 2))


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


def read_ngram_embeddings(cfg: dict, layer_types: tuple[str, ...]) -> NGramEmbeddings | None:
    """Its per-layer n-gram embeddings' settings, transformers' defaults where config.json leaves them out; None
    without them. ValueError for what transformers refuses."""
    layer_ids = sorted({int(layer) for layer in cfg.get("ple_layer_ids") or ()})
    if not layer_ids:
        return None
    if layer_ids[0] < 1 or layer_ids[-1] > len(layer_types):
        raise ValueError(f"ple_layer_ids count layers from 1 to {len(layer_types)}, got {layer_ids}")
    not_linear = [layer for layer in layer_ids if layer_types[layer - 1] != LINEAR]
    if not_linear:
        raise ValueError(f"Qwen4-Exp's per-layer n-gram embeddings are on linear-attention layers only, got layers "
                         f"{not_linear}")
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is None or eos == []:
        raise ValueError("Qwen4-Exp's per-layer n-gram embeddings need eos_token_id")
    ngrams = NGramEmbeddings(
        layers=tuple(layer - 1 for layer in layer_ids),
        embed_dim=int(cfg.get("ple_embed_dim") or cfg["hidden_size"]), ngram_size=int(cfg.get("ngram_size", 3)),
        heads_per_ngram=int(cfg.get("heads_per_ngram", 8)), conv_kernel=int(cfg.get("ple_conv_kernel_size", 4)),
        vocab_base=int(cfg.get("ngram_vocab_size_base", 20_000_000)),
        vocab_divisor=int(cfg.get("make_ngram_vocab_size_divisible_by", 128)), seed=int(cfg.get("seed", 1234)),
        num_shards=int(cfg.get("split_ngram_parts", 512)), eos_token_id=int(eos), vocab_size=int(cfg["vocab_size"]))
    if ngrams.num_heads <= 0 or ngrams.embed_dim % ngrams.num_heads:
        raise ValueError(f"ple_embed_dim {ngrams.embed_dim} must be a positive multiple of the n-gram heads "
                         f"({ngrams.num_heads}: heads_per_ngram for each n-gram length from 2 to ngram_size)")
    if ngrams.conv_kernel < 1 or ngrams.num_shards < 1:
        raise ValueError("ple_conv_kernel_size and split_ngram_parts must be positive")
    return ngrams


def read_qwen4_exp(cfg: dict, head_dim: int, rotary_dim: int, layer_types: tuple[str, ...]) -> Qwen4ExpLayout:
    """ValueError for what transformers refuses of it. `head_dim`, `rotary_dim`: its attention heads' width and the
    part of it RoPE turns; `layer_types`: its layers' kinds (engine/linear_attention_config.py)."""
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
                          indexer=BlockIndexer(heads, index_dim, budget, block),
                          ngrams=read_ngram_embeddings(cfg, layer_types))
