"""The checkpoint an engine serves, changed in place: a later checkpoint of the same model read
into the model's tensors (SGLang's update_weights_from_disk: a trainer's next one), or the served
one read again (its memory given back to the host, engine/memory_release.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from engine.model_config import ModelConfig
from engine.model_config_loader import load_model_config
from engine.vocabulary import vocabulary_ids

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def update_weights(engine: LLMEngine, model_dir: str | Path) -> int | None:
    """`LLMEngine.update_weights`: the number of prefix blocks forgotten; None while pages are held."""
    if engine.block_manager.num_free_blocks < engine.block_manager.num_blocks:
        return None
    model_config = load_model_config(Path(model_dir), engine.config.hf_overrides)
    differs = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "weights_dtype"
               and getattr(model_config, f.name) != getattr(engine.model_config, f.name)]
    if differs:
        raise ValueError(f"{model_dir} is not the served model's shape: its {', '.join(differs)} differ")
    served, engine.weights_dir = engine.weights_dir, str(model_dir)
    try:
        engine.reload_weights()
    except BaseException:
        # Failed part way (a bad tensor in its last shard): the model holds some of each checkpoint.
        engine.weights_dir = served
        engine.reload_weights()
        raise
    return engine.block_manager.reset_prefix_cache()


def reload_weights(engine: LLMEngine) -> None:
    """`LLMEngine.reload_weights`: the served checkpoint (`weights_dir`) read into the model again."""
    engine.runner.load_weights(engine.weights_dir)
    if engine.draft_model is not None and engine.draft_model.reads_served_checkpoint:  # its MTP layer is in it
        engine.draft_model.runner.load_weights(engine.weights_dir)
    if engine.model_config.classifier_tokens:  # made from the LM head's rows, which have changed
        engine.runner.model.make_classifier(vocabulary_ids(engine.model_config.classifier_tokens, engine.tokenizer))
    engine.released_memory.discard("weights")
