"""vLLM's thinking_token_budget: a reasoning model's thinking is ended for it after so many tokens.

A request's `ThinkingBudget` names the tokens that open and close its thinking (Qwen3's `<think>`
and `</think>`) and the tokens written to close it once the budget is spent (vLLM's
`reasoning_end_str`, which may lead into the close with a phrase of its own). A sequence is
thinking while the last opening among its tokens, prompt and output, has no close after it; its
thinking tokens are those after that opening, the prompt's among them (a template that opens the
thinking in the prompt spends the budget too, as vLLM counts). Once they number `max_tokens`, the
sampler writes the forced close, a token a step, whatever the logits say; the answer then follows
as the model goes on. A thinking the model closes itself in time is left as it is.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingBudget:
    max_tokens: int  # thinking tokens before the close is forced; 0: closed as soon as it opens
    start_token_ids: tuple[int, ...]
    end_token_ids: tuple[int, ...]
    # What is written to close the thinking; it ends with end_token_ids, so the thinking is then
    # closed. Empty: end_token_ids alone.
    forced_end_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("start_token_ids", "end_token_ids", "forced_end_token_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.max_tokens < 0:
            raise ValueError(f"thinking budget: max_tokens must be >= 0, got {self.max_tokens}")
        if not self.start_token_ids or not self.end_token_ids:
            raise ValueError("thinking budget: the tokens that open and close the thinking are needed")
        if min(self.start_token_ids + self.end_token_ids + self.forced_end_token_ids) < 0:
            raise ValueError("thinking budget: token ids must be >= 0")
        if self.forced_end[-len(self.end_token_ids):] != self.end_token_ids:
            # Else the thinking would stay open after it, and the close be forced again and again.
            raise ValueError("thinking budget: forced_end_token_ids must end with end_token_ids")

    @property
    def forced_end(self) -> tuple[int, ...]:
        return self.forced_end_token_ids or self.end_token_ids


class ThinkingMarks:
    """Where one sequence's last opening and close of thinking are, kept up to date as its tokens grow:
    each new token is looked at once (the whole list again only if it shrank)."""

    def __init__(self, budget: ThinkingBudget) -> None:
        self.budget = budget
        self._num_seen = 0
        self._last_start = -1  # the index its last opening begins at; -1: none
        self._last_end = -1

    def forced_token(self, token_ids: list[int]) -> int | None:
        """The token the sequence must take next to close its thinking, or None: it may take any."""
        self._see(token_ids)
        budget = self.budget
        if self._last_start < 0 or self._last_end > self._last_start:
            return None
        num_thought = len(token_ids) - self._last_start - len(budget.start_token_ids)
        if num_thought < budget.max_tokens:
            return None
        forced = budget.forced_end
        # Of the forced close, what its last tokens have written already (never the opening's tokens).
        num_written = next((k for k in range(min(len(forced) - 1, num_thought), 0, -1)
                            if tuple(token_ids[-k:]) == forced[:k]), 0)
        return forced[num_written]

    def _see(self, token_ids: list[int]) -> None:
        if len(token_ids) < self._num_seen:
            self._num_seen, self._last_start, self._last_end = 0, -1, -1
        start, end = self.budget.start_token_ids, self.budget.end_token_ids
        self._last_start = max(self._last_start, _last_index(token_ids, start, self._num_seen - len(start) + 1))
        self._last_end = max(self._last_end, _last_index(token_ids, end, self._num_seen - len(end) + 1))
        self._num_seen = len(token_ids)


def _last_index(token_ids: list[int], marker: tuple[int, ...], lo: int) -> int:
    """The last index at or after `lo` that `marker` begins at in `token_ids`; -1: none. The first
    look at a long prompt runs at list.index's speed, not a Python loop's."""
    first, size = marker[0], len(marker)
    at, found, stop = max(lo, 0), -1, len(token_ids) - size + 1
    while at < stop:
        try:
            at = token_ids.index(first, at, stop)
        except ValueError:
            break
        if size == 1 or tuple(token_ids[at:at + size]) == marker:
            found = at
        at += 1
    return found
