"""When a sampled token ends a sequence, and with which finish reason."""
from __future__ import annotations

from engine.sequence import FinishReason, Sequence


def advance_guide(seq: Sequence, token: int, eos_token_ids: frozenset[int]) -> FinishReason | None:
    """Move a guided sequence's guide past `token`. "stop" when it cannot: a token the grammar
    does not allow was sampled all the same (the sampler gives EOS to a row with nothing left, so
    this is a safety net, not a path)."""
    if seq.guide is None or token in eos_token_ids:
        return None
    try:
        seq.advance_guide(token)
    except ValueError:
        return "stop"
    return None


def finish_reason(seq: Sequence, token: int, eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
    """Why `seq`, `token` its last token (its guide already past it), is finished; None if it goes on."""
    params = seq.sampling_params
    is_eos = token in eos_token_ids
    # A guided text is complete when its guide lets EOS through: ignore_eos cannot go on past it.
    if token in params.stop_token_ids or (is_eos and (not params.ignore_eos or seq.is_guided)):
        return "stop"
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return "prefilled" if seq.is_prefill_only else None
