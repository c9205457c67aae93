"""NAVER's HyperCLOVA X SEED (HyperCLOVAXForCausalLM) config.json read as transformers reads it: Granite's layers and
muP scalings, but logits multiplied by `logits_scaling` (Granite divides), attention scaled by `attention_multiplier`
or, null or absent, head_dim ** -0.5, and each block's output RMS-normed before it joins the residual where
`use_post_norm` says (Peri-LN, on unless it says). Its model is engine/models/granite.py's."""
from __future__ import annotations

HYPERCLOVAX = "HyperCLOVAXForCausalLM"
