"""Protobuf ↔ engine types shared by the services (only converters and servicers import protos)."""
from __future__ import annotations

from collections.abc import Sequence

from engine.sampling_params import SamplingParams
from engine.thinking_budget import ThinkingBudget
from protos import common_pb2, scheduler_pb2
from services.kvstore.layout import PageLayout

FINISH_REASONS = {  # as the engine and the OpenAI API name them
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
    "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS,
}
FINISH_REASON_NAMES = {reason: name for name, reason in FINISH_REASONS.items() if name is not None}


def finish_reason_name(reason: int) -> str:
    """A FinishReason as the engine and the metrics name it ("stop")."""
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


SAMPLING_MEMO_SIZE = 256
_sampling_memo: dict[bytes, SamplingParams] = {}


def sampling_params_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Absent optional fields take the engine's defaults. Raises ValueError on a value out of range.

    Memoized by the message's bytes: a deployment's requests repeat a few settings, and the
    conversion is the worker's first code on a request's path after sitting idle, run cold
    (about 50 us of each prefill's way to the engine here: six fields looked up by name, a
    frozen dataclass's checks). Equal bytes give equal params, and requests may share one
    immutable SamplingParams, as `LLMEngine.generate`'s prompts do."""
    if p.HasField("prompt_embeds") or p.images:  # the prompt's, not its sampling (services/common/prompt_embeds.py)
        p = _without_prompt_inputs(p)
    key = p.SerializeToString(deterministic=True)
    params = _sampling_memo.get(key)
    if params is None:
        params = _sampling_params(p)  # a refusal raises: never memoized
        if len(_sampling_memo) >= SAMPLING_MEMO_SIZE:
            del _sampling_memo[next(iter(_sampling_memo))]  # the oldest
        _sampling_memo[key] = params
    return params


def _without_prompt_inputs(p: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
    stripped = common_pb2.SamplingParams()
    stripped.CopyFrom(p)
    stripped.ClearField("prompt_embeds")
    stripped.ClearField("images")
    return stripped


def _sampling_params(p: common_pb2.SamplingParams) -> SamplingParams:
    kwargs = {}
    for name in ("max_tokens", "temperature", "top_p", "repetition_penalty", "seed", "logprobs", "prompt_logprobs",
                 "guided_regex", "guided_grammar", "lora_name", "cache_salt"):
        if p.HasField(name):
            kwargs[name] = getattr(p, name)
    if p.guide_after_token_ids:
        kwargs["guide_after_token_ids"] = tuple(p.guide_after_token_ids)
    elif p.HasField("guide_after_token_id"):
        kwargs["guide_after_token_ids"] = (p.guide_after_token_id,)
    if p.HasField("thinking_budget"):
        thinking = p.thinking_budget
        kwargs["thinking_budget"] = ThinkingBudget(thinking.max_tokens, thinking.start_token_ids,
                                                   thinking.end_token_ids, thinking.forced_end_token_ids)
    return SamplingParams(
        top_k=p.top_k, min_p=p.min_p, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos, logit_bias=p.logit_bias,
        min_tokens=p.min_tokens, allowed_token_ids=tuple(p.allowed_token_ids), priority=p.priority,
        bad_words_token_ids=tuple(tuple(word.token_ids) for word in p.bad_words),
        logprob_token_ids=tuple(p.logprob_token_ids), **kwargs,
    )


def layout_to_proto(layout: PageLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(num_layers=layout.num_layers, block_size=layout.block_size,
                               num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
                               model_fingerprint=layout.fingerprint)


def layout_from_proto(layout: common_pb2.KVLayout, num_blocks: int) -> PageLayout:
    """The proto carries no block count (two compatible pools may differ in it): the caller names one."""
    return PageLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, block_size=layout.block_size,
                      head_dim=layout.head_dim, dtype=layout.dtype, num_blocks=num_blocks,
                      fingerprint=layout.model_fingerprint)


def top_logprobs(token_id: int, logprobs: dict[int, float], n: int,
                 requested: Sequence[int] = ()) -> common_pb2.TopLogprobs:
    """`requested`: SamplingParams.logprob_token_ids, whose logprobs the engine put among the rest."""
    best = sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:n]
    return common_pb2.TopLogprobs(
        sampled=common_pb2.TokenLogprob(token_id=token_id, logprob=logprobs.get(token_id, float("nan"))),
        top=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in best],
        requested=[common_pb2.TokenLogprob(token_id=t, logprob=logprobs[t]) for t in requested],
    )


def prompt_logprobs_to_proto(prompt_token_ids: Sequence[int], records: Sequence[dict[int, float] | None],
                             n: int, requested: Sequence[int] = ()) -> list[common_pb2.TopLogprobs]:
    """An engine's prompt logprobs (None first) as the wire carries them: one per token after the first."""
    return [top_logprobs(token_id, record, n, requested)
            for token_id, record in zip(prompt_token_ids[1:], records[1:])]


# The memory a worker gives back to the host, by the engine's names (engine/memory_release.py's KINDS).
MEMORY_KINDS = {scheduler_pb2.MEMORY_KIND_WEIGHTS: "weights", scheduler_pb2.MEMORY_KIND_KV_CACHE: "kv_cache"}
