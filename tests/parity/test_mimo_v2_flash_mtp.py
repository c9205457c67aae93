"""Speculative decoding with MiMo-V2-Flash's multi-token prediction layers (engine/models/mimo_v2_flash_mtp.py),
vLLM's and SGLang's `{"method": "mtp"}`: the drafts are the first layer's as transformers' own sliding-window decoder
layer of the model computes it from transformers' hidden states of the target, over more tokens than the window too;
the tokens are plain decoding's, beside a target split across ranks too (the layer reading the embeddings and LM
head whole, where each rank holds a share of them); the layer's KV lies in the target's pages; a checkpoint without
the layers is refused."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.speculative import SpeculativeConfig
from tests.draft_models import with_mimo_v2_flash_mtp_layers
from tests.parity.test_mtp import PARAMS, PROMPTS, _first_drafts, greedy_drafts
from tests.unit.test_draft_model import _run
from tests.unit.test_speculative import assert_same_outputs

MTP = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 3})
LAYER = "model.mtp.layers.0."
RELEASED_NAMES = (("attention_sink_bias", "sinks"), ("pre_mlp_layernorm.", "post_attention_layernorm."))


@pytest.fixture(scope="module")
def mtp_model(tiny_model_dirs, tmp_path_factory):
    return with_mimo_v2_flash_mtp_layers(tiny_model_dirs["mimo-v2-flash"], tmp_path_factory.mktemp("mimo") / "mtp")


def _reference_drafts(model_dir, prompt: list[int], num_drafts: int) -> list[int]:
    """The first MTP layer's greedy drafts after the prompt and the target's first token, as vLLM's layer computes
    them, with transformers' sliding-window decoder layer of the model (its sinks, narrower scaled values, partial
    RoPE of the sliding layers' theta, a dense MLP) and transformers' last, normed hidden states of the target: at
    position q, the token at q + 1 and the target's hidden state at q, each normed, joined by eh_proj, through the
    layer; its output normed by final_layernorm makes the logits through the target's LM head, and is the next
    draft's hidden state."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as modeling

    config = AutoConfig.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        features = target.model(torch.tensor([prompt])).last_hidden_state[0]
        first = int(target.lm_head(features[-1]).argmax())
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers  # the MTP layer's kind, at index 0
    config.mlp_layer_types = ["dense"] * config.num_hidden_layers
    config._attn_implementation = "eager"  # (its sinks)
    layer = modeling.MiMoV2FlashDecoderLayer(config, 0).eval()
    tensors = {name.removeprefix(LAYER): t for name, t in load_file(model_dir / "model.safetensors").items()
               if name.startswith(LAYER)}
    state = {}
    for name, t in tensors.items():
        for released, ours in RELEASED_NAMES:
            name = name.replace(released, ours)
        state[name] = t
    own = {name: state.pop(name) for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                              "final_layernorm.weight")}
    layer.load_state_dict(state)

    def norm(name):
        module = modeling.MiMoV2FlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        module.weight.data.copy_(own[f"{name}.weight"])
        return module

    embedding_norm, hidden_norm, final_norm = norm("enorm"), norm("hnorm"), norm("final_layernorm")

    def through(tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        x = torch.cat((embedding_norm(target.model.embed_tokens(torch.tensor(tokens))), hidden_norm(features)), dim=-1)
        x = (x @ own["eh_proj.weight"].T)[None]
        n = len(tokens)
        distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        window = torch.zeros(n, n).masked_fill((distance < 0) | (distance >= config.sliding_window), float("-inf"))
        positions = torch.arange(n)[None]
        return final_norm(layer(x, attention_mask=window[None, None], position_ids=positions,
                                position_embeddings=target.model.rotary_emb(x, positions, "sliding_attention")))[0]

    return greedy_drafts(prompt[1:] + [first], features, num_drafts, through, target.lm_head)


@pytest.mark.parametrize("length", [37, 3, 70])  # 70: past the window of 48
def test_the_mtp_layers_drafts_are_its_layer_computed_by_transformers(mtp_model, length):
    prompt = [(13 * j) % 400 + 5 for j in range(length)]
    engine = LLMEngine(EngineConfig(model=str(mtp_model), num_kv_blocks=64, max_num_batched_tokens=16,
                                    speculative=MTP))
    assert engine.runner.kv_pool.tensor.shape[0] == 4  # its layer's KV in every page, past the model's three
    assert _first_drafts(engine, prompt) == _reference_drafts(mtp_model, prompt, 3)
    engine.close()


def test_the_mtp_layer_changes_how_many_tokens_a_step_makes_never_which(mtp_model):
    plain, _, _ = _run(mtp_model, None, PROMPTS, PARAMS, max_num_batched_tokens=32)
    drafted, scheduler, _ = _run(mtp_model, MTP, PROMPTS, PARAMS, max_num_batched_tokens=32)
    assert_same_outputs(drafted, plain)
    assert scheduler.drafting.num_draft_tokens > 0


def test_a_checkpoint_without_its_mtp_layers_is_refused(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"the checkpoint has no MTP layer \(model.mtp.layers.0.eh_proj.weight\)"):
        LLMEngine(EngineConfig(model=str(tiny_model_dirs["mimo-v2-flash"]), num_kv_blocks=32, speculative=MTP))


def test_a_target_split_across_ranks_drafts_with_its_mtp_layer_on_rank_0(mtp_model):
    plain, _, _ = _run(mtp_model, None, PROMPTS[:2], PARAMS[:2])
    drafted, scheduler, _ = _run(mtp_model, MTP, PROMPTS[:2], PARAMS[:2], tensor_parallel_size=2)
    assert_same_outputs(drafted, plain)
    assert scheduler.drafting.num_draft_tokens > 0
