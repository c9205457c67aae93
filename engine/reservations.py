"""`Reservations`: pages set aside for requests whose KV another worker writes (disaggregated
prefill), held by id until a sequence adopts them or they are released."""
from __future__ import annotations

from engine.block_pool import BlockPool


class Reservations:
    """The pages of each reservation id, taken from `pool` in few runs of consecutive ids (a KV
    transfer fills them) and held once each. An act that cannot be done raises before changing
    anything."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.block_ids: dict[str, list[int]] = {}

    def reserve(self, reservation_id: str, num_blocks: int) -> list[int]:
        """Take `num_blocks` fresh pages for `reservation_id`; returns their ids."""
        if reservation_id in self.block_ids:
            raise ValueError(f"{reservation_id!r} already holds blocks")
        if num_blocks > len(self.pool.free_block_ids):
            raise RuntimeError(f"not enough free KV blocks to reserve {num_blocks} for {reservation_id!r}")
        block_ids = self.pool.take_free_runs(num_blocks)
        self.block_ids[reservation_id] = block_ids
        return block_ids

    def release(self, reservation_id: str) -> bool:
        """Give reserved pages back to the pool's free queue. False if unknown."""
        block_ids = self.block_ids.pop(reservation_id, None)
        if block_ids is None:
            return False
        for block_id in reversed(block_ids):
            self.pool.blocks[block_id].ref_count = 0
            self.pool.free_block_ids.push(block_id)
        return True

    def rename(self, reservation_id: str, new_id: str) -> bool:
        """Hold `reservation_id`'s pages under `new_id` instead; False if unknown."""
        if new_id in self.block_ids:
            raise ValueError(f"{new_id!r} already holds blocks")
        block_ids = self.block_ids.pop(reservation_id, None)
        if block_ids is None:
            return False
        self.block_ids[new_id] = block_ids
        return True

    def hand_over(self, reservation_id: str, num_computed_tokens: int, num_state_blocks: int = 0) -> list[int]:
        """The pages of `reservation_id`, reserved no more, for a sequence whose KV they hold for
        its first `num_computed_tokens` tokens (and its recurrent states, in the last `num_state_blocks`); the
        references pass to it. ValueError for an unknown reservation or one too small."""
        block_ids = self.block_ids.get(reservation_id)
        if block_ids is None:
            raise ValueError(f"no reservation {reservation_id!r}")
        if (len(block_ids) - num_state_blocks) * self.block_size < num_computed_tokens:
            raise ValueError(
                f"reservation {reservation_id!r} holds {len(block_ids)} blocks, too few for "
                f"{num_computed_tokens} computed tokens"
            )
        del self.block_ids[reservation_id]
        return block_ids
