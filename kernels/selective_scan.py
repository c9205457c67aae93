"""Mamba-1's selective scan (Jamba's Mamba layers), in float32: each channel's state [N] decays by exp(dt A) a token
and takes dt x B, and the channel's output is its state read by C. Token by token (a kernel over page-resident
states is a GPU session's work)."""
from __future__ import annotations

import torch


def step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, states: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: x, dt [B, D]; a [D, N]; b, c [B, N]; states [B, D, N]. Returns y [B, D]
    and the states after it."""
    after = states * torch.exp(dt[..., None] * a) + (dt * x)[..., None] * b[:, None, :]
    return (after @ c[..., None]).squeeze(-1), after


def run(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
        ) -> torch.Tensor:
    """T tokens of one sequence: x, dt [T, D]; b, c [T, N]; `state` [D, N] updated in place. Returns y [T, D]."""
    out = x.new_empty(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        state.mul_(torch.exp(dt[t, :, None] * a)).add_((dt[t] * x[t])[:, None] * b[t])
        out[t] = state @ c[t]
    return out
