"""`SpecDecodeStats`: one request's speculative verification steps, as vLLM's per-request acceptance
metrics count them (`--per-request-spec-decode-metrics`): for each length of draft proposed, how
many steps accepted 0, 1, ... of its tokens (the bonus token each step makes left out), and with
`detailed` each step's (drafted, accepted) in order. Only steps that computed drafts count; the
storage grows with the draft lengths seen, not the steps, unless `detailed`."""
from __future__ import annotations

from typing import Literal

PerRequestSpecDecodeMetrics = Literal["none", "summary", "detailed"]
PER_REQUEST_SPEC_DECODE_METRICS = ("none", "summary", "detailed")


class SpecDecodeStats:
    def __init__(self, num_spec_tokens: int, is_detailed: bool) -> None:
        self.num_spec_tokens = num_spec_tokens  # the most drafts a step proposes (the configured k)
        self.rows: dict[int, list[int]] = {}  # draft length k -> [j]: steps that accepted j of its k
        self.per_step: list[tuple[int, int]] | None = [] if is_detailed else None  # (drafted, accepted)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        row = self.rows.get(num_drafted)
        if row is None:
            row = self.rows[num_drafted] = [0] * (num_drafted + 1)
        row[num_accepted] += 1
        if self.per_step is not None:
            self.per_step.append((num_drafted, num_accepted))
