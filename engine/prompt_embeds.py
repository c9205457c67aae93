"""A step's prompt rows given as embeddings (vLLM's prompt embeds, an image's rows): where they sit among
the step's token rows, and what the model reads there in place of its embedding of their placeholder tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class WithheldEmbeddings:
    """A prompt given as embeddings whose rows were not sent (a decode worker's: protos/decode.proto's
    DecodeRequest): their shape, and what names them in the cache salt. Never read: a preempted request
    whose prefix cache no longer holds its prompt ends instead (engine/sequence.py's `withheld_end`)."""

    shape: tuple[int, int]  # [rows, hidden_size]
    digest: str


def given_in(given: tuple[tuple[int, torch.Tensor], ...], first_row: int, start: int, n: int
             ) -> list[tuple[int, torch.Tensor]]:
    """Of a sequence's `given` embeddings ((first position, rows) each), those of positions [start, start + n),
    computed in a step's rows from `first_row` on: (row, rows) each."""
    pieces = []
    for position, rows in given:
        lo, hi = max(start, position), min(start + n, position + rows.shape[0])
        if lo < hi:
            pieces.append((first_row + lo - start, rows[lo - position:hi - position]))
    return pieces


def spans_in(spans: tuple[tuple[int, int], ...], start: int, n: int) -> tuple[tuple[int, int], ...]:
    """The spans that hold any of positions [start, start + n)."""
    return tuple((lo, hi) for lo, hi in spans if lo < start + n and hi > start)


@dataclass(frozen=True)
class GivenEmbeddings:
    rows: torch.Tensor    # [R] int64: the step's rows they replace
    values: torch.Tensor  # [R, hidden]

    @classmethod
    def of(cls, pieces: list[tuple[int, torch.Tensor]], device: torch.device) -> GivenEmbeddings | None:
        """From each chunk's (first row, its given rows); None when the step has none. Rows narrower than others
        (a prompt's embeddings beside Qwen3-VL's images and their DeepStack) add nothing to the layers after."""
        if not pieces:
            return None
        rows = [first + i for first, values in pieces for i in range(values.shape[0])]
        width = max(values.shape[1] for _, values in pieces)
        return cls(torch.tensor(rows, dtype=torch.int64, device=device),
                   torch.cat([F.pad(values, (0, width - values.shape[1])) for _, values in pieces]).to(device))

    def placed(self, embedded: torch.Tensor) -> torch.Tensor:
        """`embedded` (the step's token embeddings) with the given rows in their places."""
        return embedded.index_copy(0, self.rows, self.values[:, :embedded.shape[1]].to(embedded.dtype))

    def num_added_layers(self, hidden_size: int) -> int:
        """How many of the model's first layers' outputs take more of these rows (Qwen3-VL's DeepStack)."""
        return self.values.shape[1] // hidden_size - 1

    def added_after(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """`h` (the step's states out of `layer`, one of the first `num_added_layers`) with the given rows' share
        for that layer added at their places, as transformers' Qwen3VLTextModel adds its DeepStack rows."""
        width = h.shape[1]
        added = self.values[:, width * (layer + 1):width * (layer + 2)]
        return h.index_add(0, self.rows, added.to(h.dtype))
