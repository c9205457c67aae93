"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends a token budget: running sequences first (one token for a
decode, the next chunk for a prompt still being prefilled), then waiting ones,
oldest first. When a running sequence needs a page and none is free, the most
recently admitted sequence is preempted: its pages are freed and it waits to be
recomputed from its tokens, so the pool never deadlocks.

Under the priority policy both queues are kept in (priority, arrival) order instead: the
budget goes to the most urgent first, the most urgent waiting sequence is admitted
first, and the least urgent running one is preempted first.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Protocol

import torch

from engine.batch import ScheduledBatch
from engine.block_manager import BlockManager
from engine.sampler import Sampler, SamplerOutput
from engine.sequence import FinishReason, Sequence, SequenceStatus


class Drafter(Protocol):
    """What proposes speculative drafts: engine/speculative.py's NgramDrafter, engine/draft_model.py's DraftModel."""

    num_speculative_tokens: int

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, list[int]]: ...

    def forget(self, request_id: str) -> None: ...


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        policy: str = "fcfs",
        drafter: Drafter | None = None,
        max_loras: int | None = None,
        whole_embeddings: bool = False,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Finished prefill-only sequences whose pages wait to be copied out.
        self.held: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.is_by_priority = policy == "priority"
        self.drafter = drafter  # None: no drafts
        self.max_loras = max_loras  # most LoRA adapters a batch computes with; None: no limit
        self.num_draft_tokens = 0  # drafts proposed, and of them accepted, over the engine's life
        self.num_accepted_tokens = 0
        self.num_drafts = 0  # sequences' steps that computed drafts
        self.num_accepted_tokens_per_position: list[int] = []  # [k]: drafts accepted as a step's (k+1)-th
        # An encoder's embedding requests are computed in one step: their tokens attend to each other.
        self.whole_embeddings = whole_embeddings

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        if self.is_by_priority:
            bisect.insort(self.waiting, seq, key=_urgency)
        else:
            self.waiting.append(seq)

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        if self.is_by_priority:
            bisect.insort(self.running, seq, key=_urgency)
        else:
            self.running.append(seq)

    def add_running(self, seq: Sequence) -> bool:
        """Adds a sequence that already holds its pages (adopted from a reservation).

        Its last token was sampled elsewhere; if that token already ends it, the
        sequence is finished (pages freed) instead, and False is returned.
        """
        reason = self._finish_reason(seq, seq.last_token_id)
        if reason is not None:
            self._finish(seq, reason)
            return False
        self._run(seq)
        return True

    def release(self, request_id: str) -> bool:
        """Frees the pages of a finished prefill-only sequence; False if none are held."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq)
        return True

    def abort(self, request_id: str) -> Sequence | None:
        """Finishes the request wherever it is and frees its pages; None if unknown."""
        if self.release(request_id):
            return None
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        return None

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        preempted = False
        drafts = self._propose(budget) if self.drafter is not None else {}
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.request_id in drafts:
                self._draft(seq, drafts[seq.request_id], budget)
            while not bm.can_append_slot(seq):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.block_copies += bm.append_slot(seq)
                num_new = min(seq.num_uncomputed_tokens, budget)
                batch.add(seq, num_new)
                budget -= num_new
                i += 1
        # Admitting new work while pages are short would only preempt it again.
        adapters = {seq.sampling_params.lora_name for seq in batch.seqs} - {None} if self.max_loras else set()
        i = 0
        while not preempted and i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            lora_name = seq.sampling_params.lora_name
            if self.max_loras and lora_name is not None and lora_name not in adapters:
                if len(adapters) >= self.max_loras:  # its adapter would be one too many: it waits, the next may not
                    i += 1
                    continue
                adapters.add(lora_name)
            if not bm.can_allocate(seq):
                break
            if self.whole_embeddings and seq.sampling_params.embed and seq.num_uncomputed_tokens > budget:
                break  # the next step's budget takes it whole (LLMEngine refuses one it never could)
            bm.allocate(seq)
            del self.waiting[i]
            self._run(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            batch.add(seq, num_new)
            budget -= num_new
        return batch

    def _propose(self, budget: int) -> dict[str, list[int]]:
        """Drafts for the decoding sequences, all at once (a draft model computes them as batches), as
        many as the budget would leave each were the running sequences scheduled in turn, its
        max_tokens and the context leave room for (speculative.py)."""
        wanted = []
        for seq in self.running:
            if budget <= 0:
                break
            room = 0
            if seq.num_uncomputed_tokens == 1 and not seq.is_prefill_only:
                room = max(0, min(budget - 1, self.drafter.num_speculative_tokens,
                                  seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
                                  self.max_model_len - seq.num_tokens - 1))
                if room > 0:
                    wanted.append((seq, room))
            budget -= min(seq.num_uncomputed_tokens, budget) + room
        return self.drafter.propose(wanted) if wanted else {}

    def _draft(self, seq: Sequence, drafts: list[int], budget: int) -> None:
        """Append a decoding sequence's drafts, as many as the budget leaves room for and its pages can
        take now."""
        drafts = drafts[:budget - 1]
        if not drafts:
            return
        seq.add_drafts(drafts)
        if not self.block_manager.can_append_slot(seq):  # no page for them: decode plainly
            seq.take_drafts()

    def retract_running(self) -> int:
        """Preempt every running sequence (SGLang's pause in retract mode): their pages are freed and
        they are recomputed from their tokens once stepping resumes, in the order they ran."""
        retracted = self.running
        self.running = []
        for seq in reversed(retracted):  # each goes to the front of the queue: the first ends first
            self._preempt(seq)
        return len(retracted)

    def _preempt(self, seq: Sequence) -> None:
        seq.take_drafts()
        if self.drafter is not None:
            self.drafter.forget(seq.request_id)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.is_by_priority:
            bisect.insort(self.waiting, seq, key=_urgency)
        else:
            self.waiting.appendleft(seq)

    def postprocess(
        self, batch: ScheduledBatch, sampled: list[Sequence], output: SamplerOutput | None
    ) -> list[Sequence]:
        """Advances every scheduled sequence, appends sampled tokens, and finishes
        the sequences that hit a stop condition. Returns the finished ones."""
        bm = self.block_manager
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
            bm.cache_computed_blocks(seq)
        if output is None:
            return []
        return [seq for seq, token, logprobs in zip(sampled, output.token_ids, output.logprobs)
                if self._accept(seq, token, logprobs)]

    def postprocess_drafted(self, batch: ScheduledBatch, sampled: list[Sequence], logits: torch.Tensor,
                            sampler: Sampler) -> list[Sequence]:
        """`postprocess` for a step that computed drafts: `logits` holds, for each sampled sequence in
        turn, a row after its last token and one after each of its drafts. Each sequence's positions
        are sampled in turn, its drafts taken as its tokens while they equal what was sampled
        (speculative.py). Returns the finished sequences."""
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
        alive, position = list(zip(sampled, first_rows)), 0
        while alive:
            rows = torch.tensor([first + position for _, first in alive], device=logits.device)
            output = sampler(logits[rows], [seq for seq, _ in alive])
            going_on = []
            for (seq, first), token, logprobs in zip(alive, output.token_ids, output.logprobs):
                if self._accept(seq, token, logprobs):
                    finished.append(seq)
                    continue
                proposed = drafts.get(seq.request_id, ())
                if position < len(proposed) and token == proposed[position]:
                    # The draft's KV, computed as the next row's input, is the token's own.
                    seq.num_computed_tokens += 1
                    bm.cache_computed_blocks(seq)
                    self.num_accepted_tokens += 1
                    per_position = self.num_accepted_tokens_per_position
                    per_position += [0] * (position + 1 - len(per_position))
                    per_position[position] += 1
                    going_on.append((seq, first))
            alive, position = going_on, position + 1
        return finished

    def _accept(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> bool:
        """Append a sampled token to `seq`, finishing it if the token ends it; True if it did."""
        seq.append_token(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        reason = self._advance_guide(seq, token) or self._finish_reason(seq, token)
        if reason is None:
            return False
        self.running.remove(seq)
        self._finish(seq, reason)
        return True

    def _advance_guide(self, seq: Sequence, token: int) -> FinishReason | None:
        """Move a guided sequence's guide past `token`. "stop" when it cannot: a token the grammar
        does not allow was sampled all the same (the sampler gives EOS to a row with nothing left, so
        this is a safety net, not a path)."""
        if seq.guide is None or token in self.eos_token_ids:
            return None
        try:
            seq.advance_guide(token)
        except ValueError:
            return "stop"
        return None

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.sampling_params
        is_eos = token in self.eos_token_ids
        # A guided text is complete when its guide lets EOS through: ignore_eos cannot go on past it.
        if token in params.stop_token_ids or (is_eos and (not params.ignore_eos or seq.is_guided)):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return "prefilled" if seq.is_prefill_only else None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if self.drafter is not None:
            self.drafter.forget(seq.request_id)
        if reason == "prefilled":
            self.held[seq.request_id] = seq
        else:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def _urgency(seq: Sequence) -> tuple[int, float]:
    """The priority policy's order: lower priority values first, then earlier arrivals."""
    return seq.sampling_params.priority, seq.arrival_time
