"""What a config.json says of a mixture of experts (engine/models/moe.py computes it), read as
transformers reads it for each architecture that has one."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.axk1_config import AXK1
from engine.bailing_hybrid_config import BAILING_HYBRID
from engine.beam_config import BEAM
from engine.cohere2_moe_config import COHERE2_MOE, SCORINGS
from engine.dbrx_config import DBRX
from engine.flint_config import FLINT
from engine.hy_v3_config import HY_V3
from engine.hy_v4_config import HY_V4
from engine.kolibri1_config import KOLIBRI1
from engine.laguna_config import LAGUNA
from engine.linear_attention_config import KIMI_LINEAR, QWEN3_5_MOE, QWEN3_NEXT
from engine.longcat_flash_config import LONGCAT_FLASH
from engine.mamba1_config import JAMBA, jamba_expert_layers
from engine.mamba_config import NEMOTRON_H
from engine.mellum_config import MELLUM
from engine.mimo_v2_flash_config import MIMO_V2_FLASH
from engine.minimax_config import MINIMAX
from engine.minimax_m3_config import MINIMAX_M3
from engine.mla_config import DEEPSEEK_V32, GLM_MOE_DSA
from engine.qwen4_exp_config import QWEN4_EXP
from engine.rope_config import HUNYUAN_MOE, PHIMOE
from engine.short_conv_config import LFM2_MOE
from engine.step3p7_config import STEP3P7

QWEN_MOES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
GLM4_MOE, DEEPSEEK_V2, DEEPSEEK_V3 = "Glm4MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
GLM4_MOE_LITE = "Glm4MoeLiteForCausalLM"  # GLM-4.7-Flash: DeepSeek-V3's latent attention and routing
DOTS1 = "Dots1ForCausalLM"  # rednote's dots.llm1: Qwen3's attention, DeepSeek-V3's experts and routing
SOLAR_OPEN = "SolarOpenForCausalLM"  # Upstage's Solar Open: Llama's attention, GLM-4.5's experts in every layer
EXAONE_MOE = "ExaoneMoeForCausalLM"  # K-EXAONE: EXAONE 4.0's attention in pre-norm layers, DeepSeek-V3's experts
LLAMA4, GPT_OSS = "Llama4ForCausalLM", "GptOssForCausalLM"
MINIMAX_M2 = "MiniMaxM2ForCausalLM"
ERNIE45_MOE = "Ernie4_5_MoeForCausalLM"
OLMOE = "OlmoeForCausalLM"
AFMOE = "AfmoeForCausalLM"  # Arcee's Trinity (engine/models/afmoe.py)
FLEX_OLMO = "FlexOlmoForCausalLM"  # OLMo 2's layers with OLMoE's experts
# Granite 3.0/3.1 MoE; with a shared MLP; Granite SWA's MoE (windows, sinks and RoPE a layer: attention_layout.py)
GRANITE_MOES = ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteMoeSWAForCausalLM")
GRANITE_SWAS = ("GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM")
GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"  # Granite 4.0: its attention-only checkpoints (4.0-Micro)
MISTRAL4 = "Mistral4ForCausalLM"  # Mistral Small 4's text model: DeepSeek's latent attention, softmax-routed experts
# Where config.json leaves them out, transformers' defaults for the routing GLM-4.5 and DeepSeek-V3 share.
_GROUPED_DEFAULTS = {GLM4_MOE: dict(n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0),
                     DEEPSEEK_V3: dict(n_group=8, topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5),
                     DEEPSEEK_V32: dict(n_group=8, topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5),
                     GLM_MOE_DSA: dict(n_group=1, topk_group=1, first_k_dense_replace=3, routed_scaling_factor=2.5),
                     KIMI_LINEAR: dict(n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.446),
                     BAILING_HYBRID: dict(n_group=8, topk_group=4, first_k_dense_replace=2, routed_scaling_factor=2.5),
                     GLM4_MOE_LITE: dict(n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.8),
                     DOTS1: dict(n_group=1, topk_group=1, first_k_dense_replace=0, routed_scaling_factor=1.0),
                     EXAONE_MOE: dict(n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5),
                     SOLAR_OPEN: dict(n_group=1, topk_group=1, first_k_dense_replace=0, routed_scaling_factor=1.0),
                     HY_V3: dict(n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.826),
                     HY_V4: dict(n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827),
                     BEAM: dict(n_group=8, topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5),
                     AXK1: dict(n_group=8, topk_group=4, first_k_dense_replace=1, routed_scaling_factor=2.5),
                     MIMO_V2_FLASH: dict(n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0)}


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 0  # 0: no experts, every MLP dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # Experts every token passes through beside the routed ones (their sizes summed); 0: none.
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False  # Qwen2-MoE weighs the shared expert by a sigmoid gate of its own
    norm_topk_prob: bool = False  # the chosen experts' weights rescaled to sum to 1
    dense_layers: frozenset[int] = field(default_factory=frozenset)  # layers whose MLP is dense though
    weighs_experts_in_float32: bool = False  # Mixtral's, GLM's; Qwen's cast the weights to the compute dtype
    router_in_float32: bool = False  # the router's weight and input in float32 (DeepSeek's, GLM's)
    # How the router scores experts: "softmax" (Mixtral, Qwen, DeepSeek-V2), or "sigmoid" (GLM-4.5,
    # DeepSeek-V3): sigmoid scores, chosen by score plus a learnt correction bias. Either chooses among
    # the `topk_groups` best of `num_groups` groups of experts (a group scored by its best expert under
    # softmax, its best two under sigmoid), and weighs an expert by its score times `routed_scaling_factor`.
    # "sigmoid_of_top_k" (Llama 4): the top-k router logits, each expert weighed by its logit's sigmoid (renormalized
    # where norm_topk_prob says: Command A MoE's).
    scoring: str = "softmax"
    weighs_inputs: bool = False  # Llama 4 weighs each expert's input, not its output
    # gpt-oss's: "softmax_of_top_k" scoring (the top-k router logits softmaxed among themselves), a
    # router with a bias, experts with biases, gate and up clamped to `swiglu_limit` and gated as
    # (up + 1) * gate * sigmoid(alpha * gate).
    has_biases: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # Qwen3-VL-MoE's: each layer's experts stored as two tensors, `experts.gate_up_proj` and `experts.down_proj`
    # ([E, in, out] as released, [E, out, in] as transformers 5 saves them), not a tensor a projection an expert.
    fused_experts: bool = False
    # Ernie 4.5's: softmax scores chosen by score plus a learnt correction bias, weighed by the score alone.
    choice_bias: bool = False
    # Nemotron 3's: the routed experts compute in a narrower width, projected into it and back; 0: none.
    latent_size: int = 0
    # LongCat-Flash's: experts past the real ones that compute nothing (a token routed to one gets its input back,
    # weighed as any expert's output); 0: none.
    identity_experts: int = 0
    # Laguna's: the router's logits soft-capped, cap * tanh(logit / cap), before their sigmoid; None: not.
    router_logit_softcap: float | None = None
    # "sparsemixer" (Phi-3.5-MoE's, at inference): the best expert, then the best of the rest, each weighed by the
    # softmax of the logits within `jitter_eps` (relatively, twice it) of its own.
    jitter_eps: float = 0.0
    shared_expert_average: bool = False  # Command A MoE's: the routed experts' output and the shared ones' averaged
    # Kolibri-1's "sigmoid" routing: experts chosen by router logit plus the bias, not by sigmoid score plus it.
    choice_by_logits: bool = False

    def is_sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers


def read_moe_config(cfg: dict, arch: str) -> MoEConfig:
    """KeyError for a field the architecture needs; ValueError for values that cannot route."""
    num_layers = int(cfg["num_hidden_layers"])
    if arch in ("MixtralForCausalLM", MINIMAX):
        moe = MoEConfig(num_experts=int(cfg.get("num_local_experts") or cfg["num_experts"]),
                        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                        weighs_experts_in_float32=True)
    elif arch in (*QWEN_MOES, QWEN3_NEXT, QWEN3_5_MOE, QWEN4_EXP) and (cfg.get("num_experts")
                                                                     or cfg.get("num_local_experts")):
        # Qwen's own configs name the count num_experts; transformers 5 saves it as num_local_experts.
        step, only_mlp = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
        # Qwen2-MoE's one shared expert, weighed by a gate of its own; Qwen3-Next's and Qwen3.5's too.
        is_qwen2 = arch in ("Qwen2MoeForCausalLM", QWEN3_NEXT, QWEN3_5_MOE, QWEN4_EXP)
        moe = MoEConfig(num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts")),
                        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                        shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]) if is_qwen2 else 0,
                        shared_expert_gated=is_qwen2,
                        # Qwen3.5-MoE's router renormalizes whatever config.json says; Qwen3-Next's by default.
                        norm_topk_prob=arch == QWEN3_5_MOE or bool(cfg.get("norm_topk_prob",
                                                                           arch in (QWEN3_NEXT, QWEN4_EXP))),
                        dense_layers=frozenset(i for i in range(num_layers) if i in only_mlp or (i + 1) % step),
                        fused_experts=cfg.get("model_type") == "qwen3_vl_moe_text")
    elif arch == MINIMAX_M3:  # M2's routing, scaled, beside shared experts; clamped GLUs; dense layers by name
        moe = MoEConfig(num_experts=int(cfg.get("num_local_experts", 128)),
                        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 4)),
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=True,
                        weighs_experts_in_float32=True, router_in_float32=True, scoring="sigmoid",
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.0)),
                        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                        shared_expert_intermediate_size=int(cfg.get("shared_intermediate_size", 3072)),
                        fused_experts=True,
                        dense_layers=frozenset(i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "dense"))
    elif arch == LAGUNA:  # sigmoid scores of the soft-capped logits plus a bias, renormalized, scaled; a shared expert
        cap = float(cfg.get("moe_router_logit_softcapping") or 0.0)
        moe = MoEConfig(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                        shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
                        norm_topk_prob=True, weighs_experts_in_float32=True, router_in_float32=True,
                        scoring="sigmoid", routed_scaling_factor=float(cfg.get("moe_routed_scaling_factor", 1.0)),
                        router_logit_softcap=cap if cap > 0 else None,
                        dense_layers=frozenset(i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "dense"))
    elif arch == MELLUM:  # Qwen3-MoE's routing, in the layers mlp_layer_types calls sparse
        moe = MoEConfig(num_experts=int(cfg["num_local_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                        norm_topk_prob=bool(cfg["norm_topk_prob"]),
                        dense_layers=frozenset(i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "dense"))
    elif arch == COHERE2_MOE:  # the top-k router logits softmaxed or sigmoided; shared experts summed or averaged
        inter, scoring = int(cfg["intermediate_size"]), SCORINGS[cfg.get("expert_selection_fn", "softmax")]
        moe = MoEConfig(num_experts=int(cfg.get("num_experts", 8)),
                        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)), moe_intermediate_size=inter,
                        shared_expert_intermediate_size=inter * int(cfg.get("num_shared_experts", 0)),
                        scoring=scoring, norm_topk_prob=scoring == "sigmoid_of_top_k" and bool(
                            cfg.get("norm_topk_prob", True)),
                        shared_expert_average=cfg.get("shared_expert_combination_strategy", "average") == "average",
                        dense_layers=frozenset(i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "dense"))
    elif arch == KOLIBRI1:  # by logit plus a bias, weighed by the logits' sigmoids; a shared expert in every layer
        moe = MoEConfig(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                        shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
                        norm_topk_prob=bool(cfg["norm_topk_prob"]), weighs_experts_in_float32=True,
                        router_in_float32=True, scoring="sigmoid", choice_by_logits=True)
    elif arch == FLINT:  # the sigmoids of the top-k logits, renormalized; an ungated shared expert; dense by name
        only_mlp = set(cfg["mlp_only_layers"])
        moe = MoEConfig(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                        shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
                        norm_topk_prob=bool(cfg["norm_topk_prob"]), scoring="sigmoid_of_top_k",
                        router_in_float32=True, weighs_experts_in_float32=True,
                        dense_layers=frozenset(i for i in range(num_layers) if i in only_mlp))
    elif arch == DBRX:  # softmax over every expert, the top-k renormalized (moe_normalize_expert_weights 1)
        moe = MoEConfig(num_experts=int(cfg["num_local_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                        norm_topk_prob=bool(cfg["norm_topk_prob"]))
    elif arch == STEP3P7:  # sigmoid scores plus a learnt bias, renormalized, scaled; a shared expert; dense by name
        moe = MoEConfig(num_experts=int(cfg["n_routed_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=True,
                        weighs_experts_in_float32=True, router_in_float32=True, scoring="sigmoid",
                        routed_scaling_factor=float(cfg.get("moe_router_scaling_factor") or 1.0),
                        shared_expert_intermediate_size=int(cfg["share_expert_dim"]),
                        dense_layers=frozenset(i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "dense"))
    elif arch == LONGCAT_FLASH:  # softmax scores chosen by score plus a learnt bias, weighed by the score, in float32
        moe = MoEConfig(num_experts=int(cfg["n_routed_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]), choice_bias=True,
                        router_in_float32=True, weighs_experts_in_float32=True,
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 6.0)),
                        identity_experts=int(cfg.get("zero_expert_num", 256) or 0),
                        dense_layers=frozenset(range(num_layers)))  # its sublayers' MLPs: the experts stand beside
    elif arch in _GROUPED_DEFAULTS:
        inter = int(cfg["moe_intermediate_size"])
        defaults = _GROUPED_DEFAULTS[arch]
        given = {key: defaults[key] if cfg.get(key) is None else cfg[key] for key in defaults}
        num_experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg["num_experts"]
        num_shared = cfg.get("num_shared_experts", 1) if arch == EXAONE_MOE else cfg.get("n_shared_experts", 1)
        moe = MoEConfig(num_experts=int(num_experts),
                        num_experts_per_tok=int(cfg["num_experts_per_tok"]), moe_intermediate_size=inter,
                        shared_expert_intermediate_size=inter * int(num_shared),
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", arch != DOTS1)),
                        dense_layers=_grouped_dense_layers(cfg, int(given["first_k_dense_replace"])),
                        weighs_experts_in_float32=True, router_in_float32=True, scoring="sigmoid",
                        num_groups=int(given["n_group"]),
                        topk_groups=int(given["topk_group"]),
                        routed_scaling_factor=float(given["routed_scaling_factor"]),
                        fused_experts=arch == HY_V4)  # (Hy4's as transformers 5 saves them)
    elif arch == NEMOTRON_H and int(cfg.get("n_routed_experts") or 0):  # Nemotron 3: routed as DeepSeek-V3
        kinds = cfg.get("layers_block_type") or cfg.get("layer_types") or list(cfg.get("hybrid_override_pattern") or "")
        moe = MoEConfig(num_experts=int(cfg["n_routed_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                        shared_expert_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size") or 0),
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                        dense_layers=frozenset(i for i, kind in enumerate(kinds) if kind not in ("moe", "E")),
                        weighs_experts_in_float32=True, router_in_float32=True, scoring="sigmoid",
                        num_groups=int(cfg.get("n_group") or 1), topk_groups=int(cfg.get("topk_group") or 1),
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                        latent_size=int(cfg.get("moe_latent_size") or 0))
    elif arch == MINIMAX_M2:
        # Every layer's experts (intermediate_size wide), chosen by sigmoid score plus a correction bias among them
        # all, weighed by the score renormalized: GLM's routing of one group, unscaled.
        moe = MoEConfig(num_experts=int(cfg["num_local_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                        weighs_experts_in_float32=True, router_in_float32=True, scoring="sigmoid")
    elif arch in GRANITE_MOES or (arch == GRANITE_HYBRID and int(cfg.get("num_local_experts") or 0)):
        # Every layer's experts, intermediate_size wide, by softmax of the top-k logits
        moe = MoEConfig(num_experts=int(cfg["num_local_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["intermediate_size"]), scoring="softmax_of_top_k",
                        shared_expert_intermediate_size=int(cfg.get("shared_intermediate_size") or 0))
    elif arch == MISTRAL4:
        if int(cfg.get("n_group") or 1) != 1:
            raise ValueError(f"n_group {cfg['n_group']} is not supported for {arch} (its experts in one group)")
        inter = int(cfg["moe_intermediate_size"])
        # As transformers holds them (each layer's experts fused in two tensors), and with shared experts beside.
        moe = MoEConfig(num_experts=int(cfg["n_routed_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=inter,
                        shared_expert_intermediate_size=inter * int(cfg.get("n_shared_experts", 1)),
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                        dense_layers=frozenset(range(int(cfg.get("first_k_dense_replace") or 0))),
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0), fused_experts=True)
    elif arch == JAMBA and int(cfg.get("num_experts", 16)) > 1:  # top-2 by softmax, unrenormalized, every other layer
        experts = jamba_expert_layers(cfg)
        moe = MoEConfig(num_experts=int(cfg.get("num_experts", 16)), num_experts_per_tok=int(cfg.get(
            "num_experts_per_tok", 2)), moe_intermediate_size=int(cfg["intermediate_size"]),
                        dense_layers=frozenset(range(num_layers)) - experts)
    elif arch == LFM2_MOE:  # LFM2-8B-A1B: after its first dense layers, experts routed as DeepSeek-V3's in one group
        moe = MoEConfig(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                        dense_layers=frozenset(range(int(cfg.get("num_dense_layers", 2)))), scoring="sigmoid",
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0))
    elif arch == HUNYUAN_MOE:
        # Experts in every layer, by softmax renormalized, the router in float32, beside a shared MLP (its
        # use_mixed_mlp_moe): transformers' are intermediate_size wide, as Hunyuan-A13B's moe_intermediate_size is.
        inter = int(_uniform(cfg, "moe_intermediate_size", cfg["intermediate_size"]))
        shared = int(cfg["intermediate_size"]) * int(_uniform(cfg, "num_shared_expert", 1))
        moe = MoEConfig(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(_uniform(cfg, "moe_topk", 1)),
                        moe_intermediate_size=inter,
                        shared_expert_intermediate_size=shared if cfg.get("use_mixed_mlp_moe", True) else 0,
                        norm_topk_prob=True, weighs_experts_in_float32=True, router_in_float32=True)
    elif arch == PHIMOE:  # experts in every layer, intermediate_size wide, two a token by SparseMixer
        if int(cfg.get("num_experts_per_tok", 2)) != 2:
            raise ValueError(f"num_experts_per_tok {cfg['num_experts_per_tok']}: SparseMixer chooses two experts")
        moe = MoEConfig(num_experts=int(cfg.get("num_local_experts", 16)), num_experts_per_tok=2,
                        moe_intermediate_size=int(cfg["intermediate_size"]), scoring="sparsemixer",
                        jitter_eps=float(cfg.get("router_jitter_noise", 0.01)))
    elif arch == AFMOE:
        # After its first num_dense_layers, experts chosen by sigmoid score plus a learnt bias, weighed by the score
        # renormalized and scaled by route_scale (DeepSeek-V3's routing in one group), beside shared experts.
        inter = int(cfg["moe_intermediate_size"])
        moe = MoEConfig(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=inter,
                        shared_expert_intermediate_size=inter * int(cfg.get("num_shared_experts", 2)),
                        norm_topk_prob=True, dense_layers=frozenset(range(int(cfg.get("num_dense_layers", 1)))),
                        weighs_experts_in_float32=True, scoring="sigmoid",
                        routed_scaling_factor=float(cfg.get("route_scale", 1.0)))
    elif arch in (OLMOE, FLEX_OLMO):  # experts in every layer, intermediate_size wide, routed as Qwen's
        moe = MoEConfig(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=int(cfg["intermediate_size"]),
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    elif arch == ERNIE45_MOE:
        # Experts in every moe_layer_interval-th layer from moe_layer_start_index to moe_layer_end_index (-1: the
        # last), ungated shared experts beside them.
        inter, num_experts = int(cfg.get("moe_intermediate_size", 1536)), int(cfg.get("moe_num_experts", 64))
        start, end = int(cfg.get("moe_layer_start_index", 1)), int(cfg.get("moe_layer_end_index", -1))
        end, interval = num_layers - 1 if end == -1 else end, int(cfg.get("moe_layer_interval", 1))
        moe = MoEConfig(num_experts=num_experts, num_experts_per_tok=int(cfg.get("moe_k", 6)),
                        moe_intermediate_size=inter,
                        shared_expert_intermediate_size=inter * int(cfg.get("moe_num_shared_experts", 2)),
                        norm_topk_prob=True, router_in_float32=True, choice_bias=True,
                        dense_layers=frozenset(i for i in range(num_layers)
                                               if (i + 1) % interval or not start <= i <= end))
    elif arch == DEEPSEEK_V2:
        # transformers' V2 router: softmax, the top-k within the best groups with group_limited_greedy,
        # the weights scaled but not renormalized.
        inter, grouped = int(cfg["moe_intermediate_size"]), cfg.get("topk_method") == "group_limited_greedy"
        moe = MoEConfig(num_experts=int(cfg["n_routed_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                        moe_intermediate_size=inter,
                        shared_expert_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
                        dense_layers=frozenset(range(int(cfg.get("first_k_dense_replace") or 0))),
                        weighs_experts_in_float32=True, router_in_float32=True,
                        num_groups=int(cfg["n_group"]) if grouped else 1,
                        topk_groups=int(cfg["topk_group"]) if grouped else 1,
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0))
    elif arch == LLAMA4:
        # MoE layers (moe_layers, else every interleave_moe_layer_step-th), each with one ungated shared expert.
        step, num_experts, inter = int(cfg.get("interleave_moe_layer_step") or 1), int(cfg["num_local_experts"]), \
            int(cfg["intermediate_size"])
        sparse = cfg.get("moe_layers")
        sparse = set(range(step - 1, num_layers, step) if sparse is None else sparse)
        moe = MoEConfig(num_experts=num_experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 1),
                        moe_intermediate_size=inter, shared_expert_intermediate_size=inter,
                        dense_layers=frozenset(set(range(num_layers)) - sparse), scoring="sigmoid_of_top_k",
                        weighs_inputs=True)
    elif arch == GPT_OSS:
        moe = MoEConfig(num_experts=int(cfg["num_local_experts"]),
                        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 4),
                        moe_intermediate_size=int(cfg["intermediate_size"]), scoring="softmax_of_top_k",
                        has_biases=True, swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))
    else:
        return MoEConfig()
    if not 0 < moe.num_experts_per_tok <= moe.num_experts:
        raise ValueError(f"num_experts_per_tok {moe.num_experts_per_tok} must be in [1, {moe.num_experts}]")
    per_group = moe.num_experts // moe.num_groups
    if moe.num_experts % moe.num_groups or not 0 < moe.topk_groups <= moe.num_groups or (
            moe.scoring == "sigmoid" and per_group < 2):  # a group is scored by its best two
        raise ValueError(f"{moe.num_experts} experts cannot make {moe.num_groups} groups of two or more, of which "
                         f"{moe.topk_groups} are chosen")
    return moe


def _uniform(cfg: dict, key: str, default: object) -> object:
    """config.json's `key`, one value or one a layer (Hunyuan's lists): ValueError where the layers differ."""
    value = cfg.get(key, default)
    if not isinstance(value, list):
        return value
    if len(set(value)) != 1:
        raise ValueError(f"{key} {value} differs by layer; Baton's experts are alike in every layer")
    return value[0]


def _grouped_dense_layers(cfg: dict, first_k_dense: int) -> frozenset[int]:
    """The dense layers of a GLM-4.5 or DeepSeek-V3 kind of MoE: `mlp_layer_types`' "dense" ones (GLM-4.7-Flash's
    config gives them so), else the first `first_k_dense`."""
    types = cfg.get("mlp_layer_types")
    if types is None:
        return frozenset(range(first_k_dense))
    if len(types) != int(cfg["num_hidden_layers"]) or not set(types) <= {"dense", "sparse"}:
        raise ValueError("mlp_layer_types must name every layer's MLP 'dense' or 'sparse'")
    return frozenset(i for i, kind in enumerate(types) if kind == "dense")
