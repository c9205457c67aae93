"""A step's prompt rows given as embeddings (vLLM's prompt embeds): where they sit among the step's
token rows, and what the model reads there in place of its embedding of their placeholder tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GivenEmbeddings:
    rows: torch.Tensor    # [R] int64: the step's rows they replace
    values: torch.Tensor  # [R, hidden]

    @classmethod
    def of(cls, pieces: list[tuple[int, torch.Tensor]], device: torch.device) -> GivenEmbeddings | None:
        """From each chunk's (first row, its given rows); None when the step has none."""
        if not pieces:
            return None
        rows = [first + i for first, values in pieces for i in range(values.shape[0])]
        return cls(torch.tensor(rows, dtype=torch.int64, device=device),
                   torch.cat([values for _, values in pieces]).to(device))

    def placed(self, embedded: torch.Tensor) -> torch.Tensor:
        """`embedded` (the step's token embeddings) with the given rows in their places."""
        return embedded.index_copy(0, self.rows, self.values.to(embedded.dtype))
