"""`load_model_config`: a Hugging Face `config.json` read into a `ModelConfig` (engine/model_config.py),
or refused with a `ModelConfigError` that names what Baton does not serve."""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.apertus1p5_config import APERTUS1P5_TEXT, READ_AS as APERTUS1P5_READ_AS, apertus1p5_keys
from engine.architectures import (
    APERTUS,
    APERTUS_DEFAULTS,
    ARCEE,
    ATTENTION_BIAS,
    BARE_MODELS,
    BITNET,
    COHERE,
    COHERE2,
    COHERE_COMPASS,
    COHERES,
    CWM,
    CWM_DEFAULTS,
    EPS_1E5,
    ERNIE45S,
    GEMMA,
    GEMMA2,
    GEMMA2_SOFTCAPS,
    GEMMAS,
    GLM4,
    GLMS,
    GPT2,
    GPT_BIGCODE,
    GPTNEOX,
    GRANITES,
    HELIUM,
    JAIS2,
    MIMO,
    MINICPM3,
    MLA_MODELS,
    NANOCHAT,
    NEMOTRON,
    OLMO,
    OPT,
    PHI,
    PROJECTION_NORMED,
    QK_NORM,
    SEED_OSS,
    SEQUENCE_CLASSIFIERS,
    SMOLLM3,
    SOLAR_OPEN,
    STABLELM,
    STARCODER2,
    SUPPORTED_ARCHITECTURES,
    VAULTGEMMA,
)
from engine.attention_layout import (
    attention_scale,
    layer_rope_thetas,
    llama4_attention,
    local_rope_theta,
    local_rotary_dim,
    q_temperature,
    rope_layers,
    sliding_layers,
    sliding_window,
)
from engine.axk1_config import AXK1, axk1_keys
from engine.axk2_config import AXK2, READ_AS as AXK2_READ_AS, axk2_keys
from engine.bailing_hybrid_config import BAILING_HYBRID, bailing_hybrid_keys, forget_gate_bound
from engine.beam_config import BEAM, beam_keys
from engine.bitnet_weights import bitnet_weights
from engine.bloom_config import BLOOM, bloom_keys
from engine.checkpoint import read_model_config
from engine.classifier_config import classifier_labels, classifier_tokens
from engine.cohere2_moe_config import COHERE2_MOE, cohere2_moe_keys, read_cohere2_moe_layout
from engine.config import stored_dtype
from engine.dbrx_config import DBRX, dbrx_keys
from engine.encoder_config import ENCODERS, read_encoder_config, sentence_transformers_pooling
from engine.falcon_config import FALCON, falcon_keys, falcon_norms
from engine.falcon_h1_config import read_mup
from engine.flint_config import FLINT, flint_keys
from engine.fp8_weights import fp8_weights
from engine.gemma3n_config import GEMMA3N, gemma3n_keys, read_altup
from engine.gemma4_config import (
    GEMMA4,
    GEMMA4_TEXT_DEFAULTS,
    GEMMA4_UNIFIED,
    gemma4_unified_keys,
    read_gemma4_layout,
)
from engine.gpt_neo_config import GPT_NEO, gpt_neo_keys
from engine.gptj_config import GPTJ, gptj_keys
from engine.hy_v3_config import HY_V3, hy_v3_keys
from engine.hy_v4_config import HY_V4, hy_v4_keys, read_hyper_connections
from engine.hyperclovax_config import HYPERCLOVAX
from engine.int4_weights import int4_weights
from engine.kolibri1_config import KOLIBRI1, kolibri1_keys
from engine.laguna_config import LAGUNA, laguna_keys, read_laguna_layout
from engine.linear_attention_config import (
    HYBRID_LINEAR,
    KIMI_LINEAR,
    OLMO_HYBRID,
    kimi_linear_keys,
    read_kimi_linear,
    read_linear_attention,
    read_olmo_hybrid,
)
from engine.longcat_flash_config import LONGCAT_FLASH, longcat_flash_keys
from engine.mamba1_config import FALCON_MAMBA, JAMBA, MAMBA_LM, mamba_keys, read_jamba, read_mamba
from engine.mamba_config import (
    BAMBA,
    FALCON_H1,
    MAMBA2_LM,
    NEMOTRON_H,
    read_bamba,
    read_falcon_h1,
    read_mamba2,
    read_mamba2_lm,
    read_nemotron_h,
)
from engine.mellum_config import MELLUM, mellum_keys
from engine.mimo_v2_flash_config import MIMO_V2_FLASH, mimo_v2_flash_keys, read_mimo_v2_flash_layout
from engine.minimax_config import MINIMAX, MINIMAX_RELEASES, minimax_release_keys, read_minimax
from engine.minimax_m3_config import MINIMAX_M3, minimax_m3_keys, read_block_sparse_indexer
from engine.mla_config import read_mla_config
from engine.model_config import ModelConfig
from engine.moe_config import (
    AFMOE,
    GLM4_MOE,
    GPT_OSS,
    GRANITE_HYBRID,
    GRANITE_SWAS,
    LLAMA4,
    MINIMAX_M2,
    PHIMOE,
    MoEConfig,
    read_moe_config,
)
from engine.mpt_config import MPT, mpt_keys
from engine.multimodal import MULTIMODAL, text_config
from engine.mxfp4_weights import is_mxfp4
from engine.persimmon_config import PERSIMMON
from engine.qwen4_exp_config import QWEN4_EXP, qwen4_exp_layer_types, qwen4_exp_output_gate, read_qwen4_exp
from engine.rope_config import (
    HUNYUANS,
    PHI3,
    mrope_interleaved,
    mrope_section,
    partial_rotary_factor,
    rope_scaling,
    rope_theta_of,
)
from engine.sarvam_config import READ_AS as SARVAM_READ_AS, sarvam_architecture, sarvam_keys
from engine.short_conv_config import LFM2, LFM2_MOE, LFM2S, LFM3, lfm2_intermediate_size, read_short_conv
from engine.step3p7_config import STEP3P7, read_step3p7_layout, step3p7_keys
from engine.zamba2_config import ZAMBA2, read_zamba2, zamba2_keys

# A model's architecture: that whose config keys and layers it has
READ_AS = {**SARVAM_READ_AS, **APERTUS1P5_READ_AS, **AXK2_READ_AS, GEMMA4_UNIFIED: GEMMA4,
           **dict.fromkeys(MINIMAX_RELEASES, MINIMAX)}
READ_AS_KEYS = {**{arch: functools.partial(sarvam_keys, arch=arch) for arch in SARVAM_READ_AS},
                APERTUS1P5_TEXT: apertus1p5_keys, AXK2: axk2_keys, GEMMA4_UNIFIED: gemma4_unified_keys,
                **dict.fromkeys(MINIMAX_RELEASES, minimax_release_keys)}


class ModelConfigError(ValueError):
    pass


def load_model_config(model_dir: str | Path, hf_overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """config.json's model, `hf_overrides` (vLLM's) in place of its own keys."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path}: not found (a model directory needs config.json)")
    try:
        cfg = read_model_config(model_dir, hf_overrides)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: invalid JSON: {e}") from e
    archs = cfg.get("architectures") or []
    known = (*SUPPORTED_ARCHITECTURES, *MULTIMODAL, *BARE_MODELS, *SEQUENCE_CLASSIFIERS, *ENCODERS, *READ_AS)
    arch = next((a for a in archs if a in known), None)
    if arch is None:
        raise ModelConfigError(
            f"{path}: unsupported architecture {archs or cfg.get('model_type')!r}; supported: {', '.join(known)}")
    if arch in ENCODERS:
        return _encoder_model_config(cfg, arch, model_dir)
    try:
        labels = classifier_labels(cfg) if arch in SEQUENCE_CLASSIFIERS else ()
        head_tokens = classifier_tokens(cfg) if arch in SEQUENCE_CLASSIFIERS else ()
        # A classifier reads its input's last token, as transformers' does, whatever a Pooling module says.
        pooling = "last" if arch in SEQUENCE_CLASSIFIERS else sentence_transformers_pooling(model_dir) or "last"
    except ValueError as e:
        raise ModelConfigError(f"{path}: {e}") from None
    # No LM head of their own, but a classifier made from its rows keeps the causal LM's.
    is_bare = arch in BARE_MODELS or (arch in SEQUENCE_CLASSIFIERS and not head_tokens)
    arch = BARE_MODELS.get(arch) or SEQUENCE_CLASSIFIERS.get(arch) or arch
    multimodal, vision = MULTIMODAL.get(arch), None
    if multimodal is not None:  # its text model is served, and its images where it has an image encoder here
        try:
            vision = multimodal.vision_config(cfg) if multimodal.vision_config is not None else None
            cfg, arch = text_config(cfg, arch)
        except ValueError as e:
            raise ModelConfigError(f"{path}: {e}") from None
        if arch not in (*SUPPORTED_ARCHITECTURES, *READ_AS):
            raise ModelConfigError(f"{path}: the text model of {archs[0]} is not one Baton serves "
                                   f"(model_type {cfg.get('model_type')!r})")
    # Models read as others whose keys and layers theirs are (Sarvam's, Apertus 1.5's, A.X K2's), served as their own
    served_as = sarvam_architecture(cfg, arch) or (arch if arch in READ_AS else None)
    if served_as is not None:
        try:
            cfg, arch = READ_AS_KEYS[served_as](cfg), READ_AS[served_as]
        except ValueError as e:
            raise ModelConfigError(f"{path}: {e}") from None
    gemma4 = altup = None
    if arch in (GEMMA4, GEMMA3N):
        cfg = {**GEMMA4_TEXT_DEFAULTS, **cfg} if arch == GEMMA4 else gemma3n_keys(cfg)
        try:
            gemma4 = read_gemma4_layout(cfg, forces_last_full=arch == GEMMA4)
            altup = read_altup(cfg) if arch == GEMMA3N else None
        except ValueError as e:
            raise ModelConfigError(f"{path}: {e}") from None
    if arch == KIMI_LINEAR:
        cfg = kimi_linear_keys(cfg)
    if arch == BAILING_HYBRID:
        cfg = bailing_hybrid_keys(cfg)
    if arch in (LONGCAT_FLASH, MINIMAX_M3, STEP3P7):
        try:
            cfg = {LONGCAT_FLASH: longcat_flash_keys, MINIMAX_M3: minimax_m3_keys, STEP3P7: step3p7_keys}[arch](cfg)
        except ValueError as e:
            raise ModelConfigError(f"{path}: {e}") from None
    if arch == OPT:
        cfg = _opt_keys(cfg, path)
    if arch in (GPT2, GPT_BIGCODE):
        cfg = _gpt2_keys(cfg, path)
    if arch == GPT_BIGCODE and cfg.get("multi_query", True):  # one k and v head for all
        cfg = {**cfg, "num_key_value_heads": 1}
    if arch in (FALCON, BLOOM, MPT, GPTJ, GPT_NEO, DBRX, HY_V3, LAGUNA, MELLUM, MIMO_V2_FLASH, COHERE2_MOE, KOLIBRI1,
                FLINT, AXK1, HY_V4, ZAMBA2, BEAM, MAMBA_LM, FALCON_MAMBA, MAMBA2_LM):
        try:
            cfg = {FALCON: falcon_keys, BLOOM: bloom_keys, MPT: mpt_keys, GPTJ: gptj_keys, GPT_NEO: gpt_neo_keys,
                   DBRX: dbrx_keys, HY_V3: hy_v3_keys, LAGUNA: laguna_keys,
                   MELLUM: mellum_keys, MIMO_V2_FLASH: mimo_v2_flash_keys, COHERE2_MOE: cohere2_moe_keys,
                   KOLIBRI1: kolibri1_keys, FLINT: flint_keys, AXK1: axk1_keys, HY_V4: hy_v4_keys,
                   ZAMBA2: zamba2_keys, BEAM: beam_keys, MAMBA_LM: mamba_keys, FALCON_MAMBA: mamba_keys,
                   MAMBA2_LM: functools.partial(mamba_keys, ties_embeddings=False)}[arch](cfg)
        except ValueError as e:
            raise ModelConfigError(f"{path}: {e}") from None
    if arch == GPTNEOX:  # older configs' (Pythia's) names of RoPE's part of a head and its base
        older = {"partial_rotary_factor": cfg.get("rotary_pct"), "rope_theta": cfg.get("rotary_emb_base")}
        cfg = {**{key: value for key, value in older.items() if value is not None}, **cfg}
    if arch in (CWM, APERTUS) and not (cfg.get("rope_parameters") or cfg.get("rope_scaling") or cfg.get("rope_theta")):
        cfg = {**(CWM_DEFAULTS if arch == CWM else APERTUS_DEFAULTS), **cfg}
    if arch == CWM and cfg.get("eos_token_id") is None:
        cfg = {**cfg, "eos_token_id": CWM_DEFAULTS["eos_token_id"]}
    linear_attention = None
    if arch == QWEN4_EXP:
        cfg = {**cfg, "layer_types": qwen4_exp_layer_types(cfg)}
    if arch in (*HYBRID_LINEAR, KIMI_LINEAR, BAILING_HYBRID, OLMO_HYBRID, QWEN4_EXP):
        try:
            linear_attention = read_kimi_linear(cfg) if arch in (KIMI_LINEAR, BAILING_HYBRID) else \
                read_olmo_hybrid(cfg) if arch == OLMO_HYBRID else read_linear_attention(cfg, arch)
            if arch == QWEN4_EXP:
                linear_attention = dataclasses.replace(linear_attention, output_gate=qwen4_exp_output_gate(cfg))
            if arch == BAILING_HYBRID:
                linear_attention = dataclasses.replace(linear_attention, forget_gate_bound=forget_gate_bound(cfg))
        except ValueError as e:
            raise ModelConfigError(f"{path}: {e}") from None
    try:
        bitnet = bitnet_weights(cfg)
    except ValueError as e:
        raise ModelConfigError(f"{path}: {e}") from None
    if bitnet is not None and arch != BITNET:
        raise ModelConfigError(f"{path}: BitNet's ternary weights are read for {BITNET} only, not {arch}")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    supported_act = "gelu_pytorch_tanh" if arch in (*GEMMAS, GEMMA4, GEMMA3N, GEMMA, STARCODER2, PHI, BLOOM) else "silu"
    if arch == PHI and act == "gelu_new":  # Phi's name of GELU's tanh approximation, the same numbers
        act = "gelu_pytorch_tanh"
    if arch == OPT:  # its MLP's (fc1, the activation, fc2)
        supported_act = "relu"
    if arch in (GPT2, GPT_BIGCODE, GPTJ, GPT_NEO):  # "gelu_new": GELU's tanh approximation
        act = {"gelu_new": "gelu_pytorch_tanh"}.get(act, act)
        supported_act = "gelu_pytorch_tanh"
    if arch in (FALCON, MPT, ZAMBA2):  # its MLP's exact GELU (Zamba2's gating it)
        supported_act = "gelu"
    if arch == GPTNEOX:  # its MLP's GELU, exact (Pythia's), or with the tanh approximation
        act = {"gelu_new": "gelu_pytorch_tanh", "gelu_fast": "gelu_pytorch_tanh"}.get(act, act)
        supported_act = act if act in ("gelu", "gelu_pytorch_tanh") else "gelu"
    if arch == GEMMA and act == "gelu":  # Gemma's releases' legacy name of it, transformers reads it so
        act = "gelu_pytorch_tanh"
    if arch == NEMOTRON_H:  # its MLPs' (up, squared ReLU, down); its Mamba-2 layers' SiLU is their own
        act, supported_act = cfg.get("mlp_hidden_act", "relu2"), "relu2"
    if arch in (ARCEE, JAIS2, NANOCHAT, NEMOTRON, PERSIMMON, BITNET):  # squared ReLU: transformers' default for it
        act, supported_act = cfg.get("hidden_act") or "relu2", "relu2"
    if arch == APERTUS:  # its MLP's: up, xIELU (engine/models/apertus.py), down
        act, supported_act = cfg.get("hidden_act") or "xielu", "xielu"
    if act != supported_act:
        raise ModelConfigError(f"{path}: unsupported hidden_act {act!r} for {arch} (only {supported_act})")
    softcaps = {name: cfg.get(name, GEMMA2_SOFTCAPS[name] if arch in (GEMMA2, VAULTGEMMA) else None)
                for name in GEMMA2_SOFTCAPS}
    if arch == NANOCHAT:  # its logits capped at 15 unless it says (transformers' default); its attention's not
        softcaps = {"attn_logit_softcapping": None, "final_logit_softcapping": cfg.get("final_logit_softcapping", 15.0)}
    if arch in (GEMMA4, GEMMA3N):  # its attention scores are not capped (transformers reads no such setting for it)
        softcaps["attn_logit_softcapping"] = None
    for name, cap in softcaps.items():
        beams = arch == BEAM and name == "final_logit_softcapping"  # (Beam's logits capped too)
        if cap is not None and arch not in (*GEMMAS, GEMMA4, GEMMA3N, NANOCHAT) and not beams:
            raise ModelConfigError(f"{path}: {name} is not supported for {arch} (Gemma's and Beam's only)")
        if cap is not None and not float(cap) > 0:
            raise ModelConfigError(f"{path}: {name} must be positive, got {cap}")
    # Gemma 4's full layers turn part of a head by a RoPE of their own (engine/gemma4_config.py); latent attention
    # turns its qk_rope_head_dim (Mistral 4's config gives that as a part of its whole q/k head).
    partial = 1.0 if arch in (GEMMA4, GEMMA3N, *MLA_MODELS, LFM3) else 0.5 if arch == BAMBA else \
        partial_rotary_factor(cfg, 0.5 if arch in (GLM4_MOE, *GLMS, PHI, NEMOTRON, PERSIMMON) else
                              0.25 if arch in (STABLELM, GPTNEOX) else 1.0)
    if arch == MINIMAX_M2 and cfg.get("rotary_dim"):  # as released: the dimensions turned, not their part
        partial = int(cfg["rotary_dim"]) / int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if partial != 1.0 and arch not in (PHI3, GLM4_MOE, MINIMAX_M2, MINIMAX_M3, MINIMAX, *GLMS, *HYBRID_LINEAR,
                                       QWEN4_EXP, BAMBA, STABLELM, PHI, GPTNEOX, STEP3P7, NEMOTRON, GPTJ, LAGUNA,
                                       MIMO_V2_FLASH, PERSIMMON):
        raise ModelConfigError(f"{path}: partial_rotary_factor {partial} is not supported for {arch} "
                               f"(Phi-3's, GLM-4's, GLM-4.5's, MiniMax-M2's, Qwen3-Next's and Qwen3.5's only)")
    try:
        scaling = None if arch in (GEMMA4, GEMMA3N) else rope_scaling(cfg, arch)
    except ValueError as e:
        raise ModelConfigError(f"{path}: {e}") from None
    section = mrope_section(cfg)
    rotated = int(int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) * partial)
    if section is not None and sum(section) * 2 != rotated:
        raise ModelConfigError(f"{path}: mrope_section {list(section)} must split the frequencies RoPE turns "
                               f"({rotated // 2} a head)")
    minimax = None
    if arch == MINIMAX:
        try:
            minimax = read_minimax(cfg)
        except ValueError as e:
            raise ModelConfigError(f"{path}: {e}") from None
    mamba1 = None
    if arch in (JAMBA, MAMBA_LM, FALCON_MAMBA):
        try:
            mamba1 = read_jamba(cfg) if arch == JAMBA else read_mamba(cfg, arch)
        except ValueError as e:
            raise ModelConfigError(f"{path}: {e}") from None
    short_conv = None
    if arch in LFM2S:
        if arch == LFM2_MOE and not cfg.get("use_expert_bias", True):
            raise ModelConfigError(f"{path}: LFM2-MoE's routing without its expert bias (use_expert_bias false) is "
                                   "not supported")
        try:
            short_conv = read_short_conv(cfg)
        except ValueError as e:
            raise ModelConfigError(f"{path}: {e}") from None
    mamba = mup = zamba2 = None
    if arch in (GRANITE_HYBRID, NEMOTRON_H, FALCON_H1, BAMBA, ZAMBA2, MAMBA2_LM):
        try:
            if arch == ZAMBA2:
                mamba, zamba2 = read_zamba2(cfg)
            else:
                mamba = {GRANITE_HYBRID: read_mamba2, NEMOTRON_H: read_nemotron_h, FALCON_H1: read_falcon_h1,
                         BAMBA: read_bamba, MAMBA2_LM: read_mamba2_lm}[arch](cfg)
            mup = read_mup(cfg) if arch == FALCON_H1 else None
        except ValueError as e:
            raise ModelConfigError(f"{path}: {e}") from None
        if arch == NEMOTRON_H:  # its layers' count is its pattern's
            cfg = {**cfg, "num_hidden_layers": len(mamba.layer_types)}
    if arch == PHI and cfg.get("qk_layernorm"):
        raise ModelConfigError(f"{path}: qk_layernorm is not supported for {arch} (no released Phi sets it)")
    if cfg.get("clip_qkv") is not None and arch not in (OLMO, MPT, DBRX):  # OLMoE's: its releases leave it off
        raise ModelConfigError(f"{path}: clip_qkv is not supported for {arch} (OLMo's, MPT's and DBRX's only)")
    if cfg.get("use_bidirectional_attention") and arch != GEMMA4:
        raise ModelConfigError(f"{path}: use_bidirectional_attention is not supported (a decoder attends causally)")
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        # (GPT-NeoX's and Persimmon's heads are every one q's, k's and v's, whatever num_key_value_heads says)
        num_kv_heads = num_heads if arch in (GPTNEOX, PERSIMMON) else int(cfg.get("num_key_value_heads") or num_heads)
        # Cohere 2's is its width's share whatever config.json says (transformers sets it so).
        head_dim = hidden // num_heads if arch == COHERE2 else int(cfg.get("head_dim") or hidden // num_heads)
        rotary_dim = int(head_dim * partial)
        mla = read_mla_config(cfg, arch) if arch in MLA_MODELS else None
        if served_as == AXK2:
            mla = dataclasses.replace(mla, output_gate=True)
        if mla is not None:  # the pages hold the latent, one row a token for every head (kernels/mla_attention.py)
            num_kv_heads, head_dim, rotary_dim = 1, mla.page_head_dim, mla.qk_rope_head_dim
        if gemma4 is not None:  # its pages' heads, which hold either kind of layer's
            num_kv_heads, head_dim = gemma4.page_heads, gemma4.page_head_dim
            rotary_dim = head_dim
        qwen4_exp = read_qwen4_exp(cfg, head_dim, rotary_dim, linear_attention.layer_types) \
            if arch == QWEN4_EXP else None
        minimax_m3 = read_block_sparse_indexer(cfg, num_kv_heads, head_dim, rotary_dim) if arch == MINIMAX_M3 else None
        step3p7 = read_step3p7_layout(cfg) if arch == STEP3P7 else None
        hyper_connections = read_hyper_connections(cfg) if arch == HY_V4 else None
        # their layers' own q heads, their sliding layers' own RoPE width
        per_layer = arch in (STEP3P7, LAGUNA, MIMO_V2_FLASH)
        config = ModelConfig(
            architecture=served_as or arch,
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            # Llama 4's dense layers' own; its experts' is intermediate_size (MoEConfig).
            intermediate_size=lfm2_intermediate_size(cfg) if arch == LFM2 else int(cfg[_mlp_width_key(cfg, arch)]),
            vocab_size=int(cfg["vocab_size"]),
            gated_norm_rank=int(cfg["gated_norm_rank"]) if served_as == AXK2 else None,
            output_vocab_size=int(cfg["output_vocab_size"]) if served_as == APERTUS1P5_TEXT
            and cfg.get("output_vocab_size") not in (None, cfg["vocab_size"]) else None,
            rms_norm_eps=float(cfg.get(_eps_key(arch), _default_eps(arch))),
            rope_theta=layer_rope_thetas(cfg, arch)[0] or rope_theta_of(cfg, arch, head_dim),
            rope_scaling=scaling,
            local_rope_theta=local_rope_theta(cfg, arch),
            rope_layers=rope_layers(cfg, arch),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            # Absent, transformers' default for the architecture: Gemma's embedding is its LM head.
            tie_word_embeddings=is_bare or bool(cfg.get("tie_word_embeddings", cfg.get(
                "tie_embedding", arch in (*GEMMAS, GEMMA, STARCODER2, OPT, GPT2, GPT_BIGCODE, SMOLLM3, *ERNIE45S,
                                          MINICPM3, *COHERES, *LFM2S)))),
            **_biases(cfg, arch),
            # Granite SWA's, Flint's and Hy4's, an extra logit a head as gpt-oss's
            attention_sinks=arch in (GPT_OSS, *GRANITE_SWAS, FLINT, HY_V4),
            qk_norm="head" if arch in (*QK_NORM, GEMMA4, GEMMA3N, *HYBRID_LINEAR, QWEN4_EXP, MINIMAX_M3, *LFM2S)
            or (arch == GLM4_MOE and cfg.get("use_qk_norm")) else
            "projection" if arch in PROJECTION_NORMED else "head_after_rope" if arch in (*HUNYUANS, NANOCHAT) else
            "head_layer_norm" if (arch == COHERE and cfg.get("use_qk_norm"))
            or (arch == STABLELM and cfg.get("qk_layernorm")) else
            "head_shared_layer_norm" if arch == PERSIMMON and cfg.get("qk_layernorm", True) else None,
            moe=read_moe_config(cfg, arch),
            sliding_window=sliding_window(cfg, arch),
            sliding_layers=sliding_layers(cfg, arch) if gemma4 is None else
            frozenset(i for i, kind in enumerate(gemma4.layer_types) if kind == "sliding_attention"),
            **llama4_attention(cfg, arch),
            q_temperature=q_temperature(cfg, arch),
            multimodal=multimodal,
            vision=vision,
            labels=labels,
            decoder_pooling=pooling,
            classifier_tokens=head_tokens,
            classifier_difference=bool(cfg.get("is_original_qwen3_reranker")),
            hidden_act=act,
            mlp_gated=arch not in (ARCEE, STARCODER2, JAIS2, NEMOTRON, APERTUS, PHI, GPTNEOX, OPT, GPT2, GPT_BIGCODE,
                                   NANOCHAT, FALCON, BLOOM, MPT, GPTJ, GPT_NEO, PERSIMMON),
            lm_head_bias=arch in (PHI, GPTJ) or (arch == PHIMOE and bool(cfg.get("lm_head_bias"))),
            parallel_residual=arch in (PHI, GPTJ) or (arch in (STABLELM, GPTNEOX) and bool(
                cfg.get("use_parallel_residual", arch == GPTNEOX)))
            or (arch == FALCON and falcon_norms(cfg) > 0),
            parallel_norms=falcon_norms(cfg) if arch == FALCON and falcon_norms(cfg) else 1,
            attention_scale=attention_scale(cfg, arch, head_dim, mla, scaling),
            mla=mla,
            **{name: None if cap is None else float(cap) for name, cap in softcaps.items()},
            **_granite_multipliers(cfg, arch),
            weights_dtype=str(stored_dtype(cfg) or "float32"),
            fp8_weights=fp8_weights(cfg),
            mxfp4_weights=is_mxfp4(cfg),
            int4_weights=int4_weights(cfg),
            bitnet=bitnet,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(model_dir, cfg),
            mrope_section=section,
            mrope_interleaved=mrope_interleaved(cfg) or (multimodal is not None and multimodal.interleaved_mrope),
            gemma4=gemma4,
            altup=altup,
            linear_attention=linear_attention,
            mamba=mamba,
            zamba2=zamba2,
            short_conv=short_conv,
            mup=mup,
            mamba1=mamba1,
            minimax=minimax,
            qwen4_exp=qwen4_exp,
            minimax_m3=minimax_m3,
            step3p7=step3p7,
            hyper_connections=hyper_connections,
            layer_num_heads=tuple(cfg["num_attention_heads_per_layer"]) if per_layer else None,
            local_rotary_dim=local_rotary_dim(cfg, head_dim) if per_layer else None,
            laguna=read_laguna_layout(cfg) if arch == LAGUNA else None,
            mimo_v2_flash=read_mimo_v2_flash_layout(cfg) if arch == MIMO_V2_FLASH else None,
            cohere2_moe=read_cohere2_moe_layout(cfg) if arch == COHERE2_MOE else None,
            logit_scale=_logit_scale(cfg, arch),
            clip_qkv=float(cfg["clip_qkv"]) if arch in (OLMO, MPT, DBRX) and cfg.get("clip_qkv") is not None else None,
            alibi="bloom" if arch == BLOOM else "mpt" if arch == MPT else None,
            block_post_norms=arch == HYPERCLOVAX and bool(cfg.get("use_post_norm", True)),
        )
    except KeyError as e:
        raise ModelConfigError(f"{path}: missing field {e.args[0]!r}") from e
    except ValueError as e:
        raise ModelConfigError(f"{path}: {e}") from None
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ModelConfigError(f"{path}: partial_rotary_factor {partial} turns {rotary_dim} of {head_dim} "
                               "dimensions a head; RoPE needs an even number, at least 2")
    if scaling is not None and scaling["rope_type"] == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(scaling.get(name) or ()) != rotary_dim // 2:
                raise ModelConfigError(f"{path}: longrope's {name} needs {rotary_dim // 2} numbers, one a frequency")
    # (Gemma 4's num_kv_heads are its pages' heads: each kind of layer's own heads are grouped)
    for kv_heads in (gemma4.sliding.num_kv_heads, gemma4.full.num_kv_heads) if gemma4 is not None else (num_kv_heads,):
        if num_heads % kv_heads:
            raise ModelConfigError(f"{path}: num_attention_heads {num_heads} not divisible by "
                                   f"num_key_value_heads {kv_heads}")
    return config


def _encoder_model_config(cfg: dict, arch: str, model_dir: Path) -> ModelConfig:
    """A BERT-family encoder's: what a decoder has and it has not (experts; RoPE and windows but ModernBERT's) left
    out."""
    path = model_dir / "config.json"
    try:
        encoder = read_encoder_config(cfg, arch, model_dir)
        hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim, num_layers = hidden // num_heads, int(cfg["num_hidden_layers"])
        return ModelConfig(
            architecture=arch, hidden_size=hidden, num_layers=num_layers, num_heads=num_heads,
            num_kv_heads=num_heads, head_dim=head_dim, rotary_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=encoder.layer_norm_eps, rope_theta=encoder.rope_theta, rope_scaling=None,
            local_rope_theta=encoder.local_rope_theta or None, rope_layers=frozenset(),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 512)) - encoder.position_offset,
            tie_word_embeddings=True, qkv_bias=encoder.attention_bias, o_bias=encoder.attention_bias,
            mlp_bias=encoder.mlp_bias, qk_norm=None, moe=MoEConfig(), mla=None, sliding_window=encoder.sliding_window,
            sliding_layers=frozenset(i for i in range(num_layers) if i % encoder.global_every),
            attention_chunk_size=None, chunked_layers=frozenset(), qk_l2_norm=False, rope_interleaved=False,
            q_temperature=None, attention_sinks=False, multimodal=None, vision=None, hidden_act=encoder.hidden_act,
            attention_scale=head_dim ** -0.5, attn_logit_softcapping=None, final_logit_softcapping=None,
            embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0,
            weights_dtype=str(stored_dtype(cfg) or "float32"), fp8_weights=None, mxfp4_weights=False,
            int4_weights=None, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos_ids(model_dir, cfg),
            labels=classifier_labels(cfg) if encoder.head else (), encoder=encoder)
    except KeyError as e:
        raise ModelConfigError(f"{path}: missing field {e.args[0]!r}") from e
    except (ValueError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path}: {e}") from None


def _mlp_width_key(cfg: dict, arch: str) -> str:
    """config.json's width of the dense MLP: Llama 4's own key; Granite 4.0's without experts its shared MLP's."""
    if arch == LLAMA4:
        return "intermediate_size_mlp"
    if arch == GRANITE_HYBRID and not int(cfg.get("num_local_experts") or 0):
        return "shared_intermediate_size"
    if arch == COHERE2_MOE:  # its dense prefix's; its experts' and shared ones' intermediate_size
        return "prefix_dense_intermediate_size"
    if "intermediate_size" not in cfg and "moe_intermediate_size" in cfg:  # experts alone (Qwen4-Exp's): unused
        return "moe_intermediate_size"
    return "intermediate_size"


def _eps_key(arch: str) -> str:
    return "layer_norm_eps" if arch in COHERES else "layer_norm_epsilon" if arch == NEMOTRON_H else \
        "norm_eps" if arch == NEMOTRON else \
        "norm_eps" if arch in LFM2S else "norm_epsilon" if arch == STARCODER2 else \
        "layer_norm_eps" if arch in (JAIS2, STABLELM, PHI, GPTNEOX, PERSIMMON) else \
        "layer_norm_epsilon" if arch in (FALCON, BLOOM, MPT, GPTJ, GPT_NEO) else "rms_norm_eps"


def _default_eps(arch: str) -> float:
    """transformers' rms_norm_eps for the architecture, where config.json leaves it out."""
    return 1e-5 if arch in EPS_1E5 else 1.5625e-7 if arch == GLM4 else 1e-8 if arch == HELIUM else 1e-6


def _biases(cfg: dict, arch: str) -> dict:
    """Where the architecture's layers have biases (on q, k and v; on o; on gate, up and down), as config.json's
    switches for it say."""
    if arch in ERNIE45S:  # one switch for them all
        return dict.fromkeys(("qkv_bias", "o_bias", "mlp_bias"), bool(cfg.get("use_bias")))
    if arch in GLMS:  # on q, k and v unless it says
        return dict(qkv_bias=bool(cfg.get("attention_bias", True)), o_bias=False, mlp_bias=False)
    if arch in (PHI, GPT2, GPT_BIGCODE, PERSIMMON):  # everywhere
        return dict.fromkeys(("qkv_bias", "o_bias", "mlp_bias"), True)
    if arch == GPTJ:  # on its MLP alone (and its LM head)
        return dict(qkv_bias=False, o_bias=False, mlp_bias=True)
    if arch == GPT_NEO:  # on o and its MLP
        return dict(qkv_bias=False, o_bias=True, mlp_bias=True)
    if arch in (BLOOM, MPT, DBRX):  # BLOOM's everywhere; MPT's (whatever no_bias says, as transformers reads them)
        # and DBRX's nowhere
        return dict.fromkeys(("qkv_bias", "o_bias", "mlp_bias"), arch == BLOOM)
    if arch == FALCON:  # everywhere by bias (off unless it says), but its layer norms' always
        return dict.fromkeys(("qkv_bias", "o_bias", "mlp_bias"), bool(cfg.get("bias", False)))
    if arch == OPT:  # everywhere by enable_bias
        return dict.fromkeys(("qkv_bias", "o_bias", "mlp_bias"), bool(cfg.get("enable_bias", True)))
    if arch == GPTNEOX:  # on its attention by attention_bias (on unless it says), always on its MLP
        attention = bool(cfg.get("attention_bias", True))
        return dict(qkv_bias=attention, o_bias=attention, mlp_bias=True)
    if arch == STABLELM:  # on q, k and v by use_qkv_bias alone
        return dict(qkv_bias=bool(cfg.get("use_qkv_bias")), o_bias=False, mlp_bias=False)
    if arch in (HELIUM, SOLAR_OPEN):  # on q, k and v by attention_bias; its o has none
        return dict(qkv_bias=bool(cfg.get("attention_bias")), o_bias=False, mlp_bias=bool(cfg.get("mlp_bias")))
    if arch == STARCODER2:  # one switch for them all, on unless it says
        return dict.fromkeys(("qkv_bias", "o_bias", "mlp_bias"), bool(cfg.get("use_bias", True)))
    if arch == ZAMBA2:  # its MLP's by add_bias_linear (zamba2_keys), its attention's none
        return dict(qkv_bias=False, o_bias=False, mlp_bias=bool(cfg.get("mlp_bias")))
    if arch in (FALCON_H1, BAMBA, LFM3):
        attention = bool(cfg.get("attention_bias"))
        return dict(qkv_bias=attention, o_bias=attention, mlp_bias=bool(cfg.get("mlp_bias")))
    if arch == SEED_OSS:  # q, k and v's on unless it says, o's a switch of its own
        return dict(qkv_bias=bool(cfg.get("attention_bias", True)), o_bias=bool(cfg.get("attention_out_bias")),
                    mlp_bias=bool(cfg.get("mlp_bias")))
    attention = bool(cfg.get("attention_bias"))
    return dict(
        qkv_bias=arch in ("Qwen2ForCausalLM", MIMO)
        or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True)))
        or (arch in (*ATTENTION_BIAS, GLM4_MOE, *MLA_MODELS) and attention),
        o_bias=arch in (*ATTENTION_BIAS, *MLA_MODELS) and attention,
        mlp_bias=arch in ("LlamaForCausalLM", "GraniteForCausalLM", SMOLLM3, ARCEE, JAIS2, NEMOTRON)
        and bool(cfg.get("mlp_bias")))


def _opt_keys(cfg: dict, path: Path) -> dict:
    """OPT's config.json read by the usual names (its MLP's width `ffn_dim`, its activation `activation_function`, no
    RoPE); ModelConfigError for its layouts Baton does not serve."""
    for key, served, what in (("do_layer_norm_before", True, "norms after each block (opt-350m's)"),
                              ("layer_norm_elementwise_affine", True, "layer norms without weights"),
                              ("_remove_final_layer_norm", False, "no final norm")):
        if bool(cfg.get(key, served)) != served:
            raise ModelConfigError(f"{path}: {key} {cfg[key]}: OPT with {what} is not supported")
    if int(cfg.get("word_embed_proj_dim") or cfg["hidden_size"]) != int(cfg["hidden_size"]):
        raise ModelConfigError(f"{path}: word_embed_proj_dim {cfg['word_embed_proj_dim']} (embeddings projected in and "
                               "out of the hidden size, opt-350m's) is not supported")
    return {**cfg, "intermediate_size": cfg["ffn_dim"], "hidden_act": cfg.get("activation_function", "relu"),
            "num_key_value_heads": cfg["num_attention_heads"]}  # (every head its own k and v)


def _gpt2_keys(cfg: dict, path: Path) -> dict:
    """GPT-2's config.json read by the usual names (n_embd, n_head, n_layer, n_positions, n_inner: four times the width
    where null; its layer norms' layer_norm_epsilon); ModelConfigError for its options Baton does not serve."""
    if cfg.get("scale_attn_by_inverse_layer_idx") or not cfg.get("scale_attn_weights", True):
        raise ModelConfigError(f"{path}: GPT-2's attention scaled otherwise than by head_dim ** -0.5 "
                               "(scale_attn_weights, scale_attn_by_inverse_layer_idx) is not supported")
    hidden = int(cfg.get("n_embd", 768))
    return {**cfg, "hidden_size": hidden, "num_attention_heads": cfg.get("n_head", 12),
            "num_key_value_heads": cfg.get("n_head", 12), "num_hidden_layers": cfg.get("n_layer", 12),
            "max_position_embeddings": cfg.get("n_positions", 1024),
            "intermediate_size": cfg.get("n_inner") or 4 * hidden,
            "hidden_act": cfg.get("activation_function", "gelu_new"),
            "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5)}


def _granite_multipliers(cfg: dict, arch: str) -> dict:
    names = ("embedding_multiplier", "residual_multiplier", "logits_scaling")
    if arch == AFMOE:  # Trinity's muP: its embeddings times sqrt(hidden_size), where mup_enabled
        return dict.fromkeys(names, 1.0) | (
            {"embedding_multiplier": int(cfg["hidden_size"]) ** 0.5} if cfg.get("mup_enabled") else {})
    if arch == MINICPM3:  # MiniCPM's, transformers' defaults (MiniCPM3-4B's) where config.json leaves them out
        depth, base = cfg.get("scale_depth", 1.4), cfg.get("dim_model_base", 256)
        layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
        return {"embedding_multiplier": float(cfg.get("scale_emb", 12)),
                "residual_multiplier": 1.0 if depth is None else float(depth) / layers ** 0.5,
                "logits_scaling": 1.0 if base is None else hidden / float(base)}
    if arch not in GRANITES:
        return dict.fromkeys(names, 1.0)
    multipliers = {name: float(cfg.get(name, 1.0)) for name in names}
    if arch == HYPERCLOVAX:  # its logits multiplied by logits_scaling, where Granite's are divided
        multipliers["logits_scaling"] = 1.0 / multipliers["logits_scaling"]
    return multipliers


def _eos_ids(model_dir: Path, cfg: dict) -> tuple[int, ...]:
    # generation_config.json is what HF generate() stops on; config.json is the fallback.
    eos = cfg.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        try:
            eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{gen_path}: invalid JSON: {e}") from e
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _logit_scale(cfg: dict, arch: str) -> float:
    """Cohere's logits' scale: config.json's, else transformers' default (North's: none)."""
    if arch not in COHERES:
        return 1.0
    given = cfg.get("logit_scale", None if arch == COHERE_COMPASS else 0.0625)
    return 1.0 if given is None else float(given)
