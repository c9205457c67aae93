"""What the engine hands back after each step."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import FinishReason


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
    num_cached_tokens: int = 0
