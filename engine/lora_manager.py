"""Which LoRA adapters an engine serves, loaded at start (`--lora-modules`) or while it runs (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter).

An adapter unloaded while requests still compute with it retires: no new request may name it, and
its weights go, with the prefix-cache blocks computed with it, once its last request has finished.
Its cached blocks must go: a later adapter loaded under the same name hashes its blocks alike.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine.block_manager import BlockManager
from engine.lora import LoRAAdapter, LoRAError, Target


class LoRAConflictError(LoRAError):
    """The name is taken: an adapter is served under it, or still finishing its requests."""


class LoRAManager:
    """Owns the runner's adapters (`loras`, by name: what the step computes with) and their lifecycle.
    Every method but `read` runs on the engine's thread."""

    def __init__(self, loras: dict[str, LoRAAdapter], model, dtype: torch.dtype, block_manager: BlockManager,
                 max_rank: int | None = None) -> None:
        self._loras = loras
        self._max_rank = max_rank  # None: any
        self._target_of: Callable[[str], Target | None] = model.lora_target  # a projection's place in the model
        self._serve: Callable[[], None] = model.serve_loras  # hooks the model's projections to adapters, once
        self._dtype = dtype
        self._block_manager = block_manager
        self._retiring: set[str] = set()

    def read(self, name: str, path: str | Path) -> LoRAAdapter:
        """The adapter in directory `path`, read and checked against the model (any thread: it touches
        nothing served). LoRAError for one the model cannot serve, or of a rank over `max_rank`."""
        adapter = LoRAAdapter.load(name, path, self._target_of, self._dtype)
        if self._max_rank is not None and adapter.rank > self._max_rank:
            raise LoRAError(f"{path}: LoRA rank {adapter.rank} is greater than max_lora_rank {self._max_rank}")
        return adapter

    def add(self, adapter: LoRAAdapter) -> None:
        """Serve `adapter` from the next step on. LoRAConflictError when its name is taken."""
        if adapter.name in self._retiring:
            raise LoRAConflictError(f"LoRA adapter {adapter.name!r} was unloaded and is still finishing its "
                                    f"requests; load it again once they are done")
        if adapter.name in self._loras:
            raise LoRAConflictError(f"LoRA adapter {adapter.name!r} is already loaded")
        self._loras[adapter.name] = adapter
        self._serve()

    def is_served(self, name: str) -> bool:
        return name in self._loras and name not in self._retiring

    @property
    def served(self) -> list[str]:
        return [name for name in self._loras if name not in self._retiring]

    def path_of(self, name: str) -> Path | None:
        """The directory a served adapter was read from; None for a name not served."""
        return self._loras[name].path if self.is_served(name) else None

    def remove(self, name: str, in_use: Callable[[str], bool]) -> bool:
        """Stop serving `name`: at once if no unfinished request computes with it (`in_use(name)`),
        else once the last one has (`drop_unused`). False for a name not served."""
        if not self.is_served(name):
            return False
        self._retiring.add(name)
        self.drop_unused(in_use)
        return True

    @property
    def has_retiring(self) -> bool:
        return bool(self._retiring)

    def drop_unused(self, in_use: Callable[[str], bool]) -> None:
        """Let go of each retiring adapter that no unfinished request computes with any more."""
        for name in [name for name in self._retiring if not in_use(name)]:
            self._retiring.discard(name)
            del self._loras[name]
            self._block_manager.forget_adapter(name)
