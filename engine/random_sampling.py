"""Random sampling: temperature, min-p, top-k and top-p (`shaped_logits`), then one draw per row (`draw`).

A seeded request draws from its own generator, seeded for the output position it draws for
(`position_seed`), so its tokens depend on its seed and position alone, not on the batch.
`row_argmax`, the draw's last step, is also the whole of a greedy row's.
"""
from __future__ import annotations

import torch

from engine.logits_processors import apply_min_p, apply_top_k, apply_top_k_top_p
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

MASK_64 = (1 << 64) - 1


def shaped_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p: the logits a row's token is drawn from. Greedy rows go
    through with temperature 1 (and their top-k and top-p, which ask nothing by default)."""
    vocab_size, device = logits.shape[-1], logits.device
    temperature = [p.temperature or 1.0 for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    # One host→device copy for all per-row parameters; top_k is exact in fp32.
    cols = torch.tensor([temperature, top_k, top_p, min_p], dtype=torch.float32).to(device)  # [4, B]
    if any(t != 1.0 for t in temperature):
        logits = logits / cols[0].unsqueeze(1)
    if any(m > 0.0 for m in min_p):
        logits = apply_min_p(logits, cols[3])
    max_k = max((k for k in top_k if k < vocab_size), default=None)
    if any(p < 1.0 for p in top_p):
        logits = apply_top_k_top_p(logits, None if max_k is None else cols[1].long(), cols[2])
    elif max_k is not None:
        logits = apply_top_k(logits, cols[1].long(), max_k)
    return logits


def draw(shaped: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]) -> torch.Tensor:
    """One token per row from its `shaped_logits`, by an exponential race. Returns [B] ids; greedy
    rows' are drawn too, and the caller overrides them."""
    vocab_size, device = shaped.shape[-1], shaped.device
    probs = shaped.softmax(dim=-1)  # [B, V]
    # Exponential race: argmax(p / q), q ~ Exp(1), samples from p (Gumbel-max).
    q = torch.empty_like(probs)  # [B, V]
    seeded = [i for i, seq in enumerate(seqs) if seq.generator is not None and params[i].temperature > 0]
    if len(seeded) < len(seqs):
        q.exponential_()
    if seeded:
        # Drawn on the CPU from each request's own generator, seeded for the position of the token
        # drawn: the stream depends on the seed and the position alone, so an engine that takes a
        # request over with output made elsewhere goes on from it with nothing to replay.
        draws = []
        for i in seeded:
            generator = seqs[i].generator
            generator.manual_seed(position_seed(params[i].seed, seqs[i].num_output_tokens))
            draws.append(torch.empty(vocab_size).exponential_(generator=generator))
        draws = torch.stack(draws)
        q[torch.tensor(seeded).to(device)] = draws.to(device)
    return row_argmax(probs.div_(q))


def position_seed(seed: int, position: int) -> int:
    """The seed of output position `position`'s draw of a request seeded `seed`: splitmix64 of the
    two, so neighbouring seeds and positions give unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK_64
    return z ^ (z >> 31)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (first index on ties). x: [B, V] → [B] int64.

    On CPU numpy's vectorized argmax is 5-10x faster than torch's here, and it
    runs on every decode step.
    """
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)
