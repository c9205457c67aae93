"""Multi-token prediction layers as draft heads: the layer past the last that DeepSeek-V3 (R1, V3.1, V3.2),
GLM-4.5/4.6, GLM-4.7-Flash and GLM-5 (its layer with an indexer of its own) checkpoints carry, trained to predict the
token after next (vLLM's `{"method": "mtp"}`, once `deepseek_mtp`; engine/eagle.py drafts with it as with an EAGLE
head).

At position q the layer reads the token at q + 1 and the target's last hidden state at q (normed), each
normed again (`enorm`, `hnorm`), joined by `eh_proj`, through one decoder layer of the target's own kind
(multi-head latent attention and experts for DeepSeek); its output, normed by `shared_head.norm`, makes logits
through `shared_head.head`, and is itself the next draft's hidden state. The first position's embedding is
zeroed, as vLLM's layer zeroes it (the head is handed the token id MASKED there).

The pieces other models' MTP layers share are here too: JoinedInputs (the joining of an embedding and a hidden
state), LayerUnderPrefix (one layer under a prefix of the checkpoint's own: MiMo's, MiMo-V2-Flash's, Mellum 2's) and
the config of such a head (`joined_head_config`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.attention_metadata import AttentionMetadata
from engine.eagle_config import EagleConfig
from engine.model_config import ModelConfig
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.eagle import features_of
from engine.models.glm4_moe import Glm4MoeForCausalLM
from engine.models.llama_layers import KVCache
from engine.models.parameters import empty_param
from engine.prompt_embeds import GivenEmbeddings
from kernels.registry import Kernels

MASKED = -1  # the input id of a position whose embedding the layer zeroes


class JoinedInputs:
    """An MTP layer's first step (mixed in before the model class whose layers it runs): the next token's embedding
    and the target's hidden state, each RMS-normed, joined by a projection (the embedding's half first, or the hidden
    state's: `hidden_first`); its drafts greedy. Its embeddings and LM head are the target's unless `share` is told
    otherwise."""

    hidden_first: ClassVar[bool] = False
    splits_across_ranks = False  # (it drafts beside a split target, whole on rank 0)

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        hidden = config.hidden_size
        self.embedding_norm = empty_param(hidden, dtype=dtype)
        self.hidden_norm = empty_param(hidden, dtype=dtype)
        self.fc_weight = empty_param(hidden, 2 * hidden, dtype=dtype)

    def share(self, target) -> None:
        """Compute with the target's embeddings and LM head (the very tensors: a weight update reaches both), unless
        it has read them whole from the checkpoint (EagleConfig.has_embeddings: a target split across ranks holds a
        share of each)."""
        if not self.config.eagle.has_embeddings:
            self.embed, self.lm_head = target.embed, target.lm_head

    def _vocabulary_names(self) -> list[str]:
        """The target's embeddings and LM head, where the head reads them whole."""
        if not self.config.eagle.has_embeddings:
            return []
        return ["model.embed_tokens.weight", *([] if self.config.tie_word_embeddings else ["lm_head.weight"])]

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        return features  # the target's last hidden states, as they are

    def joined(self, input_ids: torch.Tensor, given: GivenEmbeddings | None) -> torch.Tensor:
        eps, norm = self.config.rms_norm_eps, self.kernels.rms_norm
        parts = (norm(self._embedded(input_ids), self.embedding_norm, eps),
                 norm(features_of(given, input_ids), self.hidden_norm, eps))
        return self.kernels.linear(torch.cat(parts[::-1] if self.hidden_first else parts, dim=-1), self.fc_weight)

    def _embedded(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `input_ids`, zeros where an id is MASKED (EagleConfig.masks_first's first position)."""
        embedded = F.embedding(input_ids.clamp(min=0), self.embed)
        return embedded.masked_fill((input_ids == MASKED).unsqueeze(-1), 0.0)

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden).argmax(dim=-1)


class _MultiTokenPredictor(JoinedInputs):
    """DeepSeek-V3's MTP layer over a target model class's decoder layer (mixed in before that class). Its
    ModelConfig is the target's with one layer, and EagleConfig.mtp_layer that layer's index in the checkpoint."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        self._checkpoint_layer = config.eagle.mtp_layer  # (read as the layer is made)
        super().__init__(config, kernels, dtype, max_positions)

    def _is_sparse(self, layer: int) -> bool:
        return self.config.moe.is_sparse(self._checkpoint_layer)  # its place in the target's stack says

    def share(self, target) -> None:
        """Its embeddings and head are its own (the checkpoint's copies)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        cos, sin = next(iter(self._ropes(positions)))
        return self.layers[0](self.joined(input_ids, given), cos, sin, kv_caches[0], meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(self.kernels.rms_norm(hidden, self.norm, self.config.rms_norm_eps),
                                   self.lm_head).float()

    def _own_names(self) -> dict[str, torch.Tensor]:
        p = f"model.layers.{self._checkpoint_layer}."
        return {p + "enorm.weight": self.embedding_norm, p + "hnorm.weight": self.hidden_norm,
                p + "eh_proj.weight": self.fc_weight,
                p + "shared_head.norm.weight": self.norm, p + "shared_head.head.weight": self.lm_head,
                p + "embed_tokens.weight": self.embed}

    def checkpoint_names(self) -> list[str]:
        layer = [name.replace("model.layers.0.", f"model.layers.{self._checkpoint_layer}.", 1)
                 for name in super().checkpoint_names() if name.startswith("model.layers.0.")]
        return [*self._own_names(), *layer]

    def is_unused_tensor(self, name: str) -> bool:
        return not name.startswith(f"model.layers.{self._checkpoint_layer}.")  # the target's own tensors

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        prefix = f"model.layers.{self._checkpoint_layer}."
        super().load_weights(("model.layers.0." + name.removeprefix(prefix), tensor)
                             for name, tensor in read_own(tensors, self._own_names()))


class LayerUnderPrefix(JoinedInputs):
    """A JoinedInputs head whose one decoder layer the checkpoint holds under `layer_prefix` (by the model's own
    names of a layer's tensors past it, and as the model's `renames` read them), its own tensors by `_own_names`;
    the output normed by the model's final norm (the head's own) makes the logits and is the next draft's hidden
    state."""

    layer_prefix: ClassVar[str]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        cos, sin = next(iter(self._ropes(positions)))
        return self._final_norm(self.layers[0](self.joined(input_ids, given), cos, sin, kv_caches[0], meta))

    def _own_names(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def checkpoint_names(self) -> list[str]:
        layer = [self.layer_prefix + name.removeprefix("model.layers.0.") for name in super().checkpoint_names()
                 if name.startswith("model.layers.0.")]
        return [*self._own_names(), *self._vocabulary_names(), *layer]

    def is_unused_tensor(self, name: str) -> bool:
        return not name.startswith(self.layer_prefix)  # the target's own tensors, and MTP layers past the first

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name.replace(self.layer_prefix, "model.layers.0.", 1), tensor)
                             for name, tensor in read_own(tensors, self._own_names()))


def joined_head_config(target: ModelConfig, architecture: str, reads_vocabulary: bool, masks_first: bool = False,
                       mtp_layer: int = 0, **changes) -> ModelConfig:
    """A LayerUnderPrefix head's ModelConfig: the target's, of one layer (`changes` past that); `reads_vocabulary`:
    its embeddings and LM head read from the checkpoint rather than shared with the target (a target split across
    ranks holds a share of each)."""
    return dataclasses.replace(target, **{
        "architecture": architecture, "num_layers": 1, "rope_layers": frozenset({0}), "layer_num_heads": None,
        # (one table until share, the target's, unless it reads them)
        "tie_word_embeddings": target.tie_word_embeddings if reads_vocabulary else True,
        "eagle": EagleConfig("mtp", target.vocab_size, target.hidden_size, has_embeddings=reads_vocabulary,
                             has_lm_head=reads_vocabulary, masks_first=masks_first, mtp_layer=mtp_layer),
        **changes})


def read_own(tensors: Iterable[tuple[str, torch.Tensor]], own: dict[str, torch.Tensor],
             stored: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, tensor: tensor,
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """An MTP layer's tensors of its own (`own`, by checkpoint name) copied in, as `stored` makes them of the
    checkpoint's (ValueError for another shape); the others, its decoder layer's, yielded for the model to read."""
    for name, tensor in tensors:
        if name not in own:
            yield name, tensor
            continue
        if own[name].shape != tensor.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
        own[name].data.copy_(stored(name, tensor))


class DeepseekV3MTP(_MultiTokenPredictor, DeepseekV3ForCausalLM):
    pass


class Glm4MoeMTP(_MultiTokenPredictor, Glm4MoeForCausalLM):
    pass


# The target architectures whose checkpoints carry MTP layers, and the head each makes.
MTP_HEADS = {"DeepseekV3ForCausalLM": "DeepseekV3MTP", "DeepseekV32ForCausalLM": "DeepseekV3MTP",  # (its indexer too)
             "Glm4MoeForCausalLM": "Glm4MoeMTP",
             "Glm4MoeLiteForCausalLM": "DeepseekV3MTP",  # GLM-4.7-Flash's: DeepSeek-V3's kind of layer
             "GlmMoeDsaForCausalLM": "DeepseekV3MTP"}  # GLM-5's: V3.2's, its indexer of its own


def mtp_head_config(target: ModelConfig, mtp_layer: int) -> ModelConfig:
    """The head's ModelConfig: the target's, of the one layer at `mtp_layer` in its checkpoint."""
    return dataclasses.replace(target, architecture=MTP_HEADS[target.architecture], num_layers=1,
                               rope_layers=frozenset({0}), sliding_layers=frozenset(), tie_word_embeddings=False,
                               eagle=EagleConfig("mtp", target.vocab_size, target.hidden_size, mtp_layer=mtp_layer,
                                                 masks_first=True))
