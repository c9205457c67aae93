"""Speculative decoding within the scheduler's steps (the method: engine/speculative.py): which
decoding sequences are given drafts and how many, appending them as the step's budget and pages
allow, and taking the tokens of a step that computed them; with the counts of drafts proposed and
accepted, as vLLM's spec_decode metrics count them."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from engine.batch import ScheduledBatch
from engine.block_manager import BlockManager
from engine.sampler import Sampler
from engine.sequence import Sequence
from engine.spec_decode_stats import PerRequestSpecDecodeMetrics, SpecDecodeStats


class Drafter(Protocol):
    """What proposes speculative drafts: engine/speculative.py's NgramDrafter, engine/draft_model.py's DraftModel."""

    num_speculative_tokens: int

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, list[int]]: ...

    def forget(self, request_id: str) -> None: ...

    def prefilled(self, seq: Sequence, room: int) -> list[int]: ...


# Appends a sampled token (and its logprobs) to a sequence; True if the token finished it.
Accept = Callable[[Sequence, int, dict[int, float] | None], bool]


class Drafting:
    """A drafter's part of each step. `propose` and `add` run while the scheduler spends a step's
    budget, `postprocess` in place of the plain postprocess after a step that computed drafts. The
    counts only grow."""

    def __init__(self, drafter: Drafter | None, block_manager: BlockManager, max_model_len: int,
                 per_request: PerRequestSpecDecodeMetrics = "none") -> None:
        self.drafter = drafter  # None: no drafts (propose is never called)
        self.per_request = per_request  # what each sequence keeps of its own steps (spec_decode_stats.py)
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.num_draft_tokens = 0  # drafts proposed, and of them accepted, over the engine's life
        self.num_accepted_tokens = 0
        self.num_drafts = 0  # sequences' steps that computed drafts
        self.num_accepted_tokens_per_position: list[int] = []  # [k]: drafts accepted as a step's (k+1)-th

    def propose(self, running: list[Sequence], budget: int) -> dict[str, list[int]]:
        """Drafts for the decoding sequences, all at once (a draft model computes them as batches), as
        many as the budget would leave each were the running sequences scheduled in turn, its
        max_tokens and the context leave room for (speculative.py)."""
        wanted, handed = [], {}
        for seq in running:
            if budget <= 0:
                break
            room = 0
            if seq.num_uncomputed_tokens == 1 and not seq.is_prefill_only:
                room = self._room(seq, budget - 1)
                if seq.handoff_drafts:  # a decode worker's first step: the prefill worker's drafts
                    handed[seq.request_id], seq.handoff_drafts = seq.handoff_drafts[:room], []
                elif room > 0:
                    wanted.append((seq, room))
            budget -= min(seq.num_uncomputed_tokens, budget) + room
        return {**handed, **self.drafter.propose(wanted)} if wanted else handed

    def prefilled(self, seq: Sequence) -> list[int]:
        """A prompt computed for a decode worker, its first token sampled: the drafter's drafts for what follows
        it, as many as its first decode step may take (none from a drafter that can draft there itself)."""
        return self.drafter.prefilled(seq, self._room(seq, self.drafter.num_speculative_tokens))

    def _room(self, seq: Sequence, budget: int) -> int:
        """The drafts a decoding sequence's step may take within `budget`, its max_tokens and the context."""
        return max(0, min(budget, self.drafter.num_speculative_tokens,
                          seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens - 1))

    def add(self, seq: Sequence, drafts: list[int], budget: int) -> None:
        """Append a decoding sequence's drafts, as many as the budget leaves room for and its pages can
        take now."""
        drafts = drafts[:budget - 1]
        if not drafts:
            return
        seq.add_drafts(drafts)
        if not self.block_manager.can_append_slot(seq):  # no page for them: decode plainly
            seq.take_drafts()

    def postprocess(self, batch: ScheduledBatch, sampled: list[Sequence], logits: torch.Tensor,
                    sampler: Sampler, accept: Accept) -> list[Sequence]:
        """Scheduler.postprocess_drafted, each sampled token given to `accept` (the scheduler's, which
        finishes the sequences it ends). Returns the finished sequences."""
        bm = self.block_manager
        drafts: dict[str, list[int]] = {}
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_draft_tokens:
                drafts[seq.request_id] = seq.take_drafts()
                self.num_draft_tokens += len(drafts[seq.request_id])
                self.num_drafts += 1
            seq.num_computed_tokens += num_new - len(drafts.get(seq.request_id, ()))
            bm.cache_computed_blocks(seq)
        first_rows, row = [], 0
        for seq in sampled:
            first_rows.append(row)
            row += 1 + len(drafts.get(seq.request_id, ()))
        finished: list[Sequence] = []
        num_accepted = dict.fromkeys(drafts, 0)  # by request id: this step's drafts accepted
        alive, position = list(zip(sampled, first_rows)), 0
        while alive:
            rows = torch.tensor([first + position for _, first in alive], device=logits.device)
            output = sampler(logits[rows], [seq for seq, _ in alive])
            going_on = []
            for (seq, first), token, logprobs in zip(alive, output.token_ids, output.logprobs):
                if accept(seq, token, logprobs):
                    finished.append(seq)
                    continue
                proposed = drafts.get(seq.request_id, ())
                if position < len(proposed) and token == proposed[position]:
                    # The draft's KV, computed as the next row's input, is the token's own.
                    seq.num_computed_tokens += 1
                    bm.cache_computed_blocks(seq)
                    self.num_accepted_tokens += 1
                    num_accepted[seq.request_id] += 1
                    per_position = self.num_accepted_tokens_per_position
                    per_position += [0] * (position + 1 - len(per_position))
                    per_position[position] += 1
                    going_on.append((seq, first))
            alive, position = going_on, position + 1
        if self.per_request != "none":
            self._record_per_request(batch.seqs, drafts, num_accepted)
        return finished

    def keep_stats(self, seq: Sequence) -> None:
        """Give a new sequence its own count of its steps' drafts, when they are kept per request (a
        sequence that never drafts reports its steps all zero)."""
        if self.drafter is not None and self.per_request != "none":
            seq.spec_decode = SpecDecodeStats(self.drafter.num_speculative_tokens, self.per_request == "detailed")

    def _record_per_request(self, seqs: list[Sequence], drafts: dict[str, list[int]],
                            num_accepted: dict[str, int]) -> None:
        for seq in seqs:
            proposed = drafts.get(seq.request_id)
            if proposed is not None:
                seq.spec_decode.record(len(proposed), num_accepted[seq.request_id])
