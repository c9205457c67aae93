"""Speculative decoding of hybrid models by drafts of a model or head. Qwen3-Next's and Qwen3.5's own multi-token
prediction layer (engine/models/qwen3_next_mtp.py; vLLM's `{"method": "mtp"}`, once `qwen3_next_mtp`): its drafts
are the layer's as transformers' own decoder layer of the model computes it from transformers' hidden states of the
target; the tokens are plain decoding's and transformers', whether the drafts are taken or not (the recurrent states
going on from the last token taken), in one engine, from a cached prefix and after a prefill engine's handoff (the
layer's KV in the pages handed over). Nemotron 3's MTP layer (engine/models/nemotron_h_mtp.py: an attention block
and an expert block) alike. An EAGLE-3 head and a draft model of attention layers draft for them too; what is
refused."""
from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative import SpeculativeConfig
from tests.draft_models import (
    eagle_head,
    qwen3_next_mtp_replica,
    with_nemotron_h_mtp_layer,
    with_qwen3_next_mtp_layer,
)
from tests.parity.conftest import decoded_from_handed_over_pages, greedy_outputs
from tests.parity.test_hybrid_models import _greedy
from tests.parity.test_mtp import PARAMS, PROMPTS, _first_drafts, causal_mask, greedy_drafts
from tests.parity.test_transformers_parity import _mixed_prompts
from tests.unit.test_draft_model import _run
from tests.unit.test_speculative import assert_same_outputs

MODELS = ["qwen3.5", "qwen3-next", "qwen3.5-moe"]
MTP = SpeculativeConfig.from_dict({"method": "qwen3_next_mtp", "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def mtp_models(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-mtp")
    return {name: with_qwen3_next_mtp_layer(tiny_model_dirs[name], root / name) for name in MODELS}


@pytest.fixture(scope="module")
def replicas(tiny_model_dirs, tmp_path_factory):
    """Targets whose layers add a hundredth of what they added, their MTP layer drafting their LM head's pick: it
    is taken about one time in five, one to three drafts at a time."""
    root = tmp_path_factory.mktemp("qwen-mtp-replica")
    return {name: qwen3_next_mtp_replica(tiny_model_dirs[name], root / name, layer_scale=0.01)
            for name in ("qwen3.5", "qwen3-next")}


def _reference_drafts(model_dir, prompt: list[int], num_drafts: int) -> list[int]:
    """The MTP layer's greedy drafts after the prompt and the target's first token, as vLLM's layer computes them,
    with transformers' full-attention decoder layer of the model (its gated attention, experts or MLP, RoPE and
    norms of 1 + weight) and transformers' last, normed hidden states of the target: at position q, the token at
    q + 1 and the target's hidden state at q, each normed, joined by fc, through the layer; its output normed by
    mtp.norm makes the logits through the target's LM head, and is the next draft's hidden state."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        features = target.model(torch.tensor([prompt])).last_hidden_state[0]
        first = int(target.lm_head(features[-1]).argmax())
    modeling = sys.modules[type(target).__module__]
    prefix = type(target).__name__.removesuffix("ForCausalLM")
    config.layer_types = ["full_attention"] * config.num_hidden_layers  # the MTP layer's kind, at index 0
    layer = getattr(modeling, f"{prefix}DecoderLayer")(config, 0).eval()
    tensors = {name.removeprefix("mtp."): t for name, t in load_file(model_dir / "model.safetensors").items()
               if name.startswith("mtp.")}
    state = {name.removeprefix("layers.0."): t for name, t in tensors.items()
             if name.startswith("layers.0.") and ".mlp.experts." not in name}
    if getattr(config, "num_experts", 0):  # transformers holds them fused: [E, gate + up, in], [E, out, in]
        experts = range(config.num_experts)
        state["mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat((tensors[f"layers.0.mlp.experts.{e}.gate_proj.weight"],
                       tensors[f"layers.0.mlp.experts.{e}.up_proj.weight"])) for e in experts])
        state["mlp.experts.down_proj"] = torch.stack([tensors[f"layers.0.mlp.experts.{e}.down_proj.weight"]
                                                      for e in experts])
    layer.load_state_dict(state)
    rope = target.model.rotary_emb

    def norm(name):
        module = getattr(modeling, f"{prefix}RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
        module.weight.data.copy_(tensors[f"{name}.weight"])
        return module

    embedding_norm, hidden_norm, final_norm = norm("pre_fc_norm_embedding"), norm("pre_fc_norm_hidden"), norm("norm")

    def through(tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        x = torch.cat((embedding_norm(target.model.embed_tokens(torch.tensor(tokens))), hidden_norm(features)), dim=-1)
        x = (x @ tensors["fc.weight"].T)[None]
        positions = torch.arange(len(tokens))[None]
        return final_norm(layer(x, attention_mask=causal_mask(len(tokens)), position_ids=positions,
                                position_embeddings=rope(x, positions))[0])

    return greedy_drafts(prompt[1:] + [first], features, num_drafts, through, target.lm_head)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("length", [37, 3])
def test_the_mtp_layers_drafts_are_its_layer_computed_by_transformers(mtp_models, name, length):
    prompt = [(13 * j) % 400 + 5 for j in range(length)]
    engine = LLMEngine(EngineConfig(model=str(mtp_models[name]), num_kv_blocks=64, max_num_batched_tokens=16,
                                    speculative=MTP))
    assert engine.runner.kv_pool.tensor.shape[0] == 3  # its layer's KV in every page, past the model's two
    assert _first_drafts(engine, prompt) == _reference_drafts(mtp_models[name], prompt, 3)
    engine.close()


@pytest.mark.parametrize("name", MODELS)
def test_the_mtp_layer_changes_how_many_tokens_a_step_makes_never_which(mtp_models, name):
    plain, _, _ = _run(mtp_models[name], None, PROMPTS, PARAMS, max_num_batched_tokens=32)
    drafted, scheduler, _ = _run(mtp_models[name], MTP, PROMPTS, PARAMS, max_num_batched_tokens=32)
    assert_same_outputs(drafted, plain)
    assert scheduler.num_draft_tokens > 0


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3-next"])
def test_drafts_taken_in_part_leave_the_states_after_the_last_token_taken(replicas, name):
    """Steps taking 0 to 3 of their drafts: the tokens are transformers', so each step went on from the recurrent
    states after the last token it took."""
    prompts = _mixed_prompts(512)[:6]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    drafted, scheduler, _ = _run(replicas[name], MTP, prompts, params, max_num_batched_tokens=64)
    assert [drafted[str(i)][0] for i in range(len(prompts))] == _greedy(replicas[name], prompts, 24)
    accepted = scheduler.num_accepted_tokens_per_position
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens and len(accepted) == 3 and accepted[2] > 0


def test_prompts_drafted_for_continue_from_a_cached_prefix(replicas):
    """A prompt sharing 40 tokens with a computed one continues from its first 32 (the states kept at a chunk's
    end), the MTP layer's KV of them in the same pages."""
    model_dir = replicas["qwen3.5"]
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=256, max_num_batched_tokens=32,
                                    speculative=MTP))
    prompts = _mixed_prompts(512)
    outputs = greedy_outputs(engine, {"r2": (prompts[2], {})}, 16)
    outputs |= greedy_outputs(engine, {"r3": (prompts[3], {})}, 16)
    assert engine.block_manager.num_prefix_hit_tokens == 32
    assert [outputs["r2"], outputs["r3"]] == _greedy(model_dir, [prompts[2], prompts[3]], 16)
    assert engine.scheduler.num_accepted_tokens > 0
    engine.close()


def test_a_decode_engine_drafts_from_the_mtp_layers_kv_its_prefill_engine_computed(replicas):
    """The prefill engine computes the MTP layer's KV of the prompt into the pages it hands over (with the states'
    pages), and drafts from the prompt's last hidden state for the decode engine's first step, which takes them
    (as one engine doing both drafts there); its layer drafts over the whole prompt from then on."""
    model_dir = replicas["qwen3-next"]
    prefill, decode, one = (LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=128, max_num_batched_tokens=32,
                                                   speculative=MTP, per_request_spec_decode_metrics="detailed"))
                            for _ in range(3))
    prompts = _mixed_prompts(512)[1:4]
    outputs = decoded_from_handed_over_pages(prefill, decode, {f"r{i}": (p, 16, {}, {}) for i, p in enumerate(prompts)})
    assert [outputs[f"r{i}"].token_ids for i in range(3)] == _greedy(model_dir, prompts, 16)
    for i, prompt in enumerate(prompts):
        one.add_request(f"r{i}", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    one_outputs = {}
    while one.has_unfinished_requests():
        one_outputs |= {out.request_id: out for out in one.step() if out.finished}
    for i in range(3):  # each step's drafts and those taken
        assert outputs[f"r{i}"].spec_decode.per_step == one_outputs[f"r{i}"].spec_decode.per_step
        assert outputs[f"r{i}"].spec_decode.per_step[0][0] == MTP.num_speculative_tokens
    assert decode.scheduler.num_accepted_tokens > 0
    one.close()
    prefill.close()
    decode.close()


def _head_kv(engine: LLMEngine, pages: list[int], num_positions: int) -> torch.Tensor:
    """The MTP layer's K and V (the pool's last layer) of the first positions of a sequence's pages."""
    kv = engine.runner.kv_pool.tensor[-1][:, :, pages]  # [2, Hkv, pages, bs, D]
    return kv.flatten(2, 3)[:, :, :num_positions]


def test_the_mtp_layers_kv_handed_over_is_what_one_engine_computes(mtp_models):
    """A 77-token prompt in chunks of 32: the prefill engine's pages hold the layer's KV of every prompt position,
    the last chunk's computed once its first token is sampled, as one engine's drafting computes it."""
    model_dir, prompt = mtp_models["qwen3-next"], _mixed_prompts(512)[5]
    prefill, one = (LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=32,
                                           speculative=MTP)) for _ in range(2))
    prefill.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0.0), prefill_only=True)
    while not any(out.finished for out in prefill.step()):
        pass
    handed = _head_kv(prefill, prefill.held_block_ids("r")[:-prefill.block_manager.num_state_blocks], len(prompt))
    _first_drafts(one, prompt)
    assert (handed - _head_kv(one, one.scheduler.running[0].block_table, len(prompt))).abs().max().item() < 1e-5
    prefill.close()
    one.close()


def test_a_multimodal_qwen3_5_checkpoints_mtp_layer_drafts_beside_its_images(tmp_path):
    """Qwen3.5 as released: mtp_num_hidden_layers in text_config, the layer under `mtp.` beside the text model's
    `model.language_model.` and the tower's `model.visual.`; prompts with images give transformers' tokens, and the
    layer's input at position j is turned by the model's multimodal position j (an image's tokens by their rows and
    columns, the text after it counting on from one past the largest), as vLLM's layer is."""
    from engine.prompt_images import MRoPEPositions
    from tests.parity.images import image_engine, saved_qwen_vl
    from tests.parity.test_qwen_vl_images import IMAGE, VISION_END, VISION_START, _assert_transformers_tokens, _requests

    model = saved_qwen_vl("qwen3_5", tmp_path / "vl", 35, image_token_id=IMAGE, vision_start_token_id=VISION_START,
                          vision_end_token_id=VISION_END)
    model_dir = with_qwen3_next_mtp_layer(tmp_path / "vl", tmp_path / "vl-mtp")
    engine = image_engine(model_dir, speculative=MTP)
    _assert_transformers_tokens(engine, model, _requests(2))
    assert engine.scheduler.num_draft_tokens > 0
    engine.close()

    engine = image_engine(model_dir, speculative=MTP)
    drafter = engine.scheduler.drafter
    seen, forward = [], drafter.runner.model.forward

    def recorded(ids, positions, meta, *rest):  # (the one sequence's positions as the layer reads them)
        seen.append((positions, meta.positions, drafter._held["three"].rope_positions))
        return forward(ids, positions, meta, *rest)

    drafter.runner.model.forward = recorded
    prompt, images = _requests(2)["three"]
    greedy_outputs(engine, {"three": (prompt, {"images": images})}, 8)
    assert len(seen) > 2
    for turned, flat, table in seen:  # each step's rows: the prompt's from its table, later ones past it by the delta
        assert isinstance(table, MRoPEPositions)
        in_prompt = flat < table.prompt.shape[1]
        expected = (flat + table.delta).expand(3, -1).clone()
        expected[:, in_prompt] = table.prompt[:, flat[in_prompt]]
        assert torch.equal(turned, expected)
    assert any(len(set(column)) > 1 for turned, _, _ in seen for column in turned.t().tolist())  # an image's tokens
    engine.close()


def test_mtp_layers_baton_does_not_read_are_refused(tiny_model_dirs, mtp_models, tmp_path):
    def engine(model_dir):
        return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=32, speculative=MTP))

    with pytest.raises(ValueError, match=r"the checkpoint has no MTP layer \(mtp.fc.weight\)"):
        engine(tiny_model_dirs["qwen3.5"])
    for key, value, message in [("mtp_num_hidden_layers", 2, "mtp_num_hidden_layers is 2; Baton drafts with a"),
                                ("mtp_use_dedicated_embeddings", True, "with embeddings of its own")]:
        changed = shutil.copytree(mtp_models["qwen3.5"], tmp_path / key)
        config = json.loads((changed / "config.json").read_text())
        (changed / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=message):
            engine(changed)


@pytest.mark.parametrize("kind", ["eagle3", "draft_model"])
def test_an_eagle_head_or_a_draft_model_drafts_for_a_hybrid_model(tiny_model_dirs, tmp_path, kind):
    """An EAGLE-3 head reading the inputs of a linear-attention layer and two full-attention ones (its KV in the
    target's pages); a Llama of the same vocabulary (its own pages)."""
    target = tiny_model_dirs["qwen3.5"]
    if kind == "eagle3":
        head = eagle_head(target, tmp_path / "head", "eagle3", target_layers=[0, 1, 3])
        config = json.loads((head / "config.json").read_text())  # a Llama's RoPE, as EAGLE-3's releases have
        (head / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "default",
                                                                                      "rope_theta": 10000.0}}))
        speculative = SpeculativeConfig.from_dict({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    else:
        speculative = SpeculativeConfig.from_dict({"model": str(tiny_model_dirs["llama-gqa-untied"]),
                                                   "num_speculative_tokens": 3})
    plain, _, _ = _run(target, None, PROMPTS, PARAMS, max_num_batched_tokens=32)
    drafted, scheduler, _ = _run(target, speculative, PROMPTS, PARAMS, max_num_batched_tokens=32)
    assert_same_outputs(drafted, plain)
    assert scheduler.num_draft_tokens > 0


def test_a_draft_model_with_recurrent_layers_is_refused(tiny_model_dirs):
    speculative = SpeculativeConfig.from_dict({"model": str(tiny_model_dirs["qwen3.5"]), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"a draft model with recurrent layers \(Qwen3_5ForCausalLM\) is not"):
        LLMEngine(EngineConfig(model=str(tiny_model_dirs["qwen3-next"]), num_kv_blocks=32, speculative=speculative))


@pytest.fixture(scope="module")
def nemotron_mtp(tiny_model_dirs, tmp_path_factory):
    return with_nemotron_h_mtp_layer(tiny_model_dirs["nemotron-h-moe"], tmp_path_factory.mktemp("nemotron") / "mtp")


def _nemotron_reference_drafts(model_dir, prompt: list[int], num_drafts: int) -> list[int]:
    """Nemotron 3's MTP layer's greedy drafts after the prompt and the target's first token, as vLLM's layer computes
    them, with transformers' Nemotron-H blocks of the pattern's kinds (attention without RoPE; experts of squared
    ReLU in the latent width) and transformers' last, normed hidden states of the target: the token at q + 1 and the
    hidden state at q, each normed, joined by eh_proj, through the blocks, normed by the last one's final_layernorm
    into the target's LM head; its output is the next draft's hidden state."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.nemotron_h import modeling_nemotron_h as nemotron

    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        features = target.get_decoder()(torch.tensor([prompt])).last_hidden_state[0]
        first = int(target.lm_head(features[-1]).argmax())
    assert config.mtp_layers_block_type == ["full_attention", "moe"]  # read from mtp_hybrid_override_pattern "*E"
    config.layers_block_type = config.mtp_layers_block_type
    tensors = {name.removeprefix("mtp.layers."): t for name, t in load_file(model_dir / "model.safetensors").items()
               if name.startswith("mtp.layers.")}
    blocks = []
    for i in range(2):
        block = nemotron.NemotronHBlock(config, i).eval()
        state = {name.removeprefix(f"{i}."): t for name, t in tensors.items()
                 if name.startswith(f"{i}.") and ".experts." not in name}
        if i == 1:  # transformers holds the experts fused: [E, out, in] each
            for projection in ("up_proj", "down_proj"):
                state[f"mixer.experts.{projection}"] = torch.stack([tensors[f"1.mixer.experts.{e}.{projection}.weight"]
                                                                    for e in range(config.n_routed_experts)])
        own = ("enorm.", "hnorm.", "eh_proj.", "final_layernorm.")
        block.load_state_dict({name: t for name, t in state.items() if not name.startswith(own)})
        blocks.append(block)

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.layer_norm_epsilon)

    def through(tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        embedded = target.get_input_embeddings()(torch.tensor(tokens))
        x = torch.cat((rms(embedded, tensors["0.enorm.weight"]), rms(features, tensors["0.hnorm.weight"])), dim=-1)
        x = (x @ tensors["0.eh_proj.weight"].T)[None]
        for block in blocks:
            x = block(x, attention_mask=causal_mask(len(tokens)))
        return rms(x[0], tensors["1.final_layernorm.weight"])

    return greedy_drafts(prompt[1:] + [first], features, num_drafts, through, target.lm_head)


@pytest.mark.parametrize("length", [37, 3])
def test_nemotron_3s_mtp_layers_drafts_are_its_blocks_computed_by_transformers(nemotron_mtp, length):
    prompt = [(13 * j) % 400 + 5 for j in range(length)]
    engine = LLMEngine(EngineConfig(model=str(nemotron_mtp), num_kv_blocks=64, max_num_batched_tokens=16,
                                    speculative=MTP))
    assert engine.runner.kv_pool.tensor.shape[0] == 2  # its attention block's KV in every page, past the model's one
    assert _first_drafts(engine, prompt) == _nemotron_reference_drafts(nemotron_mtp, prompt, 3)
    engine.close()


def test_nemotron_3s_mtp_layer_changes_how_many_tokens_a_step_makes_never_which(nemotron_mtp):
    plain, _, _ = _run(nemotron_mtp, None, PROMPTS, PARAMS, max_num_batched_tokens=32)
    drafted, scheduler, _ = _run(nemotron_mtp, MTP, PROMPTS, PARAMS, max_num_batched_tokens=32)
    assert_same_outputs(drafted, plain)
    assert scheduler.num_draft_tokens > 0


def test_nemotron_mtp_layers_baton_does_not_read_are_refused(tiny_model_dirs, nemotron_mtp, tmp_path):
    def engine(model_dir):
        return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=32, speculative=MTP))

    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        engine(tiny_model_dirs["nemotron-h-moe"])
    for changes, message in [({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers is 2; Baton drafts with"),
                             ({"mtp_hybrid_override_pattern": "M*"}, r"blocks \['M', '\*'\] is not supported")]:
        changed = shutil.copytree(nemotron_mtp, tmp_path / str(len(message)))
        config = json.loads((changed / "config.json").read_text())
        (changed / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(ValueError, match=message):
            engine(changed)
