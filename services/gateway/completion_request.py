"""POST /v1/completions' body (`CompletionRequest`): the fields chat shares (openai_protocol.py), the
prompts (text, token ids or embeddings, one or a batch), `echo`, `best_of`, and `max_tokens` 0 for the prompt alone."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator, model_validator

from services.gateway.errors import FieldError
from services.gateway.openai_protocol import (
    MAX_CHOICES,
    MAX_LOGPROBS,
    UINT32_MAX,
    SamplingFields,
    TokenId,
)

# Prompts × n per request: batches as evaluation harnesses send them (vLLM sets no limit);
# --max-num-requests counts each one, as it counts separate requests.
MAX_CHOICES_PER_REQUEST = 2048


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    # Tried in this order, ids strictly: pydantic's default (smart) union validated a 512-id
    # prompt against every member, 0.13 ms of the gateway's time before the request starts.
    prompt: Annotated[str | list[TokenId] | list[str] | list[list[TokenId]], Field(union_mode="left_to_right")] | None \
        = None
    # vLLM's (with --enable-prompt-embeds): prompts given as embeddings, each the base64 of a torch.save'd
    # [tokens, hidden] tensor (prompt_embeds.py); with `prompt` too, their choices come first.
    prompt_embeds: str | list[str] | None = None
    # OpenAI's default for completions; 0 with echo: the prompt alone, with its logprobs (vLLM's)
    max_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    # OpenAI's: this many candidates per prompt, of which the response keeps the n whose tokens are the
    # likeliest on average (each token's logprob under the raw logits); every candidate's tokens are usage.
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    # vLLM's: false encodes a text prompt without the tokenizer's special tokens (a BOS it already has)
    add_special_tokens: bool = True

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt_shape(cls, value: Any, handler):
        try:
            return handler(value)
        except ValidationError:  # one error naming the field, not one per shape it is not
            raise ValueError("must be a string, a list of strings, a list of token ids (integers in "
                             "[0, 2**31)) or a list of such lists") from None

    @model_validator(mode="after")
    def _check_supported(self):
        if self.prompt is None and not self.prompt_embeds:
            raise FieldError("prompt", "prompt (or prompt_embeds) is required")
        if self.prompt_embeds:
            self._check_embedded()
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported")
        if self.echo and self.truncate_prompt_tokens is not None:
            raise FieldError("echo", "echo with truncate_prompt_tokens is not supported")
        if self.max_tokens == 0 and (self.num_candidates > self.n or self.use_beam_search or self.min_tokens):
            raise FieldError("max_tokens", "max_tokens 0 (the prompt alone) takes no best_of greater than n, "
                             "use_beam_search or min_tokens")
        if self.num_candidates < self.n:
            raise FieldError("best_of", f"best_of must be at least n ({self.n})")
        if self.num_candidates > self.n and self.stream:
            raise FieldError("best_of", "best_of greater than n cannot be streamed: the best are known at the end")
        if self.num_candidates > self.n and self.use_beam_search:
            raise FieldError("best_of", "best_of greater than n is not supported with use_beam_search (n beams)")
        if len(self.prompts) * self.num_candidates > MAX_CHOICES_PER_REQUEST:
            raise FieldError("best_of" if self.best_of else "n",
                             f"at most {MAX_CHOICES_PER_REQUEST} choices per request (prompts × best_of, or × n)")
        self._check_beam_search()
        return self

    def _check_embedded(self) -> None:
        """What a prompt given as embeddings cannot do: it has no tokens to echo, score or search from."""
        if self.echo:
            raise FieldError("echo", "a prompt given as embeddings has no text or tokens to echo")
        if self.prompt_logprobs is not None:
            raise FieldError("prompt_logprobs", "a prompt given as embeddings has no tokens to give logprobs of")
        if self.use_beam_search:
            raise FieldError("use_beam_search", "beam search takes text or token-id prompts, not embeddings")

    @property
    def max_tokens_run(self) -> int | None:
        """The engine's max_tokens: 0 (the prompt alone) runs one token, which `prompt_only` leaves out."""
        return 1 if self.max_tokens == 0 else self.max_tokens

    @property
    def num_candidates(self) -> int:
        """Choices generated per prompt: best_of (given) or n."""
        return self.best_of or self.n

    @property
    def num_candidate_logprobs(self) -> int | None:
        """The logprobs each choice's tokens are generated with: the request's, and with best_of > n at
        least each sampled token's own, which ranks the candidates."""
        if self.num_candidates > self.n:
            return self.logprobs or 0
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Echoed with logprobs, the prompt's tokens are listed with theirs (`logprobs` candidates each)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @cached_property
    def prompts(self) -> list[str | list[int] | EmbeddedPrompt]:
        """One entry per prompt: given as embeddings (first, as vLLM orders them), text, or token ids."""
        given = self.prompt_embeds
        embedded = [EmbeddedPrompt(encoded) for encoded in ([given] if isinstance(given, str) else given or [])]
        prompt = self.prompt
        if prompt is None:
            return embedded
        if isinstance(prompt, str):
            return [*embedded, prompt]
        if not prompt:
            raise FieldError("prompt", "prompt must not be empty")
        if isinstance(prompt[0], int):  # list[StrictInt] matched: all of them are
            return [*embedded, prompt]
        return [*embedded, *prompt]


@dataclass(frozen=True)
class EmbeddedPrompt:
    encoded: str  # as the request gave it (prompt_embeds.py reads it)


def pipeline_prompt(prompt: str | list[int], add_special_tokens: bool = True) -> dict[str, Any]:
    """A text or token-id prompt as the pipeline's `generate` (and beam search) takes it."""
    if isinstance(prompt, str):
        return {"prompt_text": prompt, "add_special_tokens": add_special_tokens}
    return {"prompt_token_ids": prompt}
