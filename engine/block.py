"""`Block`: one page of KV, as the block manager, its free queue and its prefix cache see it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    """One page of KV.

    `hash` is set only while this block is the registered holder of a full,
    computed block whose tokens are `token_ids`; it survives the block being
    freed and is dropped when the page is reused (lazy eviction). `chances` is
    how many more times eviction passes the block over: each prefix hit adds one
    (up to MAX_CHANCES), each pass takes one.
    """

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    parent_hash: int | None = None  # the hash of the block before it in its prompt, while `hash` is set
    token_ids: tuple[int, ...] = ()
    chances: int = 0
    lora_name: str | None = None  # the adapter its cached KV was computed with (None: the base model)
