"""The multi-token prediction layer Nemotron 3 checkpoints carry under `mtp.` (vLLM's `{"method": "mtp"}`, once
`nemotron_h_mtp`; engine/eagle.py drafts with it as with an EAGLE head): a few Nemotron-H blocks, their kinds
config.json's `mtp_layers_block_type` (["attention", "moe"]) or `mtp_hybrid_override_pattern` ("*E").

At position q it reads the token at q + 1 and the target's last (normed) hidden state at q, each RMS-normed (the
first block's `enorm`, `hnorm`), joined by its `eh_proj`, through the blocks (each one mixer behind a norm, the
residual around it); the last block's `final_layernorm` norms the output, which makes logits through the target's
LM head and is itself the next draft's hidden state. Its embeddings and LM head are the target's; no position's
embedding is zeroed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from engine.attention_metadata import AttentionMetadata
from engine.eagle_config import EagleConfig
from engine.mamba_config import MAMBA, NEMOTRON_KINDS
from engine.model_config import ModelConfig
from engine.models.llama_layers import KVCache
from engine.models.mtp import JoinedInputs, read_own
from engine.models.nemotron_h import NemotronHForCausalLM
from engine.prompt_embeds import GivenEmbeddings

PREFIX = "mtp.layers."


class NemotronHMTP(JoinedInputs, NemotronHForCausalLM):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        return self._through_layers(self.joined(input_ids, given), positions, meta, kv_caches)

    def _own_names(self) -> dict[str, torch.Tensor]:
        last = f"{PREFIX}{self.config.num_layers - 1}."
        return {PREFIX + "0.enorm.weight": self.embedding_norm, PREFIX + "0.hnorm.weight": self.hidden_norm,
                PREFIX + "0.eh_proj.weight": self.fc_weight, last + "final_layernorm.weight": self.norm}

    def checkpoint_names(self) -> list[str]:
        blocks = [name.replace("model.layers.", PREFIX, 1) for name in super().checkpoint_names()
                  if name.startswith("model.layers.")]
        return [*self._own_names(), *blocks]

    def is_unused_tensor(self, name: str) -> bool:
        return not name.startswith(PREFIX)  # the target's own tensors

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name.replace(PREFIX, "model.layers.", 1), tensor)
                             for name, tensor in read_own(tensors, self._own_names()))


def nemotron_h_mtp_config(target: ModelConfig, blocks: list[str]) -> ModelConfig:
    """The head's ModelConfig: the target's, of the blocks whose kinds `blocks` names (its attention blocks' pages
    past the target's). ValueError for a kind it cannot hold."""
    kinds = tuple(NEMOTRON_KINDS.get(kind) for kind in blocks)
    if not kinds or None in kinds or MAMBA in kinds:
        raise ValueError(f"an MTP layer of Nemotron-H blocks {blocks} is not supported (of attention, MLP and expert "
                         "blocks it is)")
    return dataclasses.replace(target, architecture="NemotronHMTP", num_layers=len(kinds),
                               mamba=dataclasses.replace(target.mamba, layer_types=kinds),
                               tie_word_embeddings=True,  # (one table until share: the target's)
                               eagle=EagleConfig("mtp", target.vocab_size, target.hidden_size))
