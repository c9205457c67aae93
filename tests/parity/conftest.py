"""Tiny Hugging Face checkpoints made by `transformers` itself, one per architecture.

Wide random init (std 0.2) plus noisy norm weights and biases, so a wrong RoPE
pairing, an ignored norm weight, a dropped bias or a wrong GQA head mapping
each change the greedy tokens.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import tensor_parallel_workers
from tests.services.preloaded_python import spawn

transformers = pytest.importorskip("transformers")

SHARED_MODELS = Path(__file__).resolve().parents[3] / "shared" / "models"

COMMON = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)

LONGROPE_ORIGINAL_CONTEXT = 512  # past the longest generic prompt and its output (300 + 32)

# Gated DeltaNet's heads in the tiny hybrid models (Qwen3.5, Qwen3-Next), and their experts.
LINEAR_HEADS = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
HYBRID_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=40)

# Granite 4.0-H's Mamba-2 layers, tiny.
MAMBA_HEADS = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                   mamba_expand=2)

# name → (config class name, extra config, save options)
TINY_MODELS = {
    "llama-gqa-untied": ("LlamaConfig", dict(tie_word_embeddings=False), {}),
    "llama3-rope-tied": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        ),
        {},
    ),
    "llama-linear-rope-bf16": (
        "LlamaConfig",
        dict(rope_scaling={"rope_type": "linear", "factor": 4.0}, num_key_value_heads=1),
        {"dtype": torch.bfloat16},
    ),
    "mistral-sharded": ("MistralConfig", dict(sliding_window=None), {"max_shard_size": "100KB"}),
    "mistral-window": ("MistralConfig", dict(sliding_window=48), {}),
    # Ministral 8B: windowed layers beside full ones, as layer_types says.
    "ministral": ("MinistralConfig", dict(sliding_window=48, layer_types=["sliding_attention", "full_attention"],
                                         head_dim=16), {}),
    "qwen2-bias": ("Qwen2Config", dict(tie_word_embeddings=False), {}),
    # Llama's optional biases: attention_bias on q, k, v and o; mlp_bias on gate, up and down.
    "llama-biases": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True), {}),
    # An explicit head_dim unlike hidden_size / heads (Qwen3 configs give one); its q/k norms are noised too.
    "qwen3-qk-norm": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True), {}),
    # Qwen's long-context setting: YaRN over an original context shorter than the prompts here.
    # Experts: top-2 of 4, one dense layer among them (Qwen3-MoE's mlp_only_layers).
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         mlp_only_layers=[1], norm_topk_prob=True), {}),
    # Qwen2-MoE: top-2 of 4 with a shared expert beside them, its own sigmoid gate; q/k/v biases;
    # every second layer sparse (decoder_sparse_step), so the first is dense.
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=40, decoder_sparse_step=2,
                                         num_hidden_layers=3), {}),
    # GLM-4.5: the first layer dense, then 8 experts in 4 groups (2 chosen), 2 experts a token by
    # sigmoid score and a correction bias, scaled; a shared expert; RoPE over half of each head; q/k norms.
    "glm4-moe": ("Glm4MoeConfig", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                       n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                       first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
                                       num_hidden_layers=3, pad_token_id=0), {}),
    # Sarvam-30B: GLM-4.5's model with RoPE over whole heads (theta 8e6), q and k normed a head, its checkpoint's
    # q/k/v fused and its tensors named its own way (as transformers saves it); Sarvam-105B: DeepSeek-V3's.
    "sarvam-moe": ("SarvamMoEConfig", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                           n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                                           head_dim=16, num_hidden_layers=3, pad_token_id=0), {}),
    "sarvam-mla": ("SarvamMLAConfig", dict(
        q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, num_hidden_layers=3, pad_token_id=0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}), {}),
    # dots.llm1: Qwen3's attention (q/k normed per head, biases here), the first layer dense, then experts routed
    # as DeepSeek-V3's in groups beside a shared one; layers from max_window_layers on windowed.
    "dots1": ("Dots1Config", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                  n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                  first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True,
                                  sliding_window=16, max_window_layers=2, num_hidden_layers=3, pad_token_id=0), {}),
    # DeepSeek-V3: multi-head latent attention (q through a rank-32 latent, k and v from a rank-24
    # one, RoPE over 8 of each head's 24 q/k dimensions, interleaved in the weights; v 20 wide),
    # YaRN with DeepSeek's mscale; the first layer dense, then 8 experts in 4 groups.
    "deepseek-v3": ("DeepseekV3Config", dict(
        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
        num_hidden_layers=3, pad_token_id=0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}), {}),
    # LongCat-Flash: 2 layers of two latent-attention sublayers each (q and the latent scaled by sqrt(hidden / rank),
    # YaRN's mscale on the scores; head_dim its RoPE's), 4 real experts and 2 that compute nothing beside each pair,
    # 2 a token by softmax score plus a learnt bias.
    "longcat-flash": ("LongcatFlashConfig", dict(
        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
        head_dim=8, num_key_value_heads=4, num_hidden_layers=4, n_routed_experts=4, zero_expert_num=2, moe_topk=2,
        expert_ffn_hidden_size=48, routed_scaling_factor=2.0, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "beta_fast": 32, "beta_slow": 1}), {}),
    # MiniMax-M3's text model: a dense layer then experts (2 of 4 a token beside a shared one, clamped GLUs), Gemma's
    # norms; its second and fourth layers block-sparse, each KV head's group of a query over the 3 blocks of 8 keys
    # whose best key its indexer head scores best, the query's own block among them (the 300-token prompts see 38).
    "minimax-m3": ("MiniMaxM3VLTextConfig", dict(
        intermediate_size=48, num_hidden_layers=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        dense_intermediate_size=96, shared_intermediate_size=40, routed_scaling_factor=2.0, index_n_heads=2,
        index_head_dim=16, index_block_size=8, index_topk_blocks=3, index_local_blocks=1,
        layer_types=["full_attention", "minimax_m3_sparse"] * 2, mlp_layer_types=["dense"] + ["sparse"] * 3,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        swiglu_limit=2.0), {}),
    # MiniCPM3: DeepSeek-V2's latent attention (RoPE's pairs half apart) before dense MLPs, embeddings times 12, each
    # block's output times 1.4 / sqrt(layers), logits divided by hidden_size / 16; its LM head the embeddings.
    "minicpm3": ("MiniCPM3Config", dict(
        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
        num_key_value_heads=4, dim_model_base=16, pad_token_id=0), {}),
    # Falcon-40B's and 180B's layout: attention (2 KV heads, each a group's q heads, k and v fused a group at a time)
    # beside an ungated GELU MLP, each from a layer norm of its own; and Falcon-7B's: one k and v head, both from one
    # norm, biases on.
    "falcon": ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=160,
                                    tie_word_embeddings=False), {}),
    "falcon-7b": ("FalconConfig", dict(multi_query=True, parallel_attn=True, ffn_hidden_size=160, bias=True), {}),
    # nanochat: norms without weights (the embeddings' too), q and k normed after RoPE turning the other way, squared
    # ReLU without a gate, logits capped at 15.
    "nanochat": ("NanoChatConfig", dict(hidden_act="relu2"), {}),
    # BitNet b1.58 (its "-bf16" master weights, no quantization_config): norms before o_proj and down_proj, squared
    # ReLU. Its ternary checkpoints: tests/parity/test_bitnet.py.
    "bitnet": ("BitNetConfig", dict(pad_token_id=0), {}),
    # DeepSeek-V3.2: V3's model, each query attending to the 8 earlier tokens its indexer (16 heads of 16, RoPE over
    # the first 8 of each) scores best (DSA). (With few heads, a query whose heads all weigh negatively scores many
    # tokens exactly 0, and which of them is chosen is the sort's whim: transformers' and ours may differ.)
    "deepseek-v3.2": ("DeepseekV32Config", dict(
        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
        num_hidden_layers=3, pad_token_id=0, index_topk=8, index_head_dim=16, index_n_heads=16,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}), {}),
    # A.X K2: V3.2's sparse attention with each head's output gated (q's up-projection fused with the gates, reading
    # q's normed latent and the latent) and norms gated by a low-rank MLP of their output; routed in one group (A.X K2
    # Light's) or in groups, the first layer dense.
    **{name: ("AXK2Config", dict(
        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, num_hidden_layers=3, pad_token_id=0,
        index_topk=8, index_head_dim=16, index_n_heads=16, gated_norm_rank=8, **groups,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}), {})
       for name, groups in (("axk2", {}), ("axk2-grouped", dict(n_group=4, topk_group=2)))},
    # GLM-5 (GlmMoeDsa): V3.2's sparse attention, its indexer's RoPE pairs side by side, layers 2 and 3 attending to the
    # tokens layer 1's indexer chose; routed in one group. (Its rms_norm_eps 1e-6: transformers norms q's and kv's
    # latents with 1e-6 whatever it says, vLLM and Baton with it.)
    "glm5": ("GlmMoeDsaConfig", dict(rms_norm_eps=1e-6,
        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, num_hidden_layers=4, pad_token_id=0,
        index_topk=8, index_head_dim=16, index_n_heads=16, indexer_types=["full", "full", "shared", "shared"]), {}),
    # Hy4 (HYV4): V3.2's sparse attention, the indexer's RoPE over the last 8 of each head, layers 2 and 3 attending to
    # the tokens layer 1's indexer chose; each head's output gated, a sink logit a head; the first layer dense, then
    # experts routed in one group, their GLUs clamped to 1.5; three hyper-connected streams (their weights at least
    # 0.05, written at most 1.5). (rms_norm_eps its default, 1e-5: its latents' norms take 1e-6 whatever it says.)
    "hy-v4": ("HYV4Config", dict(
        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, num_hidden_layers=4, pad_token_id=0,
        index_topk=8, index_head_dim=16, index_n_heads=16, indexer_types=["full", "full", "shared", "shared"],
        swiglu_limit=1.5, hc_mult=3, hc_eps=0.05, hc_magnitude=1.5), {}),
    # Beam: q and k normed a head, each head's output gated element by element (its gate biased a head); sliding
    # windows (16) with RoPE in three layers of four, the fourth without RoPE, its q scaled by position; four norms a
    # layer and depth-weighed residuals; the first layer dense, then 2 of 8 experts in the best of 2 groups; logits
    # capped at 30.
    "beam": ("BeamConfig", dict(
        head_dim=16, num_hidden_layers=4, sliding_window=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=48, n_group=2, topk_group=1, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["sliding_attention"] * 3 + ["full_attention"], pad_token_id=0), {}),
    # Gemma 3n: four AltUp streams, LAuReL of rank 8, per-layer embeddings (8 wide, a table of 256 rows: tokens past it
    # take its first), sliding windows (16) in four layers of six, the last two layers sharing their kinds' KV, each
    # layer's MLP of its own width, the first two's gates sparse.
    "gemma3n": ("Gemma3nTextConfig", dict(
        num_hidden_layers=6, head_dim=16, intermediate_size=[96, 128, 96, 128, 96, 128], sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, laurel_rank=8,
        activation_sparsity_pattern=[0.95, 0.5, 0.0, 0.0, 0.0, 0.0], pad_token_id=0), {}),
    # Gemma 4 unified (its 12B's text model): Gemma 4's layers (full ones of heads twice as wide) without per-layer
    # embeddings or experts; windows of 16.
    "gemma4-unified": ("Gemma4UnifiedTextConfig", dict(
        num_hidden_layers=4, head_dim=16, global_head_dim=32, sliding_window=16, pad_token_id=0), {}),
    # GLM-4.7-Flash (Glm4MoeLite): DeepSeek-V3's latent attention and routing in one group, scaled by 1.8, its
    # dense layers named by mlp_layer_types (here the first two).
    "glm4-moe-lite": ("Glm4MoeLiteConfig", dict(
        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        n_shared_experts=1, num_hidden_layers=3, mlp_layer_types=["dense", "dense", "sparse"], pad_token_id=0), {}),
    # Moonlight's variant of it: q through one projection, RoPE pairs half a part apart, no YaRN; a
    # cache row of odd width (8 + 23), padded in the pages.
    "deepseek-v3-q-proj": ("DeepseekV3Config", dict(
        q_lora_rank=None, kv_lora_rank=23, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        n_group=2, topk_group=1, first_k_dense_replace=1, num_hidden_layers=2, rope_interleave=False,
        pad_token_id=0), {}),
    # DeepSeek-V2: MLA with complex (interleaved) RoPE; softmax routing, 3 experts a token from the best
    # of 3 groups of 4 (more than the best experts overall would give), scaled; two shared experts;
    # YaRN with DeepSeek's mscale.
    "deepseek-v2": ("DeepseekV2Config", dict(
        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_key_value_heads=4, n_routed_experts=12, num_experts_per_tok=3, moe_intermediate_size=48,
        n_shared_experts=2, topk_method="group_limited_greedy", n_group=3, topk_group=1, routed_scaling_factor=1.5,
        first_k_dense_replace=1, num_hidden_layers=3, pad_token_id=0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                      "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}), {}),
    # DeepSeek-V2-Lite's routing: softmax top-k over all experts, no groups, no query projection rank.
    "deepseek-v2-lite": ("DeepseekV2Config", dict(
        q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        n_shared_experts=2, topk_method="greedy", first_k_dense_replace=1, num_hidden_layers=2, pad_token_id=0), {}),
    # Llama 4: chunked attention (chunks of 16) with q/k L2 norms in its RoPE layers (llama3-scaled,
    # pairs side by side), the fourth layer NoPE with attention temperature (floor_scale 8); experts in
    # every other layer, 2 of 4 by sigmoid, weighing their inputs, beside a shared expert.
    "llama4": ("Llama4TextConfig", dict(
        num_hidden_layers=4, head_dim=16, intermediate_size=48, intermediate_size_mlp=96, num_local_experts=4,
        num_experts_per_tok=2, interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=8, attn_scale=0.1,
        pad_token_id=0, rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                         "rope_theta": 10000.0}), {}),
    # Ministral 3: YaRN, and q scaled by 1 + beta ln(1 + floor(position / original context)) after RoPE.
    "ministral3": ("Ministral3Config", dict(
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                         "llama_4_scaling_beta": 0.1, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "rope_theta": 10000.0}), {}),
    # gpt-oss: attention sinks, sliding windows (16) in every other layer, YaRN; 2 of 4 experts a token
    # by the softmax of the top router logits, experts with biases and the GLU clamped (to 0.5, so
    # that the clamps bite in a tiny model).
    "gpt-oss": ("GptOssConfig", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=16,
        swiglu_limit=0.5,
        num_hidden_layers=2, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 10000.0}), {}),
    # MiniMax-M2: q and k normed over whole projections, RoPE over half of each head (the released config's
    # rotary_dim), 2 of 4 experts a token by sigmoid score plus a correction bias, renormalized.
    "minimax-m2": ("MiniMaxM2Config", dict(head_dim=16, intermediate_size=48, num_local_experts=4,
                                           num_experts_per_tok=2, rotary_dim=8, pad_token_id=0), {}),
    # Seed-OSS: biases on q, k and v (its default) and on o (attention_out_bias).
    "seed-oss": ("SeedOssConfig", dict(head_dim=16, attention_out_bias=True, pad_token_id=0), {}),
    # Ernie 4.5: biases everywhere (use_bias), RoPE's pairs side by side in q and k.
    "ernie4.5": ("Ernie4_5Config", dict(head_dim=16, use_bias=True, pad_token_id=0), {}),
    # Ernie 4.5 MoE (21B-A3B): 2 of 4 experts by softmax score plus a correction bias, from the second layer on,
    # beside an ungated shared expert; RoPE pairs side by side.
    "ernie4.5-moe": ("Ernie4_5_MoeConfig", dict(
        head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=48, moe_num_shared_experts=1,
        moe_layer_start_index=1, num_hidden_layers=3, pad_token_id=0), {}),
    # HunYuan dense (Hunyuan-0.5B to 7B): each head's q and k normed after RoPE, its base stretched by an NTK alpha;
    # attention biases.
    "hunyuan": ("HunYuanDenseV1Config", dict(head_dim=16, attention_bias=True, pad_token_id=0, rope_parameters={
        "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}), {}),
    # K-EXAONE: EXAONE 4.0's attention (q and k normed per head, windows in three layers of four, RoPE in those only)
    # in pre-norm layers, the first dense, then experts routed as DeepSeek-V3's beside shared ones.
    "exaone-moe": ("ExaoneMoeConfig", dict(head_dim=16, num_hidden_layers=4, sliding_window=16,
                                           sliding_window_pattern=4, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=48, num_shared_experts=2, n_group=4, topk_group=2,
                                           first_k_dense_replace=1, pad_token_id=0), {}),
    # Hunyuan-A13B: the dense model's attention and RoPE, experts in every layer (softmax, renormalized) beside a
    # shared MLP.
    "hunyuan-moe": ("HunYuanMoEV1Config", dict(head_dim=16, attention_bias=True, pad_token_id=0, num_experts=8,
                                               moe_topk=2, intermediate_size=48, rope_parameters={
                                                   "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                   "rope_theta": 10000.0}), {}),
    # GLM-4 (glm-4-9b-chat-hf) and GLM-4-0414 (with norms after attention and the MLP): gate and up fused, biases
    # on q, k and v, RoPE over half of each head with its pairs side by side.
    "glm": ("GlmConfig", dict(head_dim=16, pad_token_id=0), {}),
    "glm4": ("Glm4Config", dict(head_dim=16, pad_token_id=0), {}),
    # EXAONE 4: OLMo 2's norms after each block, q and k normed per head, sliding windows (16) in three layers of
    # four, RoPE (llama3-scaled) in those only.
    "exaone4": ("Exaone4Config", dict(head_dim=16, num_hidden_layers=4, sliding_window=16, sliding_window_pattern=4,
                                      pad_token_id=0, rope_parameters={
                                          "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                          "rope_theta": 10000.0}), {}),
    # Command R+: attention and the MLP side by side from one layer norm (no bias), each head's q and k layer-normed
    # by weights of its own, RoPE's pairs side by side, logits scaled; attention biases.
    "cohere": ("CohereConfig", dict(use_qk_norm=True, attention_bias=True, logit_scale=0.5, pad_token_id=0), {}),
    # Command R7B and A: sliding windows (16) in three layers of four, RoPE in those only.
    "cohere2": ("Cohere2Config", dict(num_hidden_layers=4, sliding_window=16, logit_scale=0.5, pad_token_id=0), {}),
    # OLMoE: Llama's norms, q and k normed over whole projections, 2 of 4 experts in every layer (not renormalized).
    "olmoe": ("OlmoeConfig", dict(intermediate_size=48, num_experts=4, num_experts_per_tok=2, pad_token_id=0), {}),
    # Granite 3.0/3.1 MoE: Granite's scalings, 2 of 4 experts a token by the softmax of the top logits, fused; the
    # shared variant's MLP beside them.
    "granite-moe": ("GraniteMoeConfig", dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                             embedding_multiplier=6.0, residual_multiplier=0.4,
                                             attention_multiplier=0.2, logits_scaling=3.0, pad_token_id=0), {}),
    "granite-moe-shared": ("GraniteMoeSharedConfig", dict(intermediate_size=48, num_local_experts=4,
                                                          num_experts_per_tok=2, shared_intermediate_size=40,
                                                          embedding_multiplier=6.0, residual_multiplier=0.4,
                                                          attention_multiplier=0.2, logits_scaling=3.0,
                                                          pad_token_id=0), {}),
    # Granite 4.0's attention-only checkpoints (4.0-Micro): Granite's scalings, the dense MLP named shared_mlp, NoPE.
    "granite4": ("GraniteMoeHybridConfig", dict(intermediate_size=48, shared_intermediate_size=80, num_local_experts=0,
                                                layer_types=["attention"] * 2, position_embedding_type="nope",
                                                embedding_multiplier=6.0, residual_multiplier=0.4,
                                                attention_multiplier=0.2, logits_scaling=3.0, pad_token_id=0), {}),
    # Qwen3.5's hybrid: Gated DeltaNet linear-attention layers (two value heads a key head) between full-attention
    # layers whose q heads have gates beside them, a quarter of each head turned by RoPE, norms offset from 1.
    "qwen3.5": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, head_dim=16, **LINEAR_HEADS, pad_token_id=0,
                                          layer_types=["linear_attention", "full_attention"] * 2), {}),
    # Its mixture of experts: every layer's MLP experts (stored one by one) beside a gated shared expert.
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", dict(num_hidden_layers=4, head_dim=16, **LINEAR_HEADS, **HYBRID_EXPERTS,
                                                 pad_token_id=0,
                                                 layer_types=["linear_attention", "full_attention"] * 2), {}),
    # Qwen4-Exp: Qwen3.5-MoE's layers, four residual streams mixed by hyper-connections; each attention layer's
    # query over the 4 blocks of 8 tokens its indexer scores best and the tokens after them (the 300-token prompts
    # see 37 blocks), RoPE over half a head and the indexer's head alike; Gated DeltaNet's output gated by a sigmoid.
    "qwen4-exp": ("Qwen4ExpTextConfig", dict(
        num_hidden_layers=4, head_dim=16, **LINEAR_HEADS, **HYBRID_EXPERTS, pad_token_id=0, hc_count=4, hc_lowrank=16,
        layer_types=["linear_attention", "full_attention"] * 2, indexer_n_heads=4, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=32, indexer_compress_ratio=8, output_gate_type="sigmoid",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}), {}),
    # And its per-layer n-gram embeddings before the first and second linear-attention layers: bigrams and trigrams, 2
    # heads each, into tables of primes above 96 (stored in 4 shards), a dilated convolution over 9 tokens.
    "qwen4-exp-ngrams": ("Qwen4ExpTextConfig", dict(
        num_hidden_layers=4, head_dim=16, **LINEAR_HEADS, **HYBRID_EXPERTS, pad_token_id=0, hc_count=4, hc_lowrank=16,
        layer_types=["linear_attention", "full_attention"] * 2, indexer_n_heads=4, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=32, indexer_compress_ratio=8, ple_layer_ids=[1, 3], ple_embed_dim=64,
        ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=97, make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=4, ple_conv_kernel_size=4, seed=7,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}), {}),
    # Qwen3-Next: projections grouped by key head (in_proj_qkvz, in_proj_ba), full layers by interval, a dense layer.
    "qwen3-next": ("Qwen3NextConfig", dict(num_hidden_layers=4, head_dim=16, **LINEAR_HEADS, **HYBRID_EXPERTS,
                                           full_attention_interval=2, mlp_only_layers=[2], pad_token_id=0), {}),
    # Granite 4.0-H: Mamba-2 layers (4 heads of 32, states of 16, B and C in 2 groups) between attention layers
    # without RoPE, the dense MLP under shared_mlp's names, Granite's scalings.
    "granite4-h": ("GraniteMoeHybridConfig", dict(
        intermediate_size=48, shared_intermediate_size=80, num_local_experts=0, num_hidden_layers=4,
        layer_types=["mamba", "attention"] * 2, position_embedding_type="nope", **MAMBA_HEADS,
        embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=3.0,
        pad_token_id=0), {}),
    # Its mixtures of experts (4.0-H-Tiny, -Small): experts beside the shared MLP; RoPE here; biases on the convolution
    # and the projections.
    "granite4-h-moe": ("GraniteMoeHybridConfig", dict(
        intermediate_size=48, shared_intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["mamba", "mamba", "attention"], position_embedding_type="rope", **MAMBA_HEADS,
        mamba_proj_bias=True, embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.2,
        logits_scaling=3.0, pad_token_id=0, num_hidden_layers=3), {}),
    # Nemotron-H: blocks of one mixer each, Mamba-2 (Granite's sizes), attention without RoPE, or an MLP of squared
    # ReLU, as its hybrid_override_pattern "M-*-M-" lays them out.
    "nemotron-h": ("NemotronHConfig", dict(
        layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba", "mlp"], head_dim=16, mamba_num_heads=4,
        mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4, layer_norm_epsilon=1e-5, pad_token_id=0), {}),
    # Nemotron 3 (Nano 30B-A3B): expert layers too, routed within the best of 2 groups by sigmoid score plus a
    # correction bias, a shared expert beside them; and (Super's) a latent width the routed experts compute in.
    "nemotron-h-moe": ("NemotronHConfig", dict(
        layers_block_type=["mamba", "moe", "attention", "moe"], head_dim=16, mamba_num_heads=4, mamba_head_dim=32,
        n_groups=2, ssm_state_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        moe_shared_expert_intermediate_size=40, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        moe_latent_size=32, pad_token_id=0), {}),
    # Falcon-H1: attention and Mamba-2 (4 heads of 16, states of 16, B and C in 2 groups) side by side in each layer,
    # every muP multiplier of its own; the Mamba-2 output RMS-normed in groups after its gate, or not normed.
    "falcon-h1": ("FalconH1Config", dict(
        num_hidden_layers=3, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_conv_bias=True,
        embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.7, attention_in_multiplier=1.3,
        attention_out_multiplier=0.8, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
        ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 1.1], mlp_multipliers=[1.4, 0.6], pad_token_id=0), {}),
    "falcon-h1-unnormed": ("FalconH1Config", dict(
        num_hidden_layers=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
        mamba_d_state=16, mamba_d_conv=4, mamba_rms_norm=False, projectors_bias=True, attention_bias=True,
        embedding_multiplier=3.0, key_multiplier=1.5, ssm_multipliers=[1.2, 0.7, 1.0, 1.3, 0.9], pad_token_id=0),
                           {}),
    # Kimi-Linear: KDA layers (4 heads of 16, a decay a key channel) between latent-attention layers without RoPE,
    # DeepSeek-V3's experts after the first, dense, layer (one group, shared experts).
    "kimi-linear": ("KimiLinearConfig", dict(
        num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, q_lora_rank=None,
        kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20, num_key_value_heads=4,
        num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
        routed_scaling_factor=2.446, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
        pad_token_id=0),
        # transformers saves a dense layer's MLP under block_sparse_moe (its renaming undone blindly); the release,
        # as vLLM reads it, under mlp.
        {"renamed": ((r"\.block_sparse_moe\.(gate|up|down)_proj\.", r".mlp.\1_proj."),)}),
    # Ling 3 (BailingHybrid): KDA layers (4 heads of 16) whose forget gate's log is bounded below by -3 through a
    # sigmoid, between latent-attention layers with YaRN and interleaved RoPE pairs, a gate a head; DeepSeek-V3's
    # experts, 2 of 8 in the best of 2 groups, after the first, dense, layer.
    "bailing-hybrid": ("BailingHybridConfig", dict(
        num_hidden_layers=4, layer_group_size=2, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=20, num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=48, n_group=2, topk_group=1, first_k_dense_replace=1, kda_lower_bound=-3.0,
        pad_token_id=0, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}), {}),
    # MiniMax-Text-01 (MiniMax): lightning attention layers (4 heads of 16) in runs of 8 tokens between attention
    # layers, every layer's MLP 2 of 4 experts; each block's normed input and output weighed by factors of its kind.
    "minimax": ("MiniMaxConfig", dict(
        num_hidden_layers=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
        block_size=8, full_attn_alpha_factor=1.5, full_attn_beta_factor=0.75, linear_attn_alpha_factor=0.5,
        linear_attn_beta_factor=1.25, mlp_alpha_factor=1.25, mlp_beta_factor=0.5, pad_token_id=0), {}),
    # Zamba2: Mamba-2 layers (4 heads of 32, 2 groups, states of 16), three of them hybrid: two shared blocks in turn
    # (attention over the input beside the embeddings, heads of 32, RoPE; gated GELU MLP), each application with
    # adapters of rank 8 of its own. (Weights of std 0.1: its shared blocks' outputs, added to the Mamba-2 layers'
    # inputs, make float32's own error near the tests' bound at 0.2.)
    "zamba2": ("Zamba2Config", dict(
        num_hidden_layers=6, layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"],
        num_key_value_heads=4, n_mamba_heads=4, mamba_d_state=16, mamba_ngroups=2, num_mem_blocks=2,
        use_shared_attention_adapter=True, adapter_rank=8, intermediate_size=96, use_mem_rope=True, pad_token_id=0,
        initializer_range=0.1), {}),
    # Zamba2 with one shared block and adapters on its MLP alone, no RoPE; untied, as transformers reads it each
    # hybrid layer runs a block of its own.
    "zamba2-plain": ("Zamba2Config", dict(
        num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_key_value_heads=2,
        n_mamba_heads=4, mamba_d_state=16, intermediate_size=96, adapter_rank=8, tie_word_embeddings=False,
        pad_token_id=0, initializer_range=0.1), {}),
    # Mamba: Mamba-1 layers alone (160 channels, intermediate_size's; states of 16, dt through a rank of 4);
    # Falcon-Mamba's with dt, B and C normed without weights (their eps 0.1), untied. Their pages hold the states alone.
    "mamba": ("MambaConfig", dict(num_hidden_layers=3, state_size=16, pad_token_id=0), {}),
    "falcon-mamba": ("FalconMambaConfig", dict(num_hidden_layers=3, state_size=16, pad_token_id=0,
                                               tie_word_embeddings=False, mixer_rms_eps=0.1), {}),
    # Mamba-2 (Mamba-Codestral's): Mamba-2 layers alone, 4 heads of 32 in 2 groups, states of 16, the gated norm in
    # its groups; its steps clamped from below in prompts.
    "mamba2": ("Mamba2Config", dict(num_hidden_layers=3, num_heads=4, head_dim=32, n_groups=2, state_size=16,
                                    time_step_limit=(0.05, float("inf")), pad_token_id=0), {}),
    # Jamba: Mamba-1 layers (128 channels, states of 16, dt through a rank of 4) between attention layers without RoPE
    # (every 4th from the 2nd), 2 of 4 experts by softmax in every other layer.
    "jamba": ("JambaConfig", dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1, num_experts=4,
                                  num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16,
                                  mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False,
                                  pad_token_id=0), {}),
    # Bamba: Mamba-2 layers (Granite 4.0-H's kind) between attention layers at attn_layer_indices, RoPE over half of
    # each head.
    "bamba": ("BambaConfig", dict(num_hidden_layers=4, attn_layer_indices=[1, 3], **MAMBA_HEADS, pad_token_id=0), {}),
    # LFM2: short gated convolutions (3 taps) between attention layers whose q and k heads are normed, SwiGLU MLPs two
    # thirds as wide as configured, rounded up to a multiple of 16.
    "lfm2": ("Lfm2Config", dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
                                block_multiple_of=16, pad_token_id=0), {}),
    # LFM3: LFM2's convolutions (7 taps) between attention layers, a sliding window (16) in some with RoPE of their own,
    # a proportional RoPE (half of each head's frequencies) in the full ones; each head's output gated, every
    # operator's and MLP's output normed.
    "lfm3": ("Lfm3Config", dict(num_hidden_layers=5, head_dim=16, sliding_window=16,
                                layer_types=["conv", "sliding_attention", "conv", "full_attention", "conv"],
                                pad_token_id=0), {}),
    # LFM2-MoE: after a dense first layer, 2 of 4 experts by sigmoid score plus a learnt bias, renormalized, scaled.
    "lfm2-moe": ("Lfm2MoeConfig", dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv",
                                                                          "full_attention"],
                                       num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=48, routed_scaling_factor=2.0, pad_token_id=0), {}),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48), {}),
    # Sliding-window layers (window 16, their own RoPE theta) between full ones with scaled RoPE.
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                                        num_hidden_layers=3,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 100000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1000.0}}), {}),
    # Gemma 4 as its small models (E2B, E4B) are made: full layers of heads twice as wide (turned by proportional
    # RoPE over a quarter of them), per-layer embeddings, the last two layers attending over the KV of the last
    # earlier layer of their kind, with MLPs twice as wide; soft-capped logits.
    "gemma4-e": ("Gemma4TextConfig", dict(
        head_dim=16, global_head_dim=32, num_hidden_layers=6, sliding_window=16, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=512, num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, pad_token_id=0), {}),
    # Gemma 4 as its large dense model (31B) is made: the full layers' values are their keys, of one KV head.
    "gemma4-k-eq-v": ("Gemma4TextConfig", dict(
        head_dim=16, global_head_dim=32, num_hidden_layers=3, sliding_window=16, hidden_size_per_layer_input=0,
        attention_k_eq_v=True, num_global_key_value_heads=1, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "full_attention"], pad_token_id=0), {}),
    # Gemma 4 as its mixture of experts (26B-A4B) is made: beside each layer's MLP, 2 of 4 experts a token; its full
    # layers' values their keys, of two KV heads (so it splits in two).
    "gemma4-moe": ("Gemma4TextConfig", dict(
        head_dim=16, global_head_dim=32, num_hidden_layers=3, sliding_window=16, hidden_size_per_layer_input=0,
        attention_k_eq_v=True, num_global_key_value_heads=2, final_logit_softcapping=30.0, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=48,
        layer_types=["sliding_attention", "full_attention", "full_attention"], pad_token_id=0), {}),
    # Gemma (1): Llama's layers with Gemma's norms (1 + weight), GELU (tanh) as its releases' legacy "gelu" names it,
    # embeddings scaled, tied.
    "gemma": ("GemmaConfig", dict(head_dim=16, hidden_act="gelu", attention_bias=True), {}),
    # StarCoder 2: Mistral's window (16), layer norms with biases, biases everywhere, c_fc/GELU/c_proj without a gate.
    "starcoder2": ("Starcoder2Config", dict(sliding_window=16, pad_token_id=0), {}),
    # Swiss AI's Apertus: q and k normed per head, an MLP of xIELU (its four numbers a layer noisy here) without a gate.
    "apertus": ("ApertusConfig", dict(head_dim=16, attention_bias=True, pad_token_id=0), {}),
    # Apertus 1.5's text model: its LM head pruned to the vocabulary's first 400 rows (the rest, image and audio
    # tokens, input alone).
    "apertus1p5": ("Apertus1p5TextConfig", dict(head_dim=16, output_vocab_size=400, pad_token_id=0), {}),
    # Phi-3.5-MoE: layer norms with biases, biases on attention and the LM head, two of four experts a token by
    # SparseMixer (its jitter wide enough here to weigh both by the softmax of more than one logit), LongRoPE scaled by
    # its mscale (served within its original context: the short factors).
    "phimoe": ("PhimoeConfig", dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.3,
                                    attention_bias=True, lm_head_bias=True, pad_token_id=0, rope_parameters={
                                        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.1] * 8,
                                        "long_factor": [2.5] * 8, "short_mscale": 1.2, "long_mscale": 1.2,
                                        "original_max_position_embeddings": 512}), {}),
    # Phi-2: attention beside fc1/GELU/fc2 from one layer norm, biases everywhere (the LM head's too), RoPE over half of
    # each head (transformers' default; Phi-2's config gives 0.4).
    "phi": ("PhiConfig", dict(pad_token_id=0), {}),
    # Meta's OPT: learnt positions (offset by 2), layer norms with biases, fc1/ReLU/fc2, biases everywhere, tied.
    "opt": ("OPTConfig", dict(ffn_dim=160, pad_token_id=1), {}),
    # OpenAI's GPT-2: learnt positions, layer norms with biases, q/k/v fused (stored transposed, as every projection),
    # GELU (tanh), tied.
    "gpt2": ("GPT2Config", dict(n_inner=160, pad_token_id=0), {}),
    # BigCode's GPTBigCode (StarCoder 1): GPT-2's with its projections stored as Linear's, one k and v head for all
    # (multi_query), or each head's q, k and v in turn.
    "gpt-bigcode": ("GPTBigCodeConfig", dict(n_inner=160, pad_token_id=0), {}),
    "gpt-bigcode-mha": ("GPTBigCodeConfig", dict(n_inner=160, multi_query=False, pad_token_id=0), {}),
    # GPT-NeoX (Pythia): attention and an MLP of exact GELU without a gate side by side, each from its own layer norm,
    # q, k and v fused a head at a time, RoPE over a quarter of each head; and sequential blocks.
    "gpt-neox": ("GPTNeoXConfig", dict(pad_token_id=0), {}),
    "gpt-neox-sequential": ("GPTNeoXConfig", dict(use_parallel_residual=False, pad_token_id=0), {}),
    # StableLM 2 (1.6B): layer norms with biases, biases on q, k and v, RoPE over a quarter of each head; 12B's q and k
    # layer-normed a head by weights of their own, attention and the MLP side by side from one norm.
    "stablelm": ("StableLmConfig", dict(use_qkv_bias=True, pad_token_id=0), {}),
    "stablelm-parallel": ("StableLmConfig", dict(qk_layernorm=True, use_parallel_residual=True, pad_token_id=0), {}),
    # Kyutai's Helium: Llama with RoPE's pairs side by side (reordered as they load), biases on q, k, v and the MLP.
    "helium": ("HeliumConfig", dict(head_dim=16, attention_bias=True, mlp_bias=True, pad_token_id=0), {}),
    # Meta's CWM: Llama with every fourth layer full from the first, the others windowed (16), a Llama 3 RoPE.
    "cwm": ("CwmConfig", dict(head_dim=16, sliding_window=16, num_hidden_layers=5, pad_token_id=0), {}),
    # Jais 2: Llama's attention with biases, layer norms with biases, an MLP of squared ReLU without a gate.
    "jais2": ("Jais2Config", dict(pad_token_id=0), {}),
    # Gemma 2: sliding-window layers every other one, one RoPE, attention scores and final logits
    # soft-capped (caps low enough here to bend the tiny model's scores and logits).
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=16, num_hidden_layers=3,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=2.0), {}),
    # Upstage's Solar Open: GLM-4.5's routing (2 of 4 experts by sigmoid score plus a bias) and a shared expert in every
    # layer, Llama's attention with biases on q, k and v alone.
    "solar-open": ("SolarOpenConfig", dict(moe_intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2,
                                           n_shared_experts=1, head_dim=16, attention_bias=True,
                                           routed_scaling_factor=1.5), {}),
    # BLOOM: ALiBi for positions (6 heads: past the nearest power of two, the slopes of 8's every other one), GPT-NeoX's
    # fused heads in sequential layers, its embeddings layer-normed, biases everywhere; its LM head the embeddings.
    "bloom": ("BloomConfig", dict(num_attention_heads=6, hidden_size=96), {}),
    # MPT: ALiBi by MPT's slopes (6 heads: of 8's, the odd ones first), q, k and v fused and clipped, layer norms
    # without biases, no biases anywhere, an exact-GELU MLP; its LM head the embeddings.
    "mpt": ("MptConfig", dict(hidden_size=96, num_attention_heads=6, attn_config={"clip_qkv": 1.5}), {}),
    # GPT-J: attention beside an ungated tanh-GELU MLP from one layer norm, RoPE's pairs side by side over the first 8
    # of each head's 16 dimensions, biases on the MLP and the LM head alone.
    "gptj": ("GPTJConfig", dict(rotary_dim=8), {}),
    # GPT-Neo: GPT-2's layers with q, k and v apart, unscaled scores, every other layer over a window of 16 positions.
    "gpt-neo": ("GPTNeoConfig", dict(attention_types=[[["global", "local"], 1]], window_size=16), {}),
    # DBRX: MPT's layers with RoPE, GQA (2 KV heads), q/k/v clipped, and 2 of 4 experts by softmax, renormalized.
    "dbrx": ("DbrxConfig", dict(d_model=64, attn_config={"kv_n_heads": 2, "clip_qkv": 1.5, "rope_theta": 10000.0},
                                ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2}), {}),
    # Tencent's Hy3: q and k normed a head, a dense first layer, then 2 of 4 experts by sigmoid score plus a bias,
    # renormalized and scaled, beside a shared expert.
    "hy-v3": ("HYV3Config", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                                 moe_intermediate_size=48, max_position_embeddings=1024), {}),
    # Tencent's Youtu-LLM: DeepSeek-V3's latent attention (q through a latent, RoPE's pairs side by side) before a dense
    # MLP in every layer.
    "youtu": ("YoutuConfig", dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                  v_head_dim=20, num_key_value_heads=4), {}),
    # Laguna: each layer's own q heads (8, 4, 8), full and sliding layers with RoPEs of their own (half a head at
    # 500000, a whole one at 10000), attention gated by softplus a head at a time (and an element at a time), a dense
    # first layer, then 2 of 4 experts by sigmoid score of soft-capped logits plus a bias, scaled, beside a shared one.
    **{name: ("LagunaConfig", dict(
        head_dim=16, num_hidden_layers=3, num_attention_heads_per_layer=[8, 4, 8], sliding_window=48,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, shared_expert_intermediate_size=40, moe_router_logit_softcapping=3.0,
        moe_routed_scaling_factor=scale, gating=gating), {})
       for name, gating, scale in (("laguna", True, 2.0), ("laguna-element-gates", "per-element", 1.5))},
    # JetBrains' Mellum 2: Qwen3-MoE's attention in full and sliding layers with RoPEs of their own (half a head at
    # 500000 and 10000), a dense first layer, then 2 of 4 experts by softmax, not renormalized.
    "mellum": ("MellumConfig", dict(
        head_dim=16, num_hidden_layers=3, sliding_window=48, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=False,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), {}),
    # Xiaomi's MiMo-V2-Flash: a full layer (2 KV heads) then sliding ones (4 KV heads, a sink a head), q and k heads 24
    # wide and v heads 16 (values scaled), RoPE over a third of each head at a theta a layer type, a dense first MLP,
    # then 2 of 4 experts by sigmoid score plus a bias, scaled.
    "mimo-v2-flash": ("MiMoV2FlashConfig", dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=24, v_head_dim=16, num_hidden_layers=3,
        sliding_window=48, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        routed_scaling_factor=1.5, attention_value_scale=0.6,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500000.0,
                                            "partial_rotary_factor": 0.334},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.334}}), {}),
    # North's text model (Cohere Compass): Cohere2's parallel layers and windows with RoPE's pairs half a head apart
    # (Qwen3-VL's multimodal RoPE, a text's positions alike), RoPE in the sliding layers alone (the full type's null),
    # logits scaled.
    "cohere-compass": ("CohereCompassTextConfig", dict(
        num_hidden_layers=4, sliding_window=48, head_dim=16, logit_scale=0.5, pad_token_id=0,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                               "mrope_section": [4, 2, 2], "mrope_interleaved": True},
                         "full_attention": None}), {}),
    # Command A MoE: Command A's layers (windows in three of four, RoPE in those and the dense first layer) with RMS
    # norms, then 2 of 4 experts by the softmax of their logits (or their sigmoids, renormalized) beside a shared
    # expert, averaged (or summed).
    **{name: ("Cohere2MoeConfig", dict(
        head_dim=16, num_hidden_layers=5, sliding_window=48, num_experts=4, num_experts_per_tok=2,
        intermediate_size=48, prefix_dense_intermediate_size=96, num_shared_experts=1,
        mlp_layer_types=["dense"] + ["sparse"] * 4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"], **extra), {})
       for name, extra in (("cohere2-moe", dict(rms_norm_eps=1e-5)),
                           ("cohere2-moe-sigmoid", dict(expert_selection_fn="sigmoid", rms_norm_eps=None,
                                                        shared_expert_combination_strategy="sum",
                                                        logit_scale=0.5)))},
    # Adept's Persimmon: GPT-NeoX's fused heads in layers one after the other, q and k layer-normed a head by one
    # LayerNorm, RoPE over half of each head, an ungated MLP of squared ReLU, biases everywhere.
    "persimmon": ("PersimmonConfig", dict(pad_token_id=0), {}),
    # NAVER's HyperCLOVA X SEED: Granite's scalings (logits multiplied), each block's output RMS-normed (Peri-LN).
    "hyperclovax": ("HyperCLOVAXConfig", dict(embedding_multiplier=6.0, residual_multiplier=0.4, logits_scaling=3.0,
                                              attention_multiplier=0.2, pad_token_id=0), {}),
    # Aleph Alpha's Kolibri-1: EXAONE 4's attention (RoPE in the sliding layers alone; the fifth full) in GLM-4-0414's
    # layers, 2 of 4 experts by router logit plus a bias, weighed by their sigmoids renormalized, beside a shared one.
    "kolibri1": ("Kolibri1Config", dict(head_dim=16, num_hidden_layers=5, sliding_window=48, num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=48,
                                        shared_expert_intermediate_size=40, norm_topk_prob=True), {}),
    # Recursive's Flint: Qwen3-MoE's attention with a sink a head, full layers (the first two, the second from there on
    # every fourth, the last) beside windowed ones, dense first two MLPs, then 2 of 4 experts by the sigmoids of their
    # logits, renormalized, beside an ungated shared expert.
    "flint": ("FlintConfig", dict(head_dim=16, num_hidden_layers=6, sliding_window=48, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=40,
                                  pad_token_id=0), {}),
    # SK Telecom's A.X K1: DeepSeek-V3 (latent attention with q through a latent; 2 of 8 experts in the best 2 of 4
    # groups) with its experts' output RMS-normed, a dense first layer.
    "axk1": ("AXK1Config", dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
                                num_key_value_heads=4, moe_intermediate_size=48, n_routed_experts=8,
                                num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                                mlp_layer_types=["dense", "sparse"]), {}),
    # OLMo 1: layer norms without weights; q, k and v clipped where the tiny random projections reach past 1.
    "olmo": ("OlmoConfig", dict(clip_qkv=1.0), {}),
    # Nemotron: layer norms with biases scaling by 1 + weight, squared ReLU without a gate, RoPE over half of each
    # head (its default), biases on attention and the MLP.
    "nemotron": ("NemotronConfig", dict(attention_bias=True, mlp_bias=True), {}),
    # VaultGemma: Gemma 2's attention (windows every other layer, soft caps) in layers of two norms.
    "vaultgemma": ("VaultGemmaConfig", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                                            num_hidden_layers=3, attn_logit_softcapping=3.0,
                                            final_logit_softcapping=2.0), {}),
    # Granite's four scalings, away from 1 (and the attention's from head_dim ** -0.5) to count.
    "granite": ("GraniteConfig", dict(embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.2,
                                      logits_scaling=3.0, attention_bias=True), {}),
    # Granite SWA (granite-swash): Granite's scalings, windowed layers but every fourth from the first, a sink a head;
    # RoPE a layer by layer_rope_theta: none in the full layers, the sliding ones' theta their own. Its MoE: shared
    # experts beside the routed ones, every full layer turned by a theta of its own, other than the windowed ones'.
    "granite-swa": ("GraniteSWAConfig", dict(embedding_multiplier=6.0, residual_multiplier=0.4,
                                             attention_multiplier=0.2, logits_scaling=3.0, sliding_window=16,
                                             num_hidden_layers=5, layer_rope_theta=[0, 10000.0, 10000.0, 10000.0, 0],
                                             pad_token_id=0), {}),
    "granite-moe-swa": ("GraniteMoeSWAConfig", dict(embedding_multiplier=6.0, residual_multiplier=0.4,
                                                    attention_multiplier=0.2, logits_scaling=3.0, sliding_window=16,
                                                    num_hidden_layers=5, num_local_experts=4, num_experts_per_tok=2,
                                                    shared_intermediate_size=40,
                                                    layer_rope_theta=[500.0, 10000.0, 10000.0, 10000.0, 500.0],
                                                    pad_token_id=0), {}),
    # Arcee's AFM: Llama with an MLP of squared ReLU and no gate (biases on it here, and on attention).
    "arcee": ("ArceeConfig", dict(mlp_bias=True, attention_bias=True, pad_token_id=0), {}),
    # Arcee's Trinity: four norms a layer, attention's output gated element by element, q and k normed per head,
    # windows (16) in three layers of four and RoPE in those only; the first layer dense, then experts by sigmoid
    # score plus a bias, renormalized, scaled, beside shared ones; muP's embedding scale.
    "afmoe": ("AfmoeConfig", dict(head_dim=16, num_hidden_layers=4, sliding_window=16, global_attn_every_n_layers=4,
                                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, num_shared_experts=2,
                                  num_dense_layers=1, route_scale=2.5, mup_enabled=True, pad_token_id=0), {}),
    # OLMo Hybrid: Gated DeltaNet layers (write strengths up to 2, heads by transformers' defaults: 4 key and value
    # heads, keys 12 wide, values 24) and OLMo 3's attention every fourth layer.
    "olmo-hybrid": ("OlmoHybridConfig", dict(num_hidden_layers=4, pad_token_id=0, attention_bias=True), {}),
    # FlexOlmo: OLMo 2's layers with OLMoE's experts (softmax, not renormalized).
    "flex-olmo": ("FlexOlmoConfig", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=48,
                                         attention_bias=True, pad_token_id=0), {}),
    # OLMo 2: norms after attention and the MLP, none before; q and k normed over whole projections.
    "olmo2": ("Olmo2Config", dict(attention_bias=True), {}),
    # OLMo 3: OLMo 2 with sliding-window layers (three in four) and YaRN on the full layers only.
    "olmo3": ("Olmo3Config", dict(sliding_window=16, num_hidden_layers=4, pad_token_id=0,
                                  rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 64}), {}),
    # SmolLM3: every fourth layer without RoPE (NoPE), and those windowed.
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=16,
                                      pad_token_id=0), {}),
    # Checkpoints with q/k/v and gate/up fused; Phi-3 mini's sliding window.
    "phi3": ("Phi3Config", dict(sliding_window=48, pad_token_id=0), {}),
    "qwen3-yarn": ("Qwen3Config", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64}), {}),
    # Phi-4-mini's RoPE: over 12 of each head's 16 dimensions, LongRoPE factors a frequency, the
    # attention factor from the ratio of the contexts. Served here with a context of 512 (ENGINE_OPTIONS),
    # which selects the short factors; test_longrope_long_context_matches_transformers serves it whole.
    "phi4-mini-longrope": ("Phi3Config", dict(
        pad_token_id=0, partial_rotary_factor=0.75, max_position_embeddings=2048,
        original_max_position_embeddings=LONGROPE_ORIGINAL_CONTEXT,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                      "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}), {}),
}
# Engine settings a model's generic parity tests need.
ENGINE_OPTIONS = {"phi4-mini-longrope": {"max_model_len": LONGROPE_ORIGINAL_CONTEXT},
                  "phimoe": {"max_model_len": LONGROPE_ORIGINAL_CONTEXT}}


def make_tiny_model(path: Path, name: str) -> Path:
    config_cls, extra, save = TINY_MODELS[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # (Qwen4-Exp's n-gram convolution starts at zeros)
            # (Hy4's sinks and hyper-connections' scales and biases start at constants)
            if "norm" in pname or pname.endswith(("bias", "router.scale", "per_expert_scale", ".D", ".alpha_p",
                                                  ".alpha_n", "ple.conv1d.weight", "self_attn.sinks", "hc.scale",
                                                  "self_attn.gate_bias", "correct_output_scale",
                                                  "hc.base", "hc_head.hc_scale", "hc_head.hc_base")):
                p.add_(torch.randn_like(p) * 0.2)
        # A router's learnt bias (GLM's, LFM2-MoE's), Gemma 4's layer scalars and xIELU's beta (Apertus's) are buffers,
        # at init zeros, ones and one half.
        for pname, b in model.named_buffers():
            if pname.endswith(("correction_bias", "layer_scalar", "expert_bias", "act_fn.beta")):
                b.add_(torch.randn_like(b) * 0.2)
    if "dtype" in save:
        model = model.to(save["dtype"])
    model.save_pretrained(path, max_shard_size=save.get("max_shard_size", "2GB"))
    if save.get("renamed"):
        tensors = load_file(path / "model.safetensors")
        for pattern, replacement in save["renamed"]:
            tensors = {re.sub(pattern, replacement, name): t for name, t in tensors.items()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make_tiny_model(root / name, name) for name in TINY_MODELS}


@pytest.fixture
def forked_ranks(monkeypatch) -> None:
    """Ranks 1.. of a split model forked from the tests' preloaded Python: a rank's own process spends a second of
    CPU importing torch, and the parity tests split some hundred models. (Tests of the ranks' processes themselves,
    test_tensor_parallel.py's, start them as the engine does.)"""
    def start(pipe_fd: int, env: dict[str, str]):
        return spawn(tensor_parallel_workers.rank_command(pipe_fd), env=env, pass_fds=(pipe_fd,), inherit_output=True)

    monkeypatch.setattr(tensor_parallel_workers, "start_rank_process", start)


def copied_with_config(model_dir: Path, into: Path, changes: dict, removed: tuple[str, ...] = ()) -> Path:
    """A copy of tiny model `model_dir` in `into`, its config.json given `changes` and without the keys `removed`."""
    copy = Path(shutil.copytree(model_dir, into / model_dir.name))
    config = {**json.loads((copy / "config.json").read_text()), **changes}
    for key in removed:
        config.pop(key, None)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def shared_model_dirs() -> list[Path]:
    if not SHARED_MODELS.is_dir():
        return []
    return sorted(p for p in SHARED_MODELS.iterdir() if (p / "config.json").is_file())


def greedy_outputs(engine, requests: dict[str, tuple[list[int], dict]], max_tokens: int) -> dict[str, list[int]]:
    """Each request's greedy tokens (ignoring EOS) run to its end beside the others: `requests` maps an
    id to its prompt and the rest of what `add_request` takes for it. Every page is free after."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for request_id, (prompt, given) in requests.items():
        engine.add_request(request_id, prompt, params, **given)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    return results


def decoded_from_handed_over_pages(prefill, decode, requests: dict[str, tuple[list[int], int, dict, dict]]) -> dict:
    """Each request prefilled by `prefill`, then decoded greedily by `decode` from a copy of its pages, as a
    decode worker decodes: `requests` maps an id to its prompt, its max_tokens, and what `add_request` and
    `add_prefilled_request` take for it besides; the prefill engine's drafts (with speculative decoding) go with its
    first token. Its finished outputs by id; every page free after."""
    from engine.sampling_params import SamplingParams

    for request_id, (prompt, max_tokens, given, given_to_decode) in requests.items():
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prefill.add_request(request_id, prompt, params, prefill_only=True, **given)
        first = next(out for step in iter(prefill.step, None) for out in step if out.finished)
        source, target = prefill.held_block_ids(request_id), decode.reserve(request_id, len(prompt))
        decode.runner.kv_pool.tensor[:, :, :, target] = prefill.runner.kv_pool.tensor[:, :, :, source]
        prefill.release(request_id)
        decode.add_prefilled_request(request_id, prompt, first.token_ids[0], params,
                                     draft_token_ids=first.handoff_drafts, **given_to_decode)
    outputs = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                outputs[out.request_id] = out
    decode.block_manager.check_integrity()
    assert decode.block_manager.num_free_blocks == decode.num_kv_blocks
    return outputs
