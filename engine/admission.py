"""Whether an engine takes a request in: its token ids inside the vocabulary, its prompt and output
inside the context and the KV pool, what it asks for (an adapter, a priority) served here; and a
reservation of pages for a prompt prefilled elsewhere."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.block_hash import embeddings_digest, salted_with_embeddings
from engine.prompt_embeds import WithheldEmbeddings
from engine.prompt_images import ImageInput, WithheldImage, check_images, digest_of
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def check_weights_held(engine: LLMEngine) -> None:
    if "weights" in engine.released_memory:
        raise ValueError("this worker's weights are released (asleep): resume its memory first")


def check_new_request(engine: LLMEngine, request_id: str, prompt_token_ids: list[int],
                      sampling_params: SamplingParams, output_token_ids: list[int] | tuple[int, ...] = (),
                      prompt_embeds: torch.Tensor | WithheldEmbeddings | None = None,
                      images: Sequence[ImageInput | WithheldImage] = (), prefill_only: bool = False) -> None:
    """ValueError, naming the first unmet condition, for a request `engine` can never serve (as
    `add_request` and `add_prefilled_request` take it); changes nothing. `prefill_only`: the engine computes
    its prompt and samples one token (a prefill worker's), so its pool need not hold what follows."""
    check_weights_held(engine)
    if not prompt_token_ids:
        raise ValueError("prompt must contain at least one token")
    if engine.has_request(request_id):
        raise ValueError(f"request id {request_id!r} is already in use")
    vocab = engine.model_config.vocab_size
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
    if sampling_params.lora_name is not None and not engine.loras.is_served(sampling_params.lora_name):
        served = ", ".join(engine.loras.served) or "none"
        raise ValueError(f"LoRA adapter {sampling_params.lora_name!r} is not served here (served: {served})")
    if sampling_params.priority and not engine.scheduler.is_by_priority:
        raise ValueError(f"priority {sampling_params.priority} asks for priority scheduling, which this engine "
                         f"does not do (scheduling_policy {engine.config.scheduling_policy!r})")
    most = vocab if engine.config.max_logprobs == -1 else min(engine.config.max_logprobs, vocab)
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(sampling_params, name)
        if asked is not None and asked > most:
            raise ValueError(f"{name} must be at most {most} (max_logprobs), got {asked}")
    bad = next((t for t in output_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"output token id {bad} is outside the vocabulary [0, {vocab})")
    if len(output_token_ids) >= sampling_params.max_tokens:
        raise ValueError(f"{len(output_token_ids)} output tokens already: max_tokens "
                         f"{sampling_params.max_tokens} leaves none to make")
    bad = next((t for t, _ in sampling_params.logit_bias if t >= vocab), None)
    if bad is not None:  # the sampler would index past the logits
        raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in sampling_params.allowed_token_ids if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"allowed_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for word in sampling_params.bad_words_token_ids for t in word if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"bad_words: token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in sampling_params.logprob_token_ids if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"logprob_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in sampling_params.stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:  # never sampled, and short of min_tokens the sampler would index past the logits
        raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in sampling_params.guide_after_token_ids if t >= vocab), None)
    if bad is not None:  # never sampled: the guide would never hold
        raise ValueError(f"guide_after_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
    thinking = sampling_params.thinking_budget
    if thinking is not None:
        bad = next((t for t in thinking.start_token_ids + thinking.forced_end if t >= vocab), None)
        if bad is not None:  # a forced one would index past the logits
            raise ValueError(f"thinking budget: token id {bad} is outside the vocabulary [0, {vocab})")
    n = len(prompt_token_ids)
    if prompt_embeds is not None:
        check_prompt_embeds(engine, n, sampling_params, prompt_embeds)
    if images:
        if prompt_embeds is not None:
            raise ValueError("a prompt given as embeddings takes no images")
        check_images(engine, prompt_token_ids, images)
    # An embedding's one token is made and dropped, never computed: its prompt may fill the context.
    if n + len(output_token_ids) >= engine.max_model_len + sampling_params.embed:
        raise ValueError(f"prompt of {n} tokens (and {len(output_token_ids)} of output) does not fit the "
                         f"context of {engine.max_model_len} tokens" if output_token_ids else
                         f"prompt of {n} tokens does not fit the context of {engine.max_model_len} tokens")
    if engine.pools_whole_prompts and sampling_params.embed and n > engine.config.max_num_batched_tokens:
        raise ValueError(f"prompt of {n} tokens is more than one step computes (max_num_batched_tokens "
                         f"{engine.config.max_num_batched_tokens}), and an embedding pooled from all its tokens "
                         "is computed whole")
    # A prefill worker's pool holds the prompt (and a moved request's output) and its first token; the decode
    # worker's, all it may generate: a prefill pool under the context refuses no request a decode pool holds.
    most_new = len(output_token_ids) + 1 if prefill_only else sampling_params.max_tokens
    max_tokens_total = min(n + most_new, engine.max_model_len)
    bs = engine.config.block_size
    if (max_tokens_total + bs - 1) // bs > engine.num_kv_blocks:
        raise ValueError(
            f"request needs up to {max_tokens_total} tokens of KV, more than the pool's "
            f"{engine.num_kv_blocks * bs}"
        )


def check_prompt_embeds(engine: LLMEngine, num_prompt_tokens: int, sampling_params: SamplingParams,
                        prompt_embeds: torch.Tensor | WithheldEmbeddings) -> None:
    """A prompt given as embeddings: one row of the model's hidden size per (placeholder) token, of
    floats. What needs the prompt's tokens is refused: their logprobs, an embedding or pooling of it
    (an encoder's own embeddings are not given)."""
    hidden = engine.model_config.hidden_size
    is_withheld = isinstance(prompt_embeds, WithheldEmbeddings)
    dtype = torch.float32 if is_withheld else prompt_embeds.dtype  # a withheld one's was checked where it was given
    if len(prompt_embeds.shape) != 2 or prompt_embeds.shape[1] != hidden or not dtype.is_floating_point:
        raise ValueError(f"prompt_embeds must be floats of shape [tokens, {hidden}] (the model's hidden size), "
                         f"got {dtype} of shape {list(prompt_embeds.shape)}")
    if prompt_embeds.shape[0] != num_prompt_tokens:
        raise ValueError(f"prompt_embeds has {prompt_embeds.shape[0]} rows for a prompt of {num_prompt_tokens} tokens")
    if sampling_params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs are not available for a prompt given as embeddings: it has no tokens")
    if sampling_params.embed or sampling_params.embed_tokens or engine.model_config.encoder is not None:
        raise ValueError("a prompt given as embeddings is generated from, not embedded or pooled")
    layout = engine.model_config.gemma4
    if layout is not None and layout.per_layer_width:
        raise ValueError("a prompt given as embeddings has no tokens to look up Gemma 4's per-layer embeddings by")
    qwen4_exp = engine.model_config.qwen4_exp
    if qwen4_exp is not None and qwen4_exp.ngrams is not None:
        raise ValueError("a prompt given as embeddings has no tokens to look up Qwen4-Exp's n-gram embeddings by")
    if not is_withheld and not bool(torch.isfinite(prompt_embeds).all()):
        raise ValueError("prompt_embeds holds a value that is not finite (inf or NaN)")


def salted(sampling_params: SamplingParams, prompt_embeds: torch.Tensor | WithheldEmbeddings | None,
           images: Sequence[ImageInput | WithheldImage] = (), prompt_embeds_digest: str = "") -> SamplingParams:
    """A prompt given as embeddings, or with images, shares cached blocks only with prompts given the same
    ones: its cache salt names them (unchanged where its caller salted it so, as the gateway does for its
    router's hashes to match the workers'). `prompt_embeds_digest`: what names the embeddings where their
    sender hashed them (the gateway): not hashed again here (50 ms for 2,048 rows of 4,096 floats)."""
    if isinstance(prompt_embeds, WithheldEmbeddings):
        digest = prompt_embeds.digest
    elif prompt_embeds is not None and prompt_embeds_digest:
        digest = prompt_embeds_digest
    elif prompt_embeds is not None:
        raw = prompt_embeds.contiguous().view(torch.uint8).numpy().tobytes()
        digest = embeddings_digest(str(prompt_embeds.dtype).removeprefix("torch."), prompt_embeds.shape, raw)
    elif images:
        digest = digest_of(images)
    else:
        return sampling_params
    salt = salted_with_embeddings(sampling_params.cache_salt, digest)
    return sampling_params if salt == sampling_params.cache_salt else \
        dataclasses.replace(sampling_params, cache_salt=salt)


class NoRoomYet(RuntimeError):
    """Too few pages are free now for a reservation the pool holds room for: one may be made
    once running requests free theirs."""


def check_reservation(engine: LLMEngine, request_id: str, num_prompt_tokens: int) -> int:
    """The number of pages a prompt of `num_prompt_tokens` takes, when `engine` can reserve them now.
    ValueError for a reservation it can never take; NoRoomYet while too few pages are free, a plain
    RuntimeError where the whole pool has fewer."""
    check_weights_held(engine)
    if not 0 < num_prompt_tokens < engine.max_model_len:
        raise ValueError(f"prompt of {num_prompt_tokens} tokens does not fit the context of "
                         f"{engine.max_model_len} tokens")
    if engine.has_request(request_id):
        raise ValueError(f"request id {request_id!r} is already in use")
    num_blocks = -(-num_prompt_tokens // engine.config.block_size) + engine.block_manager.num_state_blocks
    if num_blocks > engine.block_manager.num_blocks:
        raise RuntimeError(f"no room for {num_blocks} KV blocks in a pool of {engine.block_manager.num_blocks}")
    if not engine.block_manager.can_reserve(num_blocks):
        raise NoRoomYet(f"no room for {num_blocks} KV blocks now ({engine.block_manager.num_free_blocks} free)")
    return num_blocks
