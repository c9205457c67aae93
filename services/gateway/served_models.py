"""What a request may name as its model, for both APIs: the model's served names (vLLM's
--served-model-name; responses give the first) and the LoRA adapters the workers serve
(--lora-modules), each a model card of `/v1/models`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.errors import model_not_found


@dataclass(frozen=True)
class ServedModels:
    names: tuple[str, ...]  # the model's; responses give the first
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) of each adapter
    max_model_len: int | None = None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def all_names(self) -> tuple[str, ...]:
        return (*self.names, *(name for name, _ in self.lora_modules))

    def adapter_named(self, model: str) -> str | None:
        """The LoRA adapter `model` names (None: the model itself); APIError 404 for a name neither is."""
        if model in self.names:
            return None
        if self.serves_adapter(model):
            return model
        raise model_not_found(model, self.all_names)

    def serves_adapter(self, name: str) -> bool:
        return any(name == adapter for adapter, _ in self.lora_modules)

    def cards(self) -> list[dict[str, Any]]:
        return [self.card(name) for name in self.all_names]

    def card(self, model: str) -> dict[str, Any]:
        """vLLM's card: an adapter's root is its path and its parent the model."""
        adapter = self.adapter_named(model)
        card = {"id": model, "object": "model", "created": 0, "owned_by": "baton", "max_model_len": self.max_model_len,
                "root": self.name}
        if adapter is not None:
            card.update(root=dict(self.lora_modules)[adapter], parent=self.name)
        return card
