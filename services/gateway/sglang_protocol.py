"""SGLang's native API's requests (services/gateway/sglang_api.py serves them): `/generate`'s body,
its sampling parameters as the OpenAI completions request that checks and carries them (an error
naming SGLang's field), and `/abort_request`'s body."""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.gateway.completion_request import CompletionRequest
from services.gateway.errors import APIError, validation_error
from services.gateway.openai_protocol import INT32_MAX, MAX_LOGPROBS, TokenId

# SGLang's sampling field → the OpenAI API's (CompletionRequest's) that checks and carries it.
OPENAI_FIELDS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "no_stop_trim":
                 "include_stop_str_in_output", "regex": "guided_regex", "json_schema": "guided_json",
                 "ebnf": "guided_grammar", "sampling_seed": "seed"}
# ... and those that go into the completions request's vLLM `structured_outputs`.
STRUCTURED_OUTPUT_FIELDS = ("structural_tag",)
SAME_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
               "repetition_penalty", "stop", "stop_regex", "stop_token_ids", "ignore_eos", "skip_special_tokens", "n",
               "logit_bias")
# Accepted and without effect here: how SGLang spaces special tokens' text (as it does).
IGNORED_FIELDS = {"spaces_between_special_tokens": True}
# Not the completions request's: how often the decode worker sends the tokens (`stream_interval`).
STREAM_INTERVAL = "stream_interval"
SGLANG_NAMES = {ours: theirs for theirs, ours in OPENAI_FIELDS.items()} | {
    f"structured_outputs.{name}": name for name in STRUCTURED_OUTPUT_FIELDS}
# The completions request's fields that /generate's own carry, by the name SGLang gives them.
TOP_LEVEL_NAMES = {"prompt": "input_ids", "model": "lora_path", "logprobs": "top_logprobs_num",
                   "prompt_logprobs": "top_logprobs_num"}
# SGLang's request fields that ask nothing at these values, as its clients send them (bench_serving's
# return_routed_experts, the frontend's image_data, a PD router's bootstrap fields): taken at these, any
# other value refused as a field not served here.
NO_OP_FIELDS = {"image_data": None, "video_data": None, "audio_data": None, "input_embeds": None, "modalities": None,
                "return_hidden_states": False, "return_routed_experts": False,
                "custom_logit_processor": None, "session_params": None, "lora_id": None, "bootstrap_host": None,
                "bootstrap_port": None, "bootstrap_room": None, "data_parallel_rank": None, "routed_dp_rank": None}
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
MAX_STREAM_INTERVAL = 2**31 - 1


class SGLangInput(BaseModel):
    """What SGLang's native requests (`/generate`, `/encode`) are asked about: one prompt or a batch, as
    `text` or `input_ids`; `rid`, one a prompt; `lora_path`, a served adapter's name. Its other fields
    are refused, but NO_OP_FIELDS at the values that ask nothing."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    rid: str | list[str] | None = None
    lora_path: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _without_no_ops(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {name: value for name, value in data.items()
                if name not in NO_OP_FIELDS or not _asks_nothing(name, value)}

    def prompts(self) -> list[str | list[int]]:
        if (self.text is None) == (self.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", param="text")
        given = self.text if self.text is not None else self.input_ids
        if not given:
            raise APIError(400, "the prompt must not be empty", param="text" if self.text is not None else "input_ids")
        if isinstance(given, str) or isinstance(given[0], int):
            return [given]
        return list(given)

    @property
    def is_batch(self) -> bool:
        """Whether the prompts came as a list (answered by a list, even of one)."""
        return isinstance(self.text, list) or bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def rids(self, num_prompts: int, prefix: str) -> list[str]:
        if self.rid is None:
            return [f"{prefix}-{uuid.uuid4().hex}" for _ in range(num_prompts)]
        rids = [self.rid] if isinstance(self.rid, str) else self.rid
        if len(rids) != num_prompts or len(set(rids)) != len(rids):
            raise APIError(400, f"rid: {num_prompts} distinct ids are needed, one a prompt", param="rid")
        return rids


class GenerateRequest(SGLangInput):
    """POST /generate's body (SGLang's GenerateReqInput, the fields served here)."""

    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # (usage is in every meta_info)
    return_logprob: bool = False
    logprob_start_len: int = -1  # the first prompt position whose logprob is returned; -1: none
    top_logprobs_num: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] = 0
    return_text_in_logprobs: bool = False
    # SGLang's: on workers run with --scheduling-policy priority, a larger value is scheduled first (SGLang's
    # order unless --schedule-low-priority-values-first), so it goes to them negated: vLLM's order, lower first.
    priority: Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)] | None = None
    # These ids' logprobs at each output position too: one list for every prompt, or a list per prompt
    token_ids_logprob: list[TokenId] | list[list[TokenId]] | None = None

    def sampling_per_prompt(self, num_prompts: int) -> list[dict[str, Any]]:
        given = self.sampling_params if self.sampling_params is not None else {}
        if isinstance(given, dict):
            return [given] * num_prompts
        if len(given) != num_prompts:
            raise APIError(400, f"sampling_params: {len(given)} given for {num_prompts} prompts",
                           param="sampling_params")
        return given

    def token_ids_per_prompt(self, num_prompts: int) -> list[list[int]]:
        given = self.token_ids_logprob or []
        if not given or isinstance(given[0], int):
            return [given] * num_prompts
        if len(given) != num_prompts:
            raise APIError(400, f"token_ids_logprob: {len(given)} lists given for {num_prompts} prompts",
                           param="token_ids_logprob")
        return given


def _asks_nothing(name: str, value: Any) -> bool:
    """Whether `value` of the NO_OP_FIELDS field `name` asks nothing: its no-op value, or (an empty list of
    images and the like) an empty list."""
    return value is NO_OP_FIELDS[name] or (isinstance(value, list) and not value)  # (None and False are singletons)


def completion_request(prompt: str | list[int], sampling: dict[str, Any], model: str,
                       logprobs: int | None, prompt_logprobs: int | None) -> CompletionRequest:
    """The OpenAI completions request that SGLang's sampling parameters ask for: checked as that API
    checks it, an error naming SGLang's field."""
    unknown = sorted(set(sampling) - {*OPENAI_FIELDS, *SAME_FIELDS, *IGNORED_FIELDS, *STRUCTURED_OUTPUT_FIELDS,
                                      STREAM_INTERVAL})
    if unknown:
        raise APIError(400, f"sampling_params: {', '.join(unknown)} not supported here", param="sampling_params")
    for name, served in IGNORED_FIELDS.items():
        if served is not None and sampling.get(name, served) != served:
            raise APIError(400, f"sampling_params.{name}: only {json.dumps(served)} is supported",
                           param=f"sampling_params.{name}")
    asked = {OPENAI_FIELDS.get(name, name): value for name, value in sampling.items()
             if name not in IGNORED_FIELDS and name != STREAM_INTERVAL}
    structured = {name: asked.pop(name) for name in STRUCTURED_OUTPUT_FIELDS if name in asked}
    if structured:
        asked["structured_outputs"] = structured
    asked.setdefault("max_tokens", DEFAULT_MAX_NEW_TOKENS)
    if asked.get("top_k") == -1:
        asked["top_k"] = 0  # SGLang's "all tokens"
    try:
        return CompletionRequest.model_validate({**asked, "model": model, "prompt": prompt, "logprobs": logprobs,
                                                 "prompt_logprobs": prompt_logprobs})
    except ValidationError as e:
        error = validation_error(RequestValidationError(e.errors(include_url=False)))
    if not error.param:  # a check of the whole request's
        raise APIError(400, error.message)
    name = error.param if error.param in SGLANG_NAMES else error.param.split(".")[0]
    if name in TOP_LEVEL_NAMES:  # fields of the request itself, not of its sampling_params
        raise APIError(400, error.message, param=TOP_LEVEL_NAMES[name])
    theirs = f"sampling_params.{SGLANG_NAMES.get(name, name)}"
    raise APIError(400, error.message.replace(f"{error.param}:", f"{theirs}:", 1), param=theirs)


def stream_interval(sampling: dict[str, Any]) -> int:
    """The sample's `stream_interval` (tokens per streamed chunk at least); 0 when not given: the
    gateway's --stream-interval."""
    given = sampling.get(STREAM_INTERVAL)
    if given is None:
        return 0
    if isinstance(given, bool) or not isinstance(given, int) or not 1 <= given <= MAX_STREAM_INTERVAL:
        raise APIError(400, f"sampling_params.{STREAM_INTERVAL}: must be an integer in [1, {MAX_STREAM_INTERVAL}], "
                            f"got {json.dumps(given)}", param=f"sampling_params.{STREAM_INTERVAL}")
    return given


class AbortRequest(BaseModel):
    """POST /abort_request's body."""

    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False
