"""Where the scheduler and the runner meet: one step's work, as plain data."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass
class ScheduledBatch:
    """For each sequence, compute `num_new_tokens[i]` tokens starting at its
    `num_computed_tokens`; a sequence whose chunk reaches its last token is sampled."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)
