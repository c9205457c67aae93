"""A hybrid model (Qwen3-Next's, Qwen3.5's, Granite 4.0-H's, Nemotron-H's, LFM2's, Falcon-H1's, Bamba's, Jamba's,
Kimi-Linear's, Ling 3's, OLMo Hybrid's, MiniMax-Text-01's, Zamba2's): only its attention layers have pages,
each at its place in the pool (ModelConfig.kv_places); its recurrent layers keep states instead
(AttentionMetadata.recurrent). Its LoRA adapters are served on its recurrent layers' projections too where it says
so (`serves_loras`: all but LFM3's, Kimi-Linear's, Ling 3's, MiniMax-Text-01's, Zamba2's and Qwen4-Exp's), refused
by name otherwise."""
from __future__ import annotations

from typing import ClassVar

import torch

from engine.attention_metadata import AttentionMetadata
from engine.lora import LoRAError, Target
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import KVCache
from engine.models.mamba2 import Mamba2Mixer
from engine.prompt_embeds import GivenEmbeddings


class HybridForward(LlamaForCausalLM):
    splits_across_ranks = False  # (its recurrent layers' states are whole)
    serves_loras: ClassVar[bool] = False  # whether adapters on a model with recurrent layers are served
    # Names ending so are depthwise convolutions' weights stored [C, 1, K], kept [C, K].
    stored_convolutions: ClassVar[tuple[str, ...]] = ()

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stored_convolutions and name.endswith(self.stored_convolutions):
            tensor = tensor.squeeze(1)
        return super()._placed(name, tensor)

    def _lora_rows(self, layer: int, place: str, proj: str) -> Target | None:
        """Its Mamba-2 layers' projections in and out (`mamba.in_proj`, `mamba.out_proj`) besides a Llama layer's."""
        block = self.layers[layer]
        mixer = getattr(block, "mamba", None) or getattr(block, "attn", None) or getattr(block, "mixer", None)
        if place == "mamba" and isinstance(mixer, Mamba2Mixer):
            return {"in_proj": (layer, "in", 0, mixer.in_weight.shape[0]),
                    "out_proj": (layer, "out", 0, self.config.hidden_size)}.get(proj)
        return super()._lora_rows(layer, place, proj)

    def lora_target(self, module: str) -> Target | None:
        if self.config.state_shape is not None and not self.serves_loras:
            raise LoRAError(f"LoRA adapters are not supported for {self.config.architecture} with recurrent layers yet")
        return super().lora_target(module)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        places = self.config.kv_places
        if places is None:  # a model of attention layers alone (Granite 4.0-Micro's)
            return super().forward(input_ids, positions, meta, kv_caches, given)
        h = self._embed(input_ids)
        if given is not None:
            h = given.placed(h)
        return self._through_layers(self._scaled_inputs(h, positions), positions, meta, kv_caches)

    def _through_layers(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        kv_caches: list[KVCache]) -> torch.Tensor:
        """`h` through every layer (an attention layer reading its place's pages) and the final norm."""
        places = self.config.kv_places
        captured = []
        for i, (layer, (cos, sin)) in enumerate(zip(self.layers, self._ropes(positions))):
            if i in self.captured_layers:
                captured.append(h)
            h = layer(h, cos, sin, kv_caches[places[i]] if i in places else None, meta)
        if captured:
            self.captured = torch.cat(captured, dim=-1)
        return self._final_norm(h)
