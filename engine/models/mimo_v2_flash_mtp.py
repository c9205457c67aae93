"""The multi-token prediction layers MiMo-V2-Flash checkpoints carry under `model.mtp.layers.` (vLLM's and SGLang's
`{"method": "mtp"}`; engine/eagle.py drafts with it as with an EAGLE head). Baton drafts with the first, as vLLM's
MiMo-V2-Flash drafter does; the others are left unread.

At position q it reads the token at q + 1 and the target's last (normed) hidden state at q, each RMS-normed
(`enorm`, `hnorm`), joined by `eh_proj`, through one sliding-window decoder layer of the model's own kind (its KV
heads, sinks, narrower and scaled values, the sliding layers' RoPE) with a dense MLP behind `pre_mlp_layernorm`;
`final_layernorm` norms the output, which makes logits through the target's LM head and is itself the next draft's
hidden state. Its embeddings and LM head are the target's (read whole beside a target split across ranks, each
holding a share of them); no position's embedding is zeroed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from engine.attention_metadata import AttentionMetadata
from engine.eagle_config import EagleConfig
from engine.model_config import ModelConfig
from engine.models.llama_layers import KVCache
from engine.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from engine.models.mtp import JoinedInputs, read_own
from engine.prompt_embeds import GivenEmbeddings

PREFIX = "model.mtp.layers.0."


class MiMoV2FlashMTP(JoinedInputs, MiMoV2FlashForCausalLM):
    renames = (*MiMoV2FlashForCausalLM.renames, (".pre_mlp_layernorm.", ".post_attention_layernorm."))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        cos, sin = next(iter(self._ropes(positions)))
        return self._final_norm(self.layers[0](self.joined(input_ids, given), cos, sin, kv_caches[0], meta))

    def _is_sparse(self, layer: int) -> bool:
        return False  # its MLP is dense, intermediate_size wide, wherever the model's first is not

    def _own_names(self) -> dict[str, torch.Tensor]:
        return {PREFIX + "enorm.weight": self.embedding_norm, PREFIX + "hnorm.weight": self.hidden_norm,
                PREFIX + "eh_proj.weight": self.fc_weight, PREFIX + "final_layernorm.weight": self.norm}

    def checkpoint_names(self) -> list[str]:
        layer = [PREFIX + name.removeprefix("model.layers.0.") for name in super().checkpoint_names()
                 if name.startswith("model.layers.0.")]
        return [*self._own_names(), *self._vocabulary_names(), *layer]

    def is_unused_tensor(self, name: str) -> bool:
        return not name.startswith(PREFIX)  # the target's own tensors, and the MTP layers past the first

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name.replace(PREFIX, "model.layers.0.", 1), tensor)
                             for name, tensor in read_own(tensors, self._own_names()))


def mimo_v2_flash_mtp_config(target: ModelConfig, reads_vocabulary: bool = False) -> ModelConfig:
    """The head's ModelConfig: the target's, of its one sliding-window layer; `reads_vocabulary`: its embeddings and
    LM head read from the checkpoint rather than shared with the target."""
    return dataclasses.replace(target, architecture="MiMoV2FlashMTP", num_layers=1, rope_layers=frozenset({0}),
                               sliding_layers=frozenset({0}), layer_num_heads=None,
                               # (one table until share, the target's, unless it reads them)
                               tie_word_embeddings=target.tie_word_embeddings if reads_vocabulary else True,
                               eagle=EagleConfig("mtp", target.vocab_size, target.hidden_size,
                                                 has_embeddings=reads_vocabulary, has_lm_head=reads_vocabulary))
