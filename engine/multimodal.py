"""Multimodal checkpoints whose text model is served (images are not: a request is text or token ids).

Their config.json nests the text model's settings in `text_config`; their tensors hold the text model
under a prefix, beside a vision model and a projector left unread. Llama 4 (Scout, Maverick) and
Mistral 3 (Mistral Small 3.1/3.2, Magistral Small, Ministral 3) are released so.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class MultimodalCheckpoint:
    text_architecture: Callable[[dict], str]  # of text_config
    # (checkpoint prefix, the text model's), the first that matches a tensor's name applies
    text_prefixes: tuple[tuple[str, str], ...]
    vision_prefixes: tuple[str, ...]  # the tensors left unread

    def text_name(self, name: str) -> str | None:
        """The text model's name of checkpoint tensor `name`; None for a tensor of the vision side."""
        if name.startswith(self.vision_prefixes):
            return None
        for stored, model in self.text_prefixes:
            if name.startswith(stored):
                return model + name[len(stored):]
        return name


MISTRAL3_TEXT = {"ministral3": "Ministral3ForCausalLM", "mistral": "MistralForCausalLM"}

MULTIMODAL = {
    "Llama4ForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=lambda text_config: "Llama4ForCausalLM",
        text_prefixes=(("language_model.", ""),),
        vision_prefixes=("vision_model.", "multi_modal_projector.")),
    # As released (llava's names) and as transformers 5 saves it.
    "Mistral3ForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=lambda text_config: MISTRAL3_TEXT.get(text_config.get("model_type"), "?"),
        text_prefixes=(("language_model.", ""), ("model.language_model.", "model.")),
        vision_prefixes=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                         "model.multi_modal_projector.")),
}


def text_config(cfg: dict, wrapper: str) -> tuple[dict, str]:
    """A multimodal config.json's text model settings (the top level's, text_config's over them, but
    for tie_word_embeddings) and architecture. ValueError without a text_config."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{wrapper} without a text_config")
    merged = {**{k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}, **text}
    if "tie_word_embeddings" in cfg:  # whether the LM head is the embedding: the wrapper's, as transformers reads it
        merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return merged, MULTIMODAL[wrapper].text_architecture(text)
