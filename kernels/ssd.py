"""Mamba-2's selective state space scan (its "state space duality" form) over a recurrent state, continuing from a
sequence's saved state. Plain torch, in float32.

Per head, with state S (head_dim x state_size), each token decays the state by exp(dt_t A) (A < 0, dt_t > 0) and
writes dt_t x_t B_t^T into it; it reads S_t C_t:

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T;    y_t = S_t C_t

`step` runs that for one token of each of a batch of sequences. `run` runs it over a prompt in chunks: within a
chunk, with G_t the cumulative decay from its start (G_t / G_j <= 1 for j <= t),

    Y = diag(G) C S0^T + (M * C B^T) (dt * X),   M[t, j] = G_t / G_j  (j <= t)
    S_end = G_end S0 + (X * dt * G_end / G)^T B

so only the products with S0 run chunk after chunk. (The skip connection, D x, is the caller's.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: x [B, H, P], dt [B, H], a [H], b and c [B, H, N]; `state` [B, H, P, N]
    float32, before it. Returns y [B, H, P] float32 and the state after it."""
    dt = dt.float()
    s = state * (dt * a.float()).exp()[..., None, None] + (x.float() * dt[..., None])[..., None] * b.float()[:, :, None]
    return torch.einsum("bhpn,bhn->bhp", s, c.float()), s


def run(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
        state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """A run of T tokens of one sequence: x [T, H, P], dt [T, H], a [H], b and c [T, H, N]; `state` [H, P, N]
    float32, the state before the run, updated in place to the state after it. Returns y [T, H, P] float32."""
    num_tokens, num_heads, head_dim = x.shape
    pad = -num_tokens % chunk
    # Padded tokens have dt = 0: no decay, nothing written.
    x, b, c = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)).unflatten(0, (-1, chunk)) for t in (x, b, c))
    dt = F.pad(dt.float(), (0, 0, 0, pad)).unflatten(0, (-1, chunk))  # [C, L, H]
    decay = (dt * a.float()).cumsum(1)  # log G_t
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
    ratio = (decay[:, :, None] - decay[:, None]).masked_fill(~lower, float("-inf")).exp()  # [C, t, j, H]
    written = x * dt[..., None]
    within = torch.einsum("ctjh,cjhp->cthp", torch.einsum("cthn,cjhn->ctjh", c, b) * ratio, written)
    to_end = (decay[:, -1:] - decay).exp()  # [C, L, H]
    out = torch.empty_like(within)
    s = state.float()
    for i in range(x.shape[0]):
        out[i] = within[i] + decay[i].exp()[..., None] * torch.einsum("thn,hpn->thp", c[i], s)
        s = s * decay[i, -1].exp()[:, None, None] + torch.einsum("th,thp,thn->hpn", to_end[i], written[i], b[i])
    state.copy_(s)
    return out.flatten(0, 1)[:num_tokens]
