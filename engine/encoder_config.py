"""BERT-family encoders (BertModel, RobertaModel, XLMRobertaModel) as embedding models, as vLLM
serves them: every token attends to every other, and a prompt's embedding pools its last hidden
states as its sentence-transformers `Pooling` module says (the [CLS] token's, their mean, or the
last token's; without one, the [CLS] token's, vLLM's default for these).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ENCODERS = ("BertModel", "RobertaModel", "XLMRobertaModel")
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")


def is_encoder(config: dict) -> bool:
    """Whether config.json (as read_model_config reads it) names an encoder Baton serves."""
    return any(arch in ENCODERS for arch in config.get("architectures") or ())


@dataclass(frozen=True)
class EncoderConfig:
    pooling: str  # "cls", "mean" or "last"
    layer_norm_eps: float
    type_vocab_size: int  # rows of token type embeddings: every token is type 0 (one segment)
    # RoBERTa's positions start after its padding index: position p reads row p + position_offset.
    position_offset: int


def read_encoder_config(cfg: dict, arch: str, model_dir: Path) -> EncoderConfig:
    """KeyError for a missing field; ValueError for what is not served."""
    act = cfg.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r} for {arch} (one of {', '.join(ACTIVATIONS)})")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {cfg['position_embedding_type']!r} is not supported (absolute only)")
    return EncoderConfig(pooling=sentence_transformers_pooling(model_dir) or "cls",
                         layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                         type_vocab_size=int(cfg.get("type_vocab_size", 2)),
                         position_offset=position_offset(cfg))


def position_offset(cfg: dict) -> int:
    """Rows of the position embeddings before position 0: RoBERTa's padding index and those before it."""
    archs = cfg.get("architectures") or ()
    return int(cfg.get("pad_token_id", 1)) + 1 if "RobertaModel" in archs or "XLMRobertaModel" in archs else 0


def sentence_transformers_pooling(model_dir: Path) -> str | None:
    """The pooling of the directory's sentence-transformers Pooling module; None without one."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return None
    modules = json.loads(modules_path.read_text())
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return None
    path = model_dir / pooling.get("path", "") / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    modes = [mode for key, mode in POOLING_MODES.items() if config.get(key)]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in POOLING_MODES)
    if others or len(modes) != 1:
        raise ValueError(f"{path}: pooling {', '.join(others + modes) or 'none'} is not supported "
                         f"(one of {', '.join(POOLING_MODES)})")
    return modes[0]
