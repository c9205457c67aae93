"""The multi-token prediction layer Qwen3-Next and Qwen3.5 checkpoints carry under `mtp.` (vLLM's
`{"method": "mtp"}`, once `qwen3_next_mtp` and `qwen3_5_mtp`; engine/eagle.py drafts with it as with an EAGLE
head).

At position q it reads the token at q + 1 and the target's last (normed) hidden state at q, each RMS-normed
(`pre_fc_norm_embedding`, `pre_fc_norm_hidden`), joined by `fc`, through one full-attention decoder layer of the
model's own kind (gated attention; experts where the model's first layer has them); the output, normed by
`mtp.norm`, makes logits through the target's LM head and is itself the next draft's hidden state. Its
embeddings and LM head are the target's. Unlike DeepSeek-V3's layer, no position's embedding is zeroed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from engine.attention_metadata import AttentionMetadata
from engine.eagle_config import EagleConfig
from engine.model_config import ModelConfig
from engine.models.llama_layers import KVCache
from engine.models.mtp import JoinedInputs, read_own
from engine.models.qwen3_next import Qwen3NextForCausalLM
from engine.prompt_embeds import GivenEmbeddings

PREFIX = "mtp."
LAYER = PREFIX + "layers.0."


class Qwen3NextMTP(JoinedInputs, Qwen3NextForCausalLM):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        cos, sin = next(iter(self._ropes(positions)))
        return self._final_norm(self.layers[0](self.joined(input_ids, given), cos, sin, kv_caches[0], meta))

    def _own_names(self) -> dict[str, torch.Tensor]:
        return {PREFIX + "fc.weight": self.fc_weight, PREFIX + "pre_fc_norm_embedding.weight": self.embedding_norm,
                PREFIX + "pre_fc_norm_hidden.weight": self.hidden_norm, PREFIX + "norm.weight": self.norm}

    def checkpoint_names(self) -> list[str]:
        layer = [LAYER + name.removeprefix("model.layers.0.") for name in super().checkpoint_names()
                 if name.startswith("model.layers.0.")]
        return [*self._own_names(), *layer]

    def is_unused_tensor(self, name: str) -> bool:
        return not name.startswith(PREFIX)  # the target's own tensors

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # fc as it is; the norms stored as offsets from 1, as the model's
        own = read_own(tensors, self._own_names(),
                       lambda name, tensor: tensor if name.endswith("fc.weight") else tensor.float() + 1.0)
        super().load_weights(("model.layers.0." + name.removeprefix(LAYER), tensor) for name, tensor in own)


def qwen3_next_mtp_config(target: ModelConfig) -> ModelConfig:
    """The head's ModelConfig: the target's text model of its one full-attention layer (Qwen3.5's multimodal
    positions too: a prompt's images place its tokens for the layer as for the model)."""
    return dataclasses.replace(target, architecture="Qwen3NextMTP", num_layers=1, rope_layers=frozenset({0}),
                               sliding_layers=frozenset(), linear_attention=None, multimodal=None, vision=None,
                               tie_word_embeddings=True,  # (one table until share: the target's)
                               eagle=EagleConfig("mtp", target.vocab_size, target.hidden_size))
