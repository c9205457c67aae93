"""`Sampler`: one batch of logits in, one next token per sequence out.

Every request carries its own `SamplingParams`, so each stage works on per-row
parameter tensors built once per call, and a stage no row uses is skipped.
The order is vLLM's: allowed token ids and guided decoding's grammar → logit bias → min
tokens → penalties → a thinking budget's forced close → greedy argmax → temperature → min-p → top-k
→ top-p → sample.
Logprobs are of the raw logits, as vLLM's by default, or of those the token was drawn from
(engine/sampled_logprobs.py's modes). Stop tokens and max_tokens are the scheduler's job.

The stages themselves live with their owners: logits processors in engine/logits_processors.py,
the random draw and its per-position seeds in engine/random_sampling.py, logprobs in
engine/sampled_logprobs.py.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.config import LOGPROBS_MODES
from engine.logits_processors import apply_guides, apply_logit_bias, ban_tokens, force_tokens, keep_only, penalize
from engine.random_sampling import draw, row_argmax, shaped_logits
from engine.sampled_logprobs import sampled_logprobs
from engine.sequence import Sequence


class SamplerOutput(NamedTuple):
    """One entry per input row, in row order.

    `logprobs[i]` is None unless row i asked for logprobs; otherwise it maps
    token id → logprob under the raw logits, holding the top-n tokens in
    descending order followed by the sampled token when it is not among them.
    """

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]



class Sampler:
    """Stateless; per-request randomness lives in each `Sequence.generator`.

    Contract: logits is [B, V] float, row i belongs to seqs[i], and is not
    modified. Seeded rows draw from their own generator, so their tokens do not
    depend on the rest of the batch. `eos_token_ids`: the model's, which a row
    short of its `min_tokens` may not sample (unless it ignores EOS and is not guided: a guided
    text ends at EOS all the same).
    """

    def __init__(self, eos_token_ids: tuple[int, ...] = (), logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.eos_token_ids = tuple(eos_token_ids)
        self.reports_processed = logprobs_mode.startswith("processed")
        self.reports_logits = logprobs_mode.endswith("_logits")

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        params = [seq.sampling_params for seq in seqs]
        is_greedy = [p.temperature == 0.0 for p in params]
        needs_penalties = any(p.has_penalties for p in params)
        needs_logprobs = any(p.logprobs is not None for p in params)
        needs_bias = any(p.logit_bias for p in params)
        needs_allowed = any(p.allowed_token_ids for p in params)
        guided = [i for i, seq in enumerate(seqs) if seq.is_guided]
        banned = []
        if any(p.min_tokens or p.bad_words_token_ids for p in params):
            banned = [self._stops_banned(seq) + _bad_words_banned(seq) for seq in seqs]
        needs_ban = any(banned)
        forced = []
        if any(p.thinking_budget for p in params):
            forced = [seq.thinking_marks.forced_token(seq.token_ids) if seq.thinking_marks else None for seq in seqs]
        needs_force = any(token_id is not None for token_id in forced)
        # Decode-step fast path: nothing but argmax.
        if all(is_greedy) and not (needs_penalties or needs_logprobs or needs_bias or needs_allowed or needs_ban
                                   or guided or needs_force):
            return SamplerOutput(row_argmax(logits).tolist(), [None] * len(seqs))

        raw_logits = logits
        if needs_allowed:
            logits = keep_only(logits, [p.allowed_token_ids for p in params])
        if guided:
            logits = apply_guides(logits, [seqs[i].guide for i in guided], guided, self.eos_token_ids)
        if needs_bias:
            logits = apply_logit_bias(logits, [p.logit_bias for p in params])
        if needs_ban:
            logits = ban_tokens(logits, banned)
            if (guided or needs_allowed) and self.eos_token_ids:
                logits = _eos_where_nothing_is_left(logits, self.eos_token_ids[0])
        if needs_penalties:
            logits = penalize(logits, seqs, params)
        if needs_force:
            logits = force_tokens(logits, forced)
        if all(is_greedy):
            token_ids = row_argmax(logits)  # [B]
            drawn_from = logits
        else:
            drawn_from = shaped_logits(logits, params)
            token_ids = draw(drawn_from, seqs, params)
            if any(is_greedy):
                greedy_mask = torch.tensor(is_greedy).to(logits.device)
                token_ids = torch.where(greedy_mask, row_argmax(logits), token_ids)
                if needs_logprobs and self.reports_processed:  # a greedy row's, whatever rows share its batch
                    drawn_from = torch.where(greedy_mask.unsqueeze(1), logits, drawn_from)
        if not needs_logprobs:
            return SamplerOutput(token_ids.tolist(), [None] * len(seqs))
        reported = drawn_from if self.reports_processed else raw_logits
        return SamplerOutput(token_ids.tolist(), sampled_logprobs(reported, token_ids, params, self.reports_logits))

    def _stops_banned(self, seq: Sequence) -> tuple[int, ...]:
        """The tokens that would end `seq` while it is short of its `min_tokens`: none once it is not."""
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            return ()
        if params.ignore_eos and not seq.is_guided:
            return params.stop_token_ids
        return params.stop_token_ids + self.eos_token_ids


def _eos_where_nothing_is_left(logits: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Rows with no token left (a guide or allowed_token_ids let through only what min_tokens or
    bad_words then banned: a complete guided text short of its min_tokens, say) may end with EOS:
    the text stops where it is, rather than with a token drawn from nothing."""
    stuck = torch.isneginf(logits).all(dim=-1)  # [B]
    if not bool(stuck.any()):
        return logits
    logits = logits.clone()
    logits[stuck, eos_token_id] = 0.0
    return logits


def _bad_words_banned(seq: Sequence) -> tuple[int, ...]:
    """The last tokens of `seq`'s bad words whose other tokens its output now ends with, as vLLM
    bans them: the output, not the prompt, completes a bad word."""
    params = seq.sampling_params
    if not params.bad_words_token_ids:
        return ()
    return params.bad_word_endings.banned(seq.token_ids, seq.num_output_tokens)
