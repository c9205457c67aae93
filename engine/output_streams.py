"""`OutputStreams`: how much of each request's output the engine has handed back, and the
`RequestOutput` diffs (engine/outputs.py) that hand back the rest: after each step, and for the
requests that finished outside one."""
from __future__ import annotations

from engine.outputs import ComputedPages, RequestOutput
from engine.sequence import Sequence


class OutputStreams:
    """Contract: a request's stream is `open`ed when the engine takes the request in, the output
    tokens it came with (made elsewhere) counted as handed back; each `diff` hands back what is new
    since the last one, and a finished request's diff closes its stream."""

    def __init__(self) -> None:
        self._num_emitted: dict[str, int] = {}
        # Sequences that finished outside a step (aborted, or done at their first token).
        self._finished_outside_step: list[Sequence] = []

    def open(self, request_id: str, num_emitted: int) -> None:
        self._num_emitted[request_id] = num_emitted

    def finish_outside_step(self, seq: Sequence) -> None:
        """Owe `seq` its last diff, though no step returns it."""
        self._finished_outside_step.append(seq)

    @property
    def has_finished_outside_step(self) -> bool:
        return bool(self._finished_outside_step)

    def take_finished_outside_step(self) -> list[Sequence]:
        """The sequences owed a last diff since the last take, owed no more."""
        seqs, self._finished_outside_step = self._finished_outside_step, []
        return seqs

    def diff(self, seq: Sequence, held_block_ids: list[int]) -> RequestOutput:
        """`seq`'s output since its last diff; `held_block_ids`: its pages, if it finished "prefilled"."""
        start = self._num_emitted[seq.request_id]
        out_ids = seq.output_token_ids
        self._num_emitted[seq.request_id] = len(out_ids)
        if seq.is_finished:
            del self._num_emitted[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=out_ids[start:],
            token_ids=out_ids,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            new_logprobs=seq.output_logprobs[start:],
            prompt_logprobs=seq.prompt_logprobs if start == 0 else None,
            num_cached_tokens=seq.num_cached_tokens,
            held_block_ids=held_block_ids,
            embedding=seq.embedding if seq.is_finished else None,
            token_embeddings=seq.token_embeddings if seq.is_finished else None,
            step_times=seq.step_times,
            spec_decode=seq.spec_decode if seq.is_finished else None,
            num_preemptions=seq.num_preemptions,
            handoff_drafts=seq.handoff_drafts if seq.finish_reason == "prefilled" else [],
        )


def computed_pages(seqs: list[Sequence], sampled: list[Sequence], wanted: set[str], block_size: int
                   ) -> list[ComputedPages]:
    """The `ComputedPages` of the requests in `wanted` among a step's `seqs` whose prompt it computed a
    chunk of but did not finish (none was `sampled`)."""
    done = {seq.request_id for seq in sampled}
    return [ComputedPages(seq.request_id, seq.block_table[:seq.num_computed_tokens // block_size], seq.num_preemptions)
            for seq in seqs if seq.request_id in wanted and seq.request_id not in done and not seq.is_finished]
