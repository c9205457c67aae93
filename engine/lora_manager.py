"""Which LoRA adapters an engine serves, loaded at start (`--lora-modules`) or while it runs (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter).

An adapter unloaded while requests still compute with it retires: no new request may name it, and
its weights go, with the prefix-cache blocks computed with it, once its last request has finished.
Its cached blocks must go: a later adapter loaded under the same name hashes its blocks alike.

With `max_loaded` (vLLM's --max-cpu-loras) at most that many served adapters' weights stay in
memory: the least recently asked for that no unfinished request computes with is let go, and read
again from its directory when a request names it (its cached blocks stay: the same weights make
the same KV). While more adapters than that compute requests at once, all of them stay.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine.block_manager import BlockManager
from engine.lora import LoRAAdapter, LoRAError, Sharding, Target


class LoRAConflictError(LoRAError):
    """The name is taken: an adapter is served under it, or still finishing its requests."""


class LoRAManager:
    """Owns the runner's adapters (`loras`, by name: what the step computes with) and their lifecycle.
    Every method but `read` runs on the engine's thread."""

    def __init__(self, loras: dict[str, LoRAAdapter], model, dtype: torch.dtype, block_manager: BlockManager,
                 max_rank: int | None = None, max_loaded: int | None = None,
                 in_use: Callable[[str], bool] = lambda name: False, sharding: Sharding | None = None) -> None:
        self._loras = loras  # loaded, least recently asked for first
        self._paths: dict[str, Path] = {}  # served, loaded or not: where each is read from
        self._max_loaded = max_loaded  # None: every served adapter stays loaded
        self._in_use = in_use
        self._max_rank = max_rank  # None: any
        self._sharding = sharding  # a tensor-parallel rank's share of each adapter (lora.py); None: unsplit
        self._target_of: Callable[[str], Target | None] = model.lora_target  # a projection's place in the model
        self._placed: Sharding | None = getattr(model, "lora_matrices", None)  # A and B as the model holds them
        self._serve: Callable[[], None] = model.serve_loras  # hooks the model's projections to adapters, once
        self._dtype = dtype
        self._device = next(model.parameters()).device  # where the adapters' matrices are kept
        self._block_manager = block_manager
        self._retiring: set[str] = set()
        # Each served adapter's id, as vLLM numbers its LoRARequests: from 1, in the order they were served;
        # one unloaded and loaded again takes a new one.
        self._ids: dict[str, int] = {}
        self._num_ids = 0

    def read(self, name: str, path: str | Path) -> LoRAAdapter:
        """The adapter in directory `path`, read and checked against the model (any thread: it touches
        nothing served). LoRAError for one the model cannot serve, or of a rank over `max_rank`."""
        adapter = LoRAAdapter.load(name, path, self._target_of, self._dtype, self._device, self._sharding,
                                   self._placed)
        if self._max_rank is not None and adapter.rank > self._max_rank:
            raise LoRAError(f"{path}: LoRA rank {adapter.rank} is greater than max_lora_rank {self._max_rank}")
        return adapter

    def add(self, adapter: LoRAAdapter) -> None:
        """Serve `adapter` from the next step on. LoRAConflictError when its name is taken."""
        if adapter.name in self._retiring:
            raise LoRAConflictError(f"LoRA adapter {adapter.name!r} was unloaded and is still finishing its "
                                    f"requests; load it again once they are done")
        if adapter.name in self._paths:
            raise LoRAConflictError(f"LoRA adapter {adapter.name!r} is already loaded")
        self._paths[adapter.name] = adapter.path
        self._num_ids += 1
        self._ids[adapter.name] = self._num_ids
        self._hold(adapter)

    def _hold(self, adapter: LoRAAdapter) -> None:
        self._loras[adapter.name] = adapter
        self._serve()
        if self._max_loaded is None:
            return
        # The least recently asked for first; never the one just taken, nor one computing requests.
        for name in [name for name in self._loras if name != adapter.name and not self._in_use(name)]:
            if len(self._loras) <= self._max_loaded:
                break
            del self._loras[name]

    def ensure_loaded(self, name: str) -> None:
        """A request names served adapter `name`: its weights in memory (read again if they were let
        go), and it the most recently asked for. LoRAError when its directory no longer reads."""
        adapter = self._loras.pop(name, None)
        self._hold(adapter if adapter is not None else self.read(name, self._paths[name]))

    def id_of(self, name: str) -> int | None:
        """A served (or retiring) adapter's id; None for a name not served."""
        return self._ids.get(name)

    def is_served(self, name: str) -> bool:
        return name in self._paths and name not in self._retiring

    @property
    def served(self) -> list[str]:
        return [name for name in self._paths if name not in self._retiring]

    @property
    def loaded(self) -> list[str]:
        """The adapters whose weights are in memory, least recently asked for first."""
        return list(self._loras)

    def path_of(self, name: str) -> Path | None:
        """The directory a served adapter was read from; None for a name not served."""
        return self._paths[name] if self.is_served(name) else None

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
            del self._paths[name]
            del self._ids[name]
            self._loras.pop(name, None)
            self._block_manager.forget_adapter(name)
