"""Tencent's Hy4 (HYV4ForCausalLM), read from its config.json: DeepSeek-V3.2's sparse latent attention (its indexer's
choice shared by the layers `indexer_types` calls "shared"), each head's output gated and a learnt sink logit a head;
a dense first layer, then experts routed as GLM-4.5's beside shared ones, their GLUs clamped; and hyper-connections:
the residual stream is `hc_mult` streams, which every sublayer reads as one weighed sum of them and writes back into
each, weighed again (engine/models/hy_v4.py).
"""
from __future__ import annotations

from dataclasses import dataclass

HY_V4 = "HYV4ForCausalLM"


@dataclass(frozen=True)
class HyperConnections:
    streams: int  # hc_mult
    magnitude: float  # the largest weight a sublayer's output is written into a stream with
    eps: float  # added to every weight a stream is read or written with
    swiglu_limit: float | None  # the routed experts' gate clamped from above, up both ways (None: unclamped)


def hy_v4_keys(cfg: dict) -> dict:
    """`cfg` with transformers' defaults for what it leaves out (HYV4Config's), by the names Baton reads."""
    layers = int(cfg.get("num_hidden_layers", 34))
    return {**cfg, "mlp_layer_types": cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1),
            "indexer_types": cfg.get("indexer_types") or ["full" if i == 0 or (i - 1) % 4 == 0 else "shared"
                                                          for i in range(layers)],
            "index_n_heads": cfg.get("index_n_heads", 16)}


def read_hyper_connections(cfg: dict) -> HyperConnections:
    """ValueError for fewer than one stream."""
    streams = int(cfg.get("hc_mult", 4))
    if streams < 1:
        raise ValueError(f"hc_mult must be at least 1, got {streams}")
    limit = float(cfg.get("swiglu_limit", 10.0) or 0.0)
    return HyperConnections(streams=streams, magnitude=float(cfg.get("hc_magnitude", 2.0)),
                            eps=float(cfg.get("hc_eps", 1e-6)), swiglu_limit=limit if limit > 0 else None)
