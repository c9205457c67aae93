"""ModernBERT (ModernBertModel, ModernBertForSequenceClassification) over paged KV: an encoder as
engine/models/bert.py serves one (embeddings, a cross-encoder's scores), with ModernBERT's own
layers: pre-norm, RoPE with one theta for its global layers and one for the others, a global layer
every few and the others over the tokens at most half of `local_attention` away on either side,
a gated GELU feed-forward, and no biases unless the config asks for them.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.lora import LoRABatch
from engine.model_config import ModelConfig
from engine.models.bert import ACTIVATIONS, KVCache, bidirectional_attention
from engine.models.parameters import empty_param
from kernels.registry import Kernels
from kernels.rotary import build_rope_cache

# A classifier's head tensors, by module (after the checkpoint's prefix, which its head has not): attributes.
HEAD_PARAMS = {"head.dense": ("head_weight", "head_bias"), "head.norm": ("head_norm_weight", "head_norm_bias"),
               "classifier": ("classifier", "classifier_bias")}


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, weight.shape, weight, bias, eps)


class ModernBertLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.config, self.kernels = config, kernels
        encoder, hidden, inter = config.encoder, config.hidden_size, config.intermediate_size
        self.window = config.sliding_window if layer in config.sliding_layers else None

        def norm() -> tuple[torch.Tensor, torch.Tensor | None]:
            return empty_param(hidden, dtype=dtype), empty_param(hidden, dtype=dtype) if encoder.norm_bias else None

        # The first layer's input is the embeddings' norm already: it has no norm of its own.
        self.attn_norm_weight, self.attn_norm_bias = norm() if layer else (None, None)
        self.mlp_norm_weight, self.mlp_norm_bias = norm()
        self.qkv_weight = empty_param(3 * hidden, hidden, dtype=dtype)
        self.qkv_bias = empty_param(3 * hidden, dtype=dtype) if encoder.attention_bias else None
        self.o_weight = empty_param(hidden, hidden, dtype=dtype)
        self.o_bias = empty_param(hidden, dtype=dtype) if encoder.attention_bias else None
        self.up_weight = empty_param(2 * inter, hidden, dtype=dtype)  # its input half, then its gate half
        self.up_bias = empty_param(2 * inter, dtype=dtype) if encoder.mlp_bias else None
        self.down_weight = empty_param(hidden, inter, dtype=dtype)
        self.down_bias = empty_param(hidden, dtype=dtype) if encoder.mlp_bias else None
        self.act = ACTIVATIONS[encoder.hidden_act]

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        cfg, ops, eps = self.config, self.kernels, self.config.rms_norm_eps
        x = h if self.attn_norm_weight is None else _layer_norm(h, self.attn_norm_weight, self.attn_norm_bias, eps)
        qkv = ops.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.unflatten(-1, (3, cfg.num_heads, cfg.head_dim)).unbind(1)
        q, k = ops.apply_rope(q, k, cos, sin)
        attn = bidirectional_attention(ops, q, k, v, kv_cache, meta, cfg.attention_scale, self.window)
        h = h + ops.linear(attn.flatten(1), self.o_weight, self.o_bias)
        gated, gate = ops.linear(_layer_norm(h, self.mlp_norm_weight, self.mlp_norm_bias, eps), self.up_weight,
                                 self.up_bias).chunk(2, dim=-1)
        return h + ops.linear(self.act(gated) * gate, self.down_weight, self.down_bias)


class ModernBertModel(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config, self.kernels = config, kernels
        encoder, hidden = config.encoder, config.hidden_size
        self.embed = empty_param(config.vocab_size, hidden, dtype=dtype)
        self.embed_norm_weight = empty_param(hidden, dtype=dtype)
        self.embed_norm_bias = empty_param(hidden, dtype=dtype) if encoder.norm_bias else None
        self.final_norm_weight = empty_param(hidden, dtype=dtype)
        self.final_norm_bias = empty_param(hidden, dtype=dtype) if encoder.norm_bias else None
        self.layers = nn.ModuleList(ModernBertLayer(config, kernels, dtype, i) for i in range(config.num_layers))
        self.lora_batch = LoRABatch()
        self.ropes = {theta: build_rope_cache(config.head_dim, max_positions, theta, None)
                      for theta in {config.rope_theta, config.local_rope_theta}}
        # A classifier's head on its pooled state (dense, activation, norm), then its rows of logits.
        self.head_weight = self.head_bias = self.head_norm_weight = self.head_norm_bias = None
        self.classifier = self.classifier_bias = None
        if encoder.head is not None:
            self.head_weight = empty_param(hidden, hidden, dtype=dtype)
            self.head_bias = empty_param(hidden, dtype=dtype) if encoder.head_bias else None
            self.head_norm_weight = empty_param(hidden, dtype=dtype)
            self.head_norm_bias = empty_param(hidden, dtype=dtype) if encoder.norm_bias else None
            self.classifier = empty_param(len(config.labels), hidden, dtype=dtype)
            self.classifier_bias = empty_param(len(config.labels), dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: None = None) -> torch.Tensor:
        # `given`: None, as admission refuses a prompt given as embeddings to an encoder.
        cfg, eps = self.config, self.config.rms_norm_eps
        h = _layer_norm(F.embedding(input_ids, self.embed), self.embed_norm_weight, self.embed_norm_bias, eps)
        ropes = {theta: (cos[positions], sin[positions]) for theta, (cos, sin) in self.ropes.items()}
        for layer, kv_cache in zip(self.layers, kv_caches):
            cos, sin = ropes[cfg.rope_theta if layer.window is None else cfg.local_rope_theta]
            h = layer(h, cos, sin, kv_cache, meta)
        return _layer_norm(h, self.final_norm_weight, self.final_norm_bias, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embed).float()

    def classify(self, pooled_state: torch.Tensor) -> torch.Tensor:
        """A classifier's logits from its input's pooled hidden state [H] (its embedding)."""
        encoder = self.config.encoder
        bias = None if self.head_bias is None else self.head_bias.float()
        dense = F.linear(pooled_state, self.head_weight.float(), bias)
        norm_bias = None if self.head_norm_bias is None else self.head_norm_bias.float()
        head = _layer_norm(ACTIVATIONS[encoder.head_act](dense), self.head_norm_weight.float(), norm_bias,
                           self.config.rms_norm_eps)
        return F.linear(head, self.classifier.float(), self.classifier_bias.float())

    def lora_target(self, module: str) -> None:
        """No projection of an encoder takes LoRA adapters here: every one of an adapter's is refused."""
        return None

    def serve_loras(self) -> None:
        """Never called: no adapter loads (lora_target)."""

    # --- weights -----------------------------------------------------------------

    def checkpoint_names(self) -> list[str]:
        return [name for name, _ in self._parameters_by_name()]

    def is_unused_tensor(self, name: str) -> bool:
        return False

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        targets = dict(self._parameters_by_name())
        for name, tensor in tensors:
            target = targets[name]
            if target.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)

    def _parameters_by_name(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Each checkpoint tensor's name and the parameter it fills (None parameters have no tensor)."""
        p = self.config.encoder.prefix

        def pairs(module: str, weight: torch.Tensor | None, bias: torch.Tensor | None):
            return [(f"{module}.{kind}", t.data) for kind, t in (("weight", weight), ("bias", bias)) if t is not None]

        named = [(f"{p}embeddings.tok_embeddings.weight", self.embed.data)]
        named += pairs(f"{p}embeddings.norm", self.embed_norm_weight, self.embed_norm_bias)
        for i, layer in enumerate(self.layers):
            prefix = f"{p}layers.{i}."
            named += pairs(prefix + "attn_norm", layer.attn_norm_weight, layer.attn_norm_bias)
            named += pairs(prefix + "attn.Wqkv", layer.qkv_weight, layer.qkv_bias)
            named += pairs(prefix + "attn.Wo", layer.o_weight, layer.o_bias)
            named += pairs(prefix + "mlp_norm", layer.mlp_norm_weight, layer.mlp_norm_bias)
            named += pairs(prefix + "mlp.Wi", layer.up_weight, layer.up_bias)
            named += pairs(prefix + "mlp.Wo", layer.down_weight, layer.down_bias)
        named += pairs(f"{p}final_norm", self.final_norm_weight, self.final_norm_bias)
        for module, (weight, bias) in HEAD_PARAMS.items():
            named += pairs(module, getattr(self, weight), getattr(self, bias))
        return named
