"""Requests an engine continues from output made elsewhere: one that moved here with the tokens
another engine made for it, and one whose prompt another worker prefilled into pages reserved here
(disaggregated serving), its first token sampled there."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

if TYPE_CHECKING:
    import torch

    from engine.llm_engine import LLMEngine
    from engine.prompt_embeds import WithheldEmbeddings
    from engine.prompt_images import MRoPEPositions, PlacedImage


def resume_guide(engine: LLMEngine, seq: Sequence, made_elsewhere: list[int] | tuple[int, ...]) -> None:
    """Give `seq` its guide, moved past the output tokens `made_elsewhere`: the next token is then
    guided as the engine that made them would have guided it (a seeded draw depends on its
    position alone: engine/random_sampling.py's `position_seed`). ValueError when they do not follow it."""
    params = seq.sampling_params
    if params.is_guided:
        seq.guide = engine.guides.guide(params)
        try:
            for token_id in made_elsewhere:
                if token_id not in engine.eos_token_ids:
                    seq.advance_guide(token_id)
        except ValueError:
            raise ValueError(f"output token ids do not follow {params.guide_name}") from None


def prefilled_sequence(engine: LLMEngine, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                       sampling_params: SamplingParams, output_token_ids: list[int] | tuple[int, ...],
                       prompt_embeds: torch.Tensor | WithheldEmbeddings | None = None,
                       images: tuple[PlacedImage, ...] = (),
                       bidirectional_spans: tuple[tuple[int, int], ...] = (),
                       rope_positions: MRoPEPositions | None = None) -> Sequence:
    """`request_id`'s sequence, holding the pages reserved under that id (their KV written for its
    prompt and `output_token_ids`), `first_token_id` its last token. ValueError when its output does
    not follow its guide, or the reservation does not hold it."""
    # The prefill worker sampled it as this engine would have: under the same guide, seed and position.
    made_elsewhere = [*output_token_ids, first_token_id]
    seq = Sequence(request_id, prompt_token_ids, sampling_params, engine.config.block_size,
                   output_token_ids=output_token_ids, prompt_embeds=prompt_embeds, images=images,
                   bidirectional_spans=bidirectional_spans, rope_positions=rope_positions)
    try:
        resume_guide(engine, seq, made_elsewhere)
    except ValueError:
        if output_token_ids:  # they may be what the guide refused: its message says either
            raise
        raise ValueError(f"first token id {first_token_id} does not follow {sampling_params.guide_name}") from None
    seq.num_computed_tokens = seq.num_tokens
    engine.block_manager.adopt(request_id, seq)
    seq.append_token(first_token_id)
    if sampling_params.logprobs is not None:
        # Prefill reported the first token's logprobs; this entry only keeps
        # output_logprobs aligned with output_token_ids and is never emitted.
        seq.output_logprobs.append({})
    return seq
