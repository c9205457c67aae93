"""The logprobs a sampled token reports: the top-n, the sampled token's and those of the ids the
request names (SGLang's token_ids_logprob), under the raw logits by default.

vLLM's `--logprobs-mode` says of which logits and as what (engine/config.py's LOGPROBS_MODES):
`raw_logprobs` (the default), `processed_logprobs` (those the token was drawn from: after allowed ids, guides, biases,
bans, penalties, temperature, min-p, top-k and top-p, as RL trainers want them to match their
sampling), or either as the logits themselves (`raw_logits`, `processed_logits`). A token the
processing masked is reported at LOGPROB_FLOOR, vLLM's, not -inf, which JSON cannot carry.
"""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams

LOGPROB_FLOOR = -9999.0


def sampled_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams], as_logits: bool = False
) -> list[dict[int, float] | None]:
    """Top-n, sampled-token and named ids' logprobs under `logits` (or, `as_logits`, those logits
    themselves), for rows that ask."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    rows_t = torch.tensor(rows).to(logits.device)
    logprobs = reported(logits[rows_t].float(), as_logits)  # [R, V]
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


def reported(logits: torch.Tensor, as_logits: bool) -> torch.Tensor:
    """What a row reports of `logits` (float): its logprobs, or (`as_logits`) the logits, floored."""
    values = logits if as_logits else logits.log_softmax(dim=-1)
    return values.clamp(min=LOGPROB_FLOOR)
