"""What a request may name as its model, for both APIs: the model's served names (vLLM's
--served-model-name; responses give the first) and the LoRA adapters the workers serve
(--lora-modules, and those loaded at run time: lora_updates.py), each a model card of `/v1/models`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.gateway.errors import APIError, model_not_found


class ServedModels:
    """One per gateway, shared by its HTTP and gRPC APIs: an adapter loaded or unloaded at run time
    is named (or not) by both at once."""

    def __init__(self, names: Sequence[str], lora_modules: Sequence[tuple[str, str]] = (),
                 max_model_len: int | None = None) -> None:
        self.names = tuple(names)  # the model's; responses give the first
        self.adapters: dict[str, str] = dict(lora_modules)  # name → path, in the order they came
        self.max_model_len = max_model_len
        # A sequence classifier of one label (a cross-encoder reranker): it scores a pair of texts
        # joined, with its head (score_api.py), not by the cosine of their embeddings.
        self.is_cross_encoder = False
        self.has_classifier = False  # a classification head (a *ForSequenceClassification checkpoint)
        self.generates_text = True  # False: an encoder, served for embeddings only (engine/encoder_config.py)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def all_names(self) -> tuple[str, ...]:
        return (*self.names, *self.adapters)

    def adapter_named(self, model: str) -> str | None:
        """The LoRA adapter `model` names (None: the model itself), by its name or as SGLang names one,
        "MODEL:ADAPTER"; APIError 404 for a name neither is."""
        if model in self.names:
            return None
        if self.serves_adapter(model):
            return model
        base, _, adapter = model.rpartition(":")
        if base in self.names and self.serves_adapter(adapter):
            return adapter
        raise model_not_found(model, self.all_names)

    def check_generates(self) -> None:
        """APIError 400 for a request to generate text from a model that does not."""
        if not self.generates_text:
            raise APIError(400, f"The model `{self.name}` is an embedding model: it does not generate text (it "
                                "answers /v1/embeddings).", param="model", code="model_not_generative")

    def serves_adapter(self, name: str) -> bool:
        return name in self.adapters

    def cards(self) -> list[dict[str, Any]]:
        return [self.card(name) for name in self.all_names]

    def card(self, model: str) -> dict[str, Any]:
        """vLLM's card: an adapter's root is its path and its parent the model."""
        adapter = self.adapter_named(model)
        card = {"id": model, "object": "model", "created": 0, "owned_by": "baton", "max_model_len": self.max_model_len,
                "root": self.name}
        if adapter is not None:
            card.update(root=self.adapters[adapter], parent=self.name)
        return card
