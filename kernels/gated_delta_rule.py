"""The gated delta rule (Gated DeltaNet's linear attention) over a recurrent state, continuing from a sequence's
saved state. Plain torch, in float32.

Per value head, with state S (key_dim x value_dim), each token t decays the state by exp(g_t) (g_t <= 0), then
writes the part of v_t the decayed state does not already recall for k_t, weighed by beta_t, and reads with q_t:

    S' = exp(g_t) S;   u_t = beta_t (v_t - S'^T k_t);   S_t = S' + k_t u_t^T;   o_t = S_t^T q_t

`recurrent_step` runs that for one token of each of a batch of sequences. `chunked` runs it over a prompt
in chunks: within a chunk, with G_t the cumulative decay from its start (G_t / G_j <= 1 for j <= t),

    (I + A) U = beta V - diag(beta G) K S0,   A[t, j] = beta_t (G_t / G_j) k_t.k_j   (j < t)
    O = diag(G) Q S0 + (M * Q K^T) U,         M[t, j] = G_t / G_j                     (j <= t)
    S_end = G_end S0 + (K * G_end / G)^T U

so every chunk's triangular solves run at once, and only the products with S0 run chunk after chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normed(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, H, Dk] (normed and scaled), v [B, H, Dv], g and beta [B, H];
    `state` [B, H, Dk, Dv] float32, before it. Returns o [B, H, Dv] float32 and the state after it."""
    s = state * g.float().exp()[..., None, None]
    k, v, q = k.float(), v.float(), q.float()
    recalled = torch.einsum("bhkv,bhk->bhv", s, k)
    written = (v - recalled) * beta.float()[..., None]
    s = s + k[..., :, None] * written[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """A run of T tokens of one sequence: q, k [T, H, Dk] (normed and scaled), v [T, H, Dv], g and beta [T, H];
    `state` [H, Dk, Dv] float32, the state before the run, updated in place to the state after it.
    Returns o [T, H, Dv] float32."""
    num_tokens = q.shape[0]
    pad = -num_tokens % chunk
    # [H, C, chunk, ...]: padded tokens have g = 0 (no decay) and beta = 0 (write nothing), so they leave
    # the state as it is.
    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = x.float().transpose(0, 1)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    decay = g.cumsum(-1)  # [H, C, chunk]: log G_t
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    ratio = (decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # M: G_t / G_j
    k_beta = k * beta[..., None]
    a = (k_beta @ k.transpose(-1, -2)) * ratio.tril(-1)
    system = a + torch.eye(chunk, device=q.device)
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    recalls = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * ratio
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    end_decay = decay[..., -1].exp()[..., None, None]  # [H, C, 1, 1]
    out = torch.empty_like(values)
    s = state.float()
    for c in range(q.shape[1]):
        u = values[:, c] - recalls[:, c] @ s
        out[:, c] = q_decayed[:, c] @ s + within[:, c] @ u
        s = s * end_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ u
    state.copy_(s)
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :num_tokens].transpose(0, 1)
