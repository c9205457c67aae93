"""Per-request sampling parameters, validated once at the door."""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from engine.bad_words import BadWordEndings
from engine.thinking_budget import ThinkingBudget

FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token, +100 all but forces it


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per sampled token; None = off
    # vLLM's: each prompt token's logprob given the tokens before it, with the top-n there; None = off.
    # Such a prompt is computed whole: its prefix is not read from the prefix cache.
    prompt_logprobs: int | None = None
    # Added to the logits of these token ids before any other stage, as OpenAI's and vLLM's
    # logit_bias: (token id, bias) pairs in id order (a mapping is accepted and ordered here).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: no EOS (unless ignored) and no stop token id is sampled before this many output tokens.
    min_tokens: int = 0
    # vLLM's: when given, only these ids can be sampled (logprobs stay those of the raw logits).
    allowed_token_ids: tuple[int, ...] = ()
    # The output is held to this regular expression (engine/guided_decoding.py); EOS ends it once
    # the text is complete, even with ignore_eos.
    guided_regex: str | None = None
    # Or to this context-free grammar: Lark, GBNF or llguidance's JSON (engine/guided_decoding.py).
    guided_grammar: str | None = None
    # With either: the guide holds only from the token after the output's first run of these
    # (a reasoning model's `</think>`, gpt-oss's `<|channel|>final<|message|>`), the text before it
    # free, as vLLM guides only the answer.
    guide_after_token_ids: tuple[int, ...] = ()
    # vLLM's, and no sampling setting: with the priority scheduling policy (EngineConfig), a lower
    # value is scheduled first (and preempted last); equal values go by arrival. 0 under fcfs.
    priority: int = 0
    # vLLM's bad_words as token id sequences: a sequence's last token is banned where the output so
    # far ends with the rest of it (a one-token sequence always).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # SGLang's token_ids_logprob: these ids' logprobs are reported at each sampled position too,
    # among its logprobs (which must be asked for: 0 for none of the top-n).
    logprob_token_ids: tuple[int, ...] = ()
    # vLLM's thinking_token_budget: once the thinking has this many tokens its close is written for
    # it (engine/thinking_budget.py); None: it thinks as long as it likes.
    thinking_budget: ThinkingBudget | None = None
    # vLLM's LoRA request, and no sampling setting either: the adapter (EngineConfig.lora_modules) the
    # request is computed with; None: the base model.
    lora_name: str | None = None
    # vLLM's cache_salt, no sampling setting either: the request's blocks are cached and matched under
    # this salt (engine/block_hash.py's request_extra), so only requests giving the same one share a
    # prefix; None: unsalted, shared with every unsalted request.
    cache_salt: str | None = None
    # An embedding request, and no sampling setting: its output carries the model's last hidden state
    # (after the final norm) at its last prompt token (RequestOutput.embedding), the pooling vLLM gives
    # a decoder-only model ("LAST"); it makes one token, which no one reads.
    embed: bool = False
    # With embed: every prompt token's hidden state too (RequestOutput.token_embeddings, vLLM's "ALL"
    # pooling, for its token_embed and token_classify tasks). No cached prefix serves it: a cached
    # token's hidden state is not kept.
    embed_tokens: bool = False

    def __post_init__(self) -> None:
        # First: NaN passes every range check below (each comparison is False), and a NaN or
        # infinite temperature or penalty turns the logits into NaN: token 0, every time.
        for name in FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.embed and self.max_tokens != 1:
            raise ValueError(f"an embedding request makes one token: max_tokens must be 1, got {self.max_tokens}")
        if self.embed_tokens and not self.embed:
            raise ValueError("embed_tokens is for an embedding request (embed)")
        if self.cache_salt == "":
            raise ValueError("cache_salt must be a non-empty string")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        # (How many at most is the engine's: EngineConfig.max_logprobs.)
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        object.__setattr__(self, "guide_after_token_ids", tuple(self.guide_after_token_ids))
        if self.guided_regex is not None and self.guided_grammar is not None:
            raise ValueError("guided_regex and guided_grammar cannot both be given")
        if self.guide_after_token_ids and (not self.is_guided or min(self.guide_after_token_ids) < 0):
            raise ValueError(f"guide_after_token_ids needs a guided_regex or guided_grammar and ids >= 0, got "
                             f"{list(self.guide_after_token_ids)}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if any(t < 0 for t in self.allowed_token_ids):
            raise ValueError("allowed_token_ids must not be negative")
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(word) for word in self.bad_words_token_ids))
        object.__setattr__(self, "logprob_token_ids", tuple(self.logprob_token_ids))
        if self.logprob_token_ids and (self.logprobs is None or min(self.logprob_token_ids) < 0):
            raise ValueError("logprob_token_ids: ids >= 0, with logprobs asked for (0 for none of the top)")
        if any(not word or min(word) < 0 for word in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids: each must be a non-empty sequence of token ids >= 0")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        for token_id, value in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias: token id {token_id} is negative")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # False for NaN too
                raise ValueError(f"logit_bias: the bias of token {token_id} must be in [-100, 100], got {value}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @functools.cached_property
    def bad_word_endings(self) -> BadWordEndings:
        """Its bad words indexed once, for every step to look up (kept beside the fields: a frozen dataclass's
        cached property is not one of them, so equality and hashing are unchanged)."""
        return BadWordEndings(self.bad_words_token_ids)

    @property
    def is_guided(self) -> bool:
        """Its output is held to a guided_regex or a guided_grammar."""
        return self.guided_regex is not None or self.guided_grammar is not None

    @property
    def guide_name(self) -> str:
        return "guided_regex" if self.guided_regex is not None else "guided_grammar"
