"""`Route` and `Lookup`: what a prefill router answers, across its boundary with the request's
pipeline. A `Lookup` is what the prefix index said of a prompt (router.py's `lookup`); a `Route`
is the prefill worker chosen from it (`choose`), with how much of the prompt that worker, or a
kvstore node, is thought to hold. `NO_LOOKUP` stands for a prompt the index was not asked about;
`prompt_lookup` asks it about a request's prompt.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protos import common_pb2
from services.gateway.request_errors import InvalidRequestError
from services.gateway.workers import Worker

if TYPE_CHECKING:
    from services.gateway.router import PrefixRouter


# Route and Lookup: made on every request's path, so plain slotted records (a frozen
# dataclass sets each field through object.__setattr__).
@dataclass(slots=True)
class Route:
    worker: Worker
    num_cached_tokens: int  # of the prompt, as the index says the worker holds them
    host_tier_address: str = ""  # a kvstore node holding more of the prompt's leading blocks...
    host_tier_blocks: int = 0  # ...this many, than the worker does
    decision: str = ""  # how the worker was chosen: the label it is counted under


@dataclass(slots=True)
class Lookup:
    """What the prefix index said of a prompt, in one round trip (`PrefixRouter.lookup`)."""
    hashes: Sequence[int]  # the prompt's block chain (a BlockHashChain: hashed as far as it is read)
    matched: dict[str, int] | None  # leading blocks held, by prefill worker address; None: routing by load
    tier: tuple[str, int] | None = None  # the kvstore node holding the most of them, and how many
    decode_cached_tokens: int = 0  # of the prompt, as the index says the decode worker asked about holds


NO_LOOKUP = Lookup([], None)


async def prompt_lookup(router: PrefixRouter | None, prompt: Sequence[int], params: common_pb2.SamplingParams,
                        decode_address: str | None) -> Lookup:
    """What `router`'s prefix index says of `prompt`, sampled by `params`: where its prefix is among
    the prefill workers, and how much of it the decode worker at `decode_address` holds (None: not
    asked), in one round trip. NO_LOOKUP without a router, or for a prompt whose logprobs are asked
    for: it is computed whole, so no cached prefix or host-tier block is worth anything to it, and it
    is placed by load alone. Raises InvalidRequestError for a prompt holding a negative id."""
    if router is None or params.HasField("prompt_logprobs"):
        return NO_LOOKUP
    try:
        return await router.lookup(prompt, decode_address, params.lora_name if params.HasField("lora_name") else None,
                                   params.cache_salt if params.HasField("cache_salt") else None)
    except ValueError as e:  # a negative id in a block it hashed
        raise InvalidRequestError(f"prompt {e}") from None
