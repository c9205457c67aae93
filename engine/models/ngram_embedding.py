"""Qwen4-Exp's per-layer n-gram embeddings (engine/qwen4_exp_config.py's NGramEmbeddings): before some of its
linear-attention layers, what each token's n-grams look up is added to the residual's streams.

A token's n-grams are read from its sequence's last `ngram_size - 1` tokens before it, which its states keep (as
token id + 1: 0, nothing yet, reads as EOS, as transformers starts a sequence), so a step, a cached prefix, a
handoff and drafts carry them as they carry its Gated DeltaNet states. So are its convolution's last inputs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.parameters import empty_param
from kernels.causal_conv import conv_run, conv_step
from kernels.registry import Kernels
from kernels.rms_norm import rms_norm_scaled_in_float32 as normed

# Its tensors, by their names under the layer's `ple.` (the tables' shards apart).
WEIGHTS = {"key_proj": "key_weight", "value_proj": "value_weight", "norm_key": "key_norm", "norm_query": "query_norm",
           "norm_conv": "conv_norm", "conv1d": "conv_weight"}
TABLES = "ple_embedding.ngram_embedding.shard_"
# What transformers' module keeps beside its tables, made here from the config.
BUFFERS = ("ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_vocab_sizes",
           "ple_embedding.ngram_heads_offsets")


def shifted_tokens(history: torch.Tensor, num_new: int, ngram_size: int, eos: int) -> torch.Tensor:
    """Each of the last `num_new` tokens of `history` [..., L] (token id + 1, 0 for none) and the tokens before it:
    [..., num_new, ngram_size], the first column the token, then the one before it and so on, EOS in place of a
    token at or before an EOS (an n-gram does not span one) or before the sequence."""
    tokens = history.long() - 1
    tokens = tokens.masked_fill(tokens < 0, eos)
    back = tokens[..., -(num_new + ngram_size - 1):].unfold(-1, ngram_size, 1).flip(-1)  # [..., n, N]
    blocked = torch.cumsum((back[..., 1:] == eos).long(), dim=-1) > 0
    return torch.cat((back[..., :1], back[..., 1:].masked_fill(blocked, eos)), dim=-1)


class PerLayerNGrams(nn.Module):
    """The `index`-th of the model's layers with n-gram embeddings (among NGramEmbeddings.layers)."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.ngrams = ngrams = config.qwen4_exp.ngrams
        self.linear, self.index, self.eps = kernels.linear, index, config.rms_norm_eps
        self.num_streams, self.hidden_size = config.qwen4_exp.num_streams, config.hidden_size
        width = self.num_streams * self.hidden_size
        sizes = ngrams.head_sizes(index)
        self.register_buffer("head_sizes", torch.tensor(sizes), persistent=False)
        self.register_buffer("head_offsets", torch.tensor([sum(sizes[:i]) for i in range(len(sizes))]),
                             persistent=False)
        self.register_buffer("multipliers", torch.tensor(ngrams.multipliers(index)), persistent=False)
        # In host memory whatever the model's device (transformers keeps them off the device too: the released
        # model's are about 90 GiB), neither a parameter nor a buffer, so that nothing moves them there; a step looks
        # its tokens' rows up here and takes those alone to the device.
        self.tables = torch.empty(ngrams.num_rows(index), ngrams.head_dim, dtype=dtype, device="cpu")
        self.key_weight = empty_param(width, ngrams.embed_dim, dtype=dtype)
        self.value_weight = empty_param(config.hidden_size, ngrams.embed_dim, dtype=dtype)
        self.key_norm = empty_param(width, dtype=torch.float32)  # 1 + the checkpoint's, as the model's other norms
        self.query_norm = empty_param(width, dtype=torch.float32)
        self.conv_norm = empty_param(width, dtype=torch.float32)
        self.conv_weight = empty_param(width, ngrams.conv_kernel, dtype=dtype)

    @property
    def rows_a_shard(self) -> int:
        return math.ceil(self.tables.shape[0] / self.ngrams.num_shards)

    @property
    def num_table_shards(self) -> int:
        """The checkpoint tensors its tables are stored in: split_ngram_parts, or fewer where each would be short of
        rows (transformers splits them by torch.chunk)."""
        return math.ceil(self.tables.shape[0] / self.rows_a_shard)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """What it adds to the streams [T, n * H] before its layer."""
        rows = self._table_rows(input_ids, meta).cpu()
        embeddings = F.embedding(rows, self.tables).flatten(-2).to(streams.device)  # [T, E]
        n, width = self.num_streams, self.hidden_size
        keys = normed(self.linear(embeddings, self.key_weight).unflatten(-1, (n, width)), self.key_norm.view(n, -1),
                      self.eps)
        queries = normed(streams.unflatten(-1, (n, width)), self.query_norm.view(n, -1), self.eps)
        value = self.linear(embeddings, self.value_weight)
        gate = (keys * queries).sum(dim=-1, keepdim=True) / math.sqrt(width)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = torch.sigmoid(gate) * value.unsqueeze(-2)  # [T, n, H]
        convolved = self._convolved(normed(gated, self.conv_norm.view(n, -1), self.eps).flatten(-2), meta)
        return gated.flatten(-2) + convolved

    def _table_rows(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Each token's rows of the tables, a head each [T, heads]: its n-grams hashed, each length's into
        heads_per_ngram tables."""
        ngrams, states = self.ngrams, meta.recurrent
        _, last_tokens = states.side(self.index)
        shifted = torch.empty(input_ids.shape[0], ngrams.ngram_size, dtype=torch.int64, device=input_ids.device)
        given = (input_ids + 1).to(last_tokens.dtype)

        def step(tokens, before):
            history = torch.cat((before, given[tokens].unsqueeze(-1)), dim=-1)
            return shifted_tokens(history, 1, ngrams.ngram_size, ngrams.eos_token_id)[:, 0], history[:, 1:]

        def run(start, end, state):
            history = torch.cat((state, given[start:end]))
            state.copy_(history[history.shape[0] - state.shape[0]:])
            return shifted_tokens(history, end - start, ngrams.ngram_size, ngrams.eos_token_id)

        states.advance(shifted, last_tokens, lambda row: states.kept_side(row, self.index)[1], step, run)
        places = shifted * self.multipliers
        rows = []
        for length in range(2, ngrams.ngram_size + 1):
            mixed = places[:, 0]
            for place in range(1, length):
                mixed = torch.bitwise_xor(mixed, places[:, place])
            heads = slice((length - 2) * ngrams.heads_per_ngram, (length - 1) * ngrams.heads_per_ngram)
            rows.append(torch.remainder(mixed.unsqueeze(-1), self.head_sizes[heads]) + self.head_offsets[heads])
        return torch.cat(rows, dim=-1)

    def _convolved(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, n * H] through the dilated causal convolution, each sequence going on from its window, and SiLU."""
        states, dilation = meta.recurrent, self.ngrams.ngram_size
        windows, _ = states.side(self.index)
        out = torch.empty_like(x)
        states.advance(out, windows, lambda row: states.kept_side(row, self.index)[0],
                       lambda tokens, before: conv_step(x[tokens], before, self.conv_weight, dilation=dilation),
                       lambda start, end, window: conv_run(x[start:end], window, self.conv_weight,
                                                           dilation=dilation))
        return F.silu(out)

    def target(self, name: str) -> torch.Tensor:
        """Where its checkpoint tensor `name` (after `ple.`) goes."""
        if name.startswith(TABLES):
            shard = int(name.removeprefix(TABLES).split(".")[0])
            return self.tables[shard * self.rows_a_shard:(shard + 1) * self.rows_a_shard]
        return getattr(self, WEIGHTS[name.split(".")[0]]).data

    def checkpoint_names(self, prefix: str) -> list[str]:
        return [prefix + TABLES + f"{shard}.weight" for shard in range(self.num_table_shards)] + \
            [prefix + f"{name}.weight" for name in WEIGHTS]
