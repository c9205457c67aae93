"""Llama's layers with layer norms that have a bias (before attention, before the MLP, and the final one), and an MLP
without a gate (ModelConfig.mlp_gated false):

- Jais 2 (Jais2ForCausalLM): its MLP up, squared ReLU, down; biases on q, k, v, o and the MLP by attention_bias and
  mlp_bias;
- StarCoder 2 (Starcoder2ForCausalLM): Mistral's sliding window; its MLP `c_fc`, GELU (tanh), `c_proj`; biases
  everywhere by `use_bias`.

Phi-3.5-MoE (PhimoeForCausalLM) has such layer norms too, before Mixtral's experts (routed by SparseMixer:
engine/models/moe.py), with biases on q, k, v and o by `attention_bias` and on its LM head by `lm_head_bias`; and
Phi-2 (PhiForCausalLM, Phi-1 and 1.5 too) computes attention and an MLP without a gate (`fc1`, GELU (tanh), `fc2`)
side by side from one such norm, with biases everywhere, its LM head's too, o named `dense`, RoPE over part of each
head; GPT-NeoX (GPTNeoXForCausalLM: Pythia, Dolly) has an MLP without a gate (`dense_h_to_4h`, exact GELU,
`dense_4h_to_h`) beside attention, each from a norm of its own (`use_parallel_residual`), q, k and v fused a head at
a time, RoPE over part of each head; and StableLM (StableLmForCausalLM) before Llama's gated MLP, with biases on q, k
and v by `use_qkv_bias`, RoPE over part of each head, q and k layer-normed a head by weights of its own
(`qk_layernorm`, as Command R+'s: engine/models/cohere.py), and attention and the MLP side by side from the one norm
(`use_parallel_residual`). Falcon, BLOOM, GPT-J and Persimmon are here too, each at its class.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora import Target
from engine.model_config import ModelConfig
from engine.models.cohere import CohereAttention
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import Attention, DecoderLayer
from engine.models.parameters import empty_param
from kernels.registry import Kernels

MLP_NAMES = {"c_fc": "up_proj", "c_proj": "down_proj"}  # its MLP's projections as Llama's names them
STARCODER2_RENAMED = tuple((f".mlp.{theirs}.", f".mlp.{ours}.") for theirs, ours in MLP_NAMES.items())


class LayerNormDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None,
                 is_sparse: bool = False, attention: type[Attention] = Attention) -> None:
        super().__init__(config, kernels, dtype, sliding_window, is_sparse, attention)
        self.input_norm_bias = empty_param(config.hidden_size, dtype=dtype)
        self.post_attention_norm_bias = empty_param(config.hidden_size, dtype=dtype)

    def forward(self, h, cos, sin, kv_cache, meta):
        width = (h.shape[-1],)
        h = h + self.attn(F.layer_norm(h, width, self.input_norm, self.input_norm_bias, self.eps), cos, sin, kv_cache,
                          meta)
        return h + self.mlp(F.layer_norm(h, width, self.post_attention_norm, self.post_attention_norm_bias, self.eps))


class Jais2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        self.norm_bias = empty_param(config.hidden_size, dtype=dtype)
        self.lm_head_bias = empty_param(config.vocab_size, dtype=dtype) if config.lm_head_bias else None

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return LayerNormDecoderLayer(self.config, self.kernels, dtype, self._window(layer), self._is_sparse(layer))

    def _final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(h, (h.shape[-1],), self.norm, self.norm_bias, self.config.rms_norm_eps)

    def _lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super()._lm_head_logits(hidden)
        return logits if self.lm_head_bias is None else logits + self.lm_head_bias

    def checkpoint_names(self) -> list[str]:
        biases = [f"model.layers.{i}.{norm}.bias" for i in range(self.config.num_layers) for norm in self._norm_names()]
        head = ["lm_head.bias"] if self.config.lm_head_bias else []
        return [*super().checkpoint_names(), "model.norm.bias", *biases, *head]

    def _target(self, name: str) -> torch.Tensor:
        if name == "model.norm.bias":
            return self.norm_bias.data
        if name == "lm_head.bias":
            return self.lm_head_bias.data
        parts = name.split(".")
        if len(parts) == 5 and parts[4] == "bias" and parts[3] in self._norm_names():
            layer = self.layers[int(parts[2])]
            return (layer.input_norm_bias if parts[3] == "input_layernorm" else layer.post_attention_norm_bias).data
        return super()._target(name)


class Starcoder2ForCausalLM(Jais2ForCausalLM):
    renames = STARCODER2_RENAMED

    def _lora_rows(self, layer: int, place: str, proj: str) -> Target | None:
        return super()._lora_rows(layer, place, MLP_NAMES.get(proj, proj) if place == "mlp" else proj)


class PhimoeForCausalLM(Jais2ForCausalLM):
    """(Its layers' and final norms, and its experts' names, are Jais 2's and Mixtral's: nothing of its own to read.)"""


class ParallelLayerNormDecoderLayer(LayerNormDecoderLayer):
    """Attention and the MLP side by side from one layer norm, both added to the residual."""

    def forward(self, h, cos, sin, kv_cache, meta):
        x = F.layer_norm(h, (h.shape[-1],), self.input_norm, self.input_norm_bias, self.eps)
        return h + self.attn(x, cos, sin, kv_cache, meta) + self.mlp(x)


class StableLmForCausalLM(Jais2ForCausalLM):
    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        kind = ParallelLayerNormDecoderLayer if self.config.parallel_residual else LayerNormDecoderLayer
        attention = CohereAttention if self.config.qk_norm == "head_layer_norm" else Attention
        return kind(self.config, self.kernels, dtype, self._window(layer), attention=attention)

    def _norm_names(self) -> tuple[str, ...]:
        return ("input_layernorm",) if self.config.parallel_residual else super()._norm_names()

    def _attention_names(self, layer: int) -> list[str]:
        names = [name for name in super()._attention_names(layer) if not name.endswith(("q_norm.weight",
                                                                                         "k_norm.weight"))]
        if self.config.qk_norm is None:
            return names
        p = f"model.layers.{layer}.self_attn."
        heads = {"q_layernorm": self.config.num_heads, "k_layernorm": self.config.num_kv_heads}
        return names + [p + f"{norm}.norms.{h}.weight" for norm, count in heads.items() for h in range(count)]

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) == 8 and parts[4] in ("q_layernorm", "k_layernorm"):  # one head's weights of the norm
            attn = self.layers[int(parts[2])].attn
            norm = attn.q_norm if parts[4] == "q_layernorm" else attn.k_norm
            return norm.data.view(-1, self.config.head_dim)[int(parts[6])]
        return super()._target(name)


# Phi-2's names against Llama's.
PHI_RENAMED = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.up_proj."),
               (".mlp.fc2.", ".mlp.down_proj."), ("model.final_layernorm.", "model.norm."))
PHI_PROJECTIONS = {"dense": "o_proj", "fc1": "up_proj", "fc2": "down_proj"}


class PhiForCausalLM(Jais2ForCausalLM):
    renames = PHI_RENAMED

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return ParallelLayerNormDecoderLayer(self.config, self.kernels, dtype, self._window(layer))

    def _norm_names(self) -> tuple[str, ...]:
        return ("input_layernorm",)

    def _lora_rows(self, layer: int, place: str, proj: str) -> Target | None:
        return super()._lora_rows(layer, place, PHI_PROJECTIONS.get(proj, proj))


# GPT-J's names against Llama's.
GPTJ_RENAMED = (("transformer.wte.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
                ("transformer.h.", "model.layers."), (".ln_1.", ".input_layernorm."),
                (".attn.out_proj.", ".self_attn.o_proj."), (".attn.", ".self_attn."), (".mlp.fc_in.", ".mlp.up_proj."),
                (".mlp.fc_out.", ".mlp.down_proj."))


class GPTJForCausalLM(PhiForCausalLM):
    """GPT-J: Phi-2's layers (attention beside an ungated tanh-GELU MLP from one layer norm, its LM head's bias) with
    RoPE's pairs side by side over its first `rotary_dim` dimensions a head, no biases on attention."""

    renames = GPTJ_RENAMED


class ParallelTwoNormLayer(LayerNormDecoderLayer):
    """Attention and the MLP side by side, each from a layer norm of its own, both added to the residual."""

    def forward(self, h, cos, sin, kv_cache, meta):
        width = (h.shape[-1],)
        attended = self.attn(F.layer_norm(h, width, self.input_norm, self.input_norm_bias, self.eps), cos, sin,
                             kv_cache, meta)
        return h + attended + self.mlp(F.layer_norm(h, width, self.post_attention_norm, self.post_attention_norm_bias,
                                                    self.eps))


# GPT-NeoX's names against Llama's (q, k and v fused, each head's three in turn: reordered as they load).
NEOX_RENAMED = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
                ("gpt_neox.layers.", "model.layers."), (".attention.query_key_value.", ".self_attn.qkv_proj."),
                (".attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
                (".mlp.dense_4h_to_h.", ".mlp.down_proj."), ("embed_out.", "lm_head."))
# Buffers older checkpoints (Pythia's) saved beside the weights: masks and RoPE's frequencies, made here anew.
NEOX_BUFFERS = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")


class GPTNeoXForCausalLM(Jais2ForCausalLM):
    renames = NEOX_RENAMED

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        kind = ParallelTwoNormLayer if self.config.parallel_residual else LayerNormDecoderLayer
        return kind(self.config, self.kernels, dtype, self._window(layer))

    def is_unused_tensor(self, name: str) -> bool:
        return name.endswith(NEOX_BUFFERS) or super().is_unused_tensor(name)

    def _attention_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.self_attn."
        kinds = ("weight", "bias") if self.config.qkv_bias else ("weight",)
        return [p + f"{proj}.{kind}" for proj in ("qkv_proj", "o_proj") for kind in kinds]

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if ".self_attn.qkv_proj." in name:  # [heads, (q, k, v), head_dim, ...] -> every q row, then k's, then v's
            attn = self.layers[int(name.split(".")[2])].attn
            target = attn.qkv_weight if name.endswith("weight") else attn.qkv_bias
            heads = tensor.view(self.config.num_heads, 3, self.config.head_dim, *tensor.shape[1:])
            return target.data, heads.transpose(0, 1).reshape(tensor.shape)
        return super()._placed(name, tensor)


# Persimmon's names against Llama's (q, k and v fused each head's three in turn, as GPT-NeoX's).
PERSIMMON_RENAMED = (("model.final_layernorm.", "model.norm."), (".self_attn.query_key_value.", ".self_attn.qkv_proj."),
                     (".self_attn.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
                     (".mlp.dense_4h_to_h.", ".mlp.down_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
                     (".self_attn.k_layernorm.", ".self_attn.k_norm."))


class SharedLayerNormQkAttention(Attention):
    """q and k layer-normed a head by one LayerNorm's weight and bias for every head (Persimmon's), before RoPE."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None) -> None:
        super().__init__(config, kernels, dtype, sliding_window)
        if config.qk_norm is not None:
            self.q_norm, self.k_norm = (empty_param(config.head_dim, dtype=dtype) for _ in range(2))
            self.q_norm_bias, self.k_norm_bias = (empty_param(config.head_dim, dtype=dtype) for _ in range(2))

    def _projection_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, num_tokens, width = self.config, q.shape[0], (self.config.head_dim,)
        q = F.layer_norm(q.view(num_tokens, -1, cfg.head_dim), width, self.q_norm, self.q_norm_bias, cfg.rms_norm_eps)
        k = F.layer_norm(k.view(num_tokens, -1, cfg.head_dim), width, self.k_norm, self.k_norm_bias, cfg.rms_norm_eps)
        return q.flatten(1), k.flatten(1)


class PersimmonForCausalLM(GPTNeoXForCausalLM):
    renames = PERSIMMON_RENAMED

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return LayerNormDecoderLayer(self.config, self.kernels, dtype, self._window(layer),
                                     attention=SharedLayerNormQkAttention)

    def _attention_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.self_attn."
        norms = [p + f"{norm}.{kind}" for norm in ("q_norm", "k_norm") for kind in ("weight", "bias")]
        return super()._attention_names(layer) + (norms if self.config.qk_norm else [])

    def _target(self, name: str) -> torch.Tensor:
        if name.endswith(("self_attn.q_norm.bias", "self_attn.k_norm.bias")):
            attn = self.layers[int(name.split(".")[2])].attn
            return (attn.q_norm_bias if ".q_norm." in name else attn.k_norm_bias).data
        return super()._target(name)


# Falcon's names against Llama's.
FALCON_RENAMED = (("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
                  ("transformer.h.", "model.layers."), (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
                  (".self_attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
                  (".mlp.dense_4h_to_h.", ".mlp.down_proj."), (".ln_attn.", ".input_layernorm."),
                  (".ln_mlp.", ".post_attention_layernorm."))


class FalconForCausalLM(GPTNeoXForCausalLM):
    """(engine/falcon_config.py) q, k and v fused: 40B's and 180B's a group of q heads and their k and v head at a
    time, 7B's every q head then the one k and v, the others' each head's three in turn (as GPT-NeoX's)."""

    renames = FALCON_RENAMED

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        cfg = self.config
        kind = LayerNormDecoderLayer if not cfg.parallel_residual else \
            ParallelTwoNormLayer if cfg.parallel_norms == 2 else ParallelLayerNormDecoderLayer
        return kind(cfg, self.kernels, dtype, self._window(layer))

    def _norm_names(self) -> tuple[str, ...]:
        cfg = self.config
        return ("input_layernorm",) if cfg.parallel_residual and cfg.parallel_norms == 1 else super()._norm_names()

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        if ".self_attn.qkv_proj." not in name or cfg.num_kv_heads == cfg.num_heads:
            return super()._placed(name, tensor)
        attn = self.layers[int(name.split(".")[2])].attn
        target = attn.qkv_weight if name.endswith("weight") else attn.qkv_bias
        if cfg.num_kv_heads == 1:  # every q head, then k, then v: as Llama's
            return target.data, tensor
        per_group = cfg.num_heads // cfg.num_kv_heads
        groups = tensor.view(cfg.num_kv_heads, per_group + 2, cfg.head_dim, *tensor.shape[1:])
        q, k, v = groups.split([per_group, 1, 1], dim=1)
        return target.data, torch.cat([part.reshape(-1, *tensor.shape[1:]) for part in (q, k, v)])


# BLOOM's names against Llama's (q, k and v fused each head's three in turn, as GPT-NeoX's).
BLOOM_RENAMED = (("transformer.word_embeddings_layernorm.", "model.embed_norm."),
                 ("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
                 ("transformer.h.", "model.layers."), (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
                 (".self_attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
                 (".mlp.dense_4h_to_h.", ".mlp.down_proj."))


class BloomForCausalLM(GPTNeoXForCausalLM):
    """BLOOM: GPT-NeoX's fused heads in layers one after the other, ALiBi for positions, its embeddings layer-normed."""

    renames = BLOOM_RENAMED

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        self.embed_norm = empty_param(config.hidden_size, dtype=dtype)
        self.embed_norm_bias = empty_param(config.hidden_size, dtype=dtype)

    def _scaled_inputs(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(h, (h.shape[-1],), self.embed_norm, self.embed_norm_bias, self.config.rms_norm_eps)

    def checkpoint_names(self) -> list[str]:
        return [*super().checkpoint_names(), "model.embed_norm.weight", "model.embed_norm.bias"]

    def _target(self, name: str) -> torch.Tensor:
        if name.startswith("model.embed_norm."):
            return (self.embed_norm if name.endswith("weight") else self.embed_norm_bias).data
        return super()._target(name)
