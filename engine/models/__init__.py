"""Model architectures, keyed by the `architectures` entry of config.json."""
from __future__ import annotations

from engine.models.afmoe import AfmoeForCausalLM
from engine.models.apertus import ApertusForCausalLM
from engine.models.bailing_hybrid import BailingHybridForCausalLM
from engine.models.bamba import BambaForCausalLM
from engine.models.beam import BeamForCausalLM
from engine.models.bert import BertModel
from engine.models.bitnet import BitNetForCausalLM
from engine.models.cohere import CohereForCausalLM
from engine.models.deepseek_v3 import AXK1ForCausalLM, AXK2ForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from engine.models.eagle import Eagle3LlamaForCausalLM, EagleLlamaForCausalLM
from engine.models.falcon_h1 import FalconH1ForCausalLM
from engine.models.flint import FlintForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM, GemmaForCausalLM, VaultGemmaForCausalLM
from engine.models.gemma3n import Gemma3nForCausalLM
from engine.models.gemma4 import Gemma4ForCausalLM
from engine.models.gemma4_assistant import Gemma4AssistantForCausalLM
from engine.models.glm4 import Glm4ForCausalLM, GlmForCausalLM, Kolibri1ForCausalLM
from engine.models.glm4_moe import Glm4MoeForCausalLM, SarvamMoEForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.granite import GraniteForCausalLM
from engine.models.hy_v3 import HYV3ForCausalLM
from engine.models.hy_v4 import HYV4ForCausalLM
from engine.models.jamba import JambaForCausalLM
from engine.models.kimi_linear import KimiLinearForCausalLM
from engine.models.laguna import LagunaForCausalLM
from engine.models.layer_norm_llama import (
    BloomForCausalLM,
    FalconForCausalLM,
    GPTJForCausalLM,
    GPTNeoXForCausalLM,
    Jais2ForCausalLM,
    PersimmonForCausalLM,
    PhiForCausalLM,
    PhimoeForCausalLM,
    StableLmForCausalLM,
    Starcoder2ForCausalLM,
)
from engine.models.lfm2 import Lfm2ForCausalLM, Lfm3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.llama4 import Llama4ForCausalLM
from engine.models.longcat_flash import LongcatFlashForCausalLM
from engine.models.mamba import MambaForCausalLM
from engine.models.mellum_mtp import MellumMTP
from engine.models.mimo_mtp import MiMoMTP
from engine.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from engine.models.mimo_v2_flash_mtp import MiMoV2FlashMTP
from engine.models.minicpm3 import MiniCPM3ForCausalLM
from engine.models.minimax import MiniMaxForCausalLM
from engine.models.minimax_m3 import MiniMaxM3ForCausalLM
from engine.models.modernbert import ModernBertModel
from engine.models.mpt import DbrxForCausalLM, MptForCausalLM
from engine.models.mtp import DeepseekV3MTP, Glm4MoeMTP
from engine.models.nanochat import NanoChatForCausalLM
from engine.models.nemotron import NemotronForCausalLM
from engine.models.nemotron_h import NemotronHForCausalLM
from engine.models.nemotron_h_mtp import NemotronHMTP
from engine.models.olmo import OlmoForCausalLM
from engine.models.olmo2 import Olmo2ForCausalLM
from engine.models.olmo_hybrid import OlmoHybridForCausalLM
from engine.models.opt import GPT2LMHeadModel, GPTBigCodeForCausalLM, GPTNeoForCausalLM, OPTForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen3_next import Qwen3NextForCausalLM
from engine.models.qwen3_next_mtp import Qwen3NextMTP
from engine.models.qwen4_exp import Qwen4ExpForCausalLM
from engine.models.step3p7 import Step3p7ForCausalLM
from engine.models.step3p7_mtp import Step3p7MTP
from engine.models.zamba2 import Zamba2ForCausalLM

# Mistral, Qwen2 and Qwen3 are Llama with a sliding window, q/k/v biases or q/k norms, Mixtral and the Qwen MoEs
# Llama with experts for MLPs; ModelConfig carries them.
MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MinistralForCausalLM": LlamaForCausalLM,  # its layers windowed or not by layer_types
    "OlmoForCausalLM": OlmoForCausalLM,  # layer norms without weights, q/k/v clipped (engine/models/olmo.py)
    "NemotronForCausalLM": NemotronForCausalLM,  # layer norms scaled by 1 + weight, squared ReLU (nemotron.py)
    "MixtralForCausalLM": LlamaForCausalLM,
    "SeedOssForCausalLM": LlamaForCausalLM,  # biases as its ModelConfig says
    "Ernie4_5ForCausalLM": LlamaForCausalLM,  # biases, and RoPE pairs side by side, as its ModelConfig says
    "Ernie4_5_MoeForCausalLM": LlamaForCausalLM,  # and its experts, routed as its MoEConfig says
    "HunYuanDenseV1ForCausalLM": LlamaForCausalLM,  # q and k normed after RoPE, as its ModelConfig says
    "HunYuanMoEV1ForCausalLM": LlamaForCausalLM,  # and experts beside a shared MLP, as its MoEConfig says
    "MiniMaxM2ForCausalLM": LlamaForCausalLM,  # q and k normed over whole projections, routed as its MoEConfig says
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "HeliumForCausalLM": LlamaForCausalLM,  # RoPE's pairs side by side, as its ModelConfig says
    "CwmForCausalLM": LlamaForCausalLM,  # with its windowed layers, as its ModelConfig says
    "ApertusForCausalLM": ApertusForCausalLM,  # an xIELU MLP without a gate (engine/models/apertus.py)
    "Apertus1p5TextForCausalLM": ApertusForCausalLM,  # Apertus 1.5's, its LM head pruned (engine/apertus1p5_config.py)
    "ArceeForCausalLM": LlamaForCausalLM,  # its MLP without a gate, by its ModelConfig's hidden_act
    "MiMoForCausalLM": LlamaForCausalLM,  # Qwen2's, its MTP layers left unread but as drafts (mimo_mtp.py)
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Dots1ForCausalLM": LlamaForCausalLM,  # Qwen3's attention, experts routed as DeepSeek-V3's (its MoEConfig)
    # Hybrids of Gated DeltaNet and full attention, as their ModelConfig's linear_attention lays them out.
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,  # KDA and latent attention (engine/models/kimi_linear.py)
    "BitNetForCausalLM": BitNetForCausalLM,  # BitNet b1.58: sub-norms, ternary weights, 8-bit inputs (models/bitnet.py)
    "MiniMaxForCausalLM": MiniMaxForCausalLM,  # MiniMax-Text-01/M1: lightning attention layers (models/minimax.py)
    "MiniMaxText01ForCausalLM": MiniMaxForCausalLM,  # ... as released, their config.json their own code's
    "MiniMaxM1ForCausalLM": MiniMaxForCausalLM,
    "Zamba2ForCausalLM": Zamba2ForCausalLM,  # Mamba-2 layers, shared transformer blocks (engine/models/zamba2.py)
    "BailingHybridForCausalLM": BailingHybridForCausalLM,  # Ling 3: Kimi-Linear's, full KDA gates, gated MLA heads
    "JambaForCausalLM": JambaForCausalLM,  # Mamba-1 layers between attention layers (engine/models/jamba.py)
    "MambaForCausalLM": MambaForCausalLM,  # Mamba-1 layers alone (engine/models/mamba.py)
    "FalconMambaForCausalLM": MambaForCausalLM,  # and Falcon-Mamba's, dt, B and C normed without weights
    "Mamba2ForCausalLM": MambaForCausalLM,  # Mamba-2 layers alone (Mamba-Codestral)
    "BambaForCausalLM": BambaForCausalLM,  # Mamba-2 layers between attention layers (engine/models/bamba.py)
    "FalconH1ForCausalLM": FalconH1ForCausalLM,  # attention and Mamba-2 side by side (engine/models/falcon_h1.py)
    "Lfm2ForCausalLM": Lfm2ForCausalLM,  # LFM2's convolutions between attention layers (engine/models/lfm2.py)
    "Lfm2MoeForCausalLM": Lfm2ForCausalLM,
    "Lfm3ForCausalLM": Lfm3ForCausalLM,
    "OlmoHybridForCausalLM": OlmoHybridForCausalLM,  # Gated DeltaNet beside OLMo 3's attention (olmo_hybrid.py)
    "Qwen3_5ForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3NextForCausalLM,
    # Qwen3.5's layers with hyper-connections and block-indexed attention (engine/models/qwen4_exp.py)
    "Qwen4ExpForCausalLM": Qwen4ExpForCausalLM,
    # DeepSeek-V3's layers a pair, experts beside each pair (engine/models/longcat_flash.py)
    "LongcatFlashForCausalLM": LongcatFlashForCausalLM,
    "MiniMaxM3VLForCausalLM": MiniMaxM3ForCausalLM,  # block-sparse attention, clamped GLUs (models/minimax_m3.py)
    "Step3p7ForCausalLM": Step3p7ForCausalLM,  # gated attention, sliding layers' own heads, clamps a layer (step3p7.py)
    "LagunaForCausalLM": LagunaForCausalLM,  # a layer's own q heads, softplus gates, capped router (laguna.py)
    "MellumForCausalLM": LlamaForCausalLM,  # Qwen3-MoE's layers, windows and a RoPE a layer type (mellum_config.py)
    "MiMoV2FlashForCausalLM": MiMoV2FlashForCausalLM,  # narrower v heads, more KV heads in its windows
    "PersimmonForCausalLM": PersimmonForCausalLM,  # GPT-NeoX's fused heads, q/k layer-normed (layer_norm_llama.py)
    "HYV3ForCausalLM": HYV3ForCausalLM,  # Llama's layers, per-head q/k norms, GLM-4.5's routing (hy_v3.py)
    "HYV4ForCausalLM": HYV4ForCausalLM,  # V3.2's sparse MLA, gated heads, sinks, hyper-connections (hy_v4.py)
    "BeamForCausalLM": BeamForCausalLM,  # gated heads, NoPE full layers, depth-weighed residuals (models/beam.py)
    "Gemma3nForCausalLM": Gemma3nForCausalLM,  # Gemma 4's attention and PLE, AltUp streams (models/gemma3n.py)
    "DbrxForCausalLM": DbrxForCausalLM,  # MPT's layers with RoPE, GQA and stacked experts (engine/models/mpt.py)
    "MptForCausalLM": MptForCausalLM,  # ALiBi (MPT's slopes), fused q/k/v clipped, no biases (engine/models/mpt.py)
    "GPTNeoForCausalLM": GPTNeoForCausalLM,  # GPT-2's layers, q/k/v apart, unscaled scores, local layers (opt.py)
    "GPTJForCausalLM": GPTJForCausalLM,  # Phi-2's layers, RoPE's pairs side by side over part of a head
    "BloomForCausalLM": BloomForCausalLM,  # GPT-NeoX's fused heads, ALiBi, its embeddings layer-normed
    "FalconForCausalLM": FalconForCausalLM,  # layer norms, an ungated GELU MLP beside attention (layer_norm_llama.py)
    "MiniCPM3ForCausalLM": MiniCPM3ForCausalLM,  # latent attention, MiniCPM's scalings (engine/models/minicpm3.py)
    "NanoChatForCausalLM": NanoChatForCausalLM,  # norms without weights, RoPE the other way (engine/models/nanochat.py)
    "NemotronHForCausalLM": NemotronHForCausalLM,  # Mamba-2, attention and MLP blocks, as its ModelConfig's mamba says
    "GemmaForCausalLM": GemmaForCausalLM,  # Llama's layers, Gemma's norms and embedding scale
    "VaultGemmaForCausalLM": VaultGemmaForCausalLM,  # Gemma 1's layers, Gemma 2's attention
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,  # layer norms with biases, an MLP without a gate
    "Jais2ForCausalLM": Jais2ForCausalLM,  # layer norms with biases, Arcee's MLP
    "PhimoeForCausalLM": PhimoeForCausalLM,  # layer norms with biases, Mixtral's experts by SparseMixer
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,  # q, k and v fused a head at a time, GPT-NeoX's names
    "OPTForCausalLM": OPTForCausalLM,  # learnt positions, OPT's names (engine/models/opt.py)
    "GPT2LMHeadModel": GPT2LMHeadModel,  # learnt positions, GPT-2's names and transposed projections
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,  # GPT-2's names, Linear's projections, one k and v head
    "PhiForCausalLM": PhiForCausalLM,  # attention beside an ungated MLP from one layer norm, Phi-2's names
    "StableLmForCausalLM": StableLmForCausalLM,  # layer norms with biases, q/k layer-normed a head, parallel blocks
    "Gemma2ForCausalLM": Gemma3ForCausalLM,  # with neither q/k norms nor a local RoPE, as its ModelConfig says
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,  # with its layers as its ModelConfig's gemma4 lays them out
    "Gemma4AssistantForCausalLM": Gemma4AssistantForCausalLM,  # Gemma 4's drafter (models/gemma4_assistant.py)
    "Gemma4UnifiedAssistantForCausalLM": Gemma4AssistantForCausalLM,
    "Gemma4UnifiedForCausalLM": Gemma4ForCausalLM,  # Gemma 4 unified's: no per-layer embeddings, no experts
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "HyperCLOVAXForCausalLM": GraniteForCausalLM,  # Granite's scalings, its logits', its blocks' norms
    "Kolibri1ForCausalLM": Kolibri1ForCausalLM,  # GLM-4-0414's layers, EXAONE 4's attention, experts (glm4.py)
    "FlintForCausalLM": FlintForCausalLM,  # Qwen3-MoE's attention with sinks, sigmoid experts (flint.py)
    "AXK1ForCausalLM": AXK1ForCausalLM,  # DeepSeek-V3 with its experts' output normed (deepseek_v3.py)
    "AXK2ForCausalLM": AXK2ForCausalLM,  # DeepSeek-V3.2 with gated heads and norms (deepseek_v3.py)
    "GraniteMoeForCausalLM": GraniteForCausalLM,  # with experts (and a shared MLP), as its MoEConfig says
    "GraniteMoeSharedForCausalLM": GraniteForCausalLM,
    "GraniteSWAForCausalLM": GraniteForCausalLM,  # with windows, sinks and RoPE a layer, as its ModelConfig says
    "GraniteMoeSWAForCausalLM": GraniteForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteForCausalLM,  # its attention-only checkpoints, its MLP named shared_mlp
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo2ForCausalLM,  # with sliding-window layers and their own RoPE, as its ModelConfig says
    "AfmoeForCausalLM": AfmoeForCausalLM,  # Arcee's Trinity (engine/models/afmoe.py)
    "FlexOlmoForCausalLM": Olmo2ForCausalLM,  # with OLMoE's experts, as its MoEConfig says
    "OlmoeForCausalLM": LlamaForCausalLM,  # q/k normed over whole projections, experts as its MoEConfig says
    "Exaone4ForCausalLM": Olmo2ForCausalLM,  # with q/k normed per head, RoPE on its sliding-window layers only
    "ExaoneMoeForCausalLM": LlamaForCausalLM,  # EXAONE 4.0's attention before its norms, experts as DeepSeek-V3's
    "SmolLM3ForCausalLM": LlamaForCausalLM,  # with NoPE layers, as its ModelConfig says
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "SarvamMoEForCausalLM": SarvamMoEForCausalLM,  # Sarvam-30B: GLM-4.5's, by its own names (engine/sarvam_config.py)
    "SolarOpenForCausalLM": LlamaForCausalLM,  # GLM-4.5's experts in every layer, Llama's attention
    "GlmForCausalLM": GlmForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": CohereForCausalLM,  # with sliding-window layers, RoPE in those only, as its ModelConfig says
    "Cohere2MoeForCausalLM": CohereForCausalLM,  # Command A MoE: experts beside shared ones (cohere.py)
    "CohereCompassForCausalLM": CohereForCausalLM,  # North's text model, as its ModelConfig says
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "SarvamMLAForCausalLM": DeepseekV3ForCausalLM,  # Sarvam-105B (engine/sarvam_config.py)
    "YoutuForCausalLM": DeepseekV3ForCausalLM,  # its latent attention, dense MLPs in every layer
    "DeepseekV32ForCausalLM": DeepseekV3ForCausalLM,  # its latent attention sparse, as its MLAConfig says (DSA)
    "GlmMoeDsaForCausalLM": DeepseekV3ForCausalLM,  # GLM-5: V3.2's, some layers sharing another's choice
    "Glm4MoeLiteForCausalLM": DeepseekV3ForCausalLM,  # GLM-4.7-Flash, its dense layers by its MoEConfig
    "Mistral4ForCausalLM": DeepseekV3ForCausalLM,  # Mistral Small 4's text model, q scaled by position
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "Ministral3ForCausalLM": LlamaForCausalLM,  # Mistral with its q scaled by position, as its ModelConfig says
    "GptOssForCausalLM": GptOssForCausalLM,
    # EAGLE draft heads, read only as a speculative config's (engine/eagle.py): no model of their own.
    "EagleLlamaForCausalLM": EagleLlamaForCausalLM,
    "Eagle3LlamaForCausalLM": Eagle3LlamaForCausalLM,
    "DeepseekV3MTP": DeepseekV3MTP,  # and the multi-token prediction layers of these checkpoints (engine/models/mtp.py)
    "Glm4MoeMTP": Glm4MoeMTP,
    "Qwen3NextMTP": Qwen3NextMTP,  # Qwen3-Next's and Qwen3.5's (engine/models/qwen3_next_mtp.py)
    "NemotronHMTP": NemotronHMTP,  # Nemotron 3's (engine/models/nemotron_h_mtp.py)
    "MiMoV2FlashMTP": MiMoV2FlashMTP,  # MiMo-V2-Flash's (engine/models/mimo_v2_flash_mtp.py)
    "MiMoMTP": MiMoMTP,  # Xiaomi MiMo's (engine/models/mimo_mtp.py)
    "MellumMTP": MellumMTP,  # Mellum 2's (engine/models/mellum_mtp.py)
    "Step3p7MTP": Step3p7MTP,  # Step-3.7's (engine/models/step3p7_mtp.py)
    # Encoders, for embeddings (engine/encoder_config.py): RoBERTa's are BERT's with positions offset.
    "BertModel": BertModel,
    "RobertaModel": BertModel,
    "XLMRobertaModel": BertModel,
    "BertForSequenceClassification": BertModel,  # with its head (engine/encoder_config.py)
    "RobertaForSequenceClassification": BertModel,
    "XLMRobertaForSequenceClassification": BertModel,
    "ModernBertModel": ModernBertModel,
    "ModernBertForSequenceClassification": ModernBertModel,  # with its head
}
