"""The OpenAI request bodies the gateway accepts, as pydantic models: what completions and chat
share (`SamplingFields`; completions' own: completion_request.py, chat's: chat_request.py, its
messages: chat_messages.py).

Field names, defaults and ranges follow OpenAI's API and vLLM's extras (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`, `min_tokens`,
`prompt_logprobs`, `allowed_token_ids`, `skip_special_tokens`, `truncate_prompt_tokens`,
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `structured_outputs`, `bad_words`,
`priority`, `cache_salt`, `return_tokens_as_token_ids`, `return_token_ids`, `thinking_token_budget`,
`use_beam_search` with
`length_penalty`, and chat's template options), SGLang's (`stop_regex`, `lora_path`, and its names for
vLLM's: request_aliases.py), plus Baton's `return_timeline`. Null in a field OpenAI's API documents as
nullable is its default. A value out of range fails validation here, so the client gets a 400 that
names the field before any worker is called.
Unknown fields are ignored, as OpenAI's own server does for fields a model does not use; but vLLM's
extras that are not served here (logits processors), and what beam search cannot honour (penalties,
biases, stop strings, structured output), are refused by name: ignored, they would give other output
than was asked for; so are SGLang's that are not (hidden states, its logit processors, sessions).
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    field_validator,
    model_validator,
)

from protos import common_pb2
from services.gateway.beam_search import MAX_BEAM_WIDTH
from services.gateway.errors import FieldError
from services.gateway.generation_defaults import GenerationDefaults
from services.gateway.request_aliases import NULL_IS_DEFAULT, with_sglang_names, without_nulls
from services.gateway.stop_regexes import compiled_stop_regexes
from services.gateway.structured_output import OutputGuide, output_guide
from services.tokenizer.stop_strings import Stop

INT32_MAX, UINT32_MAX = 2**31 - 1, 2**32 - 1  # the widths of the protos' fields these go into
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]  # the rest of the vocabulary check is the worker's
MAX_CHOICES = 128  # n (or best_of) per prompt: OpenAI's bound (an RL rollout's group is often 16 to 64)
# Top logprobs a request may ask for: up to the proto's width here; the gateway's --max-logprobs (vLLM's,
# 20 by default) refuses more at the pipeline, for every API.
MAX_LOGPROBS = 2**31 - 1
INLINE_BAD_WORDS = 64  # encoded on the event loop; a longer list on a worker thread
UNSERVED = {"logits_processors": "custom logits processors are not loaded here",
            "custom_logit_processor": "custom logits processors are not loaded here",  # SGLang's
            "return_hidden_states": "hidden states are not returned here",  # SGLang's
            "session_params": "sessions are not kept here"}  # SGLang's
# What a beam search cannot honour, by the values that ask for nothing: it ranks beams by the model's
# own logprobs, so a field that would change them, or end a beam on its text, is refused with it
# (vLLM's ignores them).
NOT_WITH_BEAM_SEARCH = {"stop": (None, "", []), "stop_regex": (None, "", []), "presence_penalty": (None, 0.0),
                        "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0), "logit_bias": (None, {}),
                        "min_tokens": (0,), "allowed_token_ids": (None,), "bad_words": (None, []),
                        "thinking_token_budget": (None, -1)}


def header_safe(request_id: str) -> str:
    """A request id the client chose, which goes back as the response's x-request-id header: one that
    cannot be a header's value (a control character, a character beyond Latin-1) is refused, not
    answered by a dropped connection."""
    if any(ord(c) < 0x20 or ord(c) == 0x7f or ord(c) > 0xff for c in request_id):
        raise ValueError("must be printable text of Latin-1 characters: it is the response's x-request-id header")
    return request_id


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (structured_output.py)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None


class SamplingFields(BaseModel):
    """The fields completions and chat share."""

    # Python's json reads NaN and Infinity, which pass every bound below: refused here instead.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    # Any 64-bit integer, signed as vLLM's (int64) or not; taken modulo 2**64 (the protos' width)
    seed: Annotated[int, Field(ge=-2**63, lt=2**64)] | None = None
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None  # SGLang's (stop_regexes.py)
    _stop_regexes: tuple = PrivateAttr(default=())
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    # OpenAI's: token ids (as JSON object keys, so strings) to a bias added to their logits.
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    ignore_eos: bool = False
    # vLLM's: at least this many tokens before EOS, a stop token id or a stop string ends the output.
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] = 0
    # vLLM's: each prompt token's logprob (after the first) and the top-n there, with the response.
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None  # vLLM's: only these sampled
    skip_special_tokens: bool = True  # vLLM's: the text leaves the tokenizer's special tokens out
    # vLLM's: only the prompt's last k tokens go to the model (left truncation); -1: the context's worth.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=UINT32_MAX)] | None = None
    # Structured output (structured_output.py): OpenAI's, and vLLM's extras.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark or GBNF
    structured_outputs: StructuredOutputs | None = None  # vLLM's newer name for the five above
    _output_guide: OutputGuide | None = PrivateAttr(default=None)  # what the fields above ask for, as one
    include_stop_str_in_output: bool = False
    # vLLM's: scheduled before higher values on workers run with --scheduling-policy priority
    # (workers on fcfs refuse any but 0).
    priority: Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)] = 0
    # vLLM's: the prompt's KV blocks are cached and matched under this salt, so only requests giving
    # the same one share them: a tenant's secret keeps another from telling by a fast first token
    # that it sent the same prompt.
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    user: str | None = None
    # vLLM's: logprobs name each token "token_id:N", not by its text (which may not tell two tokens apart);
    # None: as the gateway's --return-tokens-as-token-ids says
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the response has the prompt's token ids and each choice's (streamed: each chunk's)
    return_token_ids: bool | None = None
    return_timeline: bool = False  # Baton's: the request's ledger in the response (services/gateway/timeline.py)
    # vLLM's: n beams (beam_search.py), the best first; sampling fields other than these have no say.
    use_beam_search: bool = False
    length_penalty: float = 1.0  # a beam's score: its summed logprob / its length ** length_penalty
    # vLLM's and SGLang's extras this gateway does not serve (UNSERVED): refused when asked for, not
    # ignored (the output would not be what the client asked).
    logits_processors: list[Any] | None = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = None
    session_params: Any = None
    # SGLang's: the LoRA adapter, by its served name (as `model` may name it)
    lora_path: str | None = None
    # SGLang's: the request's id, as the `x-request-id` header names it (its response's id; what
    # /abort_request finds it by). The header wins.
    rid: Annotated[str, Field(min_length=1), AfterValidator(header_safe)] | None = None
    # vLLM's: words the output may not write (`encoded_bad_words`; the workers ban each one's last token
    # where the output ends with the rest of it).
    bad_words: list[str] | None = None
    # vLLM's: a reasoning model's thinking is closed for it after this many tokens (engine/thinking_budget.py,
    # by the tags reasoning_config.py names); -1 (vLLM's) or None: it thinks as long as it likes.
    thinking_token_budget: Annotated[int, Field(ge=-1, le=UINT32_MAX)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _read_as_ours(cls, data: Any) -> Any:
        return with_sglang_names(without_nulls(data, NULL_IS_DEFAULT))

    @field_validator(*UNSERVED)
    @classmethod
    def _unserved(cls, value: Any, info) -> Any:
        if value:
            raise ValueError(f"{info.field_name} is not supported: {UNSERVED[info.field_name]}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or ():
            if not key.isdecimal() or int(key) > INT32_MAX:  # the rest of the vocabulary check is the worker's
                raise ValueError(f"keys must be token ids (integers in [0, 2**31)), got {key!r}")
        return bias

    @model_validator(mode="after")
    def _check_fields(self):
        if any(not word.strip() for word in self.bad_words or ()):
            raise FieldError("bad_words", "bad_words must be words, not empty or blank strings")
        structured = self.structured_outputs.model_dump(by_alias=True) if self.structured_outputs else None
        self._output_guide = output_guide(self.response_format, self.guided_json, self.guided_regex,
                                          self.guided_choice, self.guided_grammar, structured)
        if self.truncate_prompt_tokens == 0:
            raise FieldError("truncate_prompt_tokens",
                             "truncate_prompt_tokens must be -1 (the context's worth) or at least 1")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        if any(not s for s in self.stop_strings):
            raise FieldError("stop", "stop strings must be non-empty")
        self._stop_regexes = compiled_stop_regexes(self.stop_regex)
        return self

    def _check_beam_search(self) -> None:
        """Called last by each request's own check (chat's forced tool call is a structured output)."""
        if not self.use_beam_search:
            return
        if self.n > MAX_BEAM_WIDTH:
            raise FieldError("n", f"at most {MAX_BEAM_WIDTH} beams (n) with use_beam_search")
        for name, neutral in NOT_WITH_BEAM_SEARCH.items():
            if getattr(self, name) not in neutral:
                raise FieldError(name, f"{name} is not supported with use_beam_search")
        if self._output_guide is not None:
            raise FieldError("use_beam_search", "structured output is not supported with use_beam_search")

    @property
    def output_guide(self) -> OutputGuide | None:
        """What the text is held to (structured output; chat's forced tool call): None for nothing."""
        return self._output_guide

    @property
    def is_guided(self) -> bool:
        """The text is held to a pattern from its first token (structured output, a forced tool call)."""
        return self._output_guide is not None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def stops(self) -> list[Stop]:
        """What ends the text: the stop strings, then the stop regexes."""
        return [*self.stop_strings, *self._stop_regexes]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats` (with `include_usage`): every chunk has its choice's usage so far."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling(self, max_tokens: int | None, logprobs: int | None, choice: int,
                 bad_words: Sequence[Sequence[int]] = (),
                 defaults: GenerationDefaults = GenerationDefaults()) -> common_pb2.SamplingParams:
        """The engine's sampling parameters for choice `choice` of `n`: each choice of a
        seeded request gets its own seed, so n choices differ yet repeat run to run. `bad_words`:
        `encoded_bad_words` of the request's; `defaults`: the server's for what the request leaves out."""
        params = common_pb2.SamplingParams(
            top_k=self.top_k or 0, min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, allowed_token_ids=self.allowed_token_ids or [],
            priority=self.priority)
        if max_tokens is not None:
            params.max_tokens = max_tokens
        if self.temperature is not None:
            params.temperature = self.temperature
        if self.top_p is not None:
            params.top_p = self.top_p
        if self.repetition_penalty is not None:
            params.repetition_penalty = self.repetition_penalty
        if self.cache_salt is not None:
            params.cache_salt = self.cache_salt
        if self.seed is not None:
            params.seed = (self.seed + choice) % 2**64
        if logprobs is not None:
            params.logprobs = logprobs
        if self.logit_bias:
            params.logit_bias.update({int(token_id): bias for token_id, bias in self.logit_bias.items()})
        if self.num_prompt_logprobs is not None:
            params.prompt_logprobs = self.num_prompt_logprobs
        if self._output_guide is not None:
            self._output_guide.write_into(params)
        for word in bad_words:
            params.bad_words.add(token_ids=word)
        if self.thinking_token_budget is not None and self.thinking_token_budget >= 0:
            params.thinking_budget.SetInParent()  # a budget of 0 is a budget: present, though its one field is 0
            params.thinking_budget.max_tokens = self.thinking_token_budget
        defaults.fill(params, top_k_given=self.top_k is not None, min_p_given=self.min_p is not None)
        return params

    @property
    def num_prompt_logprobs(self) -> int | None:
        """How many candidates the engine records per prompt token; None: no prompt logprobs."""
        return self.prompt_logprobs


def encoded_bad_words(words: Sequence[str] | None, tokenizer) -> list[list[int]]:
    """vLLM's `bad_words` as the token id sequences the workers ban, encoded as vLLM encodes them:
    each word alone, and with a space before it where that gives another first token and as many
    tokens (the word inside a text, not at its start)."""
    stripped = [word.lstrip() for word in words or ()]
    encoded = []
    for alone, spaced in zip(tokenizer.encode_many(stripped, add_special_tokens=False),
                             tokenizer.encode_many([" " + word for word in stripped], add_special_tokens=False)):
        if not alone:  # a word the tokenizer's normalizer drops whole can never be written
            continue
        encoded.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            encoded.append(spaced)
    return encoded


async def bad_words_encoded(words: Sequence[str] | None, tokenizer) -> list[list[int]]:
    """`encoded_bad_words`, on a worker thread for more than INLINE_BAD_WORDS words: 100,000 of them held
    the event loop, every other request's stream with it, for 1.1 s."""
    if len(words or ()) <= INLINE_BAD_WORDS:
        return encoded_bad_words(words, tokenizer)
    return await asyncio.to_thread(encoded_bad_words, words, tokenizer)
