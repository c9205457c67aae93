"""What Baton needs to know of a Hugging Face `config.json`: `ModelConfig`. It is read, and a
checkpoint Baton cannot serve refused, by `load_model_config` (engine/model_config_loader.py)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.attention_layout import QTemperature
from engine.bitnet_weights import BitNetWeights
from engine.cohere2_moe_config import Cohere2MoeLayout
from engine.eagle_config import EagleConfig
from engine.encoder_config import EncoderConfig
from engine.falcon_h1_config import MupMultipliers
from engine.fp8_weights import Fp8Weights
from engine.gemma3n_config import AltUp
from engine.gemma4_config import Gemma4Assistant, Gemma4Layout
from engine.hy_v4_config import HyperConnections
from engine.int4_weights import Int4Weights
from engine.laguna_config import LagunaLayout
from engine.linear_attention_config import LinearAttention
from engine.mamba1_config import Mamba1Layout
from engine.mamba_config import Mamba2Layout
from engine.mimo_v2_flash_config import MiMoV2FlashLayout
from engine.minimax_config import MiniMaxLayout
from engine.minimax_m3_config import BlockSparseIndexer
from engine.mla_config import MLAConfig
from engine.moe_config import MoEConfig
from engine.multimodal import MultimodalCheckpoint
from engine.qwen4_exp_config import Qwen4ExpLayout
from engine.short_conv_config import ShortConvLayout
from engine.state_shape import StateShape
from engine.step3p7_config import Step3p7Layout
from engine.vision.vision_config import VisionConfig
from engine.zamba2_config import SharedBlocks


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the dimensions of a head RoPE turns: head_dim, or fewer (Phi-4-mini's partial_rotary_factor)
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    local_rope_theta: float | None  # the sliding-window layers' own, unscaled RoPE (Gemma 3, OLMo 3); None: the above
    rope_layers: frozenset[int]  # the layers that turn q and k by RoPE (all but SmolLM3's NoPE layers)
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool  # biases on gate, up and down (Llama's mlp_bias)
    # q and k RMS-normed before RoPE: "head", each head's (Qwen3, Gemma 3); "projection", the whole
    # q and k projections' (OLMo 2); "head_after_rope": each head's after RoPE (HunYuan's); "head_layer_norm":
    # each head layer-normed by weights of its own (Command R+'s); "head_shared_layer_norm": each head layer-normed by
    # one LayerNorm's weight and bias (Persimmon's); None: not.
    qk_norm: str | None
    moe: MoEConfig  # its mixture of experts (engine/moe_config.py); one of no experts for a dense model
    mla: MLAConfig | None  # DeepSeek-V3's multi-head latent attention (engine/mla_config.py); None: not MLA
    sliding_window: int | None
    sliding_layers: frozenset[int]  # the layers that attend over `sliding_window` only (all, for Mistral)
    # Llama 4's: its RoPE layers attend within chunks of this many positions (a token to the earlier
    # tokens of its own chunk), q and k L2-normed after RoPE there; its q/k weights hold each RoPE pair
    # side by side (rope_interleaved), reordered as they load.
    attention_chunk_size: int | None
    chunked_layers: frozenset[int]
    qk_l2_norm: bool
    rope_interleaved: bool
    q_temperature: QTemperature | None  # Llama 4's NoPE layers', Ministral 3's: q scaled by position
    attention_sinks: bool  # gpt-oss's: a learnt logit per q head takes its share of each softmax
    multimodal: MultimodalCheckpoint | None  # how a multimodal checkpoint names its text model's tensors
    vision: VisionConfig | None  # its images' encoder (engine/vision/); None: text only
    hidden_act: str  # the MLP's gate: "silu", or Gemma's "gelu_pytorch_tanh"
    attention_scale: float  # of q·k: head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5
    # Gemma's soft caps, cap * tanh(x / cap): of attention scores before the mask, of the final logits.
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    # Granite's: embeddings times the first, each block's output times the second, logits divided by the third.
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float
    weights_dtype: str
    fp8_weights: Fp8Weights | None  # how FP8 weights are scaled (engine/fp8_weights.py); None: not FP8
    mxfp4_weights: bool  # some weights stored as MXFP4 blocks and scales (engine/mxfp4_weights.py)
    int4_weights: Int4Weights | None  # how 4-bit GPTQ or AWQ weights are stored (engine/int4_weights.py)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # A sequence classifier's labels, in the order of its head's rows (config.json's id2label); ():
    # no classification head.
    labels: tuple[str, ...] = ()
    # A classifier made from its LM head (engine/classifier_config.py): the tokens whose rows make it,
    # and whether it is the second row minus the first (Qwen3-Reranker's); (): the checkpoint's `score`.
    classifier_tokens: tuple[str, ...] = ()
    classifier_difference: bool = False
    encoder: EncoderConfig | None = None  # a BERT-family encoder's (engine/encoder_config.py); None: a decoder
    # A decoder embedding model's sentence-transformers Pooling mode (stella's mean); "last" without one.
    decoder_pooling: str = "last"
    # Multimodal RoPE's (Qwen2.5-VL's): a head's frequencies turned by a token's time, height and width positions,
    # so many each; None: one position a token. A text token's three are one, as a 1D position turns them all.
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # the sections interleaved over a head's frequencies (Qwen3-VL's), not in turn
    logit_scale: float = 1.0  # Cohere's: logits multiplied by it
    clip_qkv: float | None = None  # OLMo's: q, k and v clamped to ±it as they are projected; None: not
    block_post_norms: bool = False  # each block's output RMS-normed before it joins the residual (HyperCLOVA X's)
    alibi: str | None = None  # BLOOM's and MPT's positions: ALiBi, by "bloom"'s or "mpt"'s slopes; None: not
    mlp_gated: bool = True  # False: the dense MLP is up, the activation, down (Arcee's, StarCoder 2's), no gate
    lm_head_bias: bool = False  # a bias added to the logits (Phi-3.5-MoE's lm_head_bias)
    parallel_residual: bool = False  # attention and the MLP side by side from one norm (StableLM's option)
    parallel_norms: int = 1  # ... from that one norm, or each from its own (2: Falcon-40B's; GPT-NeoX's always)
    eagle: EagleConfig | None = None  # an EAGLE draft head's (engine/eagle_config.py); None: a model of its own
    # Gemma 4's layers of two head shapes and KV shared (engine/gemma4_config.py): num_kv_heads and head_dim are then
    # its pages', which hold every layer's heads.
    gemma4: Gemma4Layout | None = None
    altup: AltUp | None = None  # Gemma 3n's AltUp streams, LAuReL and per-layer MLPs (engine/gemma3n_config.py)
    # A hybrid model's linear-attention layers (engine/linear_attention_config.py): they hold no pages, but a
    # recurrent state a sequence.
    linear_attention: LinearAttention | None = None
    # A hybrid model's Mamba-2 layers (engine/mamba_config.py: Granite 4.0-H's), as linear_attention.
    mamba: Mamba2Layout | None = None
    # LFM2's short convolution layers (engine/short_conv_config.py), as linear_attention.
    short_conv: ShortConvLayout | None = None
    mup: MupMultipliers | None = None  # Falcon-H1's muP multipliers (engine/falcon_h1_config.py)
    mamba1: Mamba1Layout | None = None  # Jamba's Mamba-1 layers (engine/mamba1_config.py), as linear_attention
    # MiniMax-Text-01's lightning attention layers and residual factors (engine/minimax_config.py), as linear_attention
    minimax: MiniMaxLayout | None = None
    zamba2: SharedBlocks | None = None  # Zamba2's shared transformer blocks (engine/zamba2_config.py), beside its mamba
    # Qwen4-Exp's hyper-connections and block indexer (engine/qwen4_exp_config.py), beside its linear_attention.
    qwen4_exp: Qwen4ExpLayout | None = None
    minimax_m3: BlockSparseIndexer | None = None  # MiniMax-M3's sparse layers' indexer (engine/minimax_m3_config.py)
    # Hy4's hyper-connections and its experts' GLU clamp (engine/hy_v4_config.py)
    hyper_connections: HyperConnections | None = None
    # Step-3.7's GLU clamps, each layer's (engine/step3p7_config.py)
    step3p7: Step3p7Layout | None = None
    # Each layer's q heads where they differ from num_heads (Step-3.7's sliding layers', Laguna's); None: num_heads.
    layer_num_heads: tuple[int, ...] | None = None
    # The dimensions of a head the sliding-window layers' own RoPE turns where not rotary_dim (Step-3.7's, Laguna's).
    local_rotary_dim: int | None = None
    laguna: LagunaLayout | None = None  # Laguna's attention gate (engine/laguna_config.py)
    # An LM head pruned to the vocabulary's first rows (Apertus 1.5's: engine/apertus1p5_config.py): the logits' columns
    # past them are -inf, those tokens input alone. None: a row a token.
    output_vocab_size: int | None = None
    # Norms whose output is weighed by the sigmoid of a low-rank MLP of it, that MLP's width (A.X K2's:
    # engine/axk2_config.py). None: plain norms.
    gated_norm_rank: int | None = None
    # MiMo-V2-Flash's narrower v heads and its full layers' KV heads (engine/mimo_v2_flash_config.py)
    mimo_v2_flash: MiMoV2FlashLayout | None = None
    cohere2_moe: Cohere2MoeLayout | None = None  # Command A MoE's norms and shared experts' sum
    bitnet: BitNetWeights | None = None  # BitNet's ternary weights and 8-bit inputs (engine/bitnet_weights.py)
    # What joins a Gemma 4 assistant drafter to its target (engine/gemma4_assistant_config.py)
    gemma4_assistant: Gemma4Assistant | None = None

    @property
    def pooling(self) -> str:
        """Which last hidden states make a prompt's embedding: "last" (a decoder's unless its Pooling
        module says otherwise), "cls" or "mean"."""
        return self.encoder.pooling if self.encoder is not None else self.decoder_pooling

    @property
    def num_kv_layers(self) -> int:
        """The layers whose K and V the pages hold: all but those attending over an earlier layer's (Gemma 4's) and
        linear-attention layers (Qwen3-Next's, Qwen3.5's)."""
        if self.kv_places is not None:  # (one for a model of recurrent layers alone: its pages hold the states)
            return len(self.kv_places) or 1
        return self.gemma4.num_kv_layers if self.gemma4 is not None else self.num_layers

    @property
    def _recurrent(self) -> LinearAttention | Mamba2Layout | ShortConvLayout | Mamba1Layout | MiniMaxLayout | None:
        return self.linear_attention or self.mamba or self.short_conv or self.mamba1 or self.minimax

    @property
    def state_shape(self) -> StateShape | None:
        """What each sequence keeps for its recurrent layers (a hybrid model's); None for a model without them."""
        if self._recurrent is None:
            return None
        shape = self._recurrent.state_shape
        if self.qwen4_exp is not None and self.qwen4_exp.ngrams is not None:  # its n-gram embeddings' besides
            return self.qwen4_exp.ngrams.with_states(shape, self.hidden_size, self.qwen4_exp.num_streams)
        return shape

    @property
    def kv_places(self) -> dict[int, int] | None:
        """A hybrid model's attention layers' layers of the pages; None for a model without recurrent layers."""
        return self._recurrent.kv_places if self._recurrent is not None else None

    @property
    def page_kv_heads(self) -> int:
        """The heads a layer's pages hold a token: its KV heads, and Qwen4-Exp's or MiniMax-M3's indexer's key as one
        more."""
        return self.num_kv_heads + (self.qwen4_exp is not None or self.minimax_m3 is not None)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
