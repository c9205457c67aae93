"""A hybrid model's layers by kind (`layer_types`): which are recurrent, and where the attention layers' pages lie."""
from __future__ import annotations

LINEAR, FULL = "linear_attention", "full_attention"


class LinearAndFullLayers:
    """For a layout whose `layer_types` name each layer LINEAR (recurrent) or FULL (attention over pages)."""

    layer_types: tuple[str, ...]

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR)

    @property
    def kv_places(self) -> dict[int, int]:
        """Each full-attention layer's layer of the pages."""
        full = (i for i, kind in enumerate(self.layer_types) if kind == FULL)
        return {layer: place for place, layer in enumerate(full)}
