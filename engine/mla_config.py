"""What a config.json says of multi-head latent attention (DeepSeek-V3's MLA; engine/models/mla.py
computes it)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.bailing_hybrid_config import BAILING_HYBRID
from engine.hy_v4_config import HY_V4

DEEPSEEK_V32 = "DeepseekV32ForCausalLM"  # DeepSeek-V3.2: V3's model, its attention sparse (DSA)
GLM_MOE_DSA = "GlmMoeDsaForCausalLM"  # GLM-5: V3.2's, its indexer's RoPE pairs side by side, some layers sharing
SPARSE_MLA = (DEEPSEEK_V32, GLM_MOE_DSA, HY_V4)


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
    index_rope_interleave: bool = False  # the indexer's RoPE pairs side by side (GLM-5's), not half a part apart
    index_rope_last: bool = False  # RoPE turns the indexer's heads' last qk_rope_head_dim (Hy4's), not their first
    index_norm_eps: float = 1e-6  # its keys' layer norm's
    # Layers without an indexer of their own, attending to the tokens the last layer with one chose (GLM-5's "shared").
    shared_index_layers: frozenset[int] = frozenset()
    # q's up-projection gives each head's q and then its output gate, from q's normed latent and the latent itself
    # (A.X K2's): the sigmoid of the gate weighs the head's output before o_proj.
    output_gate: bool = False
    # Each head's output weighed by the sigmoid of a projection of the layer's input of its own (`gate_proj`), this
    # many numbers a head: Hy4's v_head_dim (one a dimension), Ling 3's one (the head's whole); 0: none.
    head_gate_width: int = 0
    latent_norm_eps: float | None = None  # q's and kv's latents' norms' where not rms_norm_eps (Hy4's: transformers')

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
    # MiniCPM3's pairs lie half a part apart, as Llama's.
    # Hy4's pairs half apart too, whatever config.json says (transformers turns them so).
    interleaved = True if arch == "DeepseekV2ForCausalLM" else False if arch in ("MiniCPM3ForCausalLM", HY_V4) else \
        bool(cfg.get("rope_interleave", True))
    index = {}
    if arch in SPARSE_MLA:
        index = dict(index_heads=int(cfg.get("index_n_heads", 64 if arch == DEEPSEEK_V32 else 32)),
                     index_head_dim=int(cfg.get("index_head_dim", 128)), index_topk=int(cfg.get("index_topk", 2048)),
                     index_rope_interleave=arch == GLM_MOE_DSA, index_rope_last=arch == HY_V4,
                     index_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)) if arch == HY_V4 else 1e-6,
                     shared_index_layers=_shared_index_layers(cfg) if arch in (GLM_MOE_DSA, HY_V4) else frozenset())
        if not q_lora_rank:
            raise ValueError("DeepSeek-V3.2's indexer reads q's low-rank latent: q_lora_rank is needed")
        if index["index_head_dim"] < int(cfg["qk_rope_head_dim"]) or index["index_topk"] < 1:
            raise ValueError(f"index_head_dim {index['index_head_dim']} must hold qk_rope_head_dim "
                             f"{cfg['qk_rope_head_dim']}, and index_topk ({index['index_topk']}) be positive")
    # (MiniCPM3's v heads, where it leaves them out: its width's share)
    v_head_dim = int(cfg.get("v_head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    return MLAConfig(q_lora_rank=int(q_lora_rank) if q_lora_rank else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                     qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                     v_head_dim=v_head_dim, rope_interleave=interleaved,
                     head_gate_width=v_head_dim if arch == HY_V4 else 1 if arch == BAILING_HYBRID else 0,
                     latent_norm_eps=1e-6 if arch == HY_V4 else None, **index)


def _shared_index_layers(cfg: dict) -> frozenset[int]:
    """GLM-5's (and Hy4's) layers that reuse the last full layer's choice, as transformers reads them: config.json's
    `indexer_types` ("full" or "shared" a layer), else `index_topk_pattern` ("F"/"S"), else every
    `index_topk_freq`-th layer full from `index_skip_topk_offset` - 1 on (and the layers before it)."""
    num_layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("indexer_types")
    pattern = cfg.get("index_topk_pattern")
    if kinds is None and pattern is not None:
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if kinds is None:
        freq, offset = max(int(cfg.get("index_topk_freq", 1)), 1), int(cfg.get("index_skip_topk_offset", 2))
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    if len(kinds) != num_layers or not set(kinds) <= {"full", "shared"} or kinds[0] != "full":
        raise ValueError(f"indexer_types must name each of the {num_layers} layers 'full' or 'shared', the first "
                         f"full, got {list(kinds)}")
    return frozenset(i for i, kind in enumerate(kinds) if kind == "shared")
