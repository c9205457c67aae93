"""What the engine hands back after each step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sequence import FinishReason
from engine.spec_decode_stats import SpecDecodeStats
from engine.step_times import StepTimes

if TYPE_CHECKING:
    import torch


@dataclass
class RequestOutput:
    """A diff for one request: the tokens new since the last output, plus totals."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    finished: bool
    finish_reason: FinishReason | None = None
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    # With the request's first token, when asked for: one per prompt token, None for the first.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    # A "prefilled" request's pages, in prompt order, held until `release`: handed out with
    # the output so whoever copies them needs no second call into the engine.
    held_block_ids: list[int] = field(default_factory=list)
    # An embedding request's (SamplingParams.embed), once finished: the model's last hidden state
    # at its last prompt token.
    embedding: list[float] | None = None
    # With SamplingParams.embed_tokens, once finished: every prompt token's last hidden state, float32 [P, H].
    token_embeddings: torch.Tensor | None = None
    # The request's own record (not a copy): its first step and prompt chunks are final once
    # its first token is out.
    step_times: StepTimes | None = field(default=None, compare=False, repr=False)
    # A finished request's speculative steps, when the engine keeps them per request (spec_decode_stats.py).
    spec_decode: SpecDecodeStats | None = field(default=None, compare=False, repr=False)
    num_preemptions: int = 0  # times its pages were freed to be computed again
    # A "prefilled" request's drafts for what follows its first token (Sequence.handoff_drafts), for the decode
    # worker's first step.
    handoff_drafts: list[int] = field(default_factory=list)


@dataclass
class ComputedPages:
    """A prefill-only request's pages whose KV is computed, after a step that did not finish its prompt
    (for a request added with `reports_pages`): those pages may be copied out while the rest computes,
    unless it is preempted (`num_preemptions` moves), which frees them."""

    request_id: str
    block_ids: list[int]  # its first pages, in prompt order, each whole
    num_preemptions: int
    finished: bool = False  # not the request's last output
