"""Speculative decoding with Xiaomi's multi-token prediction layers, vLLM's and SGLang's `{"method": "mtp"}`:
MiMo-V2-Flash's (engine/models/mimo_v2_flash_mtp.py) and MiMo's (engine/models/mimo_mtp.py). The drafts are the first
layer's as transformers' own decoder layer of the model computes it from transformers' hidden states of the target
(MiMo-V2-Flash's sliding-window layer past its window too); the tokens are plain decoding's, beside a target split
across ranks too (the layer reading the embeddings and LM head whole, where each rank holds a share of them); the
layer's KV lies in the target's pages; a checkpoint without the layers is refused."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative import SpeculativeConfig
from tests.draft_models import with_mimo_mtp_layers, with_mimo_v2_flash_mtp_layers
from tests.parity.test_mtp import PARAMS, PROMPTS, _first_drafts, causal_mask, greedy_drafts
from tests.unit.test_draft_model import _run
from tests.unit.test_speculative import assert_same_outputs

pytestmark = pytest.mark.usefixtures("forked_ranks")  # (tests/parity/conftest.py)

MTP = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 3})
MIMO_MTP = SpeculativeConfig.from_dict({"method": "mimo_mtp", "num_speculative_tokens": 3})  # (vLLM's older name)
MODELS = ["mimo-v2-flash", "mimo"]
SOURCES = {"mimo-v2-flash": "mimo-v2-flash", "mimo": "qwen2-bias"}  # (MiMo's model is Qwen2's)


@pytest.fixture(scope="module")
def mtp_models(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo")
    return {"mimo-v2-flash": with_mimo_v2_flash_mtp_layers(tiny_model_dirs["mimo-v2-flash"], root / "mimo-v2-flash"),
            "mimo": with_mimo_mtp_layers(tiny_model_dirs["qwen2-bias"], root / "mimo")}


def _target(model_dir, prompt: list[int]):
    """transformers' model of `model_dir`, its last normed hidden states over `prompt` and its greedy next token."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        features = target.model(torch.tensor([prompt])).last_hidden_state[0]
    return target, features, int(target.lm_head(features[-1]).argmax())


def _layer_tensors(model_dir, prefix: str, released_names=()) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, t in load_file(model_dir / "model.safetensors").items():
        if name.startswith(prefix):
            name = name.removeprefix(prefix)
            for released, ours in released_names:
                name = name.replace(released, ours)
            tensors[name] = t
    return tensors


def _norms(norm_class, config, tensors: dict[str, torch.Tensor], *names: str):
    norms = []
    for name in names:
        norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        norm.weight.data.copy_(tensors.pop(f"{name}.weight"))
        norms.append(norm)
    return norms


def _mimo_v2_flash_drafts(model_dir, source, prompt: list[int], num_drafts: int) -> list[int]:
    """The first MTP layer's greedy drafts after the prompt and the target's first token, as vLLM's layer computes
    them, with transformers' sliding-window decoder layer of the model (its sinks, narrower scaled values, partial
    RoPE of the sliding layers' theta, a dense MLP) and transformers' last, normed hidden states of the target: at
    position q, the token at q + 1 and the target's hidden state at q, each normed, joined by eh_proj, through the
    layer; its output normed by final_layernorm makes the logits through the target's LM head, and is the next
    draft's hidden state."""
    from transformers import AutoConfig
    from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as modeling

    target, features, first = _target(model_dir, prompt)
    config = AutoConfig.from_pretrained(model_dir)
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers  # the MTP layer's kind, at index 0
    config.mlp_layer_types = ["dense"] * config.num_hidden_layers
    config._attn_implementation = "eager"  # (its sinks)
    tensors = _layer_tensors(model_dir, "model.mtp.layers.0.", (("attention_sink_bias", "sinks"),
                                                                ("pre_mlp_layernorm.", "post_attention_layernorm.")))
    embedding_norm, hidden_norm, final_norm = _norms(modeling.MiMoV2FlashRMSNorm, config, tensors,
                                                     "enorm", "hnorm", "final_layernorm")
    projection = tensors.pop("eh_proj.weight")
    layer = modeling.MiMoV2FlashDecoderLayer(config, 0).eval()
    layer.load_state_dict(tensors)

    def through(tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        x = torch.cat((embedding_norm(target.model.embed_tokens(torch.tensor(tokens))), hidden_norm(features)), dim=-1)
        x = (x @ projection.T)[None]
        n = len(tokens)
        distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        window = torch.zeros(n, n).masked_fill((distance < 0) | (distance >= config.sliding_window), float("-inf"))
        positions = torch.arange(n)[None]
        return final_norm(layer(x, attention_mask=window[None, None], position_ids=positions,
                                position_embeddings=target.model.rotary_emb(x, positions, "sliding_attention")))[0]

    return greedy_drafts(prompt[1:] + [first], features, num_drafts, through, target.lm_head)


def _mimo_drafts(model_dir, source, prompt: list[int], num_drafts: int) -> list[int]:
    """MiMo's first MTP layer's, as vLLM's layer computes them, with transformers' Qwen2 decoder layer and its hidden
    states of the target: at position q, the token at q + 1 (zeroed at position 0) and the target's hidden state at q,
    each normed, joined by input_proj (the hidden state's half first), through the layer, its output normed by
    final_layernorm."""
    from transformers import AutoConfig
    from transformers.models.qwen2 import modeling_qwen2 as modeling

    target, features, first = _target(source, prompt)
    config = AutoConfig.from_pretrained(source)
    config._attn_implementation = "eager"
    tensors = _layer_tensors(model_dir, "model.mtp_layers.0.")
    embedding_norm, hidden_norm, final_norm = _norms(modeling.Qwen2RMSNorm, config, tensors, "token_layernorm",
                                                     "hidden_layernorm", "final_layernorm")
    projection = tensors.pop("input_proj.weight")
    layer = modeling.Qwen2DecoderLayer(config, 0).eval()
    layer.load_state_dict(tensors)

    def through(tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        embedded = target.model.embed_tokens(torch.tensor(tokens)).clone()
        embedded[0] = 0.0  # position 0
        x = (torch.cat((hidden_norm(features), embedding_norm(embedded)), dim=-1) @ projection.T)[None]
        positions = torch.arange(len(tokens))[None]
        return final_norm(layer(x, attention_mask=causal_mask(len(tokens)), position_ids=positions,
                                position_embeddings=target.model.rotary_emb(x, positions)))[0]

    return greedy_drafts(prompt[1:] + [first], features, num_drafts, through, target.lm_head)


REFERENCES = {"mimo-v2-flash": _mimo_v2_flash_drafts, "mimo": _mimo_drafts}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("length", [37, 3, 70])  # 70: past MiMo-V2-Flash's window of 48
def test_the_mtp_layers_drafts_are_its_layer_computed_by_transformers(tiny_model_dirs, mtp_models, name, length):
    prompt = [(13 * j) % 400 + 5 for j in range(length)]
    engine = LLMEngine(EngineConfig(model=str(mtp_models[name]), num_kv_blocks=64, max_num_batched_tokens=16,
                                    speculative=MTP))
    assert engine.runner.kv_pool.tensor.shape[0] == engine.model_config.num_layers + 1  # its layer's KV in the pages
    reference = REFERENCES[name](mtp_models[name], tiny_model_dirs[SOURCES[name]], prompt, 3)
    assert _first_drafts(engine, prompt) == reference
    engine.close()


@pytest.mark.parametrize("name", MODELS)
def test_the_mtp_layer_changes_how_many_tokens_a_step_makes_never_which(mtp_models, name):
    plain, _, _ = _run(mtp_models[name], None, PROMPTS, PARAMS, max_num_batched_tokens=32)
    drafted, scheduler, _ = _run(mtp_models[name], MIMO_MTP if name == "mimo" else MTP, PROMPTS, PARAMS,
                                 max_num_batched_tokens=32)
    assert_same_outputs(drafted, plain)
    assert scheduler.drafting.num_draft_tokens > 0


@pytest.mark.parametrize("name", MODELS)
def test_a_target_split_across_ranks_drafts_with_its_mtp_layer_on_rank_0(mtp_models, name):
    plain, _, _ = _run(mtp_models[name], None, PROMPTS[:2], PARAMS[:2])
    drafted, scheduler, _ = _run(mtp_models[name], MTP, PROMPTS[:2], PARAMS[:2], tensor_parallel_size=2)
    assert_same_outputs(drafted, plain)
    assert scheduler.drafting.num_draft_tokens > 0


@pytest.mark.parametrize("name, projection", [("mimo-v2-flash", "model.mtp.layers.0.eh_proj.weight"),
                                              ("mimo", "model.mtp_layers.0.input_proj.weight")])
def test_a_checkpoint_without_its_mtp_layers_is_refused(tiny_model_dirs, tmp_path, name, projection):
    import json
    import shutil

    model_dir = shutil.copytree(tiny_model_dirs[SOURCES[name]], tmp_path / name)
    if name == "mimo":  # MiMo's config, its checkpoint without the layers (as some releases are)
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["MiMoForCausalLM"]}))
    with pytest.raises(ValueError, match=rf"the checkpoint has no MTP layer \({projection}\)"):
        LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=32, speculative=MTP))


def test_a_split_prefill_engines_pages_decode_in_an_unsplit_engine_as_in_one(mtp_models):
    """MiMo-V2-Flash's full layers' KV heads every other one of the pages' and the MTP layer's KV past the model's, as
    a prefill engine split in two writes them: an unsplit decode engine decodes from them the tokens, and takes the
    drafts each step, of one unsplit engine doing both."""
    from tests.parity.conftest import decoded_from_handed_over_pages
    from tests.parity.test_transformers_parity import _mixed_prompts

    model_dir = mtp_models["mimo-v2-flash"]
    prefill, decode, one = (LLMEngine(EngineConfig(
        model=str(model_dir), num_kv_blocks=128, max_num_batched_tokens=32, speculative=MTP, tensor_parallel_size=size,
        per_request_spec_decode_metrics="detailed")) for size in (2, 1, 1))
    prompts = _mixed_prompts(512)[1:4]
    outputs = decoded_from_handed_over_pages(prefill, decode, {f"r{i}": (p, 16, {}, {}) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        one.add_request(f"r{i}", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    one_outputs = {}
    while one.has_unfinished_requests():
        one_outputs |= {out.request_id: out for out in one.step() if out.finished}
    for i in range(3):
        assert outputs[f"r{i}"].token_ids == one_outputs[f"r{i}"].token_ids
        assert outputs[f"r{i}"].spec_decode.per_step == one_outputs[f"r{i}"].spec_decode.per_step
    for engine in (prefill, decode, one):
        engine.close()
