"""The decoder architectures Baton serves, by config.json's `architectures` name, and what each one's
config.json leaves to transformers' defaults for it."""
from __future__ import annotations

from engine.axk1_config import AXK1
from engine.bailing_hybrid_config import BAILING_HYBRID
from engine.beam_config import BEAM
from engine.bloom_config import BLOOM
from engine.cohere2_moe_config import COHERE2_MOE
from engine.dbrx_config import DBRX
from engine.falcon_config import FALCON
from engine.flint_config import FLINT
from engine.gemma3n_config import GEMMA3N
from engine.gemma4_config import GEMMA4
from engine.gpt_neo_config import GPT_NEO
from engine.gptj_config import GPTJ
from engine.hy_v3_config import HY_V3
from engine.hy_v4_config import HY_V4
from engine.hyperclovax_config import HYPERCLOVAX
from engine.kolibri1_config import KOLIBRI1
from engine.laguna_config import LAGUNA
from engine.linear_attention_config import HYBRID_LINEAR, KIMI_LINEAR, OLMO_HYBRID
from engine.longcat_flash_config import LONGCAT_FLASH
from engine.mamba1_config import FALCON_MAMBA, JAMBA, MAMBA_LM
from engine.mamba_config import BAMBA, FALCON_H1, MAMBA2_LM, NEMOTRON_H
from engine.mellum_config import MELLUM
from engine.mimo_v2_flash_config import MIMO_V2_FLASH
from engine.minimax_config import MINIMAX, MINIMAX_RELEASES
from engine.minimax_m3_config import MINIMAX_M3
from engine.mla_config import GLM_MOE_DSA, SPARSE_MLA
from engine.moe_config import (
    AFMOE,
    DEEPSEEK_V2,
    DEEPSEEK_V3,
    DOTS1,
    ERNIE45_MOE,
    EXAONE_MOE,
    FLEX_OLMO,
    GLM4_MOE,
    GLM4_MOE_LITE,
    GPT_OSS,
    GRANITE_HYBRID,
    GRANITE_MOES,
    GRANITE_SWAS,
    LLAMA4,
    MINIMAX_M2,
    MISTRAL4,
    OLMOE,
    PHIMOE,
    QWEN_MOES,
    SOLAR_OPEN,
)
from engine.mpt_config import MPT
from engine.persimmon_config import PERSIMMON
from engine.qwen4_exp_config import QWEN4_EXP
from engine.rope_config import HUNYUANS
from engine.short_conv_config import LFM2S
from engine.step3p7_config import STEP3P7
from engine.zamba2_config import ZAMBA2

MINISTRAL3 = "Ministral3ForCausalLM"
VAULTGEMMA = "VaultGemmaForCausalLM"  # Gemma 2's attention in layers of two norms
YOUTU = "YoutuForCausalLM"  # Tencent's Youtu-LLM: DeepSeek-V3's latent attention before dense MLPs
OLMO = "OlmoForCausalLM"  # OLMo 1: layer norms without weights, q/k/v clipped
NEMOTRON = "NemotronForCausalLM"  # Nemotron-4, Minitron: layer norms scaled by 1 + weight, squared ReLU
MINISTRAL = "MinistralForCausalLM"  # Ministral 8B: Mistral's layers, each windowed or not as layer_types says
SEED_OSS, ERNIE45 = "SeedOssForCausalLM", "Ernie4_5ForCausalLM"
GLM, GLM4 = "GlmForCausalLM", "Glm4ForCausalLM"  # glm-4-9b-chat-hf; GLM-4-0414
GLMS = (GLM, GLM4)
EXAONE4 = "Exaone4ForCausalLM"
ARCEE = "ArceeForCausalLM"  # Arcee's AFM: Llama with an MLP of squared ReLU and no gate
STARCODER2 = "Starcoder2ForCausalLM"  # Mistral's attention, layer norms with biases, an MLP without a gate
JAIS2 = "Jais2ForCausalLM"  # Llama's attention, layer norms with biases, Arcee's MLP
BITNET = "BitNetForCausalLM"  # BitNet b1.58: Llama's layers with sub-norms and squared ReLU (engine/models/bitnet.py)
CWM = "CwmForCausalLM"  # Meta's Code World Model: Llama with three windowed layers in four
APERTUS = "ApertusForCausalLM"  # Swiss AI's: Llama with q/k norms and an xIELU MLP without a gate
MINICPM3 = "MiniCPM3ForCausalLM"  # openbmb's MiniCPM3: DeepSeek-V2's latent attention, MiniCPM's scalings
NANOCHAT = "NanoChatForCausalLM"  # Karpathy's nanochat: norms without weights, RoPE turned the other way
HELIUM = "HeliumForCausalLM"  # Kyutai's Helium: Llama with RoPE's pairs side by side, biases on q, k and v
STABLELM = "StableLmForCausalLM"  # StableLM 2 and 3B: Llama with layer norms, RoPE over a quarter of each head
PHI = "PhiForCausalLM"  # Phi-1, 1.5, 2: attention beside an ungated MLP from one layer norm, biases everywhere
GPTNEOX = "GPTNeoXForCausalLM"  # Pythia, Dolly: attention beside an ungated MLP, each from its own layer norm
OPT = "OPTForCausalLM"  # Meta's OPT: layer norms, an ungated ReLU MLP, learnt positions (engine/models/opt.py)
GPT2 = "GPT2LMHeadModel"  # OpenAI's GPT-2: the same with GELU (tanh), q/k/v fused, projections stored transposed
GPT_BIGCODE = "GPTBigCodeForCausalLM"  # StarCoder 1, SantaCoder: GPT-2's with one k and v head
# What transformers gives Apertus where config.json leaves it out: a Llama 3 RoPE of theta 1.2e7.
APERTUS_DEFAULTS = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0,
                                        "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                        "original_max_position_embeddings": 8192}}
# What transformers gives CWM where config.json leaves it out: a Llama 3 RoPE of theta 1e6, Llama 3's stop tokens.
CWM_DEFAULTS = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 16.0,
                                    "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                    "original_max_position_embeddings": 8192},
                "eos_token_id": [128001, 128008, 128009]}
GEMMA = "GemmaForCausalLM"  # Gemma (1), CodeGemma: Llama's layers, Gemma's norms and embedding scale
EXAONES = (EXAONE4, EXAONE_MOE)  # their attention alike (Kolibri-1's too: attention_layout.py)
MIMO = "MiMoForCausalLM"  # Xiaomi MiMo: Qwen2's model, its multi-token prediction layers (model.mtp_layers) beside
COHERE, COHERE2 = "CohereForCausalLM", "Cohere2ForCausalLM"  # Command R and R+; Command R7B and A
# Cohere's North (Cohere Compass)'s text model: Cohere2's layers with RoPE's pairs half a head apart, a theta a layer
# type and no RoPE in a type without one, logits unscaled where logit_scale is null
COHERE_COMPASS = "CohereCompassForCausalLM"
COHERES = (COHERE, COHERE2, COHERE2_MOE, COHERE_COMPASS)
ERNIE45S = (ERNIE45, ERNIE45_MOE)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                           "Gemma3ForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM",
                           "Olmo3ForCausalLM", "SmolLM3ForCausalLM", GLM4_MOE, DEEPSEEK_V2,
                           DEEPSEEK_V3, LLAMA4, MINISTRAL3, GPT_OSS, GEMMA4, MINIMAX_M2, GLM4_MOE_LITE, SEED_OSS,
                           ERNIE45, ERNIE45_MOE, *HUNYUANS, GLM, GLM4, *EXAONES, COHERE, COHERE2, COHERE_COMPASS,
                           OLMOE, MIMO, MISTRAL4,
                           *GRANITE_MOES, GRANITE_HYBRID, GRANITE_SWAS[0], *HYBRID_LINEAR, NEMOTRON_H, *LFM2S,
                           *SPARSE_MLA, FALCON_H1, BAMBA, JAMBA, KIMI_LINEAR, BAILING_HYBRID, DOTS1, ARCEE,
                           FLEX_OLMO, AFMOE, STARCODER2, GEMMA, OLMO_HYBRID, JAIS2, CWM,
                           APERTUS, HELIUM, PHIMOE, STABLELM, PHI, GPTNEOX, OPT, GPT2,
                           GPT_BIGCODE, QWEN4_EXP, LONGCAT_FLASH, NANOCHAT, MINIMAX_M3, MINICPM3, FALCON,
                           STEP3P7, MINISTRAL, VAULTGEMMA, OLMO, NEMOTRON, SOLAR_OPEN, BLOOM, MPT, GPTJ, GPT_NEO, DBRX,
                           HY_V3, YOUTU, LAGUNA, MELLUM, MIMO_V2_FLASH, COHERE2_MOE, PERSIMMON, HYPERCLOVAX,
                           KOLIBRI1, FLINT, AXK1, MINIMAX, ZAMBA2, BEAM, GEMMA3N, MAMBA_LM, FALCON_MAMBA, MAMBA2_LM,
                           BITNET)
# Multi-head latent attention's (engine/models/mla.py).
MLA_MODELS = (DEEPSEEK_V2, DEEPSEEK_V3, GLM4_MOE_LITE, MISTRAL4, *SPARSE_MLA, KIMI_LINEAR, BAILING_HYBRID,
              LONGCAT_FLASH, MINICPM3, YOUTU, AXK1)
# Checkpoints of the bare model, without its LM head, as embedding models are saved (e5-mistral,
# gte-Qwen2): served as the causal LM with its input embeddings for a head (only embeddings are asked
# of them; their tensors are read without the `model.` prefix: model_runner.py).
BARE_MODELS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
               "Qwen3Model": "Qwen3ForCausalLM"}
# Checkpoints of the model with a classification head for its LM head (`score`, a row of logits per
# label, read at a sequence's last token): reward models, classifiers, cross-encoder rerankers.
SEQUENCE_CLASSIFIERS = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                        "MistralForSequenceClassification": "MistralForCausalLM",
                        "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                        "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}
GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
GEMMAS = (GEMMA2, GEMMA3, VAULTGEMMA)
OLMOS = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
# q and k RMS-normed over their whole projections (ModelConfig.qk_norm "projection").
PROJECTION_NORMED = (*OLMOS, MINIMAX_M2, OLMOE, FLEX_OLMO, OLMO_HYBRID)
# Mixtral's names for their experts (`block_sparse_moe.experts.{e}.w1`), as released and as transformers 5 saves them.
MIXTRAL_NAMED = ("MixtralForCausalLM", MINIMAX_M2, PHIMOE, MINIMAX, *MINIMAX_RELEASES)
SMOLLM3, OLMO3 = "SmolLM3ForCausalLM", "Olmo3ForCausalLM"
# Absent from config.json, transformers' Gemma 2 caps attention and final logits; a null turns a cap off.
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# Qwen's layers may alternate full and sliding-window attention (use_sliding_window); Baton has one window for all.
QWENS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", *QWEN_MOES, MIMO)
QK_NORM = (BEAM, "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", GEMMA3, *EXAONES, DOTS1, AFMOE, APERTUS, STEP3P7, HY_V3,
           LAGUNA, MELLUM, KOLIBRI1, FLINT)
# Where config.json leaves rms_norm_eps out, transformers' default for these is 1e-5, for the others 1e-6.
EPS_1E5 = ("MixtralForCausalLM", "Phi3ForCausalLM", *OLMOS, GLM4_MOE, GLM4_MOE_LITE, *ERNIE45S, *HUNYUANS, *EXAONES,
           PHIMOE, STABLELM, PHI, GPTNEOX, OPT, GPT2, GPT_BIGCODE, *GRANITE_SWAS, ARCEE, AFMOE, STARCODER2, CWM,
           APERTUS, *COHERES, OLMOE, NEMOTRON_H, *LFM2S, GLM_MOE_DSA, FALCON_H1, BAMBA, KIMI_LINEAR, LONGCAT_FLASH,
           MINICPM3, FALCON, OLMO, NEMOTRON, BLOOM, MPT, GPTJ, GPT_NEO, DBRX, HY_V3, MIMO_V2_FLASH, PERSIMMON, HY_V4,
           MINIMAX, ZAMBA2, BITNET)
# Where config.json's attention_bias puts biases on q, k, v and o (Mistral's, Mixtral's and Phi-3's
# layers have none whatever it says; Qwen2's q, k and v always have one, its o never).
# Granite's four scalings (HyperCLOVA X's its own way round: attention_layout.py, model_config_loader.py)
GRANITES = ("GraniteForCausalLM", *GRANITE_MOES, GRANITE_HYBRID, GRANITE_SWAS[0], HYPERCLOVAX)
ATTENTION_BIAS = (BEAM, "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *GEMMAS, *GRANITES,
                   *OLMOS, SMOLLM3, LLAMA4, GPT_OSS, *HUNYUANS, *COHERES, OLMOE, DOTS1, ARCEE, FLEX_OLMO,
                  AFMOE, GEMMA, OLMO_HYBRID, JAIS2, APERTUS, PHIMOE, NANOCHAT, OLMO, NEMOTRON, HY_V3)
# Mistral's sliding window, where config.json gives one.
MISTRAL_SLIDING = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", MINISTRAL3, STARCODER2, PHIMOE,
                   MINIMAX)
