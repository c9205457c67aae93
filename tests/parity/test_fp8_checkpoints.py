"""FP8 checkpoints (engine/fp8_weights.py), with block scales as DeepSeek-V3, Qwen3-FP8 and
GLM-4.5-FP8 ship them and per channel as llm-compressor's compressed-tensors: Baton loading the FP8
weights and their scales computes what `transformers` computes from the dequantized weights, logits
and greedy tokens; other quantizations are refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model_config_loader import ModelConfigError, load_model_config
from tests.parity.test_transformers_parity import _check_greedy, _check_logits

BLOCK = [16, 32]  # rows, columns; 160-wide and 48-row weights leave partial edge blocks
FP8_MAX = 448.0  # e4m3's largest finite value


def quantize(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 weight, its scales (one per `block` of it) and what they dequantize to."""
    rows, columns = weight.shape
    scales = torch.empty(-(-rows // block[0]), -(-columns // block[1]))
    quantized = torch.empty(rows, columns, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            where = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scales[i, j] = weight[where].abs().max().clamp(min=1e-12) / FP8_MAX
            quantized[where] = (weight[where] / scales[i, j]).to(torch.float8_e4m3fn)
    expanded = scales.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
    return quantized, scales, quantized.float() * expanded


# (scale tensor suffix, block rows and columns, quantization_config): a channel is a block of one
# row and all columns.
LAYOUTS = {
    "block": ("_scale_inv", BLOCK, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                    "weight_block_size": BLOCK}),
    "channel": ("_scale", None, {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def fp8_and_dequantized(request, tiny_model_dirs, tmp_path_factory):
    """The llama model's projections stored in FP8 (norms and embeddings as they were), and the
    same checkpoint with those weights dequantized: what the FP8 one means."""
    suffix, block, quantization = LAYOUTS[request.param]
    source = tiny_model_dirs["llama-gqa-untied"]
    root = tmp_path_factory.mktemp("fp8")
    fp8_dir, plain_dir = shutil.copytree(source, root / "fp8"), shutil.copytree(source, root / "dequantized")
    tensors = load_file(source / "model.safetensors")
    stored, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight"):
            quantized, scales, dequantized[name] = quantize(tensor.float(), block or [1, tensor.shape[1]])
            stored[name], stored[name + suffix] = quantized, scales
        else:
            stored[name] = dequantized[name] = tensor
    save_file(stored, fp8_dir / "model.safetensors")
    save_file(dequantized, plain_dir / "model.safetensors")
    config = json.loads((fp8_dir / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    assert not torch.equal(dequantized["model.layers.0.mlp.up_proj.weight"],
                           tensors["model.layers.0.mlp.up_proj.weight"])  # FP8 lost something: the test can tell
    return fp8_dir, plain_dir


def test_an_fp8_checkpoint_computes_its_dequantized_weights(fp8_and_dequantized):
    fp8_dir, plain_dir = fp8_and_dequantized  # transformers reads the dequantized checkpoint; Baton the FP8 one
    _check_logits(fp8_dir, reference_dir=plain_dir)
    _check_greedy(fp8_dir, max_num_batched_tokens=64, max_new_tokens=16, reference_dir=plain_dir)


@pytest.mark.parametrize(("quantization", "named"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization 'bitsandbytes' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "FP8 without weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme 'static'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "format 'int-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}}, "per channel"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
        "input_activations": {"num_bits": 8, "type": "float", "dynamic": False}}}}, "static activation scales"),
])
def test_quantizations_not_loaded_are_refused_by_name(fp8_and_dequantized, tmp_path, quantization, named):
    model_dir = shutil.copytree(fp8_and_dequantized[0], tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ModelConfigError, match=named):
        load_model_config(model_dir)


def test_an_fp8_vision_tower_encodes_images_as_its_dequantized_weights_do(tmp_path):
    """A multimodal FP8 checkpoint whose vision tower and projector are FP8 too (block scales): the image encoder
    dequantizes them as the text model's weights are, its rows transformers' from the dequantized weights (read
    raw, the FP8 numbers would be the weights, their scales left out)."""
    from transformers.image_transforms import split_to_tiles

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from tests.parity.test_llama4_images import TILE, tiny_llama4

    model = tiny_llama4(590, seed=5)
    model.save_pretrained(tmp_path)
    stored, dequantized = {}, {}
    for name, tensor in load_file(tmp_path / "model.safetensors").items():
        if name.startswith(("vision_model.", "multi_modal_projector.")) and name.endswith("weight") \
                and tensor.dim() == 2:
            stored[name], stored[name + "_scale_inv"], dequantized[name] = quantize(tensor.float(), BLOCK)
        else:
            stored[name] = tensor
    assert len(dequantized) > 10
    save_file(stored, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": LAYOUTS["block"][2]}))
    assert not model.load_state_dict(dequantized, strict=False).unexpected_keys
    pixels = torch.randn(3, TILE, 2 * TILE, generator=torch.Generator().manual_seed(3))
    [ours] = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16)
                       ).runner.image_encoder.encode([pixels])
    with torch.no_grad():
        features = model.get_image_features(pixel_values=split_to_tiles(pixels[None], 1, 2)[0],
                                            return_dict=True).last_hidden_state
        theirs = model.multi_modal_projector(features).flatten(0, 1)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
