"""Gemma 3n's text decoder (Gemma3nForCausalLM; engine/gemma3n_config.py) over paged KV: Gemma 4's attention, KV
sharing and per-layer embeddings (engine/models/gemma4.py), with AltUp streams for a residual.

The embedding is widened into `streams` streams (the others projections of it, rescaled to its RMS). Before a layer,
each stream is predicted as itself plus a mix of all of them, by coefficients the active stream routes (its norm
through a projection, tanh); the layer computes on the active prediction: attention and a low-rank LAuReL residual
beside it (their sum over sqrt(2)), then the MLP (its gate sparsified where the layer says). Each stream is then
corrected by the change the layer made to the active one, weighed by coefficients the result routes; the active
corrected stream, gated by the layer's per-layer embedding, is added to every other stream. At the end the streams,
projected back and rescaled to the active one's RMS, are averaged and normed.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.gemma4 import NORMS, Gemma4Attention, Gemma4ForCausalLM
from engine.models.llama_layers import ACTIVATIONS, MLP, KVCache, RankSum
from engine.models.parameters import empty_param
from engine.prompt_embeds import GivenEmbeddings
from kernels.registry import Kernels

# A layer's AltUp and LAuReL tensors (under `altup.` and `laurel.`), by their attributes.
ALTUP = {"altup.correct_output_scale": "correct_output_scale", "altup.correction_coefs.weight": "correction_coefs",
         "altup.prediction_coefs.weight": "prediction_coefs", "altup.modality_router.weight": "modality_router",
         "altup.router_norm.weight": "router_norm", "laurel.linear_left.weight": "laurel_left",
         "laurel.linear_right.weight": "laurel_right", "laurel.post_laurel_norm.weight": "post_laurel_norm"}


class SparseGateMLP(MLP):
    """Gemma 3n's MLP: where `sparsity` > 0, the gate keeps only what lies above its mean plus its deviation times
    the standard normal's `sparsity` quantile (shifted down by that cutoff, the rest zeros). Split across ranks, each
    holding a share of the gate's width, the mean and the deviation are the whole gate's: its sums across the ranks."""

    num_ranks = 1

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sparsity: float) -> None:
        super().__init__(config, kernels, dtype)
        self.std_multiplier = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(sparsity)).item() \
            if sparsity > 0 else None

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.std_multiplier is not None:
            gate = F.relu(gate - self._cutoff(gate))
        return self.activation(gate) * up

    def _cutoff(self, gate: torch.Tensor) -> torch.Tensor:
        if self.rank_sum is None:
            return gate.mean(dim=-1, keepdim=True) + gate.std(dim=-1, keepdim=True, unbiased=False) * \
                self.std_multiplier
        width = gate.shape[-1] * self.num_ranks
        mean = self.rank_sum(gate.sum(dim=-1, keepdim=True)) / width
        deviation = (self.rank_sum((gate - mean).pow(2).sum(dim=-1, keepdim=True)) / width).sqrt()
        return mean + deviation * self.std_multiplier


class Gemma3nDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, layer: int,
                 sliding_window: int | None) -> None:
        super().__init__()
        layout, altup = config.gemma4, config.altup
        self.eps, self.rms_norm, self.linear = config.rms_norm_eps, kernels.rms_norm, kernels.linear
        self.altup, hidden = altup, config.hidden_size
        for name in NORMS.values():
            setattr(self, name, empty_param(hidden, dtype=dtype))
        self.attn = Gemma4Attention(config, kernels, dtype, layout.heads(layer), sliding_window,
                                    layout.computes_kv(layer), layout.kv_places[layer][1])
        self.mlp = SparseGateMLP(dataclasses.replace(config, intermediate_size=altup.widths[layer]), kernels, dtype,
                                 altup.sparsity[layer])
        streams = altup.streams
        self.correct_output_scale = empty_param(hidden, dtype=dtype)
        self.correction_coefs = empty_param(streams, streams, dtype=dtype)
        self.prediction_coefs = empty_param(streams * streams, streams, dtype=dtype)
        self.modality_router = empty_param(streams, hidden, dtype=dtype)
        self.router_norm = empty_param(hidden, dtype=dtype)
        self.laurel_left = empty_param(altup.laurel_rank, hidden, dtype=dtype)
        self.laurel_right = empty_param(hidden, altup.laurel_rank, dtype=dtype)
        self.post_laurel_norm = empty_param(hidden, dtype=dtype)
        self.per_layer_gate = empty_param(layout.per_layer_width, hidden, dtype=dtype)
        self.per_layer_projection = empty_param(hidden, layout.per_layer_width, dtype=dtype)
        self.activation = ACTIVATIONS[config.hidden_act]
        self.moe = None  # (Gemma 4's experts: none)

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        """The coefficients' router: [T, H] → [T, streams]."""
        routed = self.linear(self.rms_norm(x, self.router_norm, self.eps) * x.shape[-1] ** -1.0, self.modality_router)
        return torch.tanh(routed.float()).type_as(x)

    def forward(self, streams: torch.Tensor, per_layer: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        norm, eps, n, active = self.rms_norm, self.eps, self.altup.streams, self.altup.active
        num_tokens = streams.shape[1]
        coefs = self.linear(self._modalities(streams[active]), self.prediction_coefs).view(num_tokens, n, n)
        predictions = torch.matmul(streams.permute(1, 2, 0), coefs.transpose(1, 2)).permute(2, 0, 1) + streams
        predicted = predictions[active]
        normed = norm(predicted, self.input_norm, eps)
        laurel = normed + norm(self.linear(self.linear(normed, self.laurel_left), self.laurel_right),
                               self.post_laurel_norm, eps)
        attended = norm(self.attn(normed, cos, sin, kv_cache, meta), self.post_attention_norm, eps)
        h = (predicted + attended + laurel) / math.sqrt(2)
        h = h + norm(self.mlp(norm(h, self.pre_feedforward_norm, eps)), self.post_feedforward_norm, eps)
        weights = self.linear(self._modalities(h), self.correction_coefs) + 1.0  # [T, streams]
        corrected = (h - predicted)[None] * weights.t()[..., None] + predictions
        first = corrected[active]
        if self.altup.scales_correction:
            first = (first * self.correct_output_scale).type_as(h)
        gated = self.activation(self.linear(first, self.per_layer_gate)) * per_layer
        added = norm(self.linear(gated, self.per_layer_projection), self.post_per_layer_norm, eps)
        corrected[1:] += added  # (every stream but the first, whichever is active, as transformers adds it)
        return corrected


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        others = config.altup.streams - 1
        self.altup_projections = nn.Parameter(torch.empty(others, config.hidden_size, config.hidden_size,
                                                          dtype=dtype), requires_grad=False)
        self.altup_unembed_projections = nn.Parameter(torch.empty(others, config.hidden_size, config.hidden_size,
                                                                  dtype=dtype), requires_grad=False)

    def sum_across_ranks(self, rank_sum: RankSum, num_ranks: int, rank: int, vocab_size: int | None) -> None:
        """Also its MLPs' gates' statistics (each rank holding a share of their widths)."""
        super().sum_across_ranks(rank_sum, num_ranks, rank, vocab_size)
        for layer in self.layers:
            layer.mlp.num_ranks = num_ranks

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return Gemma3nDecoderLayer(self.config, self.kernels, dtype, layer, self._window(layer))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        h = self._embed(input_ids)
        if given is not None:
            h = given.placed(h)
        # (tokens past the per-layer table, Gemma 3n's audio and image ones, take its first row)
        ids = input_ids.masked_fill(input_ids >= self.layout.per_layer_vocab_size, 0)
        per_layer = self._per_layer_inputs(ids, h)
        streams = torch.stack([h, *(self._rescaled(self.kernels.linear(h, w), h) for w in self.altup_projections)])
        ropes = self._kinds_ropes(positions)
        for i, layer in enumerate(self.layers):
            cos, sin = ropes[self.layout.layer_types[i]]
            streams = layer(streams, per_layer[:, i], cos, sin, kv_caches[self.layout.kv_places[i][0]], meta)
        first = streams[0]
        unembedded = [self._rescaled(self.kernels.linear(s, w), first)
                      for s, w in zip(streams[1:], self.altup_unembed_projections)]
        return self._final_norm(torch.stack([first, *unembedded]).mean(dim=0))

    @staticmethod
    def _rescaled(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`x` scaled to `like`'s RMS a token (its own RMS floored at sqrt(1e-5))."""
        target = torch.mean(like**2, dim=-1, keepdim=True) ** 0.5
        return x * target / torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))

    def checkpoint_names(self) -> list[str]:
        names = [name for name in super().checkpoint_names() if not name.endswith(".layer_scalar")]
        names += [f"model.layers.{i}.{x}" for i in range(self.config.num_layers) for x in ALTUP]
        return names + [f"model.{kind}.{i}.weight" for kind in ("altup_projections", "altup_unembed_projections")
                        for i in range(self.config.altup.streams - 1)]

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if parts[1] in ("altup_projections", "altup_unembed_projections"):
            return getattr(self, parts[1]).data[int(parts[2])]
        if parts[1] == "layers" and ".".join(parts[3:]) in ALTUP:
            return getattr(self.layers[int(parts[2])], ALTUP[".".join(parts[3:])]).data
        return super()._target(name)
