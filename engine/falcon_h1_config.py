"""Falcon-H1's muP multipliers, read from its config.json (engine/models/falcon_h1.py folds them into the weights
as they load, all but the embeddings' and the LM head's)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MupMultipliers:
    embedding: float = 1.0  # the input embeddings (a tied LM head reads the table unscaled)
    lm_head: float = 1.0  # the logits
    attention_in: float = 1.0  # attention's input (q, k and v)
    key: float = 1.0  # k
    attention_out: float = 1.0
    ssm_in: float = 1.0  # the Mamba-2 layer's input
    ssm: tuple[float, ...] = (1.0,) * 5  # its projection's z, x, B, C and dt parts
    ssm_out: float = 1.0
    mlp_gate: float = 1.0
    mlp_down: float = 1.0


def read_mup(cfg: dict) -> MupMultipliers:
    """ValueError for multipliers of the wrong count."""
    ssm = tuple(float(x) for x in cfg.get("ssm_multipliers") or (1.0,) * 5)
    mlp = tuple(float(x) for x in cfg.get("mlp_multipliers") or (1.0, 1.0))
    if len(ssm) != 5 or len(mlp) != 2:
        raise ValueError(f"ssm_multipliers needs 5 numbers (z, x, B, C, dt) and mlp_multipliers 2 (gate, down), got "
                         f"{len(ssm)} and {len(mlp)}")
    return MupMultipliers(embedding=float(cfg.get("embedding_multiplier", 1.0)),
                          lm_head=float(cfg.get("lm_head_multiplier", 1.0)),
                          attention_in=float(cfg.get("attention_in_multiplier", 1.0)),
                          key=float(cfg.get("key_multiplier", 1.0)),
                          attention_out=float(cfg.get("attention_out_multiplier", 1.0)),
                          ssm_in=float(cfg.get("ssm_in_multiplier", 1.0)), ssm=ssm,
                          ssm_out=float(cfg.get("ssm_out_multiplier", 1.0)), mlp_gate=mlp[0], mlp_down=mlp[1])
