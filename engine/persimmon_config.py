"""Adept's Persimmon-8B (PersimmonForCausalLM, Fuyu's text model) config.json read as transformers reads it: GPT-NeoX's
layers one after the other, q, k and v fused each head's three in turn, q and k layer-normed a head by one LayerNorm
for all heads (`qk_layernorm`), RoPE over half of each head, an ungated MLP of squared ReLU, biases everywhere. Its
model is engine/models/layer_norm_llama.py's PersimmonForCausalLM."""
from __future__ import annotations

PERSIMMON = "PersimmonForCausalLM"
