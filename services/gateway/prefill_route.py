"""`Route` and `Lookup`: what a prefill router answers, across its boundary with the request's
pipeline. A `Lookup` is what the prefix index said of a prompt (router.py's `lookup`); a `Route`
is the prefill worker chosen from it (`choose`), with how much of the prompt that worker, or a
kvstore node, is thought to hold. `NO_LOOKUP` stands for a prompt the index was not asked about.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.gateway.workers import Worker


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
