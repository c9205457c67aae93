"""The drafter a config's speculative decoding names: n-gram drafts (engine/speculative.py) or a
draft model's (engine/draft_model.py)."""
from __future__ import annotations

import torch

from engine.draft_model import DraftModel
from engine.model_config import ModelConfig
from engine.scheduler import Drafter
from engine.speculative import NgramDrafter, SpeculativeConfig


def make_drafter(speculative: SpeculativeConfig | None, model_config: ModelConfig, dtype: torch.dtype,
                 device: str, max_model_len: int) -> Drafter | None:
    """None without speculative decoding; a draft model is loaded, its weights and all."""
    if speculative is None:
        return None
    if speculative.method == "ngram":
        return NgramDrafter(speculative)
    return DraftModel(speculative.model, speculative.num_speculative_tokens, model_config, dtype,
                      device, max_model_len)
