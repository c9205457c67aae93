"""vLLM's per-request output token metrics (`--enable-per-request-output-token-metrics`, experimental
in vLLM): a reasoning reply's tokens counted and timed by what they are, its thinking (`reasoning`)
and its answer (`content`), with those its reasoning parser had not told apart by its end
(`unclassified_token_count`). The counts are its usage's: `reasoning.token_count` is
`completion_tokens_details.reasoning_tokens`, and the three add up to `completion_tokens`.

Each kind is timed by the deltas that brought its tokens (a delta's tokens share its arrival, as
vLLM's share an output batch's): `time_to_first_token_ms` from when the worker's engine took the
request (request_timing.py), `generation_time_ms` from its first delta to its last, and over that
interval `mean_itl_ms` and `tokens_per_second` of its tokens after the first: null with fewer than
two tokens or no interval."""
from __future__ import annotations

from typing import Any

KINDS = ("reasoning", "content")


class TokenKinds:
    """One reply's tokens of each kind, as they come: how many, and when the first and last came."""

    __slots__ = ("counts", "first", "last")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(KINDS, 0)
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def add(self, kind: str, num_tokens: int, at: float) -> None:
        """`num_tokens` more of `kind`, come at `at` (a `time.perf_counter()`)."""
        if num_tokens > 0:
            self.counts[kind] += num_tokens
            self.first.setdefault(kind, at)
            self.last[kind] = at

    def to_json(self, scheduled_at: float | None, num_unclassified: int) -> dict[str, Any]:
        made: dict[str, Any] = {kind: self._kind(kind, scheduled_at) for kind in KINDS}
        made["unclassified_token_count"] = num_unclassified
        return made

    def _kind(self, kind: str, scheduled_at: float | None) -> dict[str, Any]:
        count, first, last = self.counts[kind], self.first.get(kind), self.last.get(kind)
        made = {"token_count": count, "time_to_first_token_ms": None, "generation_time_ms": None,
                "mean_itl_ms": None, "tokens_per_second": None}
        if first is None:
            return made
        if scheduled_at is not None:
            made["time_to_first_token_ms"] = round((first - scheduled_at) * 1e3, 3)
        made["generation_time_ms"] = round((last - first) * 1e3, 3)
        if count >= 2 and last > first:
            made["mean_itl_ms"] = round((last - first) * 1e3 / (count - 1), 3)
            made["tokens_per_second"] = round((count - 1) / (last - first), 3)
        return made
