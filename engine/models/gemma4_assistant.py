"""Gemma 4's assistant drafter (Gemma4AssistantForCausalLM; engine/gemma4_assistant_config.py): Gemma 4's layers,
every one attending over its target's pages (no KV of its own), between projections joining it to the target."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.gemma4 import Gemma4ForCausalLM
from engine.models.llama_layers import KVCache
from engine.models.parameters import empty_param
from kernels.registry import Kernels


class Gemma4AssistantForCausalLM(Gemma4ForCausalLM):
    splits_across_ranks = False  # (it drafts beside a whole target)

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        for layer in self.layers:
            if layer.attn.sliding_window is not None:
                # transformers' assistant masks a sliding layer bidirectionally over the target's keys: it reaches the
                # window's width and one more back from the last of them (a query at the last key's place here)
                layer.attn.sliding_window += 1
        joined = config.gemma4_assistant
        self.pre_projection = empty_param(config.hidden_size, 2 * joined.backbone_hidden_size, dtype=dtype)
        self.post_projection = empty_param(joined.backbone_hidden_size, config.hidden_size, dtype=dtype)
        if joined.num_centroids:
            self.centroids = empty_param(joined.num_centroids, config.hidden_size, dtype=dtype)
            self.register_buffer("token_ordering", torch.zeros(config.vocab_size, dtype=torch.int64), persistent=False)

    def draft(self, inputs: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              kv_caches: list[KVCache]) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft for each row: `inputs` [B, 2 * target hidden] ([the target's embedding of its last token | the
        hidden state before it]) → the drafted tokens [B] and the hidden state the next draft reads [B, target
        hidden]."""
        h = self.kernels.linear(inputs, self.pre_projection)
        ropes = self._kinds_ropes(positions)
        for i, layer in enumerate(self.layers):
            cos, sin = ropes[self.layout.layer_types[i]]
            h = layer(h, None, cos, sin, kv_caches[self.layout.kv_places[i][0]], meta)
        h = self._final_norm(h)
        return self._greedy(h), self.kernels.linear(h, self.post_projection)

    def _greedy(self, h: torch.Tensor) -> torch.Tensor:
        """Each row's best token: over the whole vocabulary, or over the tokens of its best-scoring clusters."""
        joined = self.config.gemma4_assistant
        if not joined.num_centroids:
            return self.compute_logits(h).argmax(dim=-1)
        clusters = F.linear(h, self.centroids).topk(joined.centroid_top_k, dim=-1).indices  # [B, k]
        tokens = self.token_ordering.view(joined.num_centroids, -1)[clusters].flatten(1)  # [B, k * V / C]
        scores = torch.einsum("bd,bnd->bn", h, self.lm_head[tokens])
        return tokens.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)

    def checkpoint_names(self) -> list[str]:
        names = [*super().checkpoint_names(), "pre_projection.weight", "post_projection.weight"]
        if self.config.gemma4_assistant.num_centroids:
            names += ["masked_embedding.centroids.weight", "masked_embedding.token_ordering"]
        return names

    def _target(self, name: str) -> torch.Tensor:
        own = {"pre_projection.weight": "pre_projection", "post_projection.weight": "post_projection",
               "masked_embedding.centroids.weight": "centroids", "masked_embedding.token_ordering": "token_ordering"}
        if name in own:
            return getattr(self, own[name]).data
        return super()._target(name)
