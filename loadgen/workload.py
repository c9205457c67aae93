"""The requests of a run: each prompt's tokens, its output length and its shared prefix.

Prompts are token ids by default (`/v1/completions` takes `prompt: [ids]` on Baton, vLLM
and SGLang), so a prompt of length L is exactly L tokens with any tokenizer. Chat takes
text only: there a prompt is L words drawn from `WORDS`, common English words that most
BPE vocabularies hold as one token each after a space, so L is approximate (and the chat
template adds its own tokens); the report counts what the server says it read.

With a shared-prefix ratio r, a prompt of length L starts with the first round(r * L)
tokens of one of K prefixes (chosen at random), and the rest is its own random tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from loadgen.distributions import LengthDistribution

PromptFormat = Literal["ids", "text"]

# Token ids are drawn from [100, 1000) unless told otherwise: below any real vocabulary's
# size (the tiny test models have 1024), and above the ids where tokenizers that put
# their special tokens first keep them, so a prompt holds no stray end-of-sequence.
DEFAULT_TOKEN_ID_RANGE = (100, 1000)

WORDS = tuple(dict.fromkeys("""
the of and to in is was for on that with as by at from his her they this have had are
not but be or which one all were when we there can an their what so if about out up them
some would other into more her time has two like him see could no make than first been
its who now people my made over did down only way find use may water long little very
after words called just where most know get through back much before go good new write
our used me man too any day same right look think also around another came come work
three word must because does part even place well such here take why things help put
years different away again off went old number great tell men say small every found
still between name should home big give air line set own under read last never us left
end along while might next sound below saw something thought both few those always
looked show large often together asked house world going want school important until
form food keep children feet land side without boy once animals life enough took sometimes
four head above kind began almost live page got earth need far hand high year mother
light parts country father let night following picture being study second eyes soon
times story boys since white days paper hard near sentence better best across during
today others however sure means knew try told young miles sun ways thing whole hear
example heard several change answer room sea against top turned learn point city play
toward five using himself usually money seen car morning body upon family later move
""".split()))  # dict.fromkeys: each word once, in order


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: `prompt` is token ids or text, `prompt_len` its length in
    tokens (ids) or words (text), of which the first `prefix_len` come from prefix
    `prefix_id` (None: no shared prefix)."""

    index: int
    prompt: list[int] | str
    prompt_len: int
    output_len: int
    prefix_id: int | None
    prefix_len: int


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int
    prompt_len: LengthDistribution
    output_len: LengthDistribution
    prompt_format: PromptFormat = "ids"
    shared_prefix_ratio: float = 0.0
    num_prefixes: int = 1
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"the number of requests must be at least 1, got {self.num_requests}")
        if not 0.0 <= self.shared_prefix_ratio <= 1.0:
            raise ValueError(f"the shared-prefix ratio must be in [0, 1], got {self.shared_prefix_ratio}")
        if self.num_prefixes < 1:
            raise ValueError(f"the number of prefixes must be at least 1, got {self.num_prefixes}")
        lo, hi = self.token_id_range
        if not 0 <= lo < hi:
            raise ValueError(f"the token id range must be LO:HI with 0 <= LO < HI, got {lo}:{hi}")


def build_workload(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    """The same config and generator state give the same requests."""
    n = config.num_requests
    prompt_lens = config.prompt_len.sample(rng, n)
    output_lens = config.output_len.sample(rng, n)
    prefix_lens = np.rint(config.shared_prefix_ratio * prompt_lens).astype(np.int64)
    prefix_ids = rng.integers(0, config.num_prefixes, size=n)
    # Each prefix is as long as the longest share of it any prompt takes.
    max_prefix = int(prefix_lens.max())
    prefixes = [_draw_tokens(config, rng, max_prefix) for _ in range(config.num_prefixes)]

    specs = []
    for i in range(n):
        length, prefix_len = int(prompt_lens[i]), int(prefix_lens[i])
        tokens = prefixes[prefix_ids[i]][:prefix_len] + _draw_tokens(config, rng, length - prefix_len)
        prompt = tokens if config.prompt_format == "ids" else " ".join(tokens)
        specs.append(RequestSpec(index=i, prompt=prompt, prompt_len=length, output_len=int(output_lens[i]),
                                 prefix_id=int(prefix_ids[i]) if prefix_len else None, prefix_len=prefix_len))
    return specs


def _draw_tokens(config: WorkloadConfig, rng: np.random.Generator, n: int) -> list:
    if config.prompt_format == "ids":
        return rng.integers(*config.token_id_range, size=n).tolist()
    return [WORDS[i] for i in rng.integers(0, len(WORDS), size=n)]
