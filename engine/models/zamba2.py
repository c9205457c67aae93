"""Zyphra's Zamba2 (Zamba2ForCausalLM; engine/zamba2_config.py): Mamba-2 layers (engine/models/mamba2.py), the hybrid
ones first running a shared transformer block on their input beside the embeddings.

A shared block RMS-norms [h | embeddings] (twice the hidden size), attends over the layer's own pages (its heads
2 x hidden / heads wide, RoPE where use_mem_rope says) back to the hidden size, RMS-norms that and runs a gated GELU
MLP; each hybrid layer's application adds low-rank adapters of its own to q, k, v and to the MLP's gate and up. The
block's output, through the layer's own projection (`linear`), joins the layer's input to its Mamba-2 layer (not the
residual): h + mamba(norm(h + linear(block(h)))).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.hybrid import HybridForward
from engine.models.llama_layers import MLP, Attention, KVCache
from engine.models.mamba2 import Mamba2Mixer
from engine.models.parameters import empty_param
from engine.prompt_embeds import GivenEmbeddings
from kernels.registry import Kernels

ADAPTER_LISTS = {"q": "self_attn.linear_q_adapter_list", "k": "self_attn.linear_k_adapter_list",
                 "v": "self_attn.linear_v_adapter_list", "gate_up": "feed_forward.gate_up_proj_adapter_list"}


class Adapters(nn.Module):
    """One hybrid layer's low-rank adapters: for each projection adapted (the MLP's gate and up; q, k and v where the
    model adapts attention), down [r, in] and up [out, r]."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, linear) -> None:
        super().__init__()
        rank, wide, self.linear = config.zamba2.adapter_rank, 2 * config.hidden_size, linear
        self.names = ("q", "k", "v", "gate_up") if config.zamba2.adapts_attention else ("gate_up",)
        for name in self.names[:-1]:
            setattr(self, f"{name}_down", empty_param(rank, wide, dtype=dtype))
            setattr(self, f"{name}_up", empty_param(wide, rank, dtype=dtype))
        self.gate_up_down = empty_param(rank, config.hidden_size, dtype=dtype)
        self.gate_up_up = empty_param(2 * config.intermediate_size, rank, dtype=dtype)

    def delta(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.linear(x, getattr(self, f"{name}_down")), getattr(self, f"{name}_up"))


class AdaptedAttention(Attention):
    """Attention over the wide input, back to the hidden size, with the application's adapters on q, k and v."""

    # The running application's adapters, while it runs (in a tuple: a module attribute would register them here).
    running: tuple[Adapters | None] = (None,)

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, hidden_size: int) -> None:
        super().__init__(config, kernels, dtype, None)
        self.o_weight = empty_param(hidden_size, config.q_size, dtype=dtype)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super()._qkv(x)
        adapters = self.running[0]
        if adapters is None or "q" not in adapters.names:
            return q, k, v
        return tuple(t + adapters.delta(name, x).view_as(t) for name, t in zip(("q", "k", "v"), (q, k, v)))


class AdaptedMLP(MLP):
    running: tuple[Adapters | None] = (None,)  # as AdaptedAttention's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.linear(x, self.gate_up_weight, self.gate_up_bias)
        if self.running[0] is not None:
            gate_up = gate_up + self.running[0].delta("gate_up", x)
        return self.linear(self._glu(*gate_up.split(self.intermediate_size, dim=-1)), self.down_weight,
                           self.down_bias)


class SharedBlock(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.rms_norm, self.eps = kernels.rms_norm, config.rms_norm_eps
        wide = dataclasses.replace(config, hidden_size=2 * config.hidden_size)
        self.input_norm = empty_param(wide.hidden_size, dtype=dtype)
        self.attn = AdaptedAttention(wide, kernels, dtype, config.hidden_size)
        self.pre_ff_norm = empty_param(config.hidden_size, dtype=dtype)
        self.mlp = AdaptedMLP(config, kernels, dtype)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, cos, sin, kv_cache: KVCache, meta: AttentionMetadata,
                adapters: Adapters | None) -> torch.Tensor:
        self.attn.running = self.mlp.running = (adapters,)
        try:
            x = self.rms_norm(torch.cat((h, embedded), dim=-1), self.input_norm, self.eps)
            attended = self.attn(x, cos, sin, kv_cache, meta)
            return self.mlp(self.rms_norm(attended, self.pre_ff_norm, self.eps))
        finally:
            self.attn.running = self.mlp.running = (None,)


class Zamba2Layer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, layer: int,
                 block: SharedBlock | None) -> None:
        super().__init__()
        self.rms_norm, self.eps, self.linear = kernels.rms_norm, config.rms_norm_eps, kernels.linear
        self.input_norm = empty_param(config.hidden_size, dtype=dtype)
        self.mamba = Mamba2Mixer(config, kernels, dtype, layer)
        self._block = (block,)  # (the model holds the blocks: a tuple keeps this layer from registering one again)
        if block is not None:
            self.block_projection = empty_param(config.hidden_size, config.hidden_size, dtype=dtype)  # `linear`
            self.adapters = Adapters(config, dtype, kernels.linear)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, cos, sin, kv_cache: KVCache | None,
                meta: AttentionMetadata) -> torch.Tensor:
        block = self._block[0]
        x = h
        if block is not None:
            x = h + self.linear(block(h, embedded, cos, sin, kv_cache, meta, self.adapters), self.block_projection)
        return h + self.mamba(self.rms_norm(x, self.input_norm, self.eps), meta)


class Zamba2ForCausalLM(HybridForward):
    # A hybrid layer's Mamba-2 layer and its norm under `mamba_decoder.`, read as a Mamba-2 layer's are.
    renames = (("model.final_layernorm.", "model.norm."), (".mamba_decoder.", "."))
    serves_loras = False  # (its shared blocks' adapters are its own; LoRA on them not yet checked)
    stored_convolutions = (".mamba.conv1d.weight",)

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        shared = self.config.zamba2
        if "shared_blocks" not in self._modules:  # (made with the first layer: the layers share them)
            self.shared_blocks = nn.ModuleList(SharedBlock(self.config, self.kernels, dtype)
                                               for _ in range(shared.num_blocks))
        block = self.shared_blocks[shared.block_of(layer)] if layer in shared.hybrid_layers else None
        return Zamba2Layer(self.config, self.kernels, dtype, layer, block)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        h = self._embed(input_ids)
        if given is not None:
            h = given.placed(h)
        embedded, places = h, self.config.kv_places
        for i, (layer, (cos, sin)) in enumerate(zip(self.layers, self._ropes(positions))):
            h = layer(h, embedded, cos, sin, kv_caches[places[i]] if i in places else None, meta)
        return self._final_norm(h)

    def checkpoint_names(self) -> list[str]:
        shared = self.config.zamba2
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        names += [] if self.config.tie_word_embeddings else ["lm_head.weight"]
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", *(p + "mamba." + name for name in layer.mamba.tensor_names())]
            if i in shared.hybrid_layers:
                names.append(p + "linear.weight")
        for block in range(shared.num_blocks):
            p = f"model.layers.{shared.hybrid_layers[block]}.shared_transformer."
            names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
            names += [p + "input_layernorm.weight", p + "pre_ff_layernorm.weight",
                      p + "feed_forward.gate_up_proj.weight", p + "feed_forward.down_proj.weight"]
            if self.config.mlp_bias:
                names += [p + "feed_forward.gate_up_proj.bias", p + "feed_forward.down_proj.bias"]
        for j, layer in enumerate(shared.hybrid_layers):  # under the first layer of the block each application uses
            p = f"model.layers.{shared.hybrid_layers[j % shared.num_blocks]}.shared_transformer."
            names += [p + f"{ADAPTER_LISTS[name]}.{j}.{k}.weight" for name in self.layers[layer].adapters.names
                      for k in (0, 1)]
        return names

    def is_unused_tensor(self, name: str) -> bool:
        """A block's tensors as a later layer using it holds them too, where a checkpoint repeats them, and adapters
        a block holds for applications of another (transformers' blocks hold a list of every application's)."""
        parts, shared = name.split("."), self.config.zamba2
        if len(parts) < 5 or parts[3] != "shared_transformer":
            return super().is_unused_tensor(name)
        firsts = shared.hybrid_layers[:shared.num_blocks]
        if int(parts[2]) not in firsts:
            return True
        application = next((int(name.split(list_name + ".")[1].split(".")[0]) for list_name in ADAPTER_LISTS.values()
                            if list_name + "." in name), None)
        return application is not None and application % shared.num_blocks != firsts.index(int(parts[2]))

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            return super()._target(name)
        layer = self.layers[int(parts[2])]
        if parts[3] == "input_layernorm":
            return layer.input_norm.data
        if parts[3] == "mamba":
            return layer.mamba.tensor(".".join(parts[4:]))
        if parts[3] == "linear":
            return layer.block_projection.data
        return self._shared_target(int(parts[2]), ".".join(parts[4:]))

    def _shared_target(self, layer: int, leaf: str) -> torch.Tensor:
        """Where `leaf` of layer `layer`'s shared_transformer goes: its block's, or (an adapter) the application's."""
        shared = self.config.zamba2
        for name, prefix in ADAPTER_LISTS.items():
            if leaf.startswith(prefix + "."):
                application, half = leaf[len(prefix) + 1:].split(".")[:2]
                adapters = self.layers[shared.hybrid_layers[int(application)]].adapters
                return getattr(adapters, f"{name}_{'down' if half == '0' else 'up'}").data
        block = self.shared_blocks[shared.block_of(layer)]
        attn, cfg = block.attn, block.attn.config
        if leaf.startswith("self_attn."):
            proj = leaf.split(".")[1]
            if proj == "o_proj":
                return attn.o_weight.data
            start = {"q_proj": 0, "k_proj": cfg.q_size, "v_proj": cfg.q_size + cfg.kv_size}[proj]
            return attn.qkv_weight.data[start:start + (cfg.q_size if proj == "q_proj" else cfg.kv_size)]
        targets = {"input_layernorm.weight": block.input_norm, "pre_ff_layernorm.weight": block.pre_ff_norm,
                   "feed_forward.gate_up_proj.weight": block.mlp.gate_up_weight,
                   "feed_forward.gate_up_proj.bias": block.mlp.gate_up_bias,
                   "feed_forward.down_proj.weight": block.mlp.down_weight,
                   "feed_forward.down_proj.bias": block.mlp.down_bias}
        return targets[leaf].data
