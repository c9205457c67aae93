"""Speculative decoding with a checkpoint's multi-token prediction layer (engine/models/mtp.py), vLLM's
`{"method": "mtp"}` (`deepseek_mtp`): for DeepSeek-V3, GLM-4.5 and GLM-4.7-Flash, the drafts are the layer's as
transformers' own decoder layer of the model computes it from transformers' hidden states of the target, and the
tokens are plain decoding's; a checkpoint without the layer is refused."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative import SpeculativeConfig
from tests.draft_models import with_mtp_layer
from tests.unit.test_draft_model import _run
from tests.unit.test_speculative import assert_same_outputs

pytestmark = pytest.mark.usefixtures("forked_ranks")  # (tests/parity/conftest.py)

MODELS = ["deepseek-v3", "deepseek-v3.2", "glm4-moe", "glm4-moe-lite", "glm5"]
MTP = SpeculativeConfig.from_dict({"method": "deepseek_mtp", "num_speculative_tokens": 3})
PROMPTS = [[5, 6, 7, 8] * 30, list(range(10, 60)), [9] * 5]  # the tiny models' vocabulary: 512 tokens
PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.8, seed=3, top_p=0.9, top_k=50, repetition_penalty=1.2,
                   presence_penalty=0.3, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=33, temperature=0.0, min_tokens=10, stop_token_ids=(439, 130), logprobs=0),
]


@pytest.fixture(scope="module")
def mtp_models(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {name: with_mtp_layer(tiny_model_dirs[name], root / name) for name in MODELS}


@pytest.mark.parametrize("name", MODELS)
def test_the_checkpoints_mtp_layer_changes_how_many_tokens_a_step_makes_never_which(mtp_models, name):
    plain, _, _ = _run(mtp_models[name], None, PROMPTS, PARAMS, max_num_batched_tokens=32)
    drafted, scheduler, _ = _run(mtp_models[name], MTP, PROMPTS, PARAMS, max_num_batched_tokens=32)
    assert_same_outputs(drafted, plain)
    assert scheduler.drafting.num_draft_tokens > 0


def test_a_target_split_across_ranks_drafts_with_its_mtp_layer_on_rank_0(mtp_models):
    """The layer reads rank 0's hidden states (whole after each layer's sum) and computes unsplit beside the ranks."""
    plain, _, _ = _run(mtp_models["deepseek-v3"], None, PROMPTS[:2], PARAMS[:2])
    drafted, scheduler, _ = _run(mtp_models["deepseek-v3"], MTP, PROMPTS[:2], PARAMS[:2], tensor_parallel_size=2)
    assert_same_outputs(drafted, plain)
    assert scheduler.drafting.num_draft_tokens > 0


def greedy_drafts(tokens: list[int], features: torch.Tensor, num_drafts: int,
                  through: Callable[[list[int], torch.Tensor], torch.Tensor],
                  logits_of: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
    """An MTP layer's greedy drafts, chained as vLLM chains them: `through(tokens, features)` is the layer's output
    [n, hidden] at each position, from the token after it and the hidden state there; its last row makes the draft
    (`logits_of`) and is the next draft's hidden state."""
    drafts = []
    with torch.no_grad():
        for _ in range(num_drafts):
            output = through(tokens, features)
            token = int(logits_of(output[-1]).argmax())
            drafts.append(token)
            tokens = [*tokens, token]
            features = torch.cat((features, output[-1:]))
    return drafts


def mtp_model_drafts(target, prompt: list[int], num_drafts: int) -> list[int]:
    """transformers' own MtpModel (`generate(use_mtp=True)`'s) of the checkpoint `target` (a transformers model) was
    read from: its first layer over the target's last hidden states and the tokens one ahead (the mask and RoPE of
    the layer's kind), each draft its logits' greedy pick, its output the next draft's hidden state."""
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel.from_pretrained(target).eval()
    with torch.no_grad():
        features = target.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        first = int(target.lm_head(features[-1]).argmax())

    def through(tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        return mtp.forward_layer(0, features[None], torch.arange(len(tokens))[None], None,
                                 input_ids=torch.tensor([tokens]))[0]

    return greedy_drafts(prompt[1:] + [first], features, num_drafts, through, mtp._project_to_logits)


def check_first_drafts(model_dir, prompt: list[int], reference: list[int]) -> None:
    """The checkpoint's MTP layer, `{"method": "mtp"}`, keeps its KV in the target's pages and drafts `reference`
    after `prompt` (prefilled in chunks of 16) and the target's first token."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=16,
                                    speculative=SpeculativeConfig.from_dict({"method": "mtp",
                                                                             "num_speculative_tokens": 3})))
    assert engine.runner.kv_pool.tensor.shape[0] == engine.model_config.num_layers + 1
    assert _first_drafts(engine, prompt) == reference
    engine.close()


def causal_mask(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def _reference_drafts(model_dir, prompt: list[int], num_drafts: int) -> list[int]:
    """The MTP layer's greedy drafts after the prompt and the target's first token, as vLLM's layer computes them,
    with transformers' decoder layer of the model (its attention, experts and RoPE) and transformers' hidden states
    of the target: at position q, the token at q + 1 (zeroed at position 0) and the target's last, normed hidden
    state at q, each normed, joined by eh_proj, through the layer; its output normed by shared_head.norm makes the
    logits, and is the next draft's hidden state."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as deepseek_v32
    from transformers.models.glm4_moe import modeling_glm4_moe as glm
    from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as glm_lite
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm_dsa

    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    modeling, prefix = {"deepseek_v3": (deepseek, "DeepseekV3"), "deepseek_v32": (deepseek_v32, "DeepseekV32"),
                        "glm4_moe": (glm, "Glm4Moe"),
                        "glm4_moe_lite": (glm_lite, "Glm4MoeLite"),
                        "glm_moe_dsa": (glm_dsa, "GlmMoeDsa")}[config.model_type]
    if config.model_type in ("glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"):  # its layer types name the model's
        # layers, not the MTP layer past them (GLM-5's with an indexer of its own)
        config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
        if config.model_type == "glm_moe_dsa":
            config.indexer_types = [*config.indexer_types, "full"]
            config.layer_types = [*config.layer_types, config.layer_types[-1]]
    mtp = config.num_hidden_layers
    tensors = {name.removeprefix(f"model.layers.{mtp}."): t for name, t in load_file(
        model_dir / "model.safetensors").items() if name.startswith(f"model.layers.{mtp}.")}
    layer = getattr(modeling, f"{prefix}DecoderLayer")(config, mtp)
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    state = {name: t for name, t in tensors.items() if not name.startswith(own + ("mlp.experts.",))}
    experts = range(config.n_routed_experts)  # transformers holds them fused: [E, gate + up, in], [E, out, in]
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat((tensors[f"mlp.experts.{e}.gate_proj.weight"],
                                                                tensors[f"mlp.experts.{e}.up_proj.weight"]))
                                                     for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([tensors[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    layer.load_state_dict(state)
    rope = getattr(modeling, f"{prefix}RotaryEmbedding")(config)

    def rms(x, weight):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
        return weight * x

    def through(tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        embedded = tensors["embed_tokens.weight"][torch.tensor(tokens)].clone()
        embedded[0] = 0.0  # position 0
        x = torch.cat((rms(embedded, tensors["enorm.weight"]), rms(features, tensors["hnorm.weight"])), dim=-1)
        x = (x @ tensors["eh_proj.weight"].T)[None]
        positions = torch.arange(len(tokens))[None]
        output = layer(x, attention_mask=causal_mask(len(tokens)), position_ids=positions,
                       position_embeddings=rope(x, positions))
        return (output[0] if isinstance(output, tuple) else output)[0]  # (GLM-5's returns the indexer's choice)

    def logits_of(last: torch.Tensor) -> torch.Tensor:
        return rms(last, tensors["shared_head.norm.weight"]) @ tensors["shared_head.head.weight"].T

    features = out.hidden_states[-1][0]  # the target's last hidden states, normed
    return greedy_drafts(prompt[1:] + [int(out.logits[0, -1].argmax())], features, num_drafts, through, logits_of)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("length", [37, 3])  # a short one: its first position weighs in every draft
def test_the_mtp_layers_drafts_are_its_layer_computed_by_transformers(mtp_models, name, length):
    prompt = [(13 * j) % 400 + 5 for j in range(length)]
    engine = LLMEngine(EngineConfig(model=str(mtp_models[name]), num_kv_blocks=64, max_num_batched_tokens=16,
                                    speculative=MTP))
    assert _first_drafts(engine, prompt) == _reference_drafts(mtp_models[name], prompt, 3)


def _first_drafts(engine: LLMEngine, prompt: list[int], request_id: str = "r") -> list[int]:
    """The three drafts the engine's drafter makes after the prompt (in chunks of 16) and its first token."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.step()
    seq = next(seq for seq in engine.scheduler.running if seq.request_id == request_id)
    while seq.num_uncomputed_tokens > 1:
        engine.step()
    return engine.scheduler.drafter.propose([(seq, 3)])[request_id]


def test_a_weight_update_brings_the_new_checkpoints_mtp_layer(tiny_model_dirs, mtp_models, tmp_path):
    """SGLang's update_weights_from_disk: the MTP layer drafting from the served checkpoint is read from the next
    (here the same model with another MTP layer)."""
    served = mtp_models["deepseek-v3"]
    following = with_mtp_layer(tiny_model_dirs["deepseek-v3"], tmp_path / "next", seed=5)
    prompt = [(13 * j) % 400 + 5 for j in range(20)]
    engine = LLMEngine(EngineConfig(model=str(served), num_kv_blocks=64, speculative=MTP))
    assert engine.update_weights(following) is not None
    assert _first_drafts(engine, prompt) == _reference_drafts(following, prompt, 3) != \
        _reference_drafts(served, prompt, 3)


def test_a_checkpoint_without_an_mtp_layer_is_refused(tiny_model_dirs, mtp_models, tmp_path):
    # GLM-4.5's config says it has one; the checkpoint, as some releases are, leaves it out
    with pytest.raises(ValueError, match=r"the checkpoint has no MTP layer \(model.layers.3.eh_proj.weight\)"):
        LLMEngine(EngineConfig(model=str(tiny_model_dirs["glm4-moe"]), num_kv_blocks=32, speculative=MTP))
    with pytest.raises(ValueError, match="LlamaForCausalLM checkpoints carry no multi-token prediction layer"):
        LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama-gqa-untied"]), num_kv_blocks=32, speculative=MTP))
    several = tmp_path / "several"
    shutil.copytree(mtp_models["deepseek-v3"], several)
    config = json.loads((several / "config.json").read_text())
    (several / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 2; Baton drafts with a checkpoint's one"):
        LLMEngine(EngineConfig(model=str(several), num_kv_blocks=32, speculative=MTP))
