"""Decoders with learnt positions instead of RoPE, over paged KV: Llama's layers with layer norms that have a bias
(engine/models/layer_norm_llama.py), an MLP without a gate, biases everywhere, and a learnt embedding of each position
added to the token's before the first layer.

- Meta's OPT (OPTForCausalLM: opt-125m to opt-66b but opt-350m's post-norm layout): fc1, ReLU, fc2; biases by
  `enable_bias`; its positions' table offset by 2 (two rows before position 0).
- OpenAI's GPT-2 (GPT2LMHeadModel): q, k and v in one projection (`c_attn`), GELU (tanh); its projections stored
  transposed (Conv1D's [in, out]), transposed as they load.
- BigCode's GPTBigCode (GPTBigCodeForCausalLM: StarCoder 1, SantaCoder, WizardCoder): GPT-2's names, its projections
  stored as Linear's; one k and v head for all q heads (`multi_query`), or every head's q, k and v in turn.
- EleutherAI's GPT-Neo (GPTNeoForCausalLM): GPT-2's layers with q, k and v apart and without biases, its scores not
  scaled (ModelConfig.attention_scale 1), every other layer (as `attention_types` says) over a sliding window.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.lora import Target
from engine.model_config import ModelConfig
from engine.models.layer_norm_llama import Jais2ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.parameters import empty_param
from engine.weights import renamed
from kernels.registry import Kernels

POSITION_OFFSET = 2  # OPT's table's rows before position 0 (its padding's, in fairseq)
# OPT's names against Llama's (the model's final norm before any layer's: it shares the name's end).
OPT_RENAMED = (("model.decoder.final_layer_norm.", "model.norm."),
               ("model.decoder.embed_tokens.", "model.embed_tokens."),
               ("model.decoder.embed_positions.", "model.embed_positions."), ("model.decoder.layers.", "model.layers."),
               (".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn_layer_norm.", ".input_layernorm."),
               (".final_layer_norm.", ".post_attention_layernorm."), (".fc1.", ".mlp.up_proj."),
               (".fc2.", ".mlp.down_proj."))


class OPTForCausalLM(Jais2ForCausalLM):
    renames = OPT_RENAMED
    position_offset = POSITION_OFFSET

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        self.position_embed = empty_param(config.max_position_embeddings + self.position_offset, config.hidden_size,
                                          dtype=dtype)

    def _scaled_inputs(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return h + F.embedding(positions + self.position_offset, self.position_embed)

    def checkpoint_names(self) -> list[str]:
        return [*super().checkpoint_names(), "model.embed_positions.weight"]

    def is_unused_tensor(self, name: str) -> bool:
        # Some releases save the LM head beside the embeddings it is tied to.
        return (name == "lm_head.weight" and self.config.tie_word_embeddings) or super().is_unused_tensor(name)

    def lora_target(self, module: str) -> Target | None:
        return super().lora_target(renamed(module + ".", self.renames).removesuffix("."))

    def _target(self, name: str) -> torch.Tensor:
        if name == "model.embed_positions.weight":
            return self.position_embed.data
        return super()._target(name)


# GPT-2's names against Llama's.
GPT2_RENAMED = (("transformer.wte.", "model.embed_tokens."), ("transformer.wpe.", "model.embed_positions."),
                ("transformer.ln_f.", "model.norm."), ("transformer.h.", "model.layers."),
                (".attn.c_attn.", ".self_attn.qkv_proj."), (".attn.c_proj.", ".self_attn.o_proj."),
                (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
                (".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))
GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")  # older checkpoints' masks, saved beside the weights


class GPT2LMHeadModel(OPTForCausalLM):
    renames = GPT2_RENAMED
    position_offset = 0
    bare_model_prefix = "transformer."  # where its releases' bare names (`wte`, `h.0...`) lie in the causal LM's
    stores_transposed = True  # its projections as Conv1D's, [in, out]

    def is_unused_tensor(self, name: str) -> bool:
        return name.endswith(GPT2_BUFFERS) or super().is_unused_tensor(name)

    def _attention_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.self_attn."
        return [p + f"{proj}.{kind}" for proj in ("qkv_proj", "o_proj") for kind in ("weight", "bias")]

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stores_transposed and name.endswith("_proj.weight"):
            tensor = tensor.t()
        if ".self_attn.qkv_proj." in name:
            attn = self.layers[int(name.split(".")[2])].attn
            return (attn.qkv_weight if name.endswith("weight") else attn.qkv_bias).data, tensor
        return super()._placed(name, tensor)


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    stores_transposed = False

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        if ".self_attn.qkv_proj." in name and cfg.num_kv_heads == cfg.num_heads:
            # [heads, (q, k, v), head_dim, ...] -> every q row, then every k's, then every v's
            heads = tensor.view(cfg.num_heads, 3, cfg.head_dim, *tensor.shape[1:])
            tensor = heads.transpose(0, 1).reshape(tensor.shape)
        return super()._placed(name, tensor)


# GPT-Neo's names against Llama's, where they are not GPT-2's.
GPT_NEO_RENAMED = ((".attn.attention.out_proj.", ".self_attn.o_proj."), (".attn.attention.", ".self_attn."),
                   *GPT2_RENAMED)
GPT_NEO_BUFFERS = (".attn.attention.bias", ".attn.attention.masked_bias")  # older checkpoints' masks


class GPTNeoForCausalLM(GPT2LMHeadModel):
    renames = GPT_NEO_RENAMED
    stores_transposed = False

    def is_unused_tensor(self, name: str) -> bool:
        return name.endswith(GPT_NEO_BUFFERS) or super().is_unused_tensor(name)

    def _attention_names(self, layer: int) -> list[str]:
        return LlamaForCausalLM._attention_names(self, layer)  # q, k and v apart, o's bias
