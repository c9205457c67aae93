"""BERT-family encoders (BertModel, RobertaModel, XLMRobertaModel, ModernBertModel) as embedding
models, and their *ForSequenceClassification checkpoints (cross-encoder rerankers: ms-marco-MiniLM,
bge-reranker, gte-reranker-modernbert) as classifiers, as vLLM serves them: every token attends to
every other, and a prompt's embedding pools its last hidden states as its sentence-transformers
`Pooling` module says (the [CLS] token's, their mean, or the last token's; without one, and always
for a BERT or RoBERTa classifier, the [CLS] token's; a ModernBERT classifier's classifier_pooling).
A pair of texts is told apart by token types where the model has them (BERT's): a token after the
first [SEP] is of the second text, as the tokenizer's pair template writes them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Architecture → where its encoder's tensors are (their names' prefix) and which head it has.
ENCODERS = {"BertModel": ("", None), "RobertaModel": ("", None), "XLMRobertaModel": ("", None),
            "BertForSequenceClassification": ("bert.", "pooler"),
            "RobertaForSequenceClassification": ("roberta.", "dense"),
            "XLMRobertaForSequenceClassification": ("roberta.", "dense"),
            "ModernBertModel": ("", None), "ModernBertForSequenceClassification": ("model.", "modernbert")}
MODERN_BERTS = ("ModernBertModel", "ModernBertForSequenceClassification")
ROBERTAS = tuple(arch for arch in ENCODERS if "Roberta" in arch)
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")


def is_encoder(config: dict) -> bool:
    """Whether config.json (as read_model_config reads it) names an encoder Baton serves."""
    return any(arch in ENCODERS for arch in config.get("architectures") or ())


@dataclass(frozen=True)
class EncoderConfig:
    pooling: str  # "cls", "mean" or "last"
    layer_norm_eps: float
    type_vocab_size: int  # rows of token type embeddings
    # RoBERTa's positions start after its padding index: position p reads row p + position_offset.
    position_offset: int
    prefix: str = ""  # of its encoder's tensor names: a classifier's checkpoint nests it ("bert.")
    # A classifier's head on the [CLS] token's hidden state, before its rows of logits: "pooler", BERT's
    # pooler (dense, tanh); "dense", RoBERTa's classifier.dense (dense, tanh); None: no head.
    head: str | None = None
    # The [SEP] that ends a pair's first text, where token types tell them apart (tokenizer_config.json's
    # sep_token; the engine finds its id in the tokenizer it loads).
    sep_token: str | None = None
    hidden_act: str = "gelu"
    # ModernBERT's: RoPE (its global layers' theta, and its sliding ones'), every `global_every`th layer
    # over the whole input and the others over the tokens at most `sliding_window` away, no biases but
    # where the config asks for them, and its classifier head's activation. 0.0: learned positions.
    rope_theta: float = 0.0
    local_rope_theta: float = 0.0
    sliding_window: int | None = None
    global_every: int = 1
    norm_bias: bool = True
    attention_bias: bool = True
    mlp_bias: bool = True
    head_act: str = "gelu"
    head_bias: bool = True  # (ModernBERT's classifier_bias: its head's dense layer's)


def read_encoder_config(cfg: dict, arch: str, model_dir: Path) -> EncoderConfig:
    """KeyError for a missing field; ValueError for what is not served."""
    if arch in MODERN_BERTS:
        return _read_modernbert_config(cfg, arch, model_dir)
    act = cfg.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r} for {arch} (one of {', '.join(ACTIVATIONS)})")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {cfg['position_embedding_type']!r} is not supported (absolute only)")
    prefix, head = ENCODERS[arch]
    type_vocab_size = int(cfg.get("type_vocab_size", 2))
    return EncoderConfig(pooling="cls" if head else sentence_transformers_pooling(model_dir) or "cls",
                         layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)), type_vocab_size=type_vocab_size,
                         position_offset=position_offset(cfg), prefix=prefix, head=head,
                         sep_token=_sep_token(model_dir) if type_vocab_size > 1 else None, hidden_act=act)


def _read_modernbert_config(cfg: dict, arch: str, model_dir: Path) -> EncoderConfig:
    prefix, head = ENCODERS[arch]
    acts = {"hidden_act": cfg.get("hidden_activation", "gelu"), "head_act": cfg.get("classifier_activation", "gelu")}
    for key, act in acts.items():
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported {key} {act!r} for {arch} (one of {', '.join(ACTIVATIONS)})")
    types = cfg.get("layer_types")
    every = int(cfg.get("global_attn_every_n_layers", 3))
    if types is not None and types != [("sliding_attention" if i % every else "full_attention")
                                       for i in range(int(cfg["num_hidden_layers"]))]:
        raise ValueError(f"layer_types other than a global layer every {every} are not supported")
    rope = cfg.get("rope_parameters") or {}
    pooling = cfg.get("classifier_pooling", "cls") if head else sentence_transformers_pooling(model_dir) or "cls"
    if pooling not in ("cls", "mean"):
        raise ValueError(f"classifier_pooling {pooling!r} is not supported (cls or mean)")
    return EncoderConfig(
        pooling=pooling, layer_norm_eps=float(cfg.get("norm_eps", 1e-5)), type_vocab_size=1, position_offset=0,
        prefix=prefix, head=head, hidden_act=acts["hidden_act"], head_act=acts["head_act"],
        rope_theta=float(rope.get("full_attention", {}).get("rope_theta", cfg.get("global_rope_theta", 160000.0))),
        local_rope_theta=float(rope.get("sliding_attention", {}).get("rope_theta",
                                                                      cfg.get("local_rope_theta", 10000.0))),
        sliding_window=int(cfg.get("local_attention", 128)) // 2, global_every=every,
        norm_bias=bool(cfg.get("norm_bias", False)), attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)), head_bias=bool(cfg.get("classifier_bias", False)))


def _sep_token(model_dir: Path) -> str | None:
    """tokenizer_config.json's sep_token; None without one."""
    path = model_dir / "tokenizer_config.json"
    sep = json.loads(path.read_text()).get("sep_token") if path.is_file() else None
    if isinstance(sep, dict):
        sep = sep.get("content")
    return sep if isinstance(sep, str) else None


def position_offset(cfg: dict) -> int:
    """Rows of the position embeddings before position 0: RoBERTa's padding index and those before it."""
    is_roberta = any(arch in ROBERTAS for arch in cfg.get("architectures") or ())
    return int(cfg.get("pad_token_id", 1)) + 1 if is_roberta else 0


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
