"""Gemma 4's text decoder (Gemma4ForCausalLM) over paged KV; its layout is engine/gemma4_config.py's.

- Gemma's four norms a layer (before and after attention and the MLP), its embeddings times
  sqrt(hidden_size), its tied LM head and soft-capped logits; unlike Gemma 3's, its norms weigh by
  their weights as they are (no 1 added), and each layer's output is scaled by its `layer_scalar`.
- q, k and v are each RMS-normed per head (v without a weight) and q·k is not scaled: the norms
  set its size.
- Experts (26B-A4B): beside each layer's MLP, on the same input, a token's top-k experts (GELU-gated, each
  weighed by its router's renormalized softmax times its learnt scale); the two outputs normed and summed.
- Per-layer embeddings: after its MLP block, a layer gates its own slice of them by a GELU of a
  projection of its output, projects the product back to the hidden size, norms it and adds it.
- Split across ranks, each holds its share of every layer's heads and of the MLP's and experts' widths; the
  per-layer embeddings are whole on each (every rank adds the same), and the pages whole too.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.gemma4_config import FULL, SLIDING, Gemma4Experts, Gemma4Heads
from engine.lora import LoRAHook, Target
from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import ACTIVATIONS, MLP, KVCache, RankSum, paged_attention
from engine.models.parameters import empty_param
from engine.prompt_embeds import GivenEmbeddings
from kernels.registry import Kernels

NORMS = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "pre_feedforward_norm", "post_feedforward_layernorm": "post_feedforward_norm",
         "post_per_layer_input_norm": "post_per_layer_norm"}
EXPERT_NORMS = {"post_feedforward_layernorm_1": "post_mlp_norm", "pre_feedforward_layernorm_2": "pre_experts_norm",
                "post_feedforward_layernorm_2": "post_experts_norm"}


class Gemma4Attention(nn.Module):
    takes_lora = True  # (each layer of its own shape)
    lora: LoRAHook | None = None  # set by the model: adds the step's LoRA deltas to q, k, v and o
    rank_sum: RankSum | None = None  # set where the model is split: sums o's output across the ranks

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, heads: Gemma4Heads,
                 sliding_window: int | None, computes_kv: bool, first_page_head: int) -> None:
        super().__init__()
        self.kernels, self.eps = kernels, config.rms_norm_eps
        self.heads, self.sliding_window, self.computes_kv = heads, sliding_window, computes_kv
        # Its heads of its pool layer's pages (a sharing layer's, those of the layer it shares).
        self.page_heads = slice(first_page_head, first_page_head + heads.num_kv_heads * heads.page_parts)
        self.num_heads = config.num_heads
        self.q_size, self.kv_size = config.num_heads * heads.head_dim, heads.num_kv_heads * heads.head_dim
        num_kv_projections = 0 if not computes_kv else 1 if heads.values_are_keys else 2
        # q, k and v fused into one matmul (k alone where values are keys, q alone where the KV is another layer's).
        self.qkv_weight = empty_param(self.q_size + num_kv_projections * self.kv_size, config.hidden_size, dtype=dtype)
        self.o_weight = empty_param(config.hidden_size, self.q_size, dtype=dtype)
        self.q_norm = empty_param(heads.head_dim, dtype=dtype)
        self.k_norm = empty_param(heads.head_dim, dtype=dtype) if computes_kv else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        ops, heads, num_tokens = self.kernels, self.heads, x.shape[0]
        qkv = ops.linear(x, self.qkv_weight)
        if self.lora is not None:
            self.lora.add("qkv", x, qkv)
        q = ops.rms_norm(qkv[:, :self.q_size].view(num_tokens, self.num_heads, heads.head_dim), self.q_norm, self.eps)
        k = v = None
        if self.computes_kv:
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(num_tokens, heads.num_kv_heads, heads.head_dim)
            v = k if heads.values_are_keys else qkv[:, self.q_size + self.kv_size:].view(k.shape)
            v = F.rms_norm(v.float(), (heads.head_dim,), eps=self.eps).to(v.dtype)
            q, k = ops.apply_rope(q, ops.rms_norm(k, self.k_norm, self.eps), cos, sin)
        else:
            q, _ = ops.apply_rope(q, q[:, :0], cos, sin)
        pages = tuple(cache[self.page_heads] for cache in kv_cache)
        # An image's tokens attend to each other both ways in the sliding-window layers only (transformers' masks).
        out = paged_attention(ops, q, k, v, pages, meta, 1.0, self.sliding_window, None, head_parts=heads.page_parts,
                              bidirectional=self.sliding_window is not None)
        attended = out.view(num_tokens, self.q_size)
        projected = ops.linear(attended, self.o_weight)
        if self.lora is not None:
            projected = self.lora.add("o", attended, projected)
        return projected if self.rank_sum is None else self.rank_sum(projected)


class Gemma4MoE(nn.Module):
    """The experts beside a layer's MLP, and their router."""

    rank_sum: RankSum | None = None  # set where the model is split: sums the experts' outputs across the ranks

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, experts: Gemma4Experts) -> None:
        super().__init__()
        self.linear, self.eps, self.top_k = kernels.linear, config.rms_norm_eps, experts.top_k
        self.activation = ACTIVATIONS[config.hidden_act]
        hidden, width = config.hidden_size, experts.width
        self.router_weight = empty_param(experts.num_experts, hidden, dtype=dtype)
        self.router_scale = empty_param(hidden, dtype=dtype)
        self.expert_scale = empty_param(experts.num_experts, dtype=dtype)
        self.gate_up_weight = empty_param(experts.num_experts, 2 * width, hidden, dtype=dtype)
        self.down_weight = empty_param(experts.num_experts, hidden, width, dtype=dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights [T, k], from the layer's input x [T, H]."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        scores = F.linear(normed * self.router_scale * x.shape[-1] ** -0.5, self.router_weight)
        weights, experts = torch.topk(F.softmax(scores, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.expert_scale[experts], experts

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():  # ascending, as transformers sums them
            tokens, slot = torch.where(experts == expert)
            gate, up = self.linear(x[tokens], self.gate_up_weight[expert]).chunk(2, dim=-1)
            made = self.linear(self.activation(gate) * up, self.down_weight[expert])
            out.index_add_(0, tokens, (made * weights[tokens, slot, None]).to(x.dtype))
        return out if self.rank_sum is None else self.rank_sum(out)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, layer: int,
                 sliding_window: int | None) -> None:
        super().__init__()
        layout = config.gemma4
        self.eps, self.rms_norm = config.rms_norm_eps, kernels.rms_norm
        self.linear = kernels.linear
        for checkpoint_name, name in NORMS.items():
            if checkpoint_name != "post_per_layer_input_norm" or layout.per_layer_width:
                setattr(self, name, empty_param(config.hidden_size, dtype=dtype))
        self.attn = Gemma4Attention(config, kernels, dtype, layout.heads(layer), sliding_window,
                                    layout.computes_kv(layer), layout.kv_places[layer][1])
        width = config.intermediate_size * (2 if layer in layout.double_wide_layers else 1)
        self.mlp = MLP(dataclasses.replace(config, intermediate_size=width), kernels, dtype)
        self.moe = None if layout.experts is None else Gemma4MoE(config, kernels, dtype, layout.experts)
        if self.moe is not None:
            for name in EXPERT_NORMS.values():
                setattr(self, name, empty_param(config.hidden_size, dtype=dtype))
        self.per_layer_width = layout.per_layer_width
        if self.per_layer_width:
            self.per_layer_gate = empty_param(layout.per_layer_width, config.hidden_size, dtype=dtype)
            self.per_layer_projection = empty_param(config.hidden_size, layout.per_layer_width, dtype=dtype)
        self.activation = ACTIVATIONS[config.hidden_act]
        self.layer_scalar = empty_param(1, dtype=dtype)

    def forward(self, h: torch.Tensor, per_layer: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        norm, eps = self.rms_norm, self.eps
        h = h + norm(self.attn(norm(h, self.input_norm, eps), cos, sin, kv_cache, meta), self.post_attention_norm, eps)
        made = self.mlp(norm(h, self.pre_feedforward_norm, eps))
        if self.moe is not None:
            weights, experts = self.moe.route(h)
            by_experts = self.moe(norm(h, self.pre_experts_norm, eps), weights, experts)
            made = norm(made, self.post_mlp_norm, eps) + norm(by_experts, self.post_experts_norm, eps)
        h = h + norm(made, self.post_feedforward_norm, eps)
        if per_layer is not None:
            gated = self.activation(self.linear(h, self.per_layer_gate)) * per_layer
            h = h + norm(self.linear(gated, self.per_layer_projection), self.post_per_layer_norm, eps)
        return h * self.layer_scalar


class Gemma4ForCausalLM(LlamaForCausalLM):
    splits_across_ranks = True

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        layout = config.gemma4
        self.layout = layout
        self.embed_scale = config.hidden_size**0.5
        self.final_softcap = config.final_logit_softcapping
        if layout.per_layer_width:
            width = config.num_layers * layout.per_layer_width
            self.per_layer_embed = empty_param(layout.per_layer_vocab_size, width, dtype=dtype)
            self.per_layer_model_projection = empty_param(width, config.hidden_size, dtype=dtype)
            self.per_layer_projection_norm = empty_param(layout.per_layer_width, dtype=dtype)

    def sum_across_ranks(self, rank_sum: RankSum, num_ranks: int, rank: int, vocab_size: int | None) -> None:
        """Also its experts' sums. (Where each layer's share of the KV heads lies in the whole pages its layout says:
        engine/tensor_parallel.py's `shard_config`.)"""
        super().sum_across_ranks(rank_sum, num_ranks, rank, vocab_size)
        for layer in self.layers:
            if getattr(layer, "moe", None) is not None:
                layer.moe.rank_sum = rank_sum

    def _register_ropes(self, max_positions: int) -> None:
        """Its two kinds of layer's own tables (no table of the model's one RoPE)."""
        for kind, heads in (("sliding", self.config.gemma4.sliding), ("full", self.config.gemma4.full)):
            cos, sin = _rope_cache(heads, max_positions)
            self.register_buffer(f"{kind}_rope_cos", cos, persistent=False)
            self.register_buffer(f"{kind}_rope_sin", sin, persistent=False)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Scaled by its embedding module, as transformers' (so rows given in place of it are not).
        embedded = super()._embed(input_ids)
        return embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)  # rounded to the dtype, as transformers

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return Gemma4DecoderLayer(self.config, self.kernels, dtype, layer, self._window(layer))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        h = self._embed(input_ids)
        if given is not None:
            h = given.placed(h)
        per_layer = None
        if self.layout.per_layer_width:  # an image's rows take the padding token's rows of the per-layer table
            ids = input_ids if given is None else input_ids.index_fill(0, given.rows, self.layout.pad_token_id)
            per_layer = self._per_layer_inputs(ids, h)
        ropes = self._kinds_ropes(positions)
        captured = []
        for i, layer in enumerate(self.layers):
            if i in self.captured_layers:
                captured.append(h)
            cos, sin = ropes[self.layout.layer_types[i]]
            h = layer(h, None if per_layer is None else per_layer[:, i], cos, sin,
                      kv_caches[self.layout.kv_places[i][0]], meta)
        if captured:
            self.captured = torch.cat(captured, dim=-1)
        return self._final_norm(h)

    def _kinds_ropes(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each kind of layer's cos and sin at the step's positions."""
        return {SLIDING: (self.sliding_rope_cos[positions], self.sliding_rope_sin[positions]),
                FULL: (self.full_rope_cos[positions], self.full_rope_sin[positions])}

    def _per_layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[T, layers, width]: each token's row of the per-layer table (scaled by sqrt(width)) and the projection
        of its scaled embedding (by 1 / sqrt(hidden_size), normed), averaged as transformers does (by 1 / sqrt(2))."""
        width, num_tokens = self.layout.per_layer_width, input_ids.shape[0]
        rows = F.embedding(input_ids, self.per_layer_embed)
        rows = (rows * torch.tensor(width**0.5, dtype=rows.dtype)).view(num_tokens, -1, width)
        projected = self.kernels.linear(embedded, self.per_layer_model_projection) * self.config.hidden_size**-0.5
        projected = self.kernels.rms_norm(projected.view(num_tokens, -1, width), self.per_layer_projection_norm,
                                          self.config.rms_norm_eps)
        return (projected + rows) * 2.0**-0.5

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def _lora_rows(self, layer: int, place: str, proj: str) -> Target | None:
        """Its layers' own rows of the fused q/k/v (no k or v in a layer sharing another's KV; no v where values are
        keys) and gate/up (twice as wide in a KV-sharing layer under use_double_wide_mlp); experts take none."""
        attn, mlp = self.layers[layer].attn, self.layers[layer].mlp
        q, kv = attn.q_size, attn.kv_size
        has_k, has_v = attn.computes_kv, attn.computes_kv and not attn.heads.values_are_keys
        if place == "self_attn":
            rows = {"q_proj": (0, q), "k_proj": (q, q + kv) if has_k else None,
                    "v_proj": (q + kv, q + 2 * kv) if has_v else None}
            if proj == "o_proj":
                return layer, "o", 0, self.config.hidden_size
            return (layer, "qkv", *rows[proj]) if rows.get(proj) else None
        if place == "mlp":
            width = mlp.intermediate_size
            rows = {"gate_proj": (0, width), "up_proj": (width, 2 * width)}
            if proj == "down_proj":
                return layer, "down", 0, self.config.hidden_size
            return (layer, "gate_up", *rows[proj]) if proj in rows else None
        return None

    # --- weights -----------------------------------------------------------------

    def checkpoint_names(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings:
            names.append("lm_head.weight")
        if self.layout.per_layer_width:
            names += ["model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight",
                      "model.per_layer_projection_norm.weight"]
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            names += [p + "layer_scalar", p + "self_attn.q_proj.weight", p + "self_attn.o_proj.weight",
                      p + "self_attn.q_norm.weight"]
            if layer.attn.computes_kv:
                names += [p + "self_attn.k_proj.weight", p + "self_attn.k_norm.weight"]
                if not layer.attn.heads.values_are_keys:
                    names.append(p + "self_attn.v_proj.weight")
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
            names += [p + f"{norm}.weight" for norm in NORMS if norm != "post_per_layer_input_norm"]
            if layer.moe is not None:
                names += [p + f"{norm}.weight" for norm in EXPERT_NORMS]
                names += [p + x for x in ("router.proj.weight", "router.scale", "router.per_expert_scale",
                                          "experts.gate_up_proj", "experts.down_proj")]
            if self.layout.per_layer_width:
                names += [p + "per_layer_input_gate.weight", p + "per_layer_projection.weight",
                          p + "post_per_layer_input_norm.weight"]
        return names

    def is_unused_tensor(self, name: str) -> bool:
        # A KV-sharing layer's own k/v projections and norms, where a checkpoint keeps them: transformers leaves
        # them unread too.
        parts = name.split(".")
        return (len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn"
                and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm")
                and not self.layout.computes_kv(int(parts[2])))

    def _target(self, name: str) -> torch.Tensor:
        whole = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head",
                 "model.embed_tokens_per_layer.weight": "per_layer_embed",
                 "model.per_layer_model_projection.weight": "per_layer_model_projection",
                 "model.per_layer_projection_norm.weight": "per_layer_projection_norm"}
        if name in whole:
            return getattr(self, whole[name]).data
        parts = name.split(".")
        layer = self.layers[int(parts[2])]
        module = parts[3]
        if module == "layer_scalar":
            return layer.layer_scalar.data
        if module in NORMS:
            return getattr(layer, NORMS[module]).data
        if module in EXPERT_NORMS:
            return getattr(layer, EXPERT_NORMS[module]).data
        if module in ("router", "experts"):
            moe_params = {"proj": "router_weight", "scale": "router_scale", "per_expert_scale": "expert_scale",
                          "gate_up_proj": "gate_up_weight", "down_proj": "down_weight"}
            return getattr(layer.moe, moe_params[parts[4]]).data
        if module == "per_layer_input_gate":
            return layer.per_layer_gate.data
        if module == "per_layer_projection":
            return layer.per_layer_projection.data
        if module == "mlp":
            mlp = layer.mlp
            if parts[4] == "down_proj":
                return mlp.down_weight.data
            return mlp.gate_up_weight.data[:mlp.intermediate_size] if parts[4] == "gate_proj" else \
                mlp.gate_up_weight.data[mlp.intermediate_size:]
        attn = layer.attn
        proj = parts[4]
        if proj in ("q_norm", "k_norm"):
            return getattr(attn, proj).data
        if proj == "o_proj":
            return attn.o_weight.data
        q, kv = attn.q_size, attn.kv_size
        rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        if proj not in rows:
            raise KeyError(f"unexpected checkpoint tensor {name!r}")
        lo, hi = rows[proj]
        return attn.qkv_weight.data[lo:hi]


def _rope_cache(heads: Gemma4Heads, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim]: proportional RoPE's, whose first `rope_fraction` of a head's frequencies
    turn at the rates of the whole head's, the others not at all (cos 1, sin 0); the default RoPE's at fraction 1."""
    dim = heads.head_dim
    turning = int(heads.rope_fraction * dim // 2)
    inv_freq = torch.zeros(dim // 2)
    inv_freq[:turning] = 1.0 / heads.rope_theta ** (torch.arange(0, 2 * turning, 2, dtype=torch.float32) / dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * (inv_freq / heads.rope_factor)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()
