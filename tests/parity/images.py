"""What the parity tests of multimodal checkpoints share: their engines, their greedy tokens with images, and
Qwen2.5-VL's and Qwen3-VL's tiny configs (the end-to-end test's too)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.prompt_images import ImageInput
from engine.sampling_params import SamplingParams
from tests.parity.conftest import greedy_outputs, transformers

Requests = dict[str, tuple[list[int], list[ImageInput]]]

# Qwen2.5-VL's sizes, tiny: 4-pixel patches merged 2x2 (8-pixel squares), windows of 2x2 squares.
QWEN2_5_VL_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048, initializer_range=0.2,
                       bos_token_id=1, eos_token_id=3,
                       rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
QWEN2_5_VL_VISION = dict(hidden_size=32, intermediate_size=64, depth=4, num_heads=4, out_hidden_size=64, patch_size=4,
                         spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1, 3])
# Qwen3-VL's: its text model Qwen3's (q/k norms, head_dim 16: the interleaved sections' last cut short, as in
# transformers), learnt positions on a 4x4 grid, DeepStack from the tower's layers 0 and 2 into the first two.
QWEN3_VL_TEXT = dict(QWEN2_5_VL_TEXT, num_hidden_layers=3, head_dim=16,
                     rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                                      "rope_theta": 10000.0})
QWEN3_VL_VISION = dict(hidden_size=32, intermediate_size=64, depth=4, num_heads=4, out_hidden_size=64, patch_size=4,
                       spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                       deepstack_visual_indexes=[0, 2])
# Qwen3-VL-MoE's: 4 experts, 2 a token, each layer's stored fused (their 2 x 24 rows unlike the hidden 64, so the
# layouts tell apart by shape).
QWEN3_VL_MOE_TEXT = dict(QWEN3_VL_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                         decoder_sparse_step=1, norm_topk_prob=True)
# Qwen2-VL's: its tower's width embed_dim, its rows' hidden_size.
QWEN2_VL_VISION = dict(embed_dim=32, hidden_size=64, depth=4, num_heads=4, mlp_ratio=2, patch_size=4,
                       spatial_merge_size=2, temporal_patch_size=2)
# North's (Cohere Compass's): its text model Command A's (RoPE in its sliding layers alone, here with Qwen3-VL's
# interleaved multimodal RoPE; the window shorter than a prompt with images), Qwen3-VL's tower and DeepStack.
COMPASS_TEXT = dict(QWEN2_5_VL_TEXT, num_hidden_layers=3, head_dim=16, sliding_window=32, logit_scale=0.5,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                           "mrope_interleaved": True, "rope_theta": 10000.0},
                                     "full_attention": None})
QWEN_VL = {  # config class, model class, tiny text and vision settings
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", QWEN2_5_VL_TEXT, QWEN2_VL_VISION),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", QWEN2_5_VL_TEXT, QWEN2_5_VL_VISION),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", QWEN3_VL_TEXT, QWEN3_VL_VISION),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", QWEN3_VL_MOE_TEXT, QWEN3_VL_VISION),
    "cohere_compass": ("CohereCompassConfig", "CohereCompassForConditionalGeneration", COMPASS_TEXT, QWEN3_VL_VISION),
}
# Qwen3.5's: its hybrid text model (Gated DeltaNet layers between full-attention ones, a quarter of each 32-wide head
# turned by multimodal RoPE, interleaved whatever the config says), Qwen3-VL's tower without DeepStack.
QWEN3_5_TEXT = dict(QWEN2_5_VL_TEXT, num_hidden_layers=4, head_dim=32, pad_token_id=0,
                    layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                    rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.25,
                                     "rope_theta": 10000.0})
QWEN3_5_VISION = {k: v for k, v in QWEN3_VL_VISION.items() if k != "deepstack_visual_indexes"}
# Models of Qwen-VL's images beside QWEN_VL, not in its shared tests (test_qwen3_5_images.py has Qwen3.5's).
HYBRID_VL = {"qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", QWEN3_5_TEXT, QWEN3_5_VISION)}


def saved_qwen_vl(kind: str, path, seed: int, vision_overrides: dict | None = None, **config):
    """A tiny `kind` of QWEN_VL (or HYBRID_VL), random but for its norms and biases off their init (so each one
    counts), saved under `path` with `config` (its tokens' ids) over its config's; the model."""
    config_class, model_class, text, vision = {**QWEN_VL, **HYBRID_VL}[kind]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(
        text_config=text, vision_config={**vision, **(vision_overrides or {})}, **config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return model


def image_engine(path, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": str(path), "dtype": "float32", "num_kv_blocks": 64,
                                     "max_num_batched_tokens": 512, **options}))


def hf_greedy(logits_of: Callable[[list[int]], torch.Tensor], prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens by whole forward passes of transformers' model (`logits_of` ids: the last position's)."""
    tokens: list[int] = []
    for _ in range(max_tokens):
        tokens.append(int(logits_of(prompt + tokens).argmax()))
    return tokens


def assert_transformers_tokens(engine: LLMEngine, requests: Requests,
                               greedy_of: Callable[[list[int], list[ImageInput]], list[int]], max_tokens: int) -> None:
    """Each of `requests`, run greedily by `engine` beside the others, gives transformers' tokens
    (`greedy_of(prompt, images)`); every page free after."""
    results = greedy_outputs(engine, {request_id: (prompt, {"images": images})
                                      for request_id, (prompt, images) in requests.items()}, max_tokens)
    for request_id, (prompt, images) in requests.items():
        assert results[request_id] == greedy_of(prompt, images), request_id


def padded(prompt: list[int], length: int) -> list[int]:
    """`prompt` with text tokens after it up to `length` (pages filled for a preemption)."""
    return prompt + [30 + k for k in range(length - len(prompt))]


def assert_logprobs_match(engine: LLMEngine, prompt: list[int], images: list[ImageInput],
                          logits_of: Callable[[list[int]], torch.Tensor], steps: tuple[int, ...] = (0, 2)) -> None:
    """The top-20 logprobs of the tokens at `steps` of a greedy request are transformers' (`logits_of` ids: the last
    position's logits) within 1e-4."""
    engine.add_request("r", prompt, SamplingParams(max_tokens=max(steps) + 1, temperature=0.0, logprobs=20,
                                                   ignore_eos=True), images=images)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    tokens = [t for out in outputs for t in out.new_token_ids]
    logprobs = [lp for out in outputs for lp in out.new_logprobs]
    for step in steps:
        ref = torch.log_softmax(logits_of(prompt + tokens[:step]), dim=-1)
        assert max(abs(logprob - float(ref[token])) for token, logprob in logprobs[step].items()) < 1e-4, step


def patchified_video(pixels: torch.Tensor, patch: int, merge: int = 2) -> torch.Tensor:
    """A video's normalized frames [channels, frames, height, width] as transformers' Qwen2VLVideoProcessor lays
    them out (its patchify: pairs, then squares, then a square's patches, each patch channels x 2 frames x pixels),
    written out here because that processor needs torchvision, which has no CPU build for this torch."""
    channels, frames, height, width = pixels.shape
    rows, cols = height // patch, width // patch
    grid = pixels.transpose(0, 1).reshape(frames // 2, 2, channels, rows // merge, merge, patch, cols // merge, merge,
                                          patch)
    return grid.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(frames // 2 * rows * cols, channels * 2 * patch * patch)
