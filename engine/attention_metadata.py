"""What attention needs to know about a flattened batch of tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.recurrent_state import RecurrentStates


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens [start, end) of the batch: one sequence's chunk after `context_len` computed tokens."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks_of_seq] int64
    # Spans of positions [start, end) attended bidirectionally (an image's tokens, in Gemma 3) that
    # the chunk's tokens are in; the chunk holds each one's end (the scheduler's).
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class AttentionMetadata:
    """The batch is ordered decodes first: tokens [0, num_decode_tokens) are each a token of
    a decoding sequence, attending to its pages up to itself (one a sequence, or a drafted
    sequence's last token and its drafts: engine/speculative.py); prefill chunks follow."""

    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V is written
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decode_tokens, max_blocks] int64
    decode_context_lens: torch.Tensor | None  # [num_decode_tokens] int64, counting the row's token
    prefills: tuple[PrefillChunk, ...]
    positions: torch.Tensor | None = None  # [T] int64: each token's position (Llama 4's NoPE layers scale q by it)
    # A hybrid model's recurrent states, a row a decode token then a row a prefill chunk (engine/recurrent_state.py).
    recurrent: RecurrentStates | None = None
    # Sparse attention's choices (engine/models/mla.py) of the last layer that made them this step, by where: "decode"
    # or a chunk's start; a layer without an indexer of its own (GLM-5's shared ones) attends by them.
    index_choices: dict[str | int, torch.Tensor] = field(default_factory=dict)
