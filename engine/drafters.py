"""The drafter a config's speculative decoding names: n-gram drafts (engine/speculative.py), a draft model's
(engine/draft_model.py), an EAGLE head's or MTP layer's (engine/eagle.py), or a Gemma 4 assistant's
(engine/assistant_drafter.py)."""
from __future__ import annotations

import torch

from engine.assistant_drafter import AssistantDrafter
from engine.draft_model import DraftModel
from engine.eagle import EagleDrafter
from engine.gemma4_assistant_config import assistant_architecture
from engine.model_runner import ModelRunner
from engine.scheduler import Drafter
from engine.speculative import NgramDrafter, SpeculativeConfig


def make_drafter(speculative: SpeculativeConfig | None, target: ModelRunner, target_dir: str, dtype: torch.dtype,
                 device: str, max_model_len: int) -> Drafter | None:
    """None without speculative decoding; a draft model or head is loaded, its weights and all (a head hooked to
    `target`'s runner, whose hidden states it reads; an MTP layer from `target_dir`'s checkpoint unless the config
    names another directory)."""
    if speculative is None:
        return None
    if speculative.method == "ngram":
        return NgramDrafter(speculative)
    if speculative.method in ("eagle", "eagle3", "mtp"):
        return EagleDrafter(speculative.model or target_dir, speculative.method, speculative.num_speculative_tokens,
                            target, dtype, device, max_model_len, reads_served_checkpoint=speculative.model is None)
    if assistant_architecture(speculative.model) is not None:
        return AssistantDrafter(speculative.model, speculative.num_speculative_tokens, target, dtype, device,
                                max_model_len)
    return DraftModel(speculative.model, speculative.num_speculative_tokens, target.model_config, dtype,
                      device, max_model_len)
