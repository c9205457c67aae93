"""What a config.json says of multi-head latent attention (DeepSeek-V3's MLA; engine/models/mla.py
computes it)."""
from __future__ import annotations

from dataclasses import dataclass

DEEPSEEK_V32 = "DeepseekV32ForCausalLM"  # DeepSeek-V3.2: V3's model, its attention sparse (DSA)


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # q through a low-rank projection and a norm; None: one projection
    kv_lora_rank: int  # the latent k and v are made from, normed
    qk_nope_head_dim: int  # a head's q and k dimensions without RoPE
    qk_rope_head_dim: int  # ... and with it: k's shared by every head
    v_head_dim: int
    rope_interleave: bool  # the RoPE dimensions' pairs are adjacent in the weights (DeepSeek's export)
    # DeepSeek-V3.2's sparse attention (DSA): an indexer of `index_heads` heads `index_head_dim` wide scores every
    # earlier token for each query, which attends to the `index_topk` best alone; 0: every token (dense MLA).
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_row_width(self) -> int:
        """A token's numbers in a layer's pages: k's RoPE part, shared by the heads, the latent, and (DSA's) the
        indexer's key."""
        return self.qk_rope_head_dim + self.kv_lora_rank + self.index_head_dim

    @property
    def page_head_dim(self) -> int:
        """The row split over a layer's k and v pages (one kv head each), the second half padded."""
        return (self.cache_row_width + 1) // 2


def read_mla_config(cfg: dict, arch: str) -> MLAConfig:
    q_lora_rank = cfg.get("q_lora_rank")
    # DeepSeek-V2 turns its RoPE dimensions as complex numbers, pairs side by side: V3's interleaving.
    interleaved = True if arch == "DeepseekV2ForCausalLM" else bool(cfg.get("rope_interleave", True))
    index = {}
    if arch == DEEPSEEK_V32:
        index = dict(index_heads=int(cfg.get("index_n_heads", 64)), index_head_dim=int(cfg.get("index_head_dim", 128)),
                     index_topk=int(cfg.get("index_topk", 2048)))
        if not q_lora_rank:
            raise ValueError("DeepSeek-V3.2's indexer reads q's low-rank latent: q_lora_rank is needed")
        if index["index_head_dim"] < int(cfg["qk_rope_head_dim"]) or index["index_topk"] < 1:
            raise ValueError(f"index_head_dim {index['index_head_dim']} must hold qk_rope_head_dim "
                             f"{cfg['qk_rope_head_dim']}, and index_topk ({index['index_topk']}) be positive")
    return MLAConfig(q_lora_rank=int(q_lora_rank) if q_lora_rank else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                     qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                     v_head_dim=int(cfg["v_head_dim"]), rope_interleave=interleaved, **index)
