"""Tencent's Hy4 (HYV4ForCausalLM): DeepSeek-V3.2's sparse latent attention with each head's output gated and a sink
logit a head (engine/models/mla.py), GLM-4.5's routing with the routed experts' GLUs clamped, and hyper-connections for
a residual (engine/hy_v4_config.py).

The residual is `streams` copies of the hidden state, [T, n, H]. Before each sublayer a hyper-connection weighs the
streams by weights of each token's own (a projection of all of them, scaled by their RMS, through a sigmoid) and sums
them into the sublayer's input; the sublayer's output is added into each stream by a second such weight. A last
weighed sum, then the final norm, ends the model. The weights are made in float32 whatever the model's dtype, as
transformers makes them.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.llama_layers import DecoderLayer, KVCache
from engine.models.mla import MLAttention
from engine.models.moe import SparseMoE
from engine.models.parameters import empty_param
from engine.prompt_embeds import GivenEmbeddings
from kernels.registry import Kernels

HYPER_CONNECTIONS = ("attn_hc", "ffn_hc")  # a layer's, before its attention and before its MLP
HYPER_CONNECTION_TENSORS = ("fn", "base", "scale")


class HyperConnection(nn.Module):
    """Reads a sublayer's input out of the streams and, where it `writes`, weighs the sublayer's output for each."""

    def __init__(self, config: ModelConfig, writes: bool) -> None:
        super().__init__()
        hc, self.eps = config.hyper_connections, config.rms_norm_eps
        self.streams, self.magnitude, self.weight_eps = hc.streams, hc.magnitude, hc.eps
        weights = 2 * hc.streams if writes else hc.streams
        self.fn = empty_param(weights, hc.streams * config.hidden_size, dtype=torch.float32)
        self.base = empty_param(weights, dtype=torch.float32)
        self.scale = empty_param(2 if writes else 1, dtype=torch.float32)
        self.writes = writes

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [T, n, H] → the sublayer's input [T, H] and each stream's weight for its output [T, n] (None where
        it does not write)."""
        flat = streams.flatten(1).float()
        mixes = F.linear(flat, self.fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        n = self.streams
        read = torch.sigmoid(mixes[:, :n] * self.scale[0] + self.base[:n]) + self.weight_eps
        read_sum = (read.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        if not self.writes:
            return read_sum, None
        write = self.magnitude * torch.sigmoid(mixes[:, n:] * self.scale[1] + self.base[n:]) + self.weight_eps
        return read_sum, write


def written(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A sublayer's output [T, H] added into each stream of `streams` [T, n, H] by its weight [T, n], in float32."""
    return (weights.unsqueeze(-1) * out.float().unsqueeze(-2) + streams.float()).to(streams.dtype)


class ClampedExperts(SparseMoE):
    """The routed experts' gate clamped from above before its SiLU, up both ways; the shared experts' GLU as Llama's."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__(config, kernels, dtype)
        self.limit = config.hyper_connections.swiglu_limit

    def _glu(self, gate: torch.Tensor, up: torch.Tensor, is_shared: bool) -> torch.Tensor:
        if is_shared or self.limit is None:
            return F.silu(gate) * up
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


class HyperConnectedLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, is_sparse: bool,
                 shares_choice: bool) -> None:
        super().__init__(config, kernels, dtype, attention=functools.partial(MLAttention, shares_choice=shares_choice),
                         mlp=ClampedExperts(config, kernels, dtype) if is_sparse else None)
        self.attn_hc = HyperConnection(config, writes=True)
        self.ffn_hc = HyperConnection(config, writes=True)

    def forward(self, streams, cos, sin, kv_cache, meta):
        x, weights = self.attn_hc(streams)
        streams = written(streams, self.attn(self.rms_norm(x, self.input_norm, self.eps), cos, sin, kv_cache, meta),
                          weights)
        x, weights = self.ffn_hc(streams)
        return written(streams, self.mlp(self.rms_norm(x, self.post_attention_norm, self.eps)), weights)


class HYV4ForCausalLM(DeepseekV3ForCausalLM):
    # Its releases' names for the hyper-connections, the heads' gates and sinks (and its dense MLPs' gate, as
    # transformers saves them) against transformers' modules', by which a checkpoint may be saved too.
    renames = ((".hc_pre.hc_head.hc_head_", ".hc_head."), (".hc_head.hc_", ".hc_head."),
               (".hc_pre.hc_attn_layer.hc_", ".attn_hc."), (".hc_pre.hc_mlp_layer.hc_", ".ffn_hc."),
               (".learnable_sink_param", ".sinks"), (".linear_gate.", ".gate_proj."))

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        self.hc_head = HyperConnection(config, writes=False)
        if not config.tie_word_embeddings:  # (kept in float32 whatever the model's dtype, as transformers keeps it)
            self.lm_head = empty_param(config.vocab_size, config.hidden_size, dtype=torch.float32)

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return HyperConnectedLayer(self.config, self.kernels, dtype, self._is_sparse(layer),
                                   shares_choice=layer in self.config.mla.shared_index_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        h = self._embed(input_ids)
        if given is not None:
            h = given.placed(h)
        streams = h.unsqueeze(1).expand(-1, self.config.hyper_connections.streams, -1)
        for layer, kv_cache, (cos, sin) in zip(self.layers, kv_caches, self._ropes(positions)):
            streams = layer(streams, cos, sin, kv_cache, meta)
        return self._final_norm(self.hc_head(streams)[0])

    def _lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(hidden.to(self.lm_head.dtype), self.lm_head).float()

    def checkpoint_names(self) -> list[str]:
        names = super().checkpoint_names() + [f"model.hc_head.{x}" for x in HYPER_CONNECTION_TENSORS]
        return names + [f"model.layers.{i}.{hc}.{x}" for i in range(self.config.num_layers)
                        for hc in HYPER_CONNECTIONS for x in HYPER_CONNECTION_TENSORS]

    def is_unused_tensor(self, name: str) -> bool:
        return name.startswith("model.mtp_layers.") or super().is_unused_tensor(name)

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if parts[1] == "hc_head":
            return getattr(self.hc_head, parts[2]).data
        if len(parts) == 5 and parts[3] in HYPER_CONNECTIONS:
            return getattr(getattr(self.layers[int(parts[2])], parts[3]), parts[4]).data
        return super()._target(name)
