"""EAGLE draft heads: a Llama layer (or a few) that reads the target model's hidden states beside each token's
embedding and predicts the states, and so the tokens, after it (vLLM's `{"method": "eagle"}` and
`{"method": "eagle3"}`; engine/eagle.py drafts with them).

Each row of a step is a token and a feature given in `given` (engine/prompt_embeds.py's GivenEmbeddings, every
row's): the target's hidden state at the position before the token (EAGLE-3's already through `fc`, see
`combine`), or the head's own output there for a drafted token. The forward returns the last layer's output
before any final norm, which is also the feature of the next draft.

- EAGLE-1 (`EagleLlamaForCausalLM`): `fc` over [embedding; feature], then Llama layers, the first without its
  input norm; the target's embeddings and LM head, no final norm.
- EAGLE-3 (`Eagle3LlamaForCausalLM`): the first layer attends over [normed embedding; normed feature] (q, k and v
  twice as wide), the feature its residual; a final norm and an LM head of its own over a vocabulary of its own,
  each row a target token (`d2t`: a draft id's offset to its target id); the target's three layers' inputs
  side by side go through `fc` to make the feature.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import MLP, Attention, DecoderLayer, KVCache
from engine.models.parameters import empty_param
from engine.prompt_embeds import GivenEmbeddings
from kernels.registry import Kernels


class _UnnormedInputLayer(DecoderLayer):
    """EAGLE-1's first layer: its input, fc's output, goes to attention without the input norm."""

    def forward(self, h, cos, sin, kv_cache, meta):
        h = h + self.attn(h, cos, sin, kv_cache, meta)
        return h + self.mlp(self.rms_norm(h, self.post_attention_norm, self.eps))


class _Eagle3FirstLayer(nn.Module):
    """EAGLE-3's first layer: attention over the normed embedding and the normed feature side by side, the
    feature the residual (normed first where `norm_before_residual`)."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps, self.rms_norm = config.rms_norm_eps, kernels.rms_norm
        self.norm_before_residual = config.eagle.norm_before_residual
        self.input_norm = empty_param(config.hidden_size, dtype=dtype)
        self.hidden_norm = empty_param(config.hidden_size, dtype=dtype)
        self.post_attention_norm = empty_param(config.hidden_size, dtype=dtype)
        self.attn = Attention(config, kernels, dtype, None)
        self.attn.qkv_weight = empty_param(config.q_size + 2 * config.kv_size, 2 * config.hidden_size, dtype=dtype)
        self.mlp = MLP(config, kernels, dtype)

    def forward(self, embedded, feature, cos, sin, kv_cache, meta):
        normed = self.rms_norm(feature, self.hidden_norm, self.eps)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat((self.rms_norm(embedded, self.input_norm, self.eps), normed), dim=-1)
        h = residual + self.attn(x, cos, sin, kv_cache, meta)
        return h + self.mlp(self.rms_norm(h, self.post_attention_norm, self.eps))


class EagleLlamaForCausalLM(LlamaForCausalLM):
    """EAGLE-1's head. Its checkpoint names tensors as a bare model does (`fc.weight`, `layers.0.mlp...`)."""

    reads_bare_names = True
    splits_across_ranks = False  # (a head drafts whole)

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        # The target's embeddings and LM head serve it (`share`): none of its own is made.
        super().__init__(dataclasses.replace(config, vocab_size=0, tie_word_embeddings=True), kernels, dtype,
                         max_positions)
        self.config = config
        self.fc_weight = empty_param(config.hidden_size, 2 * config.hidden_size, dtype=dtype)
        self.fc_bias = empty_param(config.hidden_size, dtype=dtype) if config.eagle.has_fc_bias else None

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        if layer == 0:
            return _UnnormedInputLayer(self.config, self.kernels, dtype)
        return super()._make_layer(layer, dtype)

    def share(self, target: LlamaForCausalLM) -> None:
        """Compute with `target`'s embeddings and LM head (the very tensors: a weight update reaches both)."""
        self.embed, self.lm_head = target.embed, target.lm_head

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as this head reads them: EAGLE-1's, as they are."""
        return features

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        x = self.kernels.linear(torch.cat((F.embedding(input_ids, self.embed), features_of(given, input_ids)), dim=-1),
                                self.fc_weight, self.fc_bias)
        for layer, kv_cache, (cos, sin) in zip(self.layers, kv_caches, self._ropes(positions)):
            x = layer(x, cos, sin, kv_cache, meta)
        return x

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy draft (a target token id) after each of `hidden`'s rows."""
        return self.compute_logits(hidden).argmax(dim=-1)

    def checkpoint_names(self) -> list[str]:
        names = ["fc.weight"] + (["fc.bias"] if self.fc_bias is not None else [])
        for i in range(self.config.num_layers):
            norms = ("post_attention_layernorm",) if i == 0 else ("input_layernorm", "post_attention_layernorm")
            names += [name.removeprefix("model.") for name in self._attention_names(i) + self._mlp_names(i)]
            names += [f"layers.{i}.{norm}.weight" for norm in norms]
        return names

    def is_unused_tensor(self, name: str) -> bool:
        # EAGLE-1's checkpoints carry a copy of the target's embeddings (and the first layer's unused norm).
        return name in ("embed_tokens.weight", "lm_head.weight", "layers.0.input_layernorm.weight")

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            target = {"fc.weight": self.fc_weight, "fc.bias": self.fc_bias}.get(name)
            target = target.data if target is not None else self._target("model." + name)
            if target.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)


class Eagle3LlamaForCausalLM(LlamaForCausalLM):
    """EAGLE-3's head. Its checkpoint names its first layer `midlayer.` (or `layers.0.`: EagleConfig says)."""

    reads_bare_names = True
    splits_across_ranks = False

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        eagle = config.eagle
        super().__init__(dataclasses.replace(config, vocab_size=config.vocab_size if eagle.has_embeddings else 0,
                                             tie_word_embeddings=True), kernels, dtype, max_positions)
        self.config = config
        # None where it reads the target's last hidden states (eagle_config's use_aux_hidden_state false).
        self.fc_weight = empty_param(config.hidden_size, 3 * eagle.target_hidden_size, dtype=dtype) \
            if eagle.target_layers else None
        self.lm_head = empty_param(eagle.draft_vocab_size if eagle.has_lm_head else 0, config.hidden_size, dtype=dtype)
        self.register_buffer("draft_ids", torch.zeros(eagle.draft_vocab_size if eagle.has_draft_ids else 0,
                                                      dtype=torch.int64), persistent=False)

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        if layer == 0:
            return _Eagle3FirstLayer(self.config, self.kernels, dtype)
        return super()._make_layer(layer, dtype)

    def share(self, target: LlamaForCausalLM) -> None:
        """Compute with `target`'s embeddings and LM head where the checkpoint has none of its own."""
        eagle = self.config.eagle
        if not eagle.has_embeddings:
            self.embed = target.embed
        if not eagle.has_lm_head:
            self.lm_head = target.lm_head

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's captured layer inputs [T, 3 x its hidden] as this head reads them: through fc (its last
        hidden states, as they are, where it reads those)."""
        return features if self.fc_weight is None else self.kernels.linear(features, self.fc_weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        ropes = iter(self._ropes(positions))
        cos, sin = next(ropes)
        x = self.layers[0](F.embedding(input_ids, self.embed), features_of(given, input_ids), cos, sin, kv_caches[0],
                           meta)
        for layer, kv_cache, (cos, sin) in zip(self.layers[1:], kv_caches[1:], ropes):
            x = layer(x, cos, sin, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over its own vocabulary (the target's where it has no LM head of its own)."""
        return self.kernels.linear(self.kernels.rms_norm(hidden, self.norm, self.config.rms_norm_eps),
                                   self.lm_head).float()

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy draft (a target token id) after each of `hidden`'s rows."""
        drafted = self.compute_logits(hidden).argmax(dim=-1)
        return drafted + self.draft_ids[drafted] if self.draft_ids.numel() else drafted

    def checkpoint_names(self) -> list[str]:
        eagle = self.config.eagle
        first = eagle.first_layer_name
        names = ["norm.weight"] + (["fc.weight"] if self.fc_weight is not None else [])
        names += ["embed_tokens.weight"] if eagle.has_embeddings else []
        names += ["lm_head.weight"] if eagle.has_lm_head else []
        names += ["d2t"] if eagle.has_draft_ids else []
        names += [first + f"{norm}.weight" for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
        names += [first + name.removeprefix("model.layers.0.")
                  for name in self._attention_names(0) + self._mlp_names(0)]
        for i in range(1, self.config.num_layers):
            names += [name.removeprefix("model.") for name in self._attention_names(i) + self._mlp_names(i)]
            names += [f"layers.{i}.{norm}.weight" for norm in self._norm_names()]
        return names

    def is_unused_tensor(self, name: str) -> bool:
        # the target-to-draft mask (drafting reads d2t alone); fc where the head reads the last hidden states
        return name == "t2d" or (name == "fc.weight" and self.fc_weight is None)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        first, first_name = self.layers[0], self.config.eagle.first_layer_name
        for name, tensor in tensors:
            own = {"fc.weight": self.fc_weight, "norm.weight": self.norm, "embed_tokens.weight": self.embed,
                   "lm_head.weight": self.lm_head, "d2t": self.draft_ids,
                   first_name + "hidden_norm.weight": first.hidden_norm}.get(name)
            if own is not None:
                target = own.data
            elif name.startswith(first_name):
                target = self._target("model.layers.0." + name.removeprefix(first_name))
            else:
                target = self._target("model." + name)
            if target.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)


def features_of(given: GivenEmbeddings | None, input_ids: torch.Tensor) -> torch.Tensor:
    """Each row's feature, in row order: every row of an EAGLE head's step has one."""
    if given is None or given.rows.numel() != input_ids.shape[0]:
        raise ValueError("every row of an EAGLE head's step needs its feature")
    features = torch.empty_like(given.values)
    features[given.rows] = given.values
    return features
