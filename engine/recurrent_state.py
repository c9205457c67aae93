"""The recurrent states of a hybrid model's linear-attention layers (engine/linear_attention_config.py), kept in
KV pages of their own: each sequence holds `StatePages.num_pages` pages beside those of its tokens
(Sequence.state_blocks), the states' float32 bytes laid across them.

In pages, the states need nothing of their own: the pool's bytes count them, a sequence that cannot get them
waits as for any page, and a prefill worker hands them to a decode worker with the prompt's pages by the same
transports, layout check and checksum (they follow the prompt's pages in a reservation).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.linear_attention_config import LinearAttention


@dataclass(frozen=True)
class StateShape:
    """One sequence's states: for each linear-attention layer, its convolution's last inputs [C, K-1] and its
    recurrent matrix a value head [H, Dk, Dv], float32 (as transformers keeps them)."""

    num_layers: int
    conv_dim: int
    conv_width: int
    num_heads: int
    key_dim: int
    value_dim: int

    @classmethod
    def of(cls, layout: LinearAttention) -> StateShape:
        return cls(len(layout.linear_layers), layout.conv_dim, layout.conv_kernel - 1, layout.num_value_heads,
                   layout.key_head_dim, layout.value_head_dim)

    @property
    def conv_floats(self) -> int:
        return self.conv_dim * self.conv_width

    @property
    def layer_floats(self) -> int:
        return self.conv_floats + self.num_heads * self.key_dim * self.value_dim

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.layer_floats * 4

    def num_pages(self, page_bytes: int) -> int:
        return math.ceil(self.nbytes / page_bytes)


def page_bytes(pool: torch.Tensor) -> int:
    """Bytes of one page across a pool `[L, 2, Hkv, N, bs, D]`'s layers."""
    return pool[:, :, :, 0].numel() * pool.element_size()


@dataclass(frozen=True)
class RecurrentStates:
    """A step's states, a row a sequence in the batch's order (decodes, then prefill chunks): read from their
    pages before the forward, updated in place by it, written back after."""

    shape: StateShape
    rows: torch.Tensor  # [B, S * page_bytes / 4] float32, each row's states from its start
    page_ids: torch.Tensor  # [B, S] int64: each row's pages
    spans: tuple[tuple[int, int], ...]  # each row's tokens of the step, [start, end)
    # By row: the offsets into its tokens after which its states are kept too (block ends inside a prompt chunk for
    # the prefix cache, engine/state_snapshots.py; each draft of a drafted sequence, one of which its next step
    # goes on from), and the states there, [len(offsets), rows' width].
    cuts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    kept: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def singles(self) -> list[int]:
        """The rows of one token and nothing kept: computed together, a step each."""
        return [row for row, (start, end) in enumerate(self.spans) if end - start == 1 and row not in self.cuts]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `index`-th linear-attention layer's convolution windows [B, C, K-1] and recurrent states
        [B, H, Dk, Dv]: views of `rows`."""
        return self._split(self.rows, index)

    def kept_layer(self, row: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer` of the states `row` keeps along its run: [len(cuts), C, K-1] and [len(cuts), H, Dk, Dv]."""
        return self._split(self.kept[row], index)

    def runs(self, row: int) -> list[tuple[int, int, int | None]]:
        """Row `row`'s tokens as runs (start, end, which kept states follow it; None for the last)."""
        start, end = self.spans[row]
        bounds = (start, *(start + cut for cut in self.cuts.get(row, ())), end)
        return [(a, b, i if i < len(bounds) - 2 else None) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]

    def _split(self, rows: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, num_rows = self.shape, rows.shape[0]
        start = index * s.layer_floats
        conv = rows[:, start:start + s.conv_floats].view(num_rows, s.conv_dim, s.conv_width)
        recurrent = rows[:, start + s.conv_floats:start + s.layer_floats]
        return conv, recurrent.view(num_rows, s.num_heads, s.key_dim, s.value_dim)


class StatePages:
    """Reads and writes sequences' states in their pages of `pool` (a KVPool's tensor)."""

    def __init__(self, shape: StateShape, pool: torch.Tensor) -> None:
        self.shape = shape
        self.page_bytes = page_bytes(pool)
        if self.page_bytes % 4:  # a row of pages must read as float32
            raise ValueError(f"a page of {self.page_bytes} bytes cannot hold float32 states")
        self.num_pages = shape.num_pages(self.page_bytes)
        # The pool's words as float32, pages first: [N, L, 2, Hkv, bs, D * itemsize / 4], a view. Indexed by page,
        # it gives a row's pages in one copy, and takes them back in one.
        self._pages = pool.view(torch.float32).movedim(3, 0)

    def read(self, page_ids: list[list[int]], fresh: list[bool], spans: tuple[tuple[int, int], ...],
             cuts: dict[int, tuple[int, ...]] | None = None) -> RecurrentStates:
        """The states in each row's pages; zeros for a `fresh` row (a sequence at its start: its pages hold
        another's old bytes). `spans`, `cuts`: RecurrentStates'."""
        ids = torch.tensor(page_ids, dtype=torch.int64, device=self._pages.device).view(len(page_ids), -1)
        rows = self._pages[ids.flatten()].view(len(page_ids), -1)
        if any(fresh):
            rows[torch.tensor(fresh, device=rows.device)] = 0.0
        cuts = {row: offsets for row, offsets in (cuts or {}).items() if offsets}
        kept = {row: rows.new_empty(len(offsets), rows.shape[1]) for row, offsets in cuts.items()}
        return RecurrentStates(self.shape, rows, ids, spans, cuts, kept)

    def write(self, states: RecurrentStates) -> None:
        ids = states.page_ids.flatten()
        self._pages[ids] = states.rows.view(len(ids), *self._pages.shape[1:])

    def write_row(self, page_ids: list[int], row: torch.Tensor) -> None:
        """One sequence's states `row` into its pages `page_ids`."""
        ids = torch.tensor(page_ids, dtype=torch.int64, device=self._pages.device)
        self._pages[ids] = row.view(len(page_ids), *self._pages.shape[1:])


def check_drafts(layout: LinearAttention | None, method: str | None) -> None:
    """ValueError where a hybrid model's (`layout`: its linear attention; None: not a hybrid) drafts would come
    from a model or head of their own (`method`: the speculative config's; n-gram drafts are served)."""
    if layout is not None and method not in (None, "ngram"):
        raise ValueError(f"speculative decoding by {method} drafts is not supported for hybrid linear-attention "
                         "models yet (n-gram drafts are)")


def check_state_pages(num_blocks: int, num_state_blocks: int) -> None:
    """ValueError where a pool of `num_blocks` pages cannot serve a model whose sequences each hold
    `num_state_blocks` for their states (none: not a hybrid model)."""
    if not num_state_blocks:
        return
    if num_blocks <= num_state_blocks:
        raise ValueError(f"a KV pool of {num_blocks} pages holds no sequence of this model: its recurrent states "
                         f"alone take {num_state_blocks} pages; give the pool more memory")
