"""The multi-token prediction layer JetBrains' Mellum 2 checkpoints carry under `mtp.` (transformers' MtpModel,
`generate(use_mtp=True)`; `{"method": "mtp"}` here; engine/eagle.py drafts with it as with an EAGLE head).

At position q it reads the token at q + 1 and the target's last (normed) hidden state at q, each RMS-normed
(`pre_fc_norm_embedding`, `pre_fc_norm_hidden`), joined by `fc`, through one decoder layer of the model's own kind
whose attention and MLP are of the kinds config.json's `mtp_layer_types` and `mtp_mlp_layer_types` name (a
sliding-window layer with experts where they are left out, as transformers reads them); `mtp.norm` norms the output,
which makes logits through the target's LM head and is itself the next draft's hidden state, as transformers chains
its MTP layers. Its embeddings and LM head are the target's (read whole beside a target split across ranks, each
holding a share of them); no position's embedding is zeroed.
"""
from __future__ import annotations

import dataclasses

import torch

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.mtp import LayerUnderPrefix, joined_head_config

OWN = "mtp."


class MellumMTP(LayerUnderPrefix, LlamaForCausalLM):
    layer_prefix = OWN + "layers.0."

    def _own_names(self) -> dict[str, torch.Tensor]:
        return {OWN + "fc.weight": self.fc_weight, OWN + "pre_fc_norm_embedding.weight": self.embedding_norm,
                OWN + "pre_fc_norm_hidden.weight": self.hidden_norm, OWN + "norm.weight": self.norm}


def mellum_mtp_config(raw: dict, target: ModelConfig, reads_vocabulary: bool = False) -> ModelConfig:
    """The head's ModelConfig: the target's, of one layer of the kinds config.json (`raw`) names. ValueError for more
    layers than one, or a kind it does not name."""
    count = int(raw.get("num_mtp_layers") or raw.get("num_nextn_predict_layers") or 0)
    if count != 1:
        raise ValueError(f"config.json's num_mtp_layers is {count}; Mellum's checkpoints carry one MTP layer")
    (attention,) = raw.get("mtp_layer_types") or ["sliding_attention"]
    (mlp,) = raw.get("mtp_mlp_layer_types") or ["sparse"]
    if attention not in ("sliding_attention", "full_attention") or mlp not in ("sparse", "dense"):
        raise ValueError(f"an MTP layer of kinds {attention!r} and {mlp!r} is not supported")
    moe = dataclasses.replace(target.moe, dense_layers=frozenset() if mlp == "sparse" else frozenset({0}))
    return joined_head_config(target, "MellumMTP", reads_vocabulary, moe=moe,
                              sliding_layers=frozenset({0}) if attention == "sliding_attention" else frozenset())
