"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends a token budget: running sequences first (one token for a
decode, the next chunk for a prompt still being prefilled), then waiting ones,
oldest first. When a running sequence needs a page and none is free, the most
recently admitted sequence is preempted: its pages are freed and it waits to be
recomputed from its tokens, so the pool never deadlocks. One whose prompt rows or images'
pixels were withheld (a decode worker's) is recomputed only where its prefix cache still
holds them: else it ends "withheld", for its caller to resume where they are.

Under the priority policy both queues are kept in (priority, arrival) order instead: the
budget goes to the most urgent first, the most urgent waiting sequence is admitted
first, and the least urgent running one is preempted first (engine/scheduling_policy.py).
engine/drafting.py proposes, appends and takes speculative drafts; engine/stop_conditions.py
says when a sampled token ends a sequence.
"""
from __future__ import annotations

from collections import deque

import torch

from engine.batch import ScheduledBatch
from engine.block_manager import BlockManager
from engine.drafting import Drafter, Drafting
from engine.iteration_tokens import iteration_tokens
from engine.sampler import Sampler, SamplerOutput
from engine.scheduling_policy import scheduling_policy
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.spec_decode_stats import PerRequestSpecDecodeMetrics
from engine.stop_conditions import advance_guide, finish_reason


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
        per_request_spec_decode: PerRequestSpecDecodeMetrics = "none",
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.long_prefill_token_threshold = long_prefill_token_threshold  # a step's most for one prompt; 0: none
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Finished prefill-only sequences whose pages wait to be copied out.
        self.held: dict[str, Sequence] = {}
        # Finished "withheld" while scheduling (`take_withheld`).
        self._withheld: list[Sequence] = []
        self.num_preemptions = 0
        self.iteration_tokens = iteration_tokens()  # each batch's tokens, in buckets (vLLM's histogram)
        self.policy = scheduling_policy(policy)
        self.is_by_priority = self.policy.is_by_priority
        self.drafter = drafter  # None: no drafts
        self.drafting = Drafting(drafter, block_manager, max_model_len, per_request_spec_decode)
        self.max_loras = max_loras  # most LoRA adapters a batch computes with; None: no limit
        # An encoder's embedding requests are computed in one step: their tokens attend to each other.
        self.whole_embeddings = whole_embeddings

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_draft_tokens(self) -> int:
        """Drafts proposed over the engine's life (drafting.py counts them, as those below)."""
        return self.drafting.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        return self.drafting.num_accepted_tokens

    @property
    def num_drafts(self) -> int:
        return self.drafting.num_drafts

    @property
    def num_accepted_tokens_per_position(self) -> list[int]:
        return self.drafting.num_accepted_tokens_per_position

    def add(self, seq: Sequence) -> None:
        self.drafting.keep_stats(seq)
        self.policy.wait(self.waiting, seq)

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.policy.run(self.running, seq)

    def add_running(self, seq: Sequence) -> bool:
        """Adds a sequence that already holds its pages (adopted from a reservation): it runs, or,
        with `max_num_seqs` running, waits in the queue holding them, taken in its policy's order.

        Its last token was sampled elsewhere; if that token already ends it, the
        sequence is finished (pages freed) instead, and False is returned.
        """
        self.drafting.keep_stats(seq)
        reason = finish_reason(seq, seq.last_token_id, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self._finish(seq, reason)
            return False
        if len(self.running) < self.max_num_seqs:
            self._run(seq)
        else:
            self.policy.wait(self.waiting, seq)
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
        drafts = self.drafting.propose(self.running, budget) if self.drafter is not None else {}
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.request_id in drafts:
                self.drafting.add(seq, drafts[seq.request_id], budget)
            while not bm.can_append_slot(seq):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                bm.append_slot(seq)
                num_new = self._num_new(seq, budget)
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
            if seq.block_table:  # handed over with its pages (add_running): a slot for its next token
                if not bm.can_append_slot(seq):
                    break
                bm.append_slot(seq)
            else:
                if not bm.can_allocate(seq):
                    break
                if self.whole_embeddings and seq.sampling_params.embed and seq.num_uncomputed_tokens > budget:
                    break  # the next step's budget takes it whole (LLMEngine refuses one it never could)
                bm.allocate(seq)
                if seq.num_computed_tokens < seq.withheld_end:
                    del self.waiting[i]
                    self._finish(seq, "withheld")
                    self._withheld.append(seq)
                    continue
            del self.waiting[i]
            self._run(seq)
            num_new = self._num_new(seq, budget)
            batch.add(seq, num_new)
            budget -= num_new
        if batch.seqs:
            self.iteration_tokens.observe(batch.num_tokens)
        return batch

    def take_withheld(self) -> list[Sequence]:
        """The sequences finished "withheld" since the last take."""
        withheld, self._withheld = self._withheld, []
        return withheld

    def _num_new(self, seq: Sequence, budget: int) -> int:
        """The tokens `seq` computes this step: what it has left, within the step's budget and, for a
        prompt (no drafts to verify, not an encoder's, which goes whole), the long-prefill cap."""
        num_new = min(seq.num_uncomputed_tokens, budget)
        cap = self.long_prefill_token_threshold
        if 0 < cap < num_new and not seq.num_draft_tokens and not (self.whole_embeddings and seq.sampling_params.embed):
            num_new = cap
        return _past_spans(seq, num_new) if seq.bidirectional_spans else num_new

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
        self.policy.wait_again(self.waiting, seq)

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
        return self.drafting.postprocess(batch, sampled, logits, sampler, self._accept)

    def _accept(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> bool:
        """Append a sampled token to `seq`, finishing it if the token ends it; True if it did."""
        seq.append_token(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        reason = (advance_guide(seq, token, self.eos_token_ids)
                  or finish_reason(seq, token, self.eos_token_ids, self.max_model_len))
        if reason is None:
            return False
        self.running.remove(seq)
        self._finish(seq, reason)
        return True

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if self.drafter is not None:
            if reason == "prefilled":  # its pages go on to a decode worker: an EAGLE head's layers first filled
                seq.handoff_drafts = self.drafting.prefilled(seq)
            self.drafter.forget(seq.request_id)
        if reason == "prefilled":
            self.held[seq.request_id] = seq
        else:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def _past_spans(seq: Sequence, num_new: int) -> int:
    """`num_new`, or what keeps the chunk from ending inside a span its tokens attend bidirectionally (an
    image's, in Gemma 3): it stops before the span, or takes the span whole, past the step's budget if
    need be (the span's tokens computed together, as they attend to each other)."""
    start = seq.num_computed_tokens
    end = start + num_new
    for lo, hi in seq.bidirectional_spans:
        if lo < end < hi:
            return lo - start if lo > start else hi - start
    return num_new
