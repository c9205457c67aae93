"""Lightning attention's recurrence (MiniMax-Text-01's linear-attention layers): linear attention with a decay a head.
A head's state S [D, D] decays by exp(-slope) a token and takes k^T v; the token's output is q S. A run of tokens
goes block by block (MiniMax's own form): within a block, (q k^T, each pair decayed by its distance) v, plus q, decayed
by its place in the block, against the state the block starts from; the state then decays by the block's length and
takes each key, decayed by its distance to the block's end, times its value. In float32."""
from __future__ import annotations

import torch


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, states: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k, v [B, H, D]; slopes [H]; states [B, H, D, D]. Returns the outputs
    [B, H, D] and the states after."""
    after = states * torch.exp(-slopes)[:, None, None] + k[..., :, None] * v[..., None, :]
    return (q[..., :, None] * after).sum(-2), after


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, state: torch.Tensor,
        block_size: int) -> torch.Tensor:
    """T tokens of one sequence (as `step`'s, without its batch), `state` [H, D, D] updated in place, `block_size`
    tokens at a time. Returns [T, H, D]."""
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # [H, T, D]
    rates = slopes[:, None, None]
    out = v.new_empty(qh.shape)
    for start in range(0, qh.shape[1], block_size):
        end = min(start + block_size, qh.shape[1])
        n = end - start
        places = torch.arange(1, n + 1, device=q.device, dtype=q.dtype)
        distance = places[:, None] - places[None, :]
        within = torch.exp(-rates * distance.clamp(min=0)) * (distance >= 0)  # [H, n, n]
        bq, bk, bv = qh[:, start:end], kh[:, start:end], vh[:, start:end]
        from_state = (bq * torch.exp(-rates * places[:, None])) @ state
        out[:, start:end] = ((bq @ bk.transpose(-1, -2)) * within) @ bv + from_state
        keys_to_end = bk * torch.exp(-rates * (n - places)[:, None])
        state.mul_(torch.exp(-rates * n)).add_(keys_to_end.transpose(-1, -2) @ bv)
    return out.transpose(0, 1)
