"""Speculative drafts from a small model of the same vocabulary, as vLLM's `{"method": "draft_model"}`.

The draft model decodes greedily a few tokens ahead of each decoding sequence; the target then
verifies them in one step (engine/speculative.py), so what comes out is the target's alone and the
draft only decides how many tokens a step makes. It keeps its own KV pages per sequence: on its
first drafts a sequence's whole context is computed as one chunk (a decode worker's prompt came
as the target's KV, which the draft cannot read), later only the tokens since, and the KV of the
drafts the target took as its tokens is kept.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.batch import ScheduledBatch
from engine.kv_pool import KVPool, kv_block_bytes
from engine.model_config import ModelConfig
from engine.model_config_loader import load_model_config
from engine.model_runner import ModelRunner
from engine.prompt_images import MRoPEPositions
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

# What the runner reads of a sequence's request: no prompt logprobs, no pooling, no adapter.
_DRAFTING = SamplingParams(max_tokens=1)


@dataclass(eq=False)
class DraftSequence:
    """A sequence as the draft model holds it, in the shape ModelRunner reads (engine/sequence.py's):
    its tokens and the drafts made after them, the KV computed of them, and its own pages."""

    owner: Sequence
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_verified: int = 0  # the owner's tokens when its last drafts were made: the drafts follow them
    sampling_params: SamplingParams = _DRAFTING
    prompt_logprobs: None = None
    # A prompt given as embeddings, or its images, are read by the draft model as their placeholder
    # tokens: its drafts are worse, never wrong (the target verifies them).
    prompt_embeds: None = None
    given_embeddings: tuple = ()
    pending_images: tuple = ()
    bidirectional_spans: tuple = ()
    rope_positions: MRoPEPositions | None = None  # an EAGLE head's of multimodal RoPE: its owner's (engine/eagle.py)
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def follow(self, owner_tokens: list[int]) -> None:
        """Take the owner's tokens as its own, keeping the KV of every draft the owner took as its token."""
        kept = self.num_verified
        while kept < self.num_computed_tokens and kept < len(owner_tokens) and \
                self.token_ids[kept] == owner_tokens[kept]:
            kept += 1
        # At least its last token is computed again: a step's drafts start from its logits.
        self.num_computed_tokens = min(self.num_computed_tokens, kept, len(owner_tokens) - 1)
        del self.token_ids[kept:]
        self.token_ids += owner_tokens[kept:]
        self.num_verified = len(owner_tokens)


class DraftModel:
    """The scheduler's drafter for `{"method": "draft_model"}`: a model beside the target, with a KV
    pool of its own (`allocate_kv_pool`: as many pages as the target's, of the same size)."""

    reads_served_checkpoint = False  # its weights are the served checkpoint's: read again when it changes
    pool_layers = 0  # layers it keeps in the target's pages (an EAGLE head's: engine/eagle.py); 0: a pool of its own

    def __init__(self, model_dir: str, num_speculative_tokens: int, target: ModelConfig, dtype: torch.dtype,
                 device: str, max_positions: int) -> None:
        """ValueError for a directory that cannot draft for `target`."""
        config = load_model_config(Path(model_dir))
        if config.encoder is not None or config.multimodal is not None:
            raise ValueError(f"draft model {model_dir}: a draft model must be a text decoder")
        if config.state_shape is not None:  # its sequences would need state pages of their own
            raise ValueError(f"draft model {model_dir}: a draft model with recurrent layers ({config.architecture}) "
                             "is not supported yet; one of attention layers alone, an EAGLE head or the target's MTP "
                             "layer drafts for any model")
        if config.vocab_size > target.vocab_size:
            raise ValueError(f"draft model {model_dir}: its vocabulary ({config.vocab_size} tokens) is larger than "
                             f"the target's ({target.vocab_size}); a draft model must share the target's tokenizer")
        self._start(model_dir, ModelRunner(model_dir, config, dtype, device, max_positions), num_speculative_tokens,
                    dtype)

    def _start(self, model_dir: str, runner: ModelRunner, num_speculative_tokens: int, dtype: torch.dtype) -> None:
        self.model_dir = model_dir  # its weights' checkpoint, read again after they were released
        self.num_speculative_tokens = num_speculative_tokens
        self.runner = runner
        self.dtype = dtype
        self.block_size = self.num_blocks = 0
        self._free_blocks: list[int] = []
        self._held: dict[str, DraftSequence] = {}

    def kv_block_bytes(self, block_size: int) -> int:
        return kv_block_bytes(self.runner.model_config, block_size, self.dtype)

    def allocate_kv_pool(self, num_blocks: int, block_size: int, target_pool: KVPool | None = None) -> None:
        """A pool of its own, as many pages as the target's (`target_pool`: the target's, for a drafter whose
        layers are in its pages)."""
        self.runner.allocate_kv_pool(num_blocks, block_size, self.dtype)
        self.block_size, self.num_blocks = block_size, num_blocks
        self._free_blocks = list(range(num_blocks))

    def prefilled(self, seq: Sequence, room: int) -> list[int]:
        """`seq`'s prompt is computed and its first token sampled, and its pages go on to a decode worker: what a
        drafter keeping its layers in them computes there first, and drafts up to `room` for what follows (nothing
        and none, for a draft model: it computes the prompt on the decode worker at its first step)."""
        return []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """`room` greedy drafts for what follows each sequence's tokens, by request id: none for a
        sequence whose drafts find no pages."""
        rooms: dict[int, int] = {}
        batch = ScheduledBatch()
        for seq, room in wanted:
            draft = self._draft_sequence(seq)
            if self._reserve(draft, seq.num_tokens + room - 1):
                self._add(batch, draft, room, rooms)
        return self._drafts(batch, rooms)

    def _add(self, batch: ScheduledBatch, draft: DraftSequence, room: int, rooms: dict[int, int]) -> None:
        """`draft`'s inputs since its last drafts into the first forward of a proposal, its `room` noted."""
        rooms[id(draft)] = room
        pending = draft.num_tokens - draft.num_computed_tokens
        if pending <= self.num_speculative_tokens + 1:
            # The tokens since its last drafts: decode rows, batched with the other sequences'
            # (a chunk's attention runs alone), as the runner lays out a token and its drafts.
            draft.num_draft_tokens = pending - 1
        batch.add(draft, pending)

    def _drafts(self, batch: ScheduledBatch, rooms: dict[int, int]) -> dict[str, list[int]]:
        """Greedy drafts for `batch`'s sequences, by request id, each up to its room: a forward a draft, each
        fed the one before."""
        made: dict[str, list[int]] = {}
        while batch.seqs:
            sampled, tokens, outputs = self._forward(batch)
            batch = ScheduledBatch()
            for draft, token, output in zip(sampled, tokens, outputs):
                draft.num_computed_tokens = draft.num_tokens
                draft.num_draft_tokens = 0
                drafts = made.setdefault(draft.owner.request_id, [])
                drafts.append(token)
                if len(drafts) < rooms[id(draft)]:
                    draft.token_ids.append(token)
                    self._feed(draft, output)
                    batch.add(draft, 1)
        return made

    def _forward(self, batch: ScheduledBatch) -> tuple[list[DraftSequence], list[int], list]:
        """The sequences the forward sampled (decode rows first: its order, not the batch's), each one's greedy
        draft, and what else its next input needs (nothing, for a draft model)."""
        sampled, logits = self.runner.forward(batch)
        return sampled, logits[last_rows(sampled, logits.device)].argmax(dim=-1).tolist(), [None] * len(sampled)

    def _feed(self, draft: DraftSequence, output: object) -> None:
        """Give `draft`'s next input (its last draft, appended) what `_forward` made for it besides the token."""

    def forget(self, request_id: str) -> None:
        """Free the pages of a sequence that finished or was preempted."""
        draft = self._held.pop(request_id, None)
        if draft is not None:
            self._free_blocks += draft.block_table

    def _draft_sequence(self, seq: Sequence) -> DraftSequence:
        draft = self._held.get(seq.request_id)
        if draft is None or draft.owner is not seq:  # (an id used again: none of its KV is this one's)
            self.forget(seq.request_id)
            draft = self._held[seq.request_id] = DraftSequence(seq)
        draft.follow(seq.token_ids)
        return draft

    def _reserve(self, draft: DraftSequence, num_positions: int) -> bool:
        """Pages for the first `num_positions` positions' KV; False, taking none, when too few are free."""
        missing = -(-num_positions // self.block_size) - len(draft.block_table)
        if missing > len(self._free_blocks):
            return False
        for _ in range(missing):
            draft.block_table.append(self._free_blocks.pop())
        return True


def last_rows(sampled: list[DraftSequence], device: torch.device) -> torch.Tensor:
    """Each sequence's last logits row: a sequence computed as decode rows has one a row."""
    ends = itertools.accumulate(1 + draft.num_draft_tokens for draft in sampled)
    return torch.tensor([end - 1 for end in ends], device=device)
