"""LongCat-Flash (LongcatFlashForCausalLM; engine/longcat_flash_config.py): its layers' two sublayers are
DeepSeek-V3's decoder layers with dense MLPs (engine/models/deepseek_v3.py), Baton's layers; each pair's experts
(engine/models/moe.py, some computing nothing) take what the first's MLP takes, their output added after the second.

Its latent attention scales q and the normed latent by sqrt(hidden_size / their ranks): folded into q_b_proj's and
kv_a_layernorm's weights as they load.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.lora import Target
from engine.model_config import ModelConfig
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.llama_layers import KVCache, RankSum
from engine.models.moe import SparseMoE
from engine.prompt_embeds import GivenEmbeddings
from kernels.registry import Kernels

PROJECTIONS = ("gate", "up", "down")
# A layer's modules a sublayer each (`mlps.1.`, ...), by the name a DeepSeek-V3 layer gives them.
SUBLAYER_MODULES = {"mlps": "mlp", "input_layernorm": "input_layernorm",
                    "post_attention_layernorm": "post_attention_layernorm"}


class LongcatFlashForCausalLM(DeepseekV3ForCausalLM):

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        self.experts = nn.ModuleList(SparseMoE(config, kernels, dtype) for _ in range(config.num_layers // 2))
        mla, hidden = config.mla, config.hidden_size
        self.lora_scales = {"q_b_proj.weight": (hidden / mla.q_lora_rank) ** 0.5,
                            "kv_a_layernorm.weight": (hidden / mla.kv_lora_rank) ** 0.5}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        h = self._embed(input_ids)
        if given is not None:
            h = given.placed(h)
        cos, sin = next(iter(self._ropes(positions)))
        for pair, experts in enumerate(self.experts):
            first, second = self.layers[2 * pair], self.layers[2 * pair + 1]
            h = h + first.attn(self.kernels.rms_norm(h, first.input_norm, first.eps), cos, sin, kv_caches[2 * pair],
                               meta)
            x = self.kernels.rms_norm(h, first.post_attention_norm, first.eps)
            shortcut = experts(x)
            h = second(h + first.mlp(x), cos, sin, kv_caches[2 * pair + 1], meta) + shortcut
        return self._final_norm(h)

    def sum_across_ranks(self, rank_sum: RankSum, num_ranks: int, rank: int, vocab_size: int | None) -> None:
        """Its sublayers' as DeepSeek-V3's, and each pair's experts' too: the tokens its experts that compute
        nothing hand on added on rank 0 alone."""
        super().sum_across_ranks(rank_sum, num_ranks, rank, vocab_size)
        for experts in self.experts:
            experts.rank_sum, experts.adds_identity = rank_sum, rank == 0

    def checkpoint_names(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        names += [] if self.config.tie_word_embeddings else ["lm_head.weight"]
        for pair in range(len(self.experts)):
            p = f"model.layers.{pair}."
            for k in (0, 1):
                names += self.layers[2 * pair + k].attn.checkpoint_names(f"{p}self_attn.{k}.")
                names += [f"{p}mlps.{k}.{x}_proj.weight" for x in PROJECTIONS]
                names += [f"{p}{norm}.{k}.weight" for norm in ("input_layernorm", "post_attention_layernorm")]
            names += [p + "mlp.router.classifier.weight", p + "mlp.router.e_score_correction_bias"]
            names += [p + f"mlp.experts.{e}.{x}_proj.weight" for e in range(self.config.moe.num_experts)
                      for x in PROJECTIONS]
        return names

    def is_unused_tensor(self, name: str) -> bool:
        # transformers saves gate and up projections for the experts that compute nothing too (never read).
        parts = name.split(".")
        if len(parts) > 6 and parts[3:5] == ["mlp", "experts"] and parts[5].isdigit():
            return int(parts[5]) >= self.config.moe.num_experts
        return name.startswith("model.mtp.") or super().is_unused_tensor(name)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        def the_rest() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in tensors:
                parts = name.split(".")
                if len(parts) < 6 or parts[:2] != ["model", "layers"]:
                    yield name, tensor
                    continue
                pair, module = int(parts[2]), parts[3]
                if module == "self_attn":
                    leaf = ".".join(parts[5:])
                    scale = self.lora_scales.get(leaf)
                    self.layers[2 * pair + int(parts[4])].attn.load(leaf, tensor if scale is None else tensor * scale)
                elif module in SUBLAYER_MODULES:
                    sublayer = 2 * pair + int(parts[4])
                    yield f"model.layers.{sublayer}.{SUBLAYER_MODULES[module]}.{'.'.join(parts[5:])}", tensor
                else:
                    self._load_experts(self.experts[pair], parts[4:], tensor)
        super().load_weights(the_rest())

    @staticmethod
    def _load_experts(experts: SparseMoE, parts: list[str], tensor: torch.Tensor) -> None:
        """`parts`: a tensor's name after `mlp.` (router.classifier.weight, experts.3.gate_proj.weight, ...)."""
        if parts[0] == "router":
            target = experts.router_weight if parts[1] == "classifier" else experts.router_bias
        else:
            target = experts.weight_slice(int(parts[1]), parts[2].removesuffix("_proj"))
        if target.shape != tensor.shape:
            raise ValueError(f"tensor mlp.{'.'.join(parts)} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(target.shape)}")
        target.data.copy_(tensor)

    def lora_target(self, module: str) -> Target | None:
        """Adapters on its sublayers' dense MLPs (`model.layers.P.mlps.K.`: sublayer 2P + K's); those on its latent
        attention or its experts are not served, as DeepSeek-V3's are not."""
        parts = module.split(".")
        if len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[3] != "mlps" or not parts[2].isdigit() \
                or parts[4] not in ("0", "1"):
            return None
        return super().lora_target(f"model.layers.{2 * int(parts[2]) + int(parts[4])}.mlp.{parts[5]}")
