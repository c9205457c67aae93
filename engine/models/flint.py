"""Flint (FlintForCausalLM; engine/flint_config.py): Qwen3-MoE's layers with gpt-oss's sinks and an ungated shared
expert, read by its release's names."""
from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class FlintForCausalLM(LlamaForCausalLM):
    renames = ((".self_attn.softmax_offset", ".self_attn.sinks"), (".mlp.shared_expert.", ".mlp.shared_experts."))
