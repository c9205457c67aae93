"""`KVEventLog`: the prefix cache's changes in the order they happened, for a subscriber outside the
process that keeps its own copy of what this engine caches (vLLM's KV events, which NVIDIA Dynamo's
and llm-d's KV-aware routers consume). Unlike `CacheEvents`, which keeps net changes for Redis, it
keeps every change and how a block chains onto the one before it, as such a router's tree needs.

Stores that extend the chain just stored are one `StoredBlocks` (a prompt's new blocks, as one
event); consecutive removals are one `RemovedBlocks`; a reset is one `AllBlocksCleared`, which
makes whatever came before it in the same batch moot."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from engine.block import Block


class StoredBlocks(NamedTuple):
    block_hashes: list[int]       # a chain: each block's parent is the one before it
    parent_block_hash: int | None  # the first block's parent; None: the first block of a prompt
    token_ids: list[int]          # every block's tokens, one after another
    lora_name: str | None         # the adapter whose KV the blocks hold (None: the base model's)
    lora_id: int | None = None    # its id (LoRAManager.id_of), filled in as the engine hands the events out


class RemovedBlocks(NamedTuple):
    block_hashes: list[int]


class AllBlocksCleared(NamedTuple):
    pass


KVEvent = StoredBlocks | RemovedBlocks | AllBlocksCleared


def with_lora_ids(events: list[KVEvent], id_of: Callable[[str], int | None]) -> list[KVEvent]:
    """`events`, each adapter's stored blocks given its id too (`id_of`: LoRAManager's), as vLLM's carry both."""
    return [event._replace(lora_id=id_of(event.lora_name))
            if isinstance(event, StoredBlocks) and event.lora_name is not None else event for event in events]


class KVEventLog:
    """Filled by the prefix cache, emptied by `take` after every step and command (so a log
    holds one step's changes at most)."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []

    def __bool__(self) -> bool:
        return bool(self._events)

    def stored(self, h: int, parent: int | None, tokens: Iterable[int], lora_name: str | None) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, StoredBlocks) and last.block_hashes[-1] == parent and last.lora_name == lora_name:
            last.block_hashes.append(h)
            last.token_ids.extend(tokens)
        else:
            self._events.append(StoredBlocks([h], parent, list(tokens), lora_name))

    def removed(self, h: int) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, RemovedBlocks):
            last.block_hashes.append(h)
        else:
            self._events.append(RemovedBlocks([h]))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


def stored_now(blocks: Iterable[Block]) -> list[KVEvent]:
    """What a subscriber starting now must hear: nothing before (a clear), then every cached block
    after its parent, a chain's blocks one after another (so most chains are one event)."""
    cached = {block.hash: block for block in blocks if block.hash is not None}
    children: dict[int | None, list[int]] = {}
    for h, block in cached.items():  # a block whose parent was evicted starts a chain of its own
        children.setdefault(block.parent_hash if block.parent_hash in cached else None, []).append(h)
    log = KVEventLog()
    stack = list(reversed(children.get(None, [])))
    while stack:
        h = stack.pop()
        block = cached[h]
        log.stored(h, block.parent_hash, block.token_ids, block.lora_name)
        stack.extend(reversed(children.get(h, [])))
    return [AllBlocksCleared(), *log.take()]
