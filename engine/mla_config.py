"""What a config.json says of multi-head latent attention (DeepSeek-V3's MLA; engine/models/mla.py
computes it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # q through a low-rank projection and a norm; None: one projection
    kv_lora_rank: int  # the latent k and v are made from, normed
    qk_nope_head_dim: int  # a head's q and k dimensions without RoPE
    qk_rope_head_dim: int  # ... and with it: k's shared by every head
    v_head_dim: int
    rope_interleave: bool  # the RoPE dimensions' pairs are adjacent in the weights (DeepSeek's export)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_row_width(self) -> int:
        """A token's numbers in a layer's pages: k's RoPE part, shared by the heads, and the latent."""
        return self.qk_rope_head_dim + self.kv_lora_rank

    @property
    def page_head_dim(self) -> int:
        """The row split over a layer's k and v pages (one kv head each), the second half padded."""
        return (self.cache_row_width + 1) // 2


def read_mla_config(cfg: dict, arch: str) -> MLAConfig:
    q_lora_rank = cfg.get("q_lora_rank")
    # DeepSeek-V2 turns its RoPE dimensions as complex numbers, pairs side by side: V3's interleaving.
    interleaved = True if arch == "DeepseekV2ForCausalLM" else bool(cfg.get("rope_interleave", True))
    return MLAConfig(q_lora_rank=int(q_lora_rank) if q_lora_rank else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                     qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                     v_head_dim=int(cfg["v_head_dim"]), rope_interleave=interleaved)
