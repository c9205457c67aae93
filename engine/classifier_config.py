"""What a sequence classifier's config.json says of its head, read without torch (the gateway reads
it too): its labels, and where its head comes from. A `*ForSequenceClassification` checkpoint stores
its head (`score.weight`); one whose config names `classifier_from_token` (vLLM's way to serve a
causal LM as a classifier, with `--hf-overrides`) makes it from its LM head's rows of those tokens,
and with `is_original_qwen3_reranker` (Qwen3-Reranker as released, tokens "no" and "yes") from the
second row minus the first: one label, whose sigmoid is P("yes") against "no"."""
from __future__ import annotations

from typing import Any

SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def is_sequence_classifier(cfg: dict[str, Any]) -> bool:
    return any(a.endswith(SEQUENCE_CLASSIFICATION) for a in cfg.get("architectures") or ())


def classifier_tokens(cfg: dict[str, Any]) -> tuple[str, ...]:
    """The vocabulary tokens whose LM-head rows make the head; (): the checkpoint stores it."""
    tokens = tuple(cfg.get("classifier_from_token") or ())
    if cfg.get("is_original_qwen3_reranker") and len(tokens) != 2:
        raise ValueError(f"is_original_qwen3_reranker needs classifier_from_token of two tokens (no, yes), "
                         f"got {list(tokens)}")
    return tokens


def classifier_labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """The head's labels by row, as transformers names them (LABEL_i where config.json names none)."""
    tokens = classifier_tokens(cfg)
    if cfg.get("is_original_qwen3_reranker"):
        return ("LABEL_0",)
    if tokens:
        return tokens
    id2label = cfg.get("id2label") or {}
    num_labels = len(id2label) or int(cfg.get("num_labels", 2))
    return tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(num_labels))
