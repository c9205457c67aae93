"""The multi-token prediction layers Step-3.7 checkpoints carry past the model's own (`model.layers.{N}.` for N from
num_hidden_layers on; transformers' MtpModel, `generate(use_mtp=True)`; `{"method": "mtp"}` here; engine/eagle.py
drafts with it as with an EAGLE head). Baton drafts with the first, as Baton does for MiMo-V2-Flash's; the others are
left unread.

At position q it reads the token at q + 1 and the target's last (normed) hidden state at q, each RMS-normed (`enorm`,
`hnorm`), joined by `eh_proj`, through one decoder layer of the model's own kind (its gate on attention's output, its
GLU clamps) of the kinds config.json gives it: `mtp_layer_types` and `mtp_mlp_layer_types` as transformers saves
them, or the MTP layers' entries of the per-layer lists as StepFun released them. `shared_head.norm` norms the output,
which makes logits through the target's LM head and is itself the next draft's hidden state, as transformers chains
its MTP layers (vLLM's drafter chains the output before that norm: the first draft of a step is the same, later ones
may differ). The layer's own `shared_head.output` is left unread, as transformers leaves it; its embeddings are the
target's (read whole beside a target split across ranks, each holding a share of them); no position's embedding is
zeroed. Its norms are Gemma's (1 + weight), as the model's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from engine.model_config import ModelConfig
from engine.models.mtp import LayerUnderPrefix, joined_head_config
from engine.models.step3p7 import Step3p7ForCausalLM
from engine.multimodal import text_config
from engine.step3p7_config import ALIASES, FULL, SLIDING, Step3p7Layout, expert_layers, sliding_layer_heads

WRAPPER = "Step3p7ForConditionalGeneration"


class Step3p7MTP(LayerUnderPrefix, Step3p7ForCausalLM):
    @property
    def layer_prefix(self) -> str:
        return f"model.layers.{self.config.eagle.mtp_layer}."

    def _own_names(self) -> dict[str, torch.Tensor]:
        p = self.layer_prefix
        return {p + "enorm.weight": self.embedding_norm, p + "hnorm.weight": self.hidden_norm,
                p + "eh_proj.weight": self.fc_weight, p + "shared_head.norm.weight": self.norm}

    def is_unused_tensor(self, name: str) -> bool:
        return super().is_unused_tensor(name) or name == self.layer_prefix + "shared_head.output.weight"

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = self._own_names()  # (the layer's own norms: Step3p7ForCausalLM adds the 1 to the others)
        super().load_weights((name, tensor.float() + 1.0 if name in own and name.endswith("norm.weight") else tensor)
                             for name, tensor in tensors)


def step3p7_mtp_config(raw: dict, target: ModelConfig, reads_vocabulary: bool = False) -> ModelConfig:
    """The head's ModelConfig: the target's, of the first MTP layer, of the kinds config.json (`raw`) gives it.
    ValueError where it gives none, or one Baton does not serve."""
    text, _ = text_config(raw, WRAPPER) if WRAPPER in (raw.get("architectures") or []) else (raw, None)
    text = {ALIASES.get(key, key): value for key, value in text.items()}
    layer = target.num_layers
    if int(text.get("num_nextn_predict_layers") or 0) < 1:
        raise ValueError("config.json's num_nextn_predict_layers is 0: the checkpoint names no MTP layer")
    attention = _first_mtp_entry(text, "layer_types", layer, FULL)
    has_experts = layer in (expert_layers(text) or ())
    mlp = _first_mtp_entry(text, "mlp_layer_types", layer, "sparse" if has_experts else "dense")
    if attention not in (FULL, SLIDING) or mlp not in ("sparse", "dense"):
        raise ValueError(f"an MTP layer of kinds {attention!r} and {mlp!r} is not supported")
    heads = sliding_layer_heads(text, target.num_heads) if attention == SLIDING else target.num_heads
    moe = dataclasses.replace(target.moe, dense_layers=frozenset() if mlp == "sparse" else frozenset({0}))
    limits = Step3p7Layout(swiglu_limits=(_limit(text.get("swiglu_limits"), layer),),
                           shared_swiglu_limits=(_limit(text.get("swiglu_limits_shared"), layer),))
    return joined_head_config(target, "Step3p7MTP", reads_vocabulary, mtp_layer=layer, moe=moe, step3p7=limits,
                              layer_num_heads=(heads,),
                              sliding_layers=frozenset({0}) if attention == SLIDING else frozenset())


def _first_mtp_entry(text: dict, key: str, layer: int, default: str) -> str:
    """The first MTP layer's entry: of `mtp_<key>` (transformers' config), else of `key` run on past the model's
    `layer` layers (StepFun's), else `default` where config.json has no such list."""
    if text.get(f"mtp_{key}"):
        return text[f"mtp_{key}"][0]
    given = text.get(key)
    if given is None:
        return default
    if len(given) <= layer:
        raise ValueError(f"config.json's {key} names no kind for the MTP layer (nor mtp_{key})")
    return given[layer]


def _limit(given: list | None, layer: int) -> float | None:
    """The MTP layer's GLU clamp: its entry where the list runs on past the model's layers, else the first layer's
    (transformers' MtpModel reads the list by the MTP layer's index, 0, where a saved config has cut it); 0 or none:
    unclamped."""
    if not given:
        return None
    limit = given[layer] if len(given) > layer else given[0]
    return float(limit) if limit else None
