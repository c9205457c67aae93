"""The recurrent states of a hybrid model's linear-attention, Mamba or convolution layers (engine/state_shape.py),
kept in KV pages of their own: each sequence holds `StatePages.num_pages` pages beside those of its tokens
(Sequence.state_blocks), the states' float32 bytes laid across them.

In pages, the states need nothing of their own: the pool's bytes count them, a sequence that cannot get them
waits as for any page, and a prefill worker hands them to a decode worker with the prompt's pages by the same
transports, layout check and checksum (they follow the prompt's pages in a reservation).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.state_shape import StateShape

if TYPE_CHECKING:
    from engine.sequence import Sequence

IndexRows = slice | torch.Tensor  # rows of a batch: a slice where they lead it, else their indices


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
    # By token of the step, whether it is its sequence's prompt's ([T] bool; None where none is): a Mamba-2 layer
    # clamps those tokens' steps, as transformers' scan over a prompt does, and not a decoded token's
    # (engine/models/mamba2.py).
    prompt_tokens: torch.Tensor | None = None
    # Worked out once a step, for every layer's `advance`: the rows of one token and nothing kept (computed together)
    # and their tokens, slices where they lead both (a step's decodes, as a rule), else indices (None: no such rows);
    # the other rows, computed run by run.
    single_rows: IndexRows | None = field(init=False)
    single_tokens: IndexRows | None = field(init=False)
    run_rows: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        singles = [row for row, (start, end) in enumerate(self.spans) if end - start == 1 and row not in self.cuts]
        tokens = [self.spans[row][0] for row in singles]
        single_rows = single_tokens = None
        if singles and singles == tokens == list(range(len(singles))):
            single_rows = single_tokens = slice(0, len(singles))
        elif singles:
            single_rows, single_tokens = (torch.tensor(x, device=self.rows.device) for x in (singles, tokens))
        object.__setattr__(self, "single_rows", single_rows)
        object.__setattr__(self, "single_tokens", single_tokens)
        object.__setattr__(self, "run_rows", tuple(sorted(set(range(len(self.spans))) - set(singles))))

    def advance(self, out: torch.Tensor, states: torch.Tensor, kept: Callable[[int], torch.Tensor],
                step: Callable[[IndexRows, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                run: Callable[[int, int, torch.Tensor], torch.Tensor]) -> None:
        """Every row's tokens through one of a layer's recurrences (its convolution, its scan), `states` (the
        recurrence's, a row a sequence) going on in place into `out`: the rows of one token at once by
        `step(tokens, their states)` (out and the states after), the others run by run by `run(start, end, state)`
        (out; the state updated in place), each state after a run but the last into `kept(row)`."""
        rows, tokens = self.single_rows, self.single_tokens
        if rows is not None:
            out[tokens], states[rows] = step(tokens, states[rows])
        for row in self.run_rows:
            for start, end, index in self.runs(row):
                out[start:end] = run(start, end, states[row])
                if index is not None:
                    kept(row)[index] = states[row]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `index`-th linear-attention layer's convolution windows [B, C, K-1] and recurrent states
        [B, H, Dk, Dv]: views of `rows`."""
        return self._split(self.rows, index)

    def kept_layer(self, row: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer` of the states `row` keeps along its run: [len(cuts), C, K-1] and [len(cuts), H, Dk, Dv]."""
        return self._split(self.kept[row], index)

    def side(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `index`-th side layer's convolution windows [B, C, W] and last token ids [B, P] (StateShape's)."""
        return self._split_side(self.rows, index)

    def kept_side(self, row: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`side` of the states `row` keeps along its run: [len(cuts), C, W] and [len(cuts), P]."""
        return self._split_side(self.kept[row], index)

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

    def _split_side(self, rows: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, num_rows = self.shape, rows.shape[0]
        start = s.num_layers * s.layer_floats + index * s.side_floats
        conv_end = start + s.side_conv_dim * s.side_conv_width
        conv = rows[:, start:conv_end].view(num_rows, s.side_conv_dim, s.side_conv_width)
        return conv, rows[:, conv_end:conv_end + s.side_tokens]


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
             cuts: dict[int, tuple[int, ...]] | None = None, prompt_tokens: list[bool] | None = None
             ) -> RecurrentStates:
        """The states in each row's pages; zeros for a `fresh` row (a sequence at its start: its pages hold
        another's old bytes). `spans`, `cuts`, `prompt_tokens`: RecurrentStates'."""
        ids = torch.tensor(page_ids, dtype=torch.int64, device=self._pages.device).view(len(page_ids), -1)
        rows = self._pages[ids.flatten()].view(len(page_ids), -1)
        if any(fresh):
            rows[torch.tensor(fresh, device=rows.device)] = 0.0
        cuts = {row: offsets for row, offsets in (cuts or {}).items() if offsets}
        kept = {row: rows.new_empty(len(offsets), rows.shape[1]) for row, offsets in cuts.items()}
        prompt = None if prompt_tokens is None else torch.tensor(prompt_tokens, device=rows.device)
        return RecurrentStates(self.shape, rows, ids, spans, cuts, kept, prompt)

    def write(self, states: RecurrentStates) -> None:
        ids = states.page_ids.flatten()
        self._pages[ids] = states.rows.view(len(ids), *self._pages.shape[1:])

    def write_row(self, page_ids: list[int], row: torch.Tensor) -> None:
        """One sequence's states `row` into its pages `page_ids`."""
        ids = torch.tensor(page_ids, dtype=torch.int64, device=self._pages.device)
        self._pages[ids] = row.view(len(page_ids), *self._pages.shape[1:])


# Each sequence of a step, its first row and its rows, in the order of the step's rows (ModelRunner._prepare's).
SeqRows = list[tuple["Sequence", int, int]]


def step_states(pages: StatePages, seq_rows: SeqRows, snapshot_interval: int | None) -> RecurrentStates:
    """The step's states, a row a sequence: zeros where it starts, the kept states of the cached prefix it continues
    from where it does (`Sequence.restored_state`), else its pages'; kept too after each token of a drafted sequence
    but its last (its next step goes on from the last it takes), and every `snapshot_interval` tokens inside a prompt
    chunk (None: nowhere inside)."""
    cuts = {}
    for row, (seq, _, n) in enumerate(seq_rows):
        if seq.num_draft_tokens:
            cuts[row] = tuple(range(1, n))
        elif snapshot_interval is not None and n > 1:
            start = seq.num_computed_tokens
            cuts[row] = tuple(range(snapshot_interval - start % snapshot_interval, n, snapshot_interval))
    in_prompt = [min(max(seq.num_prompt_tokens - seq.num_computed_tokens, 0), n) for seq, _, n in seq_rows]
    prompt_tokens = [t for k, (_, _, n) in zip(in_prompt, seq_rows) for t in ([True] * k + [False] * (n - k))] \
        if any(in_prompt) else None
    states = pages.read([seq.state_blocks for seq, _, _ in seq_rows],
                        [seq.num_computed_tokens == 0 for seq, _, _ in seq_rows],
                        tuple((first, first + n) for _, first, n in seq_rows), cuts, prompt_tokens)
    for row, (seq, _, _) in enumerate(seq_rows):
        if seq.restored_state is not None:
            states.rows[row] = seq.restored_state
            seq.restored_state = None
    return states


def stepped_states(pages: StatePages, states: RecurrentStates, seq_rows: SeqRows, block_size: int | None) -> None:
    """After the forward: the states into their pages; a drafted sequence's states after each token held till its
    drafts are sampled (`Sequence.draft_states`); and, where the prefix cache keeps states (`block_size` given),
    each other sequence's at the block ends of its step (`Sequence.boundary_states`)."""
    pages.write(states)
    for row, (seq, _, num_new) in enumerate(seq_rows):
        start = seq.num_computed_tokens
        if seq.num_draft_tokens:  # where it ends is known once its drafts are sampled
            seq.draft_states = (start, states.kept[row])
            continue
        if block_size is None:
            continue
        seq.boundary_states = [((start + cut) // block_size - 1, kept)
                               for cut, kept in zip(states.cuts.get(row, ()), states.kept.get(row, ()))]
        if (start + num_new) % block_size == 0:
            seq.boundary_states.append(((start + num_new) // block_size - 1, states.rows[row].clone()))


def settle_draft_states(pages: StatePages, seqs: list[Sequence]) -> None:
    """After a drafted step is sampled: each drafted sequence whose drafts were not all taken goes on from its states
    after the last token it kept, not after its last draft (`Sequence.draft_states`)."""
    for seq in seqs:
        if seq.draft_states is None:
            continue
        start, kept = seq.draft_states
        seq.draft_states = None
        num_kept = seq.num_computed_tokens - start  # its last token's and the drafts taken
        if not seq.is_finished and num_kept <= len(kept):
            pages.write_row(seq.state_blocks, kept[num_kept - 1])


def check_state_pages(num_blocks: int, num_state_blocks: int) -> None:
    """ValueError where a pool of `num_blocks` pages cannot serve a model whose sequences each hold
    `num_state_blocks` for their states (none: not a hybrid model)."""
    if not num_state_blocks:
        return
    if num_blocks <= num_state_blocks:
        raise ValueError(f"a KV pool of {num_blocks} pages holds no sequence of this model: its recurrent states "
                         f"alone take {num_state_blocks} pages; give the pool more memory")
