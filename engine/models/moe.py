"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, DeepSeek, Llama 4, Ernie 4.5, LongCat): each
token's top-k experts by its router, and the shared experts every token passes through (Qwen2-MoE's
weighed by a gate of their own, the others' not). engine/moe_config.py says how a model routes.

Experts run one after another over the tokens routed to them, in expert order, each output
weighted by its router weight (Llama 4: each input) and summed into the token's row, as
`transformers` computes it: correct on any device, not a fused MoE kernel.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig
from engine.models.parameters import empty_param
from kernels.registry import Kernels


class SparseMoE(nn.Module):
    # Set by a model split across ranks (engine/tensor_parallel.py): each expert's output made from this rank's
    # share of its width, summed across the ranks.
    rank_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    # ... and whether this rank adds the tokens the experts that compute nothing hand on as they are: rank 0's alone,
    # or the sum across the ranks would add them once a rank.
    adds_identity: bool = True

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = kernels.linear  # (the routers keep F.linear: their choices are discrete, their rows few)
        self.moe = moe = config.moe
        num_experts, inter, hidden = moe.num_experts, moe.moe_intermediate_size, config.hidden_size
        routed = num_experts + moe.identity_experts  # what the router scores
        # DeepSeek and GLM keep their routers in float32.
        self.router_weight = empty_param(routed, hidden, dtype=torch.float32 if moe.router_in_float32 else dtype)
        # GLM's and DeepSeek-V3's correction bias, in float32; gpt-oss's router's own bias.
        self.router_bias = (empty_param(routed, dtype=torch.float32) if moe.scoring == "sigmoid" or moe.choice_bias
                            else empty_param(routed, dtype=dtype) if moe.has_biases else None)
        self.gate_up_bias = empty_param(num_experts, 2 * inter, dtype=dtype) if moe.has_biases else None
        self.down_bias = empty_param(num_experts, hidden, dtype=dtype) if moe.has_biases else None
        self.gate_up_weight = empty_param(num_experts, 2 * inter, hidden, dtype=dtype)  # each expert's slices filled
        self.down_weight = empty_param(num_experts, hidden, inter, dtype=dtype)
        shared = moe.shared_expert_intermediate_size
        self.shared_gate_up_weight = empty_param(2 * shared, hidden, dtype=dtype) if shared else None
        self.shared_down_weight = empty_param(hidden, shared, dtype=dtype) if shared else None
        self.shared_weight_gate = empty_param(1, hidden, dtype=dtype) if moe.shared_expert_gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] → [T, H]
        weights, experts = self._route(x)  # [T, k] each
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():  # ascending: the order the sums are made in
            tokens, slot = torch.where(experts == expert)
            weight = weights[tokens, slot, None]
            expert_in = x[tokens] * weight if self.moe.weighs_inputs else x[tokens]
            if expert >= self.moe.num_experts:  # one that computes nothing (LongCat-Flash's)
                if self.adds_identity:
                    out.index_add_(0, tokens, (expert_in * weight).to(x.dtype))
                continue
            has_bias = self.gate_up_bias is not None
            gate, up = self.linear(expert_in, self.gate_up_weight[expert],
                                   self.gate_up_bias[expert] if has_bias else None).chunk(2, dim=-1)
            gated = self._glu(gate, up, is_shared=False)
            expert_out = self.linear(gated, self.down_weight[expert], self.down_bias[expert] if has_bias else None)
            out.index_add_(0, tokens, (expert_out if self.moe.weighs_inputs else expert_out * weight).to(x.dtype))
        if self.shared_down_weight is not None:
            gate, up = self.linear(x, self.shared_gate_up_weight).chunk(2, dim=-1)
            shared_out = self.linear(self._glu(gate, up, is_shared=True), self.shared_down_weight)
            if self.shared_weight_gate is not None:
                shared_out = torch.sigmoid(F.linear(x, self.shared_weight_gate)) * shared_out
            out = (out + shared_out) / 2 if self.moe.shared_expert_average else out + shared_out
        return out if self.rank_sum is None else self.rank_sum(out)

    def _glu(self, gate: torch.Tensor, up: torch.Tensor, is_shared: bool) -> torch.Tensor:
        """An expert's gated activation, a routed one's or (`is_shared`) the shared experts': SiLU's, or clamped
        (gpt-oss's; MiniMax-M3's shared experts' too)."""
        if self.moe.swiglu_limit is None:
            return F.silu(gate) * up
        return clamped_glu(gate, up, self.moe.swiglu_limit, self.moe.swiglu_alpha)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        if moe.scoring == "sigmoid":
            return self._route_by_groups(x)
        if moe.scoring == "softmax_of_top_k":  # gpt-oss's
            logits = F.linear(x, self.router_weight, self.router_bias)
            top, experts = torch.topk(logits, moe.num_experts_per_tok, dim=-1)
            return F.softmax(top, dim=-1), experts
        if moe.scoring == "sparsemixer":
            return sparse_mixer(F.linear(x, self.router_weight), moe.jitter_eps)
        if moe.scoring == "sigmoid_of_top_k":  # Llama 4's
            logits = F.linear(x.float() if moe.router_in_float32 else x, self.router_weight)
            top, experts = torch.topk(logits, moe.num_experts_per_tok, dim=-1)
            weights = top.float().sigmoid()
            if moe.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return (weights if moe.weighs_experts_in_float32 else weights.to(x.dtype)), experts
        logits = F.linear(x.float() if moe.router_in_float32 else x, self.router_weight)
        probs = F.softmax(logits.float(), dim=-1)  # [T, E]
        if moe.num_groups > 1:  # DeepSeek-V2's group_limited_greedy: the best groups by their best expert
            grouped = probs.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
            best_groups = grouped.max(dim=-1).values.topk(moe.topk_groups, dim=-1, sorted=False)[1]
            in_best = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
            probs = probs.masked_fill(~in_best.repeat_interleave(grouped.shape[-1], dim=1), 0.0)
        if moe.choice_bias:  # Ernie 4.5's: chosen by score plus the bias, weighed by the score
            experts = torch.topk(probs + self.router_bias, moe.num_experts_per_tok, dim=-1)[1]
            weights = probs.gather(1, experts)
        else:
            weights, experts = torch.topk(probs, moe.num_experts_per_tok, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * moe.routed_scaling_factor if moe.routed_scaling_factor != 1.0 else weights
        return (weights if moe.weighs_experts_in_float32 else weights.to(x.dtype)), experts

    def _route_by_groups(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # GLM-4.5's and DeepSeek-V3's: experts chosen by sigmoid score plus the correction bias, only
        # within the best groups (a group scored by its best two); weighted by the score alone.
        moe = self.moe
        logits = F.linear(x.float(), self.router_weight)  # [T, E]
        if moe.router_logit_softcap is not None:
            logits = torch.tanh(logits / moe.router_logit_softcap) * moe.router_logit_softcap
        scores = logits.sigmoid()
        for_choice = (logits if moe.choice_by_logits else scores) + self.router_bias
        grouped = for_choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
        best_groups = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(moe.topk_groups, dim=-1, sorted=False)[1]
        in_best = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        for_choice = for_choice.masked_fill(~in_best.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        experts = for_choice.topk(moe.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, experts

    def weight_slice(self, expert: int, proj: str) -> torch.Tensor:
        """Where a checkpoint's `proj` ("gate", "up" or "down") of `expert` goes."""
        inter = self.moe.moe_intermediate_size
        if proj == "down":
            return self.down_weight.data[expert]
        gate_up = self.gate_up_weight.data[expert]
        return gate_up[:inter] if proj == "gate" else gate_up[inter:]

    def shared_slice(self, proj: str) -> torch.Tensor:
        """Where the shared experts' `proj` ("gate", "up", "down"; "weight_gate": their gate) goes."""
        if proj == "weight_gate":
            return self.shared_weight_gate.data
        if proj == "down":
            return self.shared_down_weight.data
        if proj == "gate_up":  # stored fused (MiniMax-M3's)
            return self.shared_gate_up_weight.data
        inter = self.moe.shared_expert_intermediate_size
        return self.shared_gate_up_weight.data[:inter] if proj == "gate" else self.shared_gate_up_weight.data[inter:]


def clamped_glu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's (and MiniMax-M3's) GLU: gate clamped from above, up both ways, gated by gate * sigmoid(alpha * gate)
    plus up's own."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def sparse_mixer(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's two experts a token (SparseMixer at inference) from the router's `logits` [T, E]: the best, then
    the best of the others; each weighed by the softmax of the logits near enough to its own (their gap to it, over the
    larger of its size and each logit's, within twice `jitter_eps`), the first's among all, the second's among the
    others."""
    weights, experts, left = [], [], logits
    for _ in range(2):
        best, expert = left.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * jitter_eps
        weights.append(F.softmax(left.masked_fill(far, float("-inf")), dim=-1).gather(1, expert))
        experts.append(expert)
        left = left.scatter(1, expert, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(experts, dim=-1)
