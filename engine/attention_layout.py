"""How a decoder's layers attend, read from its config.json: which turn q and k by RoPE, and with
which theta; which attend over a sliding window or a chunk only; q's temperature by position; the
softmax's scale. A setting Baton cannot serve is a ValueError (load_model_config names the file)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.architectures import (
    COHERE2,
    COHERE_COMPASS,
    COHERES,
    CWM,
    ERNIE45S,
    EXAONES,
    GEMMA2,
    GEMMA3,
    GEMMAS,
    GLMS,
    GPT2,
    GPT_BIGCODE,
    GRANITES,
    HELIUM,
    MINISTRAL,
    MINISTRAL3,
    MISTRAL_SLIDING,
    OLMO3,
    OPT,
    QWENS,
    SMOLLM3,
    VAULTGEMMA,
)
from engine.beam_config import BEAM
from engine.bloom_config import BLOOM
from engine.cohere2_moe_config import COHERE2_MOE, dense_rope_layers
from engine.flint_config import FLINT
from engine.gemma3n_config import GEMMA3N
from engine.gemma4_config import GEMMA4
from engine.gpt_neo_config import GPT_NEO
from engine.gptj_config import GPTJ
from engine.hyperclovax_config import HYPERCLOVAX
from engine.kolibri1_config import KOLIBRI1
from engine.laguna_config import LAGUNA
from engine.linear_attention_config import KIMI_LINEAR
from engine.mamba1_config import FALCON_MAMBA, JAMBA, MAMBA_LM
from engine.mamba_config import MAMBA2_LM, NEMOTRON_H
from engine.mellum_config import MELLUM
from engine.mimo_v2_flash_config import MIMO_V2_FLASH
from engine.mla_config import MLAConfig
from engine.moe_config import AFMOE, DOTS1, GPT_OSS, GRANITE_HYBRID, GRANITE_SWAS, LLAMA4, MISTRAL4
from engine.mpt_config import MPT
from engine.rope_config import LAYER_TYPES, rope_parameters, rope_theta, yarn_temperature
from engine.short_conv_config import LFM3
from engine.step3p7_config import STEP3P7
from engine.zamba2_config import ZAMBA2


@dataclass(frozen=True)
class QTemperature:
    """q scaled by 1 + scale * ln(1 + floor((position + offset) / floor_scale)) after RoPE, so that its
    attention sharpens as the context grows: Llama 4's NoPE layers (its attn_temperature_tuning),
    Ministral 3's every layer (llama_4_scaling_beta)."""

    floor_scale: float
    scale: float
    offset: int
    layers: frozenset[int] | None  # None: every layer
    # Beam's scalable softmax instead: q scaled by (1 + (position + offset) / floor_scale) ** scale, no floor taken.
    power: bool = False


def attention_scale(cfg: dict, arch: str, head_dim: int, mla: MLAConfig | None, scaling: dict | None) -> float:
    if mla is not None:
        # DeepSeek's YaRN also sharpens the softmax, by its mscale squared.
        scale = mla.qk_head_dim ** -0.5
        if scaling is not None and scaling["rope_type"] == "yarn" and scaling.get("mscale_all_dim"):
            scale *= yarn_temperature(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
        return scale
    if arch in (*GEMMAS, STEP3P7):
        return float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5
    if arch == ZAMBA2:  # its heads read twice the hidden size, scaled as half as wide
        return (head_dim / 2) ** -0.5
    if arch == GPT_NEO:  # its scores unscaled
        return 1.0
    if arch == MPT:  # its attn_config's, where it gives one
        return float(cfg.get("softmax_scale") or head_dim ** -0.5)
    if arch in (GEMMA4, GEMMA3N):  # its q and k normed per head set the scores' size
        return 1.0
    if arch == HYPERCLOVAX:  # null or absent, head_dim ** -0.5
        return float(cfg.get("attention_multiplier") or head_dim ** -0.5)
    if arch in GRANITES:  # absent, transformers' default: 1, not head_dim ** -0.5
        return float(cfg.get("attention_multiplier", 1.0))
    return head_dim ** -0.5


def layer_rope_thetas(cfg: dict, arch: str) -> tuple[float | None, float | None]:
    """Granite SWA's `layer_rope_theta` (a theta a layer, 0 for none) as Baton's two RoPEs: the full layers' theta and
    the sliding-window layers' own where it differs (None: none given, or the same); ValueError where they take
    more than that."""
    thetas = cfg.get("layer_rope_theta")
    if arch not in GRANITE_SWAS or thetas is None:
        return None, None
    if len(thetas) != int(cfg["num_hidden_layers"]):
        raise ValueError(f"layer_rope_theta needs a theta for each of the {cfg['num_hidden_layers']} layers")
    windowed = sliding_layers(cfg, arch)
    full, local = ({float(t) for i, t in enumerate(thetas) if t and (i in windowed) == sliding} for sliding in (0, 1))
    if len(full) > 1 or len(local) > 1:
        raise ValueError(f"layer_rope_theta {thetas}: Baton turns the full layers by one theta and the sliding-window "
                         "layers by one")
    full_theta, local_theta = next(iter(full or local), None), next(iter(local), None)
    if local_theta == full_theta:
        return full_theta, None
    if rope_parameters(cfg, "full_attention").get("rope_type", "default") != "default":
        raise ValueError("a scaled RoPE with a theta of the sliding-window layers' own is not supported")
    return full_theta, local_theta


def local_rope_theta(cfg: dict, arch: str) -> float | None:
    if arch in GRANITE_SWAS:
        return layer_rope_thetas(cfg, arch)[1]
    if arch not in (GEMMA3, OLMO3, LFM3, STEP3P7, LAGUNA, MELLUM, MIMO_V2_FLASH, COHERE_COMPASS):
        return None
    params = rope_parameters(cfg, "sliding_attention")
    if params.get("rope_type", "default") != "default":
        raise ValueError("a scaled RoPE for sliding-window layers is not supported")
    # Absent, Gemma 3's is rope_local_base_freq; OLMo 3's the model's theta, unscaled.
    unset = cfg.get("rope_local_base_freq", 10000.0) if arch == GEMMA3 else full_rope_theta(cfg)
    return float(params.get("rope_theta", unset))


def local_rotary_dim(cfg: dict, head_dim: int) -> int:
    """The dimensions of a head the sliding-window layers' own RoPE turns, by their type's partial_rotary_factor
    (Step-3.7's, Laguna's)."""
    return int(head_dim * float(rope_parameters(cfg, "sliding_attention").get("partial_rotary_factor", 1.0)))


def full_rope_theta(cfg: dict) -> float:
    return rope_theta(cfg, rope_parameters(cfg, "full_attention"))


def rope_layers(cfg: dict, arch: str) -> frozenset[int]:
    num_layers = int(cfg["num_hidden_layers"])
    if arch in (AFMOE, BEAM):  # its sliding-window layers alone
        return sliding_layers(cfg, arch)
    if arch == COHERE2_MOE:  # its sliding-window layers, and its dense ones where it says
        return sliding_layers(cfg, arch) | dense_rope_layers(cfg)
    # full layers without RoPE
    if arch in (COHERE2, FLINT) or (arch in (*EXAONES, KOLIBRI1) and sliding_window(cfg, arch) is not None):
        return sliding_layers(cfg, arch) if sliding_window(cfg, arch) is not None else frozenset()
    if arch == COHERE_COMPASS:  # the layers of a type with RoPE parameters (a type's null: no RoPE)
        types = cfg.get("layer_types") or ["full_attention"] * num_layers
        nested = any(t in (cfg.get("rope_parameters") or {}) for t in LAYER_TYPES)
        return frozenset(i for i, t in enumerate(types) if not nested or cfg["rope_parameters"].get(t))
    if arch == LFM3:  # its attention layers alone (a convolution reads no positions)
        return frozenset(i for i, kind in enumerate(cfg["layer_types"]) if kind != "conv")
    if arch in GRANITE_SWAS and cfg.get("layer_rope_theta") is not None:  # theta 0: NoPE
        return frozenset(i for i, theta in enumerate(cfg["layer_rope_theta"]) if theta)
    if arch == ZAMBA2:  # its shared blocks' RoPE where use_mem_rope says
        return frozenset(range(num_layers)) if cfg.get("use_mem_rope") else frozenset()
    learnt = (OPT, GPT2, GPT_BIGCODE, GPT_NEO, BLOOM, MPT)  # their positions learnt instead, or ALiBi's
    pure_recurrent = (MAMBA_LM, FALCON_MAMBA, MAMBA2_LM)
    nope = arch in (NEMOTRON_H, JAMBA, KIMI_LINEAR, *pure_recurrent, *learnt) or \
        cfg.get("position_embedding_type") == "nope"
    if nope and arch in (GRANITE_HYBRID, NEMOTRON_H, JAMBA, KIMI_LINEAR, *pure_recurrent, *learnt):
        return frozenset()  # NoPE
    if arch not in (SMOLLM3, LLAMA4):
        return frozenset(range(num_layers))
    # SmolLM3's and Llama 4's NoPE layers: a 0 in no_rope_layers, else every no_rope_layer_interval-th layer.
    uses_rope = cfg.get("no_rope_layers") or [
        int((i + 1) % int(cfg.get("no_rope_layer_interval") or 4) != 0) for i in range(num_layers)]
    return frozenset(i for i, flag in enumerate(uses_rope) if flag)


def llama4_attention(cfg: dict, arch: str) -> dict:
    if arch != LLAMA4:  # Ernie 4.5's, GLM-4's and Cohere's q and k hold RoPE's pairs side by side too
        return dict(attention_chunk_size=None, chunked_layers=frozenset(), qk_l2_norm=False,
                    rope_interleaved=arch in (*ERNIE45S, *GLMS, *COHERES, HELIUM, GPTJ) and arch != COHERE_COMPASS)
    with_rope = rope_layers(cfg, arch)
    chunk = cfg.get("attention_chunk_size")
    types = cfg.get("layer_types") or ["chunked_attention" if i in with_rope and chunk else "full_attention"
                                       for i in range(int(cfg["num_hidden_layers"]))]
    return dict(attention_chunk_size=int(chunk) if chunk else None,
                chunked_layers=frozenset(i for i, t in enumerate(types) if t == "chunked_attention") if chunk
                else frozenset(),
                qk_l2_norm=bool(cfg.get("use_qk_norm", True)), rope_interleaved=True)


def q_temperature(cfg: dict, arch: str) -> QTemperature | None:
    if arch == LLAMA4 and cfg.get("attn_temperature_tuning", True):
        nope_layers = frozenset(range(int(cfg["num_hidden_layers"]))) - rope_layers(cfg, arch)
        return QTemperature(floor_scale=float(cfg.get("floor_scale", 8192)), scale=float(cfg.get("attn_scale", 0.1)),
                            offset=1, layers=nope_layers)
    if arch == BEAM:  # its full layers', which have no RoPE
        full = frozenset(range(int(cfg["num_hidden_layers"]))) - rope_layers(cfg, arch)
        return QTemperature(floor_scale=2048.0, scale=0.1, offset=1, layers=full, power=True)
    beta = rope_parameters(cfg, "full_attention").get("llama_4_scaling_beta")
    if arch in (MINISTRAL3, MISTRAL4) and beta is not None:
        original = rope_parameters(cfg, "full_attention").get("original_max_position_embeddings")
        return QTemperature(floor_scale=float(original or cfg["max_position_embeddings"]), scale=float(beta),
                            offset=0, layers=None)
    return None


def sliding_window(cfg: dict, arch: str) -> int | None:
    if arch in (*MISTRAL_SLIDING, *GEMMAS, GEMMA4, GEMMA3N, OLMO3, GPT_OSS, STEP3P7, GPT_NEO, LAGUNA, MELLUM,
                MIMO_V2_FLASH, KOLIBRI1, FLINT, BEAM):
        return cfg.get("sliding_window")
    if arch == LFM3:
        return cfg.get("sliding_window", 256)
    if arch in (*EXAONES, COHERE2, COHERE2_MOE, COHERE_COMPASS):  # absent, transformers' default
        return cfg.get("sliding_window", 4096)
    if arch in GRANITE_SWAS:
        return cfg.get("sliding_window", 128)
    if arch == CWM:
        return cfg.get("sliding_window", 8192) or None
    if arch == AFMOE:
        return cfg.get("sliding_window", 1024)
    if arch == MINISTRAL:  # absent, transformers' default
        return cfg.get("sliding_window", 4096)
    if arch == SMOLLM3:
        return cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if arch == DOTS1:  # absent, transformers' default, for the layers from max_window_layers on (if any)
        window = cfg.get("sliding_window", 4096)
        return window if window is not None and sliding_layers(cfg, arch) else None
    if arch in QWENS and cfg.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported")
    return None


def sliding_layers(cfg: dict, arch: str) -> frozenset[int]:
    num_layers = int(cfg["num_hidden_layers"])
    if arch not in (*GEMMAS, OLMO3, SMOLLM3, GPT_OSS, *EXAONES, COHERE2, COHERE2_MOE, LFM3, DOTS1, *GRANITE_SWAS, AFMOE,
                    CWM, STEP3P7, MINISTRAL, GPT_NEO, LAGUNA, MELLUM, MIMO_V2_FLASH, KOLIBRI1, FLINT, COHERE_COMPASS,
                    BEAM):
        return frozenset(range(num_layers))
    types = cfg.get("layer_types")
    if types:
        return frozenset(i for i, t in enumerate(types) if t == "sliding_attention")
    if arch == MINISTRAL:  # transformers': every layer, where there is a window
        return frozenset(range(num_layers))
    if arch == COHERE_COMPASS:  # transformers': every layer full
        return frozenset()
    if arch == DOTS1:  # transformers': windowed from max_window_layers on, where there is a window
        first = int(cfg.get("max_window_layers", 62))
        return frozenset(range(first, num_layers)) if cfg.get("sliding_window", 4096) is not None else frozenset()
    if arch in EXAONES:  # its pattern a count ("every fourth full") or a string of them ("LLLG": L sliding, G full)
        pattern = cfg.get("sliding_window_pattern", 4) if sliding_window(cfg, arch) is not None else 0
        if isinstance(pattern, str):
            return frozenset(i for i in range(num_layers) if pattern[i % len(pattern)] == "L")
        return frozenset(i for i in range(num_layers) if pattern and (i + 1) % int(pattern))
    if arch == AFMOE:  # every global_attn_every_n_layers-th full
        every = int(cfg.get("global_attn_every_n_layers") or 4)
        return frozenset(i for i in range(num_layers) if (i + 1) % every)
    if arch in (*GRANITE_SWAS, CWM):  # every fourth layer full, from the first
        return frozenset(i for i in range(num_layers) if i % 4)
    if arch == SMOLLM3:  # windowed where it is on, in the NoPE layers
        return frozenset(range(num_layers)) - rope_layers(cfg, arch)
    # Older configs: every `sliding_window_pattern`-th layer attends over everything (Gemma 2's every
    # other, OLMo 3's every fourth).
    default_pattern = {GEMMA2: 2, GEMMA3: 6, OLMO3: 4, GPT_OSS: 2, COHERE2: 4, VAULTGEMMA: 2}[arch]
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default_pattern)
    return frozenset(i for i in range(num_layers) if (i + 1) % pattern)
