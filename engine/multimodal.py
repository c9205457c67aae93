"""Multimodal checkpoints whose text model is served, and their images where Baton has their encoder
(Gemma 3's and 4's, Mistral 3's, Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's and Llama 4's: engine/vision/).

Their config.json nests the text model's settings in `text_config`; their tensors hold the text model
under a prefix, beside a vision model and a projector left unread. Llama 4 (Scout, Maverick), Mistral 3
(Mistral Small 3.1/3.2, Magistral Small, Ministral 3), Gemma 3 (4B, 12B, 27B), Gemma 4, Kimi K2.5, Qwen3.5,
Qwen4-Exp, Gemma 3n and Step-3.7 (its text model at the top level) are released so.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.apertus1p5_config import APERTUS1P5_TEXT
from engine.architectures import COHERE_COMPASS
from engine.gemma3n_config import GEMMA3N, GEMMA3N_TEXT_DEFAULTS
from engine.gemma4_config import GEMMA4, GEMMA4_TEXT_DEFAULTS, GEMMA4_UNIFIED
from engine.linear_attention_config import QWEN3_5, QWEN3_5_MOE
from engine.minimax_m3_config import MINIMAX_M3
from engine.qwen4_exp_config import QWEN4_EXP
from engine.step3p7_config import STEP3P7, TEXT_DEFAULTS as STEP3P7_TEXT_DEFAULTS
from engine.vision.vision_config import (
    VisionConfig,
    gemma3_vision_config,
    gemma4_vision_config,
    llama4_vision_config,
    mistral3_vision_config,
    qwen2_5_vl_vision_config,
    qwen2_vl_vision_config,
    qwen3_5_vision_config,
    qwen3_vl_vision_config,
    step3p7_vision_config,
)


@dataclass(frozen=True)
class MultimodalCheckpoint:
    text_architecture: Callable[[dict], str]  # of text_config
    # (checkpoint prefix, the text model's), the first that matches a tensor's name applies
    text_prefixes: tuple[tuple[str, str], ...]
    vision_prefixes: tuple[str, ...]  # the tensors left unread
    # What transformers' text config class takes where text_config leaves a key out (released configs
    # may give only what differs from them).
    text_defaults: Mapping[str, Any] = field(default_factory=dict)
    # Its images' encoder settings from config.json, where Baton serves its images (engine/vision/); None: text only.
    vision_config: Callable[[dict], VisionConfig] | None = None
    # Its multimodal RoPE's sections interleaved over a head's frequencies (Qwen3-VL's), whatever config.json says.
    interleaved_mrope: bool = False

    def text_name(self, name: str) -> str | None:
        """The text model's name of checkpoint tensor `name`; None for a tensor of the vision side."""
        if name.startswith(self.vision_prefixes):
            return None
        for stored, model in self.text_prefixes:
            if name.startswith(stored):
                return model + name[len(stored):]
        return name


MISTRAL3_TEXT = {"ministral3": "Ministral3ForCausalLM", "mistral": "MistralForCausalLM",
                 "mistral4": "Mistral4ForCausalLM"}  # Mistral Small 4's


# Module-level, not lambdas: a ModelConfig is pickled to a model's other tensor-parallel ranks.
def _named(architecture: str, text_config: dict) -> str:
    return architecture


def _mistral3_text_architecture(text_config: dict) -> str:
    return MISTRAL3_TEXT.get(text_config.get("model_type"), "?")

# Gemma3TextConfig's: Gemma 3's 4B, 12B and 27B configs give text_config only their sizes, window and RoPE scaling.
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
                        "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
                        "attention_bias": False, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}

MULTIMODAL = {
    "Llama4ForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, "Llama4ForCausalLM"),
        text_prefixes=(("language_model.", ""), ("model.language_model.", "model.")),
        vision_prefixes=("vision_model.", "multi_modal_projector.", "model.vision_model.",
                         "model.multi_modal_projector."),
        vision_config=llama4_vision_config),
    # As released (llava's names) and as transformers 5 saves it.
    # As released (llava's names: the language model's `model.` under `language_model.`) and as transformers 5
    # saves it; Gemma 3's LM head is its embedding.
    "Gemma3ForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, "Gemma3ForCausalLM"),
        text_prefixes=(("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                       ("model.language_model.", "model.")),
        vision_prefixes=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                         "model.multi_modal_projector."),
        text_defaults=GEMMA3_TEXT_DEFAULTS, vision_config=gemma3_vision_config),
    # Gemma 4 (E2B, E4B, 31B, 26B-A4B) as released and as transformers 5 saves it: its text model and its images
    # served, its audio encoder not yet (left unread).
    "Gemma4ForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, GEMMA4),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio."),
        text_defaults=GEMMA4_TEXT_DEFAULTS, vision_config=gemma4_vision_config),
    # Gemma 3n (E2B, E4B) as released and as transformers 5 saves it: its text model served, its MobileNet-V5 image
    # and audio encoders not yet (left unread).
    "Gemma3nForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, GEMMA3N),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio."),
        text_defaults=GEMMA3N_TEXT_DEFAULTS),
    # Gemma 4 unified (google/gemma-4-12B-it) as transformers 5 saves it: its text model served, its image and audio
    # embedders not yet (left unread).
    "Gemma4UnifiedForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, GEMMA4_UNIFIED),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("model.embed_vision.", "model.embed_audio.")),
    # Kimi K2.5 as released (remote code's name; its text model DeepSeek-V3's, `kimi_k2`) and as transformers 5 names
    # it: its text model served, its MoonViT tower not yet.
    **dict.fromkeys(("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"), MultimodalCheckpoint(
        text_architecture=functools.partial(_named, "DeepseekV3ForCausalLM"),
        text_prefixes=(("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                       ("model.language_model.", "model.")),
        vision_prefixes=("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector."))),
    "Mistral3ForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=_mistral3_text_architecture,
        text_prefixes=(("language_model.", ""), ("model.language_model.", "model.")),
        vision_prefixes=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                         "model.multi_modal_projector."),
        vision_config=mistral3_vision_config),
    # As released (a flat config.json: the text model's settings at its top level, its tensors the causal LM's,
    # the tower's under `visual.`) and as transformers 5 saves it (text_config; `model.language_model.`).
    "Qwen2VLForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, "Qwen2ForCausalLM"),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("visual.", "model.visual."), vision_config=qwen2_vl_vision_config),
    "Qwen2_5_VLForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, "Qwen2ForCausalLM"),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("visual.", "model.visual."), vision_config=qwen2_5_vl_vision_config),
    # As released and as transformers 5 saves it: its text model Qwen3's, with interleaved multimodal RoPE.
    "Qwen3VLForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, "Qwen3ForCausalLM"),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("visual.", "model.visual."), vision_config=qwen3_vl_vision_config, interleaved_mrope=True),
    # Its text model Qwen3-MoE's, each layer's experts fused in two tensors (MoEConfig.fused_experts).
    "Qwen3VLMoeForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, "Qwen3MoeForCausalLM"),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("visual.", "model.visual."), vision_config=qwen3_vl_vision_config, interleaved_mrope=True),
    # Qwen3.5 as released (each size multimodal): its hybrid text model (engine/models/qwen3_next.py) and Qwen3-VL's
    # tower without DeepStack, with Qwen3-VL's interleaved multimodal RoPE.
    "Qwen3_5ForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, QWEN3_5),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("visual.", "model.visual."), vision_config=qwen3_5_vision_config, interleaved_mrope=True),
    "Qwen3_5MoeForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, QWEN3_5_MOE),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("visual.", "model.visual."), vision_config=qwen3_5_vision_config, interleaved_mrope=True),
    # MiniMax-M3 as released: its text model (engine/models/minimax_m3.py) by MiniMax's names; its images not yet.
    "MiniMaxM3SparseForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, MINIMAX_M3),
        text_prefixes=(("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                       ("model.language_model.", "model.")),
        vision_prefixes=("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "model.vision_tower.",
                         "model.multi_modal_projector.")),
    # Qwen4-Exp as released: its text model (engine/models/qwen4_exp.py); its images not yet.
    "Qwen4ExpForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, QWEN4_EXP),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("visual.", "model.visual."), interleaved_mrope=True),
    # Cohere's North (Cohere Compass): its text model Command A's with Qwen3-VL's interleaved multimodal RoPE in the
    # layers with RoPE, Qwen3-VL's tower and DeepStack.
    "CohereCompassForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, COHERE_COMPASS),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("visual.", "model.visual."), vision_config=qwen3_vl_vision_config, interleaved_mrope=True),
    # Apertus 1.5 as released: its text model, its LM head pruned (engine/apertus1p5_config.py); its images' and audio's
    # tokenizers (codes of its vocabulary) not yet.
    "Apertus1p5ForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, APERTUS1P5_TEXT),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("model.vision_tokenizer.", "model.audio_tokenizer.")),
    # Step-3.7 as released: its text model (engine/models/step3p7.py) by StepFun's names, at the top level; its images
    # by its own tower (engine/vision/step3p7_images.py).
    "Step3p7ForConditionalGeneration": MultimodalCheckpoint(
        text_architecture=functools.partial(_named, STEP3P7),
        text_prefixes=(("model.language_model.", "model."),),
        vision_prefixes=("vision_model.", "vit_large_projector.", "model.vision_model.",
                         "model.multi_modal_projector."),
        text_defaults=STEP3P7_TEXT_DEFAULTS, vision_config=step3p7_vision_config),
}


def text_config(cfg: dict, wrapper: str) -> tuple[dict, str]:
    """A multimodal config.json's text model settings (the top level's, text_config's over them, but
    for tie_word_embeddings) and architecture: the top level's alone where the text model's sizes are there
    (Qwen2.5-VL's released configs). ValueError without them."""
    text = cfg.get("text_config")
    if text is None and "hidden_size" in cfg:
        text = {}
    if not isinstance(text, dict):
        raise ValueError(f"{wrapper} without a text_config")
    wrapper_keys = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    merged = {**MULTIMODAL[wrapper].text_defaults, **wrapper_keys, **text}
    if "tie_word_embeddings" in cfg:  # whether the LM head is the embedding: the wrapper's, as transformers reads it
        merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return merged, MULTIMODAL[wrapper].text_architecture(text)


def takes_images(cfg: dict) -> bool:
    """Whether config.json's model is one whose images Baton serves."""
    archs = cfg.get("architectures") or [None]
    checkpoint = MULTIMODAL.get(archs[0])
    return checkpoint is not None and checkpoint.vision_config is not None
