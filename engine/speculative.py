"""Speculative decoding, as vLLM's --speculative-config: n-gram (prompt lookup) drafts
(`{"method": "ngram"}`), a small draft model's (`{"method": "draft_model", "model": DIR}`:
engine/draft_model.py), or an EAGLE head's or the checkpoint's multi-token prediction layer's, reading the
target's hidden states (`{"method": "eagle" or "eagle3", "model": DIR}`, `{"method": "mtp"}`: engine/eagle.py).

With n-gram drafts, a decoding sequence whose last tokens appeared earlier in it is guessed to go
on as it went on there. Either way, up to `num_speculative_tokens` drafts are appended for one
step and computed as one chunk after the sequence's last token, so one forward pass gives the
logits after each. The sampler then samples each position in turn, as if the drafts before it were
the sequence's own tokens, and a draft is kept while it equals what was sampled: the first token
that differs ends the step. Every token is thus the one plain decoding would have sampled at its
position (the same argmax, the same seeded draw, the same penalties, guide and stop checks): drafts
change how many tokens a step makes, never which.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from engine.sequence import Sequence

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
MODEL_METHODS = frozenset({"draft_model", "eagle", "eagle3"})  # those that draft with a model directory
# vLLM's older names of its "mtp" method, one a model family
MTP_ALIASES = frozenset({"deepseek_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp", "qwen3_next_mtp", "qwen3_5_mtp",
                         "nemotron_h_mtp", "mimo_mtp"})


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int  # drafts a step, at most
    prompt_lookup_max: int = 4  # the longest suffix looked up (ngram)
    prompt_lookup_min: int = 1  # ... and the shortest
    method: str = "ngram"
    model: str | None = None  # the draft model's or EAGLE head's directory (mtp: the target's, if given)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; supported: {', '.join(METHODS)}")
        if (self.method in MODEL_METHODS) != (self.model is not None) and self.method != "mtp":
            raise ValueError(f"{self.method} drafts need the draft's directory as model" if self.model is None
                             else f"{self.method} drafts take no model")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} and "
                             f"{self.prompt_lookup_max}")

    @classmethod
    def from_dict(cls, given: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's --speculative-config keys; ValueError for a missing, unknown or bad one."""
        known = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "draft_tensor_parallel_size"}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown keys {unknown}; known: {sorted(known)}")
        # vLLM's docs give it for EAGLE heads: 1, the draft computed whole on one rank, as every draft is here.
        if given.get("draft_tensor_parallel_size", 1) != 1:
            raise ValueError(f"speculative config: draft_tensor_parallel_size must be 1 (a draft computes whole, "
                             f"beside a target split or not), got {given['draft_tensor_parallel_size']}")
        given = {key: value for key, value in given.items() if key != "draft_tensor_parallel_size"}
        if given.get("model") is not None and given.get("method") in (None, "draft_model"):
            # vLLM takes a model without a method as a draft model too.
            lookups = sorted({"prompt_lookup_max", "prompt_lookup_min"} & set(given))
            if lookups:
                raise ValueError(f"speculative config: {lookups} are n-gram keys; a draft model takes none")
            if "num_speculative_tokens" not in given:
                raise ValueError("speculative config needs num_speculative_tokens")
            return cls(num_speculative_tokens=int(given["num_speculative_tokens"]), method="draft_model",
                       model=str(given["model"]))
        if "method" not in given or "num_speculative_tokens" not in given:
            raise ValueError("speculative config needs method and num_speculative_tokens")
        if given["method"] in MTP_ALIASES:
            given = {**given, "method": "mtp"}
        lookup_max = int(given.get("prompt_lookup_max") or given.get("prompt_lookup_min") or 4)
        lookup_min = int(given.get("prompt_lookup_min") or min(lookup_max, 1))
        return cls(num_speculative_tokens=int(given["num_speculative_tokens"]), prompt_lookup_max=lookup_max,
                   prompt_lookup_min=lookup_min, method=str(given["method"]), model=given.get("model"))


class NgramDrafter:
    """Proposes each sequence's drafts from its own tokens (the scheduler's drafter, as DraftModel is)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.config = config

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """Up to `room` drafts for what follows each sequence's tokens, by request id."""
        config = self.config
        return {seq.request_id: ngram_drafts(seq.token_ids, room, config.prompt_lookup_min, config.prompt_lookup_max)
                for seq, room in wanted}

    def forget(self, request_id: str) -> None:
        """A sequence that finished or was preempted: n-gram drafts keep nothing of it."""

    def prefilled(self, seq: Sequence, room: int) -> list[int]:
        """A prompt computed for a decode worker: n-gram drafts need nothing of it, the decode worker drafting from
        its tokens at its first step."""
        return []


def ngram_drafts(token_ids: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest suffix of `token_ids`
    (of `max_n` tokens down to `min_n`) that occurred earlier: at most `num_drafts` of them; none
    when no such suffix occurred."""
    if num_drafts < 1 or len(token_ids) <= min_n or token_ids.count(token_ids[-1]) < 2:
        return []  # (the count, in C over the list, spares most steps the array below)
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        # windows[i] = tokens[i:i + n], for every start whose window ends before the suffix does
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            after = int(starts[-1]) + n
            return tokens[after:after + num_drafts].tolist()
    return []
