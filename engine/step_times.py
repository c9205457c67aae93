"""When the engine ran a request: its first step, each chunk of its prompt before the first token, and each
encoding of its images.

Wall-clock nanoseconds (`time.time_ns()`), so a service can turn them into trace spans and
queue times after the fact; the engine itself never reads them. Recording costs two clock
reads per step and, per scheduled request, one comparison once its first token is out.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from engine.batch import ScheduledBatch
    from engine.sequence import Sequence


class PrefillChunk(NamedTuple):
    """One engine step that computed part of a prompt (or all of it): its forward pass, with
    the scheduling before it and the bookkeeping after, up to its outputs."""
    start_ns: int
    end_ns: int
    num_tokens: int  # prompt tokens computed in this pass
    num_seqs: int    # requests in the same batch (this one included)


class ImageEncode(NamedTuple):
    """A step's encoding of some of a request's images (before the forward pass that reads their rows)."""
    start_ns: int
    end_ns: int
    num_images: int
    num_tokens: int  # the prompt tokens their rows take


class StepTimes:
    """Filled by `LLMEngine.step` on the engine thread; read once the request's first output is out."""

    __slots__ = ("admit_ns", "first_step_end_ns", "first_step_start_ns", "image_encodes", "prefill_chunks")

    def __init__(self) -> None:
        self.admit_ns: tuple[int, int] | None = None  # `LLMEngine.add_request`'s start and end
        self.first_step_start_ns: int | None = None  # None: never scheduled (finished outside a step)
        self.first_step_end_ns: int | None = None
        self.prefill_chunks: list[PrefillChunk] = []
        self.image_encodes: list[ImageEncode] = []

    def record(self, start_ns: int, end_ns: int, num_tokens: int, num_seqs: int, is_prefill: bool) -> None:
        if self.first_step_start_ns is None:
            self.first_step_start_ns, self.first_step_end_ns = start_ns, end_ns
        if is_prefill:
            self.prefill_chunks.append(PrefillChunk(start_ns, end_ns, num_tokens, num_seqs))

    @property
    def prefill_seconds(self) -> float:
        """From the first prompt chunk's start to the last one's end (0 without any)."""
        if not self.prefill_chunks:
            return 0.0
        return (self.prefill_chunks[-1].end_ns - self.prefill_chunks[0].start_ns) / 1e9


def sequences_to_time(batch: ScheduledBatch) -> list[tuple[Sequence, int, bool]]:
    """The sequences whose step times this step adds to, and whether each ran a prompt chunk
    (it has no token of its own before postprocess: a moved request's output came with it).
    Once its first token is out and its first step known, a sequence costs two comparisons."""
    timed = []
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
        is_prefill = seq.num_tokens - seq.num_draft_tokens == seq.num_tokens_given
        if is_prefill or seq.step_times.first_step_start_ns is None:
            timed.append((seq, num_new, is_prefill))
    return timed
