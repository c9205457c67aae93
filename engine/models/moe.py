"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): each token's top-k experts by
its router, and Qwen2-MoE's shared expert, which every token passes through, weighed by its own gate.

Experts run one after another over the tokens routed to them, in expert order, each output
weighted by its router probability and summed into the token's row, as `transformers` computes
it: correct on any device, not a fused MoE kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig
from engine.models.parameters import empty_param


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        num_experts, inter, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.router_weight = empty_param(num_experts, hidden, dtype=dtype)
        self.gate_up_weight = empty_param(num_experts, 2 * inter, hidden, dtype=dtype)  # each expert's slices filled
        self.down_weight = empty_param(num_experts, hidden, inter, dtype=dtype)
        shared = config.shared_expert_intermediate_size
        self.shared_gate_up_weight = empty_param(2 * shared, hidden, dtype=dtype) if shared else None
        self.shared_down_weight = empty_param(hidden, shared, dtype=dtype) if shared else None
        self.shared_weight_gate = empty_param(1, hidden, dtype=dtype) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] → [T, H]
        cfg = self.config
        probs = F.softmax(F.linear(x, self.router_weight).float(), dim=-1)  # [T, E]
        weights, experts = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)  # [T, k]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not cfg.weighs_experts_in_float32:
            weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():  # ascending: the order the sums are made in
            tokens, slot = torch.where(experts == expert)
            gate, up = F.linear(x[tokens], self.gate_up_weight[expert]).chunk(2, dim=-1)
            expert_out = F.linear(F.silu(gate) * up, self.down_weight[expert])
            out.index_add_(0, tokens, (expert_out * weights[tokens, slot, None]).to(x.dtype))
        if self.shared_down_weight is None:
            return out
        gate, up = F.linear(x, self.shared_gate_up_weight).chunk(2, dim=-1)
        shared_out = F.linear(F.silu(gate) * up, self.shared_down_weight)
        return out + torch.sigmoid(F.linear(x, self.shared_weight_gate)) * shared_out

    def weight_slice(self, expert: int, proj: str) -> torch.Tensor:
        """Where a checkpoint's `proj` ("gate", "up" or "down") of `expert` goes."""
        inter = self.config.moe_intermediate_size
        if proj == "down":
            return self.down_weight.data[expert]
        gate_up = self.gate_up_weight.data[expert]
        return gate_up[:inter] if proj == "gate" else gate_up[inter:]

    def shared_slice(self, proj: str) -> torch.Tensor:
        """Where the shared expert's `proj` ("gate", "up", "down"; "weight_gate": its gate) goes."""
        if proj == "weight_gate":
            return self.shared_weight_gate.data
        if proj == "down":
            return self.shared_down_weight.data
        inter = self.config.shared_expert_intermediate_size
        return self.shared_gate_up_weight.data[:inter] if proj == "gate" else self.shared_gate_up_weight.data[inter:]
