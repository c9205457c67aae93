"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) over paged KV, served for embeddings, and their
sequence classifiers (cross-encoder rerankers) with their heads.

Every token of a prompt attends to every other: a prompt is computed in one chunk (the scheduler
keeps an encoder's prompts whole and the engine caches no prefix of them), and its embedding pools
the chunk's last hidden states (ModelConfig.pooling). Its K/V are written into the pages all the
same, so the one token an embedding request makes (and drops), and a worker's warm-up requests,
run the decode path as a decoder's do; the "logits" are the hidden states against the word
embeddings, an LM head these models lack.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.lora import LoRABatch
from engine.model_config import ModelConfig
from engine.models.parameters import empty_param
from kernels.registry import Kernels

KVCache = tuple[torch.Tensor, torch.Tensor]
ACTIVATIONS = {"gelu": F.gelu, "gelu_new": functools.partial(F.gelu, approximate="tanh"),
               "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}
# A checkpoint's tensors named so (after its prefix) are read by nothing here: the pooler's dense layer
# where no head reads it (sentence embeddings pool the hidden states themselves), and the ids
# buffers older checkpoints saved.
# A classifier's head tensors, by module (its name after the prefix): (weight, bias) attributes.
HEAD_PARAMS = {"pooler.dense": ("head_weight", "head_bias"), "classifier.dense": ("head_weight", "head_bias"),
               "classifier": ("classifier", "classifier_bias"),
               "classifier.out_proj": ("classifier", "classifier_bias")}
UNUSED_NAMES = ("pooler.", "embeddings.position_ids", "embeddings.token_type_ids")


def bidirectional_attention(ops: Kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                            meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """q, k, v [T, H, D] → [T, H, D]: a whole prompt's tokens each over all of them (with `window`, over
    those at most `window` positions away); decode rows, and a chunk after cached tokens (a generation
    request's, never an embedding's), as a decoder's over all before them."""
    k_cache, v_cache = kv_cache
    ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    num_decode = meta.num_decode_tokens
    if num_decode:
        out[:num_decode] = ops.decode_attention(q[:num_decode], k_cache, v_cache, meta.decode_block_tables,
                                                meta.decode_context_lens, scale, None, None, None, None)
    for chunk in meta.prefills:
        s, e = chunk.start, chunk.end
        if chunk.context_len:
            out[s:e] = ops.prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk.block_table,
                                             chunk.context_len, scale)
            continue
        near = None
        if window is not None:
            at = torch.arange(e - s, device=q.device)
            near = (at[:, None] - at[None, :]).abs() <= window
        out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1).unsqueeze(0),
                                                  k[s:e].transpose(0, 1).unsqueeze(0),
                                                  v[s:e].transpose(0, 1).unsqueeze(0), attn_mask=near,
                                                  scale=scale)[0].transpose(0, 1)
    return out


class EncoderLayer(nn.Module):
    """Post-norm: attention, add, LayerNorm; feed-forward, add, LayerNorm."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.kernels = config, kernels
        hidden, inter = config.hidden_size, config.intermediate_size
        self.qkv_weight = empty_param(3 * hidden, hidden, dtype=dtype)
        self.qkv_bias = empty_param(3 * hidden, dtype=dtype)
        self.o_weight = empty_param(hidden, hidden, dtype=dtype)
        self.o_bias = empty_param(hidden, dtype=dtype)
        self.attn_norm_weight = empty_param(hidden, dtype=dtype)
        self.attn_norm_bias = empty_param(hidden, dtype=dtype)
        self.up_weight = empty_param(inter, hidden, dtype=dtype)
        self.up_bias = empty_param(inter, dtype=dtype)
        self.down_weight = empty_param(hidden, inter, dtype=dtype)
        self.down_bias = empty_param(hidden, dtype=dtype)
        self.out_norm_weight = empty_param(hidden, dtype=dtype)
        self.out_norm_bias = empty_param(hidden, dtype=dtype)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, h: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        cfg, eps = self.config, self.config.rms_norm_eps
        q, k, v = F.linear(h, self.qkv_weight, self.qkv_bias).unflatten(-1, (3, cfg.num_heads, cfg.head_dim)).unbind(1)
        attn = bidirectional_attention(self.kernels, q, k, v, kv_cache, meta, cfg.attention_scale)
        h = F.layer_norm(h + F.linear(attn.flatten(1), self.o_weight, self.o_bias), (cfg.hidden_size,),
                         self.attn_norm_weight, self.attn_norm_bias, eps)
        x = F.linear(self.act(F.linear(h, self.up_weight, self.up_bias)), self.down_weight, self.down_bias)
        return F.layer_norm(h + x, (cfg.hidden_size,), self.out_norm_weight, self.out_norm_bias, eps)


class BertModel(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = config
        encoder = config.encoder
        hidden = config.hidden_size
        self.word_embeddings = empty_param(config.vocab_size, hidden, dtype=dtype)
        self.position_embeddings = empty_param(config.max_position_embeddings + encoder.position_offset, hidden,
                                               dtype=dtype)
        self.token_type_embeddings = empty_param(encoder.type_vocab_size, hidden, dtype=dtype)
        self.norm_weight = empty_param(hidden, dtype=dtype)
        self.norm_bias = empty_param(hidden, dtype=dtype)
        self.layers = nn.ModuleList(EncoderLayer(config, kernels, dtype) for _ in range(config.num_layers))
        self.lora_batch = LoRABatch()
        self.sep_token_id: int | None = None  # EncoderConfig.sep_token's, set by the engine from its tokenizer
        # A classifier's head: a dense layer and tanh on the [CLS] state (BERT's pooler, RoBERTa's
        # classifier.dense), then its rows of logits (`classifier`, None without a head) and their biases.
        self.head_weight = self.head_bias = self.classifier = self.classifier_bias = None
        if encoder.head is not None:
            self.head_weight = empty_param(hidden, hidden, dtype=dtype)
            self.head_bias = empty_param(hidden, dtype=dtype)
            self.classifier = empty_param(len(config.labels), hidden, dtype=dtype)
            self.classifier_bias = empty_param(len(config.labels), dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: None = None) -> torch.Tensor:
        # `given`: None, as admission refuses a prompt given as embeddings to an encoder.
        types = self._token_types(input_ids, meta)
        h = (F.embedding(input_ids, self.word_embeddings)
             + F.embedding(positions + self.config.encoder.position_offset, self.position_embeddings)
             + (self.token_type_embeddings[0] if types is None else F.embedding(types, self.token_type_embeddings)))
        h = F.layer_norm(h, (self.config.hidden_size,), self.norm_weight, self.norm_bias, self.config.rms_norm_eps)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, kv_cache, meta)
        return h

    def _token_types(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Each token's type where the model tells a pair's texts apart: 1 after its prompt's first
        [SEP], as the pair template writes the second text; None: every token is type 0."""
        sep = self.sep_token_id
        if sep is None:
            return None
        types = torch.zeros_like(input_ids)
        for chunk in meta.prefills:
            if chunk.context_len == 0:  # a whole prompt (an encoder's inputs are computed whole)
                is_sep = (input_ids[chunk.start:chunk.end] == sep).long()
                types[chunk.start:chunk.end] = (is_sep.cumsum(0) - is_sep > 0).long()
        return types

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.word_embeddings).float()

    def classify(self, cls_state: torch.Tensor) -> torch.Tensor:
        """A classifier's logits from its input's [CLS] hidden state [H] (its pooled embedding)."""
        pooled = torch.tanh(F.linear(cls_state, self.head_weight.float(), self.head_bias.float()))
        return F.linear(pooled, self.classifier.float(), self.classifier_bias.float())

    def lora_target(self, module: str) -> None:
        """No projection of an encoder takes LoRA adapters here: every one of an adapter's is refused."""
        return None

    def serve_loras(self) -> None:
        """Never called: no adapter loads (lora_target)."""

    # --- weights -----------------------------------------------------------------

    def checkpoint_names(self) -> list[str]:
        encoder = self.config.encoder
        p = encoder.prefix
        names = [f"{p}embeddings.{x}.weight" for x in ("word_embeddings", "position_embeddings",
                                                      "token_type_embeddings")]
        names += [f"{p}embeddings.LayerNorm.weight", f"{p}embeddings.LayerNorm.bias"]
        for i in range(self.config.num_layers):
            for module in ("attention.self.query", "attention.self.key", "attention.self.value",
                           "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
                           "output.dense", "output.LayerNorm"):
                names += [f"{p}encoder.layer.{i}.{module}.{kind}" for kind in ("weight", "bias")]
        heads = {"pooler": (f"{p}pooler.dense", "classifier"), "dense": ("classifier.dense", "classifier.out_proj")}
        for module in heads.get(encoder.head, ()):
            names += [f"{module}.weight", f"{module}.bias"]
        return names

    def is_unused_tensor(self, name: str) -> bool:
        encoder = self.config.encoder
        unused = UNUSED_NAMES[1:] if encoder.head == "pooler" else UNUSED_NAMES
        return name.removeprefix(encoder.prefix).startswith(unused)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            target = self._target(name)
            if target.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)

    def _target(self, name: str) -> torch.Tensor:
        module, kind = name.removeprefix(self.config.encoder.prefix).rsplit(".", 1)
        if module in HEAD_PARAMS:
            return getattr(self, HEAD_PARAMS[module][kind == "bias"]).data
        parts = module.split(".")
        if parts[0] == "embeddings":
            if parts[1] == "LayerNorm":
                return (self.norm_weight if kind == "weight" else self.norm_bias).data
            return getattr(self, parts[1]).data
        layer = self.layers[int(parts[2])]
        module = ".".join(parts[3:])
        hidden = self.config.hidden_size
        qkv = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}
        if module in qkv:
            rows = slice(qkv[module] * hidden, (qkv[module] + 1) * hidden)
            return (layer.qkv_weight if kind == "weight" else layer.qkv_bias).data[rows]
        params = {"attention.output.dense": "o", "attention.output.LayerNorm": "attn_norm",
                  "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "out_norm"}
        return getattr(layer, f"{params[module]}_{kind}").data
