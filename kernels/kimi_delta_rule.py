"""Kimi Delta Attention's recurrence (Kimi-Linear's linear-attention layers): the gated delta rule with a decay per
key channel, not per head. A head's state S [Dk, Dv] decays row by row by exp(g) a token, is read at the token's
key, corrected toward its value by beta (S += k (beta (v - S^T k))^T), and read by its query. Token by token, in
float32 (a chunked kernel over page-resident states is a GPU session's work)."""
from __future__ import annotations

import torch


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k, g [B, H, Dk] (q and k normed, q scaled; g the log decay); v [B, H, Dv];
    beta [B, H]; states [B, H, Dk, Dv]. Returns the outputs [B, H, Dv] and the states after."""
    after = states * g.exp()[..., None]
    delta = (v - (after * k[..., None]).sum(-2)) * beta[..., None]
    after = after + k[..., None] * delta[..., None, :]
    return (after * q[..., None]).sum(-2), after


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
        ) -> torch.Tensor:
    """T tokens of one sequence (as `step`'s, without its batch), `state` [H, Dk, Dv] updated in place. Returns
    [T, H, Dv]."""
    out = v.new_empty(v.shape)
    for t in range(q.shape[0]):
        made, after = step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state[None])
        state.copy_(after[0])
        out[t] = made[0]
    return out
