"""Sarvam AI's Sarvam-30B (SarvamMoEForCausalLM; model_type sarvam_moe) and Sarvam-105B (SarvamMLAForCausalLM;
sarvam_mla) config.json read as transformers reads them: GLM-4.5's model and DeepSeek-V3's, under their original
configs' names (`num_experts`, `num_shared_experts`, `use_qkv_bias`) and with transformers' defaults where they differ
from those models' (Sarvam-30B's RoPE over whole heads at theta 8e6; Sarvam-105B's groups of one), Sarvam-105B's
`head_dim` of vLLM's MLA dropped and its `deepseek_yarn` RoPE read as YaRN. transformers saves them under GLM-4.5's and
DeepSeek-V3's architectures with these model types; Sarvam-30B's checkpoints name its tensors its own way
(engine/models/glm4_moe.py's SarvamMoEForCausalLM)."""
from __future__ import annotations

from engine.moe_config import DEEPSEEK_V3, GLM4_MOE

SARVAM_MOE, SARVAM_MLA = "SarvamMoEForCausalLM", "SarvamMLAForCausalLM"
MODEL_TYPES = {"sarvam_moe": SARVAM_MOE, "sarvam_mla": SARVAM_MLA}
READ_AS = {SARVAM_MOE: GLM4_MOE, SARVAM_MLA: DEEPSEEK_V3}  # the model whose config keys and layers theirs are
ALIASES = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts",
           "use_qkv_bias": "attention_bias", "num_mtp_layers": "num_nextn_predict_layers"}
# transformers' SarvamMoEConfig and SarvamMLAConfig defaults where they differ from GLM-4.5's and DeepSeek-V3's.
DEFAULTS = {SARVAM_MOE: dict(vocab_size=262144, intermediate_size=8192, num_hidden_layers=19, num_attention_heads=64,
                             num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6, moe_intermediate_size=1024,
                             num_experts_per_tok=6, routed_scaling_factor=2.5, use_qk_norm=True, n_group=1,
                             topk_group=1, first_k_dense_replace=1),
            SARVAM_MLA: dict(vocab_size=262144, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32,
                             num_attention_heads=64, n_routed_experts=128, q_lora_rank=None, n_group=1, topk_group=1,
                             first_k_dense_replace=1)}
MOE_ROPE = {"rope_type": "default", "rope_theta": 8_000_000.0, "partial_rotary_factor": 1.0}


def sarvam_architecture(cfg: dict, arch: str) -> str | None:
    """Sarvam's architecture where config.json is one of theirs (as released, or as transformers saves it); None
    else."""
    if arch in READ_AS:
        return arch
    served = MODEL_TYPES.get(cfg.get("model_type"))
    return served if served is not None and READ_AS[served] == arch else None


def sarvam_keys(cfg: dict, arch: str) -> dict:
    """`cfg` in the keys of the model it is read as (READ_AS), with transformers' defaults filled in."""
    cfg = {**DEFAULTS[arch], **{ALIASES.get(key, key): value for key, value in cfg.items()}}
    if arch == SARVAM_MOE:
        rope = cfg.get("rope_parameters") or {key: cfg[key] for key in ("rope_theta", "partial_rotary_factor")
                                              if key in cfg}
        return {**cfg, "rope_parameters": {**MOE_ROPE, **rope}}
    cfg.pop("head_dim", None)  # kv_lora_rank + qk_rope_head_dim, for vLLM's MLA; the model derives its own
    cfg.pop("q_head_dim", None)
    scaling = cfg.get("rope_scaling") or {}
    if "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
        cfg["rope_scaling"] = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn"}
    return cfg
