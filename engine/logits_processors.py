"""Logits processors: each stage that reshapes a batch of logits before a token is drawn.

Each takes logits [B, V] and per-row parameters and returns new logits, leaving its input
untouched. They are module-level functions so tests can hold them against a plain per-row
formula; the `Sampler` decides which stages run, in which order, for which rows.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from engine.guided_decoding import guide_bias
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each list. Returns counts: [R, V] int64."""
    num_rows = len(token_lists)
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.int64, device=device)
    lengths = [len(t) for t in token_lists]
    if sum(lengths) == 0:
        return counts.view(num_rows, vocab_size)
    # np.fromiter is several times faster than torch.tensor on a long list.
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=sum(lengths))
    rows = torch.repeat_interleave(torch.arange(num_rows), torch.tensor(lengths))
    # One scatter over the flattened [R * V] table counts every row at once.
    index = (rows * vocab_size + torch.from_numpy(flat)).to(device)
    counts.scatter_add_(0, index, torch.ones_like(index))
    return counts.view(num_rows, vocab_size)


def apply_penalties(
    logits: torch.Tensor,
    prompt_counts: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Penalize tokens already seen; returns new logits, the input is untouched.

    logits, prompt_counts, output_counts: [R, V]; penalties: [R].
    Repetition (HF/vLLM): a token seen in prompt or output has a positive
    logit divided by the penalty and a non-positive one multiplied by it.
    Presence and frequency (OpenAI) look at the output only:
    logit -= presence * (count > 0) + frequency * count.
    """
    seen = (prompt_counts > 0) | (output_counts > 0)
    rep = repetition_penalty.unsqueeze(1)  # [R, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency_penalty.unsqueeze(1) * output_counts
    return logits - presence_penalty.unsqueeze(1) * (output_counts > 0)


def penalize(logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]) -> torch.Tensor:
    """Apply penalties to the rows that have any; other rows pass through."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    vocab_size, device = logits.shape[-1], logits.device
    # A prompt given as embeddings has no tokens to repeat: its placeholders are not penalized.
    prompt_counts = token_counts([seqs[i].prompt_token_ids if seqs[i].prompt_embeds is None else []
                                  for i in rows], vocab_size, device)
    output_counts = token_counts([seqs[i].output_token_ids for i in rows], vocab_size, device)
    penalties = torch.tensor(
        [[params[i].repetition_penalty, params[i].presence_penalty, params[i].frequency_penalty] for i in rows],
        dtype=logits.dtype,
    ).to(device)  # [R, 3]
    if len(rows) == len(seqs):
        return apply_penalties(logits, prompt_counts, output_counts, *penalties.unbind(1))
    rows_t = torch.tensor(rows).to(device)
    logits = logits.clone()
    logits[rows_t] = apply_penalties(logits[rows_t], prompt_counts, output_counts, *penalties.unbind(1))
    return logits


def apply_logit_bias(logits: torch.Tensor, biases: list[tuple[tuple[int, float], ...]]) -> torch.Tensor:
    """Add row i's (token id, bias) pairs to row i; returns new logits, the input is untouched."""
    rows = [i for i, pairs in enumerate(biases) for _ in pairs]
    ids = [t for pairs in biases for t, _ in pairs]
    values = torch.tensor([b for pairs in biases for _, b in pairs], dtype=logits.dtype).to(logits.device)
    index = (torch.tensor(rows).to(logits.device), torch.tensor(ids).to(logits.device))
    return logits.index_put(index, values, accumulate=True)


def keep_only(logits: torch.Tensor, allowed: list[tuple[int, ...]]) -> torch.Tensor:
    """Row i keeps only the ids in `allowed[i]` (all of them when it is empty); returns new logits."""
    device = logits.device
    restricted = torch.tensor([bool(ids) for ids in allowed]).to(device)  # [B]
    masked = restricted.unsqueeze(1).expand_as(logits).clone()  # [B, V]
    rows = [i for i, ids in enumerate(allowed) for _ in ids]
    ids = [t for row_ids in allowed for t in row_ids]
    masked[torch.tensor(rows, dtype=torch.long).to(device), torch.tensor(ids, dtype=torch.long).to(device)] = False
    return logits.masked_fill(masked, float("-inf"))


def force_tokens(logits: torch.Tensor, forced: list[int | None]) -> torch.Tensor:
    """Row i can sample only `forced[i]` (every id where it is None), whatever the stages before made of
    its logit: a banned one too. Returns new logits, the input is untouched."""
    rows = [i for i, token_id in enumerate(forced) if token_id is not None]
    device = logits.device
    rows_t = torch.tensor(rows, dtype=torch.long).to(device)
    logits = logits.index_fill(0, rows_t, float("-inf"))
    ids = torch.tensor([forced[i] for i in rows], dtype=torch.long).to(device)
    return logits.index_put((rows_t, ids), torch.tensor(0.0, dtype=logits.dtype).to(device))


def ban_tokens(logits: torch.Tensor, banned: list[tuple[int, ...]]) -> torch.Tensor:
    """Row i can no longer sample the ids in `banned[i]`; returns new logits, the input is untouched."""
    rows = [i for i, ids in enumerate(banned) for _ in ids]
    ids = [t for row_ids in banned for t in row_ids]
    device = logits.device
    index = (torch.tensor(rows, dtype=torch.long).to(device), torch.tensor(ids, dtype=torch.long).to(device))
    return logits.index_put(index, torch.tensor(float("-inf"), dtype=logits.dtype).to(device))


def apply_guides(
    logits: torch.Tensor, guides: list, rows: list[int], eos_token_ids: tuple[int, ...] = ()
) -> torch.Tensor:
    """Rows `rows` keep only what their guide's state allows; the others pass through. A guide knows one
    EOS (the model's first); where it allows that one, the model's others end the text as well (Llama 3's
    chat turns end with `<|eot_id|>`, its second: masked, a text the guide lets go on would run to its
    length limit)."""
    # Added, not masked_fill'ed: a guide's mask is scattered, and masked_fill's branch a token took 8.4 ms
    # for 16 rows of a 151,936-token vocabulary where the sum takes 0.7.
    bias = guide_bias(guides, logits.shape[-1], logits.device).to(logits.dtype)  # [R, V]: 0 or -inf
    if len(eos_token_ids) > 1:
        others = torch.tensor(eos_token_ids[1:]).to(logits.device)
        bias[:, others] = torch.maximum(bias[:, others], bias[:, eos_token_ids[0]].unsqueeze(1))
    if len(rows) == logits.shape[0]:
        return bias.add_(logits)
    guided = torch.tensor(rows).to(logits.device)
    out = logits.clone()
    out[guided] += bias
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose prob is below min_p × the row's top prob.

    logits: [B, V]; min_p: [B], 0 = off for that row.
    """
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th are kept).

    logits: [B, V]; top_k: [B] int64 in [1, V] (V = off); max_k: the largest
    k below V in the batch, passed from the host so no device sync is needed.
    A partial top-k is far cheaper than the full sort top-p needs.
    """
    vocab_size = logits.shape[-1]
    top_values = logits.topk(max_k, dim=-1).values  # [B, max_k]
    kth_value = top_values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))  # [B, 1]
    kth_value.masked_fill_(top_k.unsqueeze(1) >= vocab_size, float("-inf"))
    return logits.masked_fill(logits < kth_value, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Keep each row's k largest logits, then the smallest set of those whose
    probability mass reaches top_p (the top token always survives).

    logits: [B, V]; top_k: [B] int64 in [1, V] (V = off), or None when no row
    uses it; top_p: [B] in (0, 1] (1 = off). Ties at the k-th value are kept.
    """
    # Ascending sort: the dropped tokens are a prefix of each row.
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # [B, V]
    vocab_size = logits.shape[-1]
    if top_k is not None:
        kth_index = (vocab_size - top_k).clamp(0, vocab_size - 1).unsqueeze(1)  # [B, 1]
        kth_value = sorted_logits.gather(1, kth_index)  # [B, 1]
        sorted_logits.masked_fill_(sorted_logits < kth_value, float("-inf"))
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    # Drop a token when everything above it already holds >= top_p mass.
    drop = cum_probs <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
