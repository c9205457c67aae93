"""`Sequence`: the only per-request state the engine keeps."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Literal

import torch

from engine.prompt_embeds import WithheldEmbeddings
from engine.prompt_images import WithheldImage
from engine.sampling_params import SamplingParams
from engine.spec_decode_stats import SpecDecodeStats
from engine.step_times import StepTimes
from engine.thinking_budget import ThinkingMarks

if TYPE_CHECKING:
    from engine.prompt_images import MRoPEPositions, PlacedImage

# "prefilled": a prefill-only request whose first token is out and whose pages
# wait for another worker to take them over (disaggregated serving). "withheld": one preempted
# whose prompt rows or images' pixels it was not given (a decode worker's), where its prefix
# cache no longer holds their tokens: it cannot be computed again here; its caller resumes it
# elsewhere.
FinishReason = Literal["stop", "length", "abort", "prefilled", "withheld"]


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """A request's tokens, its pages and its progress.

    Invariants: `token_ids` is prompt + output; the KV of the first
    `num_computed_tokens` tokens is in the pages of `block_table`;
    `num_cached_tokens <= num_computed_tokens` counts the leading tokens that
    came from the prefix cache at the last allocation.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        block_size: int,
        arrival_time: float | None = None,
        is_prefill_only: bool = False,
        output_token_ids: list[int] | tuple[int, ...] = (),
        prompt_embeds: torch.Tensor | WithheldEmbeddings | None = None,
        images: tuple[PlacedImage, ...] = (),
        bidirectional_spans: tuple[tuple[int, int], ...] = (),
        rope_positions: MRoPEPositions | None = None,
    ) -> None:
        """`output_token_ids`: output it already has, made elsewhere (a request that moved): its KV
        is computed after the prompt's, and it counts as output, not prompt. `prompt_embeds`: the
        prompt given as embeddings, a [P, H] tensor whose rows the model reads in place of its
        token ids' (placeholders then, as in vLLM), or withheld (a decode worker's). `images`: each image in the
        prompt with its runs of image tokens, whose encoder's rows are read in place of those tokens' embeddings;
        `bidirectional_spans`: positions [start, end) whose tokens attend to each other whatever their order
        (Gemma 3's images); `rope_positions`: its tokens' multimodal RoPE positions where its images give them
        (Qwen2.5-VL's)."""
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.token_ids: list[int] = [*prompt_token_ids, *output_token_ids]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.prompt_embeds = prompt_embeds
        # Prompt rows given as embeddings, (first position, rows) in order: the whole prompt's, or each image's
        # runs' once its pixels, pending till then, are encoded (engine/prompt_images.py).
        self.given_embeddings: tuple[tuple[int, torch.Tensor], ...] = \
            ((0, prompt_embeds),) if isinstance(prompt_embeds, torch.Tensor) else ()
        self.pending_images = images
        # Its tokens before this position cannot be computed here, their rows or images' pixels not sent (a
        # decode worker's request): preempted, it goes on only where its prefix cache still holds them.
        self.withheld_end = max([len(prompt_token_ids) if isinstance(prompt_embeds, WithheldEmbeddings) else 0,
                                 *(placed.end for placed in images if isinstance(placed.image, WithheldImage))])
        self.bidirectional_spans = bidirectional_spans
        self.rope_positions = rope_positions
        self.num_tokens_given = len(self.token_ids)  # on arrival: tokens past them were made here
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.is_prefill_only = is_prefill_only
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        # A hybrid model's pages of this sequence's recurrent states (engine/recurrent_state.py), beside its tokens'.
        self.state_blocks: list[int] = []
        # Its states where a cached prefix it starts from ends, until its first step reads them into its pages; its
        # states at the block ends of its last step, (block index, their rows); and (the chain hash, the rows) of
        # the last block end past its prompt (engine/state_snapshots.py keeps them as it finishes).
        self.restored_state: torch.Tensor | None = None
        self.boundary_states: list[tuple[int, torch.Tensor]] = []
        self.pending_snapshot: tuple[int, torch.Tensor] | None = None
        # A drafted step's (tokens computed before it, its states after each token but the last), until its drafts
        # are sampled (ModelRunner.settle_draft_states).
        self.draft_states: tuple[int, torch.Tensor] | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        # Speculative drafts at the end of `token_ids`, from the scheduling of a step to its
        # verification (engine/speculative.py); 0 at any other time.
        self.num_draft_tokens = 0
        # Drafts for what follows its first token, made where its prompt was prefilled by an EAGLE head or MTP
        # layer that saw the prompt's last hidden state (set there as it finishes "prefilled"; here, until its
        # first step proposes them).
        self.handoff_drafts: list[int] = []
        self.num_preemptions = 0
        self.step_times = StepTimes()
        # Its speculative steps' drafts and acceptances, when the engine keeps them per request.
        self.spec_decode: SpecDecodeStats | None = None
        # Per-token logprob records for the output tokens, when asked for.
        # Output it came with has none: empty records keep them aligned, never emitted.
        self.output_logprobs: list[dict[int, float]] = (
            [{} for _ in output_token_ids] if sampling_params.logprobs is not None else [])
        # Per prompt position when asked for: None for the first token (nothing predicts it),
        # then each token's record given the ones before it, filled in chunk by chunk.
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        # An embedding request's (SamplingParams.embed): the hidden state at its last prompt token.
        self.embedding: list[float] | None = None
        # With SamplingParams.embed_tokens: each prompt token's hidden state, a float32 [P, H] tensor
        # filled in chunk by chunk (by position: a chunk run again after a preemption writes the same rows).
        self.token_embeddings: torch.Tensor | None = None
        # Where its output stands in its guided_regex or guided_grammar (engine/guided_decoding.py), when it has one.
        self.guide = None
        # The guide holds only once the output has its guide_after_token_ids (SamplingParams): the
        # output's last tokens while it waits, as many as they are.
        self.is_guide_waiting = bool(sampling_params.guide_after_token_ids)
        self._waited: tuple[int, ...] = ()
        # With a thinking budget: where its thinking opens and closes, for the sampler to close it in time.
        thinking = sampling_params.thinking_budget
        self.thinking_marks = ThinkingMarks(thinking) if thinking is not None else None
        # Per-request RNG, reseeded for each position it draws for (random_sampling.position_seed): seeded
        # requests draw from their own streams, so the batch around them cannot change their tokens.
        self.generator = torch.Generator() if sampling_params.seed is not None else None

    @property
    def is_guided(self) -> bool:
        """Its next token is held to its guide."""
        return self.guide is not None and not self.is_guide_waiting

    def advance_guide(self, token_id: int) -> None:
        """Move the guide past `token_id` (an output token other than EOS), or past the free text
        before it; ValueError when the guide does not allow it."""
        if self.is_guide_waiting:
            after = self.sampling_params.guide_after_token_ids
            self._waited = (*self._waited, token_id)[-len(after):]
            self.is_guide_waiting = self._waited != after
        elif self.guide is not None:
            self.guide.advance(token_id)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.name})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold every token's KV."""
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def num_full_blocks(self) -> int:
        return self.num_tokens // self.block_size

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    @property
    def reads_every_prompt_row(self) -> bool:
        """Its prompt's every hidden state is read (its prompt logprobs, or each token's embedding):
        no cached prefix can serve it, as a cached token's hidden state is not kept."""
        return self.prompt_logprobs is not None or self.sampling_params.embed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def add_drafts(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)
        self.num_draft_tokens = len(token_ids)

    def take_drafts(self) -> list[int]:
        """Remove the drafts and return them."""
        n = self.num_draft_tokens
        drafts = self.token_ids[len(self.token_ids) - n:] if n else []
        if n:
            del self.token_ids[-n:]
        self.num_draft_tokens = 0
        return drafts
