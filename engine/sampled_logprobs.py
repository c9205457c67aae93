"""The logprobs a sampled token reports: the top-n, the sampled token's and those of the ids the
request names (SGLang's token_ids_logprob), under the raw logits."""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def sampled_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> list[dict[int, float] | None]:
    """Top-n, sampled-token and named ids' logprobs under the raw logits, for rows that ask."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    rows_t = torch.tensor(rows).to(raw_logits.device)
    logprobs = raw_logits[rows_t].float().log_softmax(dim=-1)  # [R, V]
    sampled_ids = token_ids[rows_t].unsqueeze(1)  # [R, 1]
    sampled = logprobs.gather(1, sampled_ids).squeeze(1).tolist()
    sampled_ids = sampled_ids.squeeze(1).tolist()
    num_top = max(params[i].logprobs for i in rows)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [R, num_top]
    top_values, top_ids = top_values.tolist(), top_ids.tolist()

    out: list[dict[int, float] | None] = [None] * len(params)
    for r, i in enumerate(rows):
        n = params[i].logprobs
        entry = dict(zip(top_ids[r][:n], top_values[r][:n]))
        entry.setdefault(sampled_ids[r], sampled[r])
        named = params[i].logprob_token_ids
        if named:
            entry.update((t, lp) for t, lp in zip(named, logprobs[r, list(named)].tolist()) if t not in entry)
        out[i] = entry
    return out
