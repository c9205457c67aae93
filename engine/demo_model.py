"""A tiny Llama with random weights and a locally trained tokenizer (engine/demo_tokenizer.py).

`make_demo_model` writes a Hugging Face `LlamaForCausalLM` directory (config,
safetensors weights, tokenizer.json, tokenizer and generation configs) from a
seed, offline, in a few seconds. It is what `baton generate` serves when no
model is given, and what tests load into both Baton and `transformers`.
Nothing here imports `transformers`: it stays a test-only dependency.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, pre_tokenizers

from engine.demo_model_dir import default_demo_model_dir, is_demo_model_dir
from engine.demo_tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END_TOKEN,
    SPECIAL_TOKENS,
    THINK_TOKENS,
    demo_tokenizer,
)
from engine.dtypes import TORCH_DTYPES

# Weight scales (see `_make_weights`): chosen so the residual stream, attention
# and logits all stay O(1) at any size, which keeps greedy decoding varied and
# the top-1/top-2 logit gap well above float32 noise.
EMBED_STD = 1.0
QK_GAIN = 1.5  # sharper-than-uniform attention, so positions and the KV cache matter
LOGIT_STD = 3.0
NORM_NOISE_STD = 0.1  # norms ~1 but not exactly 1, so a norm weight left unloaded shows


def make_demo_model(
    path: str | os.PathLike,
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 8192,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
    init_gain: float = 1.0,
    think_tokens: bool = False,
) -> Path:
    """Write a random-weight Llama model directory at `path` and return it.

    The same arguments give byte-identical files (on one torch version; the tokenizer is the same
    on every Python up to engine/demo_tokenizer.py's SHIPPED_VOCAB_SIZE). `intermediate_size=None`
    means 8/3 x hidden, rounded up to a multiple of 64. The tokenizer may hold fewer than `vocab_size`
    tokens when the corpus runs out of merges; the embedding rows beyond it are unused.
    `init_gain` scales every projection's weights (1.0: unit-variance outputs
    for unit-RMS inputs). `think_tokens`: the tokenizer also has `<think>` and `</think>` as
    tokens of their own, as reasoning models' do. Existing files of the same names are overwritten.
    """
    if intermediate_size is None:
        intermediate_size = 64 * math.ceil(hidden_size * 8 / 3 / 64)
    _check_args(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab_size,
                 max_position_embeddings, dtype)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = demo_tokenizer(vocab_size - len(THINK_TOKENS) if think_tokens else vocab_size)
    if think_tokens:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tokenizer.save(str(out / "tokenizer.json"))
    bos_id, eos_id, im_end_id = (tokenizer.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, IM_END_TOKEN))

    head_dim = hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        # Both spellings: transformers 5 reads rope_parameters, older readers rope_theta.
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": bos_id,
        # A chat turn ends at <|im_end|>, plain text at <|end_of_text|>.
        "eos_token_id": [eos_id, im_end_id],
    })
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
    })

    weights = _make_weights(config, seed, init_gain)
    weights = {name: w.to(TORCH_DTYPES[dtype]).contiguous() for name, w in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates the file 0600; other users (a service container) read it too.
    (out / "model.safetensors").chmod(0o644)
    return out


def ensure_demo_model(path: str | os.PathLike | None = None, **dims) -> Path:
    """Return the demo model directory, making it on first use with the defaults, or with
    `dims` (`make_demo_model`'s keyword arguments; a directory of other dims is not checked).

    The model is written to a temporary sibling and renamed into place, so a
    crash never leaves half a model, and processes racing to make it all end
    up with the one that was renamed first. An existing non-empty directory
    that is not a complete model is an error, never overwritten.
    """
    target = Path(path).expanduser() if path is not None else default_demo_model_dir()
    if is_demo_model_dir(target):
        return target
    if target.exists() and any(target.iterdir()):
        raise ValueError(f"{target} exists but is not a complete demo model; remove it to remake it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        make_demo_model(tmp, **dims)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, target)  # replaces an empty directory too (POSIX)
        except OSError:
            if not is_demo_model_dir(target):
                raise
            # Another process finished first; its model is the same as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check_args(hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 intermediate_size: int, vocab_size: int, max_position_embeddings: int, dtype: str) -> None:
    sizes = dict(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                 num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                 max_position_embeddings=max_position_embeddings)
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    if (hidden_size // num_heads) % 2:
        raise ValueError(f"head_dim ({hidden_size // num_heads}) must be even for RoPE")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    min_vocab = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be >= {min_vocab} (bytes + special tokens), got {vocab_size}")
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")


def _make_weights(config: dict, seed: int, init_gain: float) -> dict[str, torch.Tensor]:
    """Seeded float32 weights under HF Llama names, drawn in a fixed order.

    Each projection W: [out, in] is N(0, gain^2 / in), so a unit-RMS input gives
    unit-variance outputs and every layer adds O(1) to the residual stream: the
    embedding, attention and MLP all visibly steer the next token. lm_head is
    scaled to logits of std LOGIT_STD, whose top-1/top-2 gaps average about
    LOGIT_STD / sqrt(2 ln vocab) (~0.7 at 8192 tokens).
    """
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def linear(out_dim: int, in_dim: int, gain: float = 1.0) -> torch.Tensor:
        return normal((out_dim, in_dim), gain * init_gain / math.sqrt(in_dim))

    def norm() -> torch.Tensor:
        return 1.0 + normal((hidden,), NORM_NOISE_STD)

    w = {"model.embed_tokens.weight": normal((vocab, hidden), EMBED_STD)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = linear(q_dim, hidden, QK_GAIN)
        w[p + "self_attn.k_proj.weight"] = linear(kv_dim, hidden, QK_GAIN)
        w[p + "self_attn.v_proj.weight"] = linear(kv_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, q_dim)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    w["model.norm.weight"] = norm()
    w["lm_head.weight"] = normal((vocab, hidden), LOGIT_STD / math.sqrt(hidden))
    return w


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")
