"""Model architectures, keyed by the `architectures` entry of config.json."""
from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

# Mistral and Qwen2 are Llama with a sliding window or q/k/v biases; ModelConfig carries both.
MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
