"""Swiss AI's Apertus 1.5 text model (Apertus1p5TextForCausalLM; the text model of Apertus1p5ForConditionalGeneration,
whose images and audio are tokens of the same vocabulary, coded by tokenizers of its own Baton does not run yet):
Apertus's model over a vocabulary of text, visual and audio tokens whose LM head may be pruned to the text's first
`output_vocab_size` (the logits' columns past them are -inf: those tokens are input alone). Its config.json is
read as Apertus's."""
from __future__ import annotations

from engine.architectures import APERTUS

APERTUS1P5_TEXT = "Apertus1p5TextForCausalLM"
DEFAULTS = {"vocab_size": 266752}  # transformers' Apertus1p5TextConfig's, past Apertus's


def apertus1p5_keys(cfg: dict) -> dict:
    """ValueError for an LM head wider than the vocabulary or of no rows."""
    cfg = {**DEFAULTS, **cfg}
    output = cfg.get("output_vocab_size")
    if output is not None and not 1 <= int(output) <= int(cfg["vocab_size"]):
        raise ValueError(f"output_vocab_size {output} must be in [1, vocab_size {cfg['vocab_size']}]")
    return cfg


READ_AS = {APERTUS1P5_TEXT: APERTUS}
