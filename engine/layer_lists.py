"""config.json's lists of a setting a layer (`layer_types`, `mlp_layer_types`, ...), checked against the layers."""
from __future__ import annotations


def check_layer_lists(num_layers: int, **lists: list) -> None:
    """ValueError, naming the lists, where one does not give each of `num_layers` layers an entry."""
    if any(len(given) != num_layers for given in lists.values()):
        verb = "needs" if len(lists) == 1 else "need"
        raise ValueError(f"{' and '.join(lists)} {verb} one entry for each of {num_layers} layers")
