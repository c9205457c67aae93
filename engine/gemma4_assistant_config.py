"""Gemma 4's assistant drafters (Gemma4AssistantForCausalLM, google/gemma-4-*-it-assistant; Gemma 4 unified's,
Gemma4UnifiedAssistantForCausalLM), read from config.json:
a small Gemma 4 text model (`text_config`) whose every layer attends over its target's KV, not any of its own, and
what joins it to the target: its input a projection of [the target's embedding of the last token | the target's last
hidden state] (`backbone_hidden_size` wide), its output projected back to that width for its next draft, and its
logits by its LM head, or (`use_ordered_embeddings`) by the LM head's rows of the `centroid_intermediate_top_k` of
`num_centroids` clusters of tokens a centroid layer scores best (`token_ordering` lists each cluster's tokens).

Its layers read the target's pages: each layer of a kind those of the target's last layer of that kind computing KV
(as transformers' target hands them over, `shared_kv_states`), so each kind's heads must be the target's.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from engine.gemma4_config import FULL, GEMMA4, GEMMA4_UNIFIED, SLIDING, Gemma4Assistant, Gemma4Layout
from engine.model_config import ModelConfig
from engine.model_config_loader import load_model_config

GEMMA4_ASSISTANT = "Gemma4AssistantForCausalLM"
# Gemma 4 unified's (google/gemma-4-12b-it's): its text model Gemma 4 unified's, read with its defaults.
GEMMA4_UNIFIED_ASSISTANT = "Gemma4UnifiedAssistantForCausalLM"
ASSISTANTS = {GEMMA4_ASSISTANT: GEMMA4, GEMMA4_UNIFIED_ASSISTANT: GEMMA4_UNIFIED}  # by the text model they are made of


def assistant_architecture(model_dir: str) -> str | None:
    """The Gemma 4 assistant `model_dir` holds; None for another model (or none: the draft model's loading names
    what is missing)."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return next((arch for arch in config.get("architectures") or [] if arch in ASSISTANTS), None)


def load_assistant_config(model_dir: str, target: ModelConfig) -> ModelConfig:
    """The assistant in `model_dir` drafting for `target`, its layers placed in the target's pages; ValueError where
    it cannot draft for it."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    text = raw.get("text_config") or {}
    if target.gemma4 is None:
        raise ValueError(f"{model_dir}: a Gemma 4 assistant drafts for a Gemma 4 target, not {target.architecture}")
    backbone = int(raw.get("backbone_hidden_size", 1536))
    if backbone != target.hidden_size or int(text.get("vocab_size", 0)) != target.vocab_size:
        raise ValueError(f"{model_dir}: the assistant was trained for a target {backbone} wide of "
                         f"{text.get('vocab_size')} tokens, not {target.hidden_size} wide of {target.vocab_size}")
    if text.get("hidden_size_per_layer_input") or text.get("enable_moe_block") or text.get("use_double_wide_mlp"):
        raise ValueError(f"{model_dir}: an assistant with per-layer embeddings, experts or double-wide MLPs is not "
                         "read (transformers' refuses them too)")
    # Read as a Gemma 4 text model whose layers compute KV, then placed in the target's pages.
    architecture = assistant_architecture(model_dir)
    config = load_model_config(model_dir, {**text, "architectures": [ASSISTANTS[architecture]],
                                           "num_kv_shared_layers": 0})
    own, theirs = config.gemma4, target.gemma4
    for kind, mine, target_heads in ((SLIDING, own.sliding, theirs.sliding), (FULL, own.full, theirs.full)):
        if (mine.num_kv_heads, mine.head_dim) != (target_heads.num_kv_heads, target_heads.head_dim):
            raise ValueError(f"{model_dir}: its {kind} layers' KV heads ({mine.num_kv_heads} of {mine.head_dim}) are "
                             f"not its target's ({target_heads.num_kv_heads} of {target_heads.head_dim})")
    computing = range(theirs.first_sharing_layer)  # the target's layers computing KV; each kind's last is read
    sources = {theirs.layer_types[i]: theirs.kv_places[i] for i in computing}
    if set(own.layer_types) - set(sources):
        raise ValueError(f"{model_dir}: its layers' kinds {sorted(set(own.layer_types))} are not all its target's")
    layout = Gemma4Layout(
        layer_types=own.layer_types, sliding=dataclasses.replace(own.sliding, page_parts=theirs.sliding.page_parts),
        full=dataclasses.replace(own.full, page_parts=theirs.full.page_parts),
        kv_places=tuple(sources[kind] for kind in own.layer_types), num_kv_layers=theirs.num_kv_layers,
        first_sharing_layer=0, double_wide_layers=frozenset(), per_layer_width=0, per_layer_vocab_size=0,
        page_heads=theirs.page_heads, page_head_dim=theirs.page_head_dim)
    ordered = bool(raw.get("use_ordered_embeddings", False))
    assistant = Gemma4Assistant(backbone, int(raw.get("num_centroids", 2048)) if ordered else 0,
                                int(raw.get("centroid_intermediate_top_k", 32)))
    if assistant.num_centroids and target.vocab_size % assistant.num_centroids:
        raise ValueError(f"{model_dir}: {assistant.num_centroids} centroids do not split {target.vocab_size} tokens")
    return dataclasses.replace(config, architecture=architecture, gemma4=layout, gemma4_assistant=assistant,
                               num_kv_heads=theirs.page_heads, head_dim=theirs.page_head_dim)
