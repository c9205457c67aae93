"""Speculative decoding with Step-3.7's multi-token prediction layer (engine/models/step3p7_mtp.py), `{"method":
"mtp"}`, against transformers' own MtpModel (`generate(use_mtp=True)`'s) reading the same checkpoint: each draft is
its layer's greedy pick over transformers' hidden states of the target, the layer's output chained into the next draft
as transformers chains its layers; for a full-attention layer with a dense MLP and a sliding-window one with experts.
The tokens are plain decoding's, beside a target split across ranks too; the layer's kinds, heads and clamps as
StepFun's released configs give them; what it cannot read is refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config_loader import load_model_config
from engine.models.step3p7_mtp import step3p7_mtp_config
from engine.speculative import SpeculativeConfig
from tests.draft_models import with_step3p7_mtp_layer
from tests.parity.conftest import transformers
from tests.parity.test_mtp import PARAMS, PROMPTS, check_first_drafts, mtp_model_drafts
from tests.parity.test_step3p7 import TEXT, _make, _released
from tests.unit.test_draft_model import _run
from tests.unit.test_speculative import assert_same_outputs

pytestmark = pytest.mark.usefixtures("forked_ranks")  # (tests/parity/conftest.py)

MTP = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 3})
# (transformers' MtpModel gives a sliding MTP layer the full layers' q heads: its target's sliding ones have as many)
KINDS = {("full_attention", "dense"): {}, ("sliding_attention", "sparse"): {"num_sliding_attention_heads": 4}}


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("step3p7-mtp")
    return {kinds: with_step3p7_mtp_layer(_make(root / f"target-{kinds[0]}", **changes), root / "-".join(kinds),
                                          *kinds)
            for kinds, changes in KINDS.items()}


@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("length", [3, 70])  # 70: past the window of 48
def test_the_mtp_layers_drafts_are_transformers_mtp_models(mtp_models, kinds, length):
    prompt = [(13 * j) % 400 + 5 for j in range(length)]
    target = transformers.Step3p7ForConditionalGeneration.from_pretrained(mtp_models[kinds], dtype=torch.float32)
    check_first_drafts(mtp_models[kinds], prompt, mtp_model_drafts(target.eval(), prompt, 3))


@pytest.mark.parametrize("size", [1, 2])
def test_the_mtp_layer_changes_how_many_tokens_a_step_makes_never_which(mtp_models, size):
    model_dir = mtp_models["sliding_attention", "sparse"]
    plain, _, _ = _run(model_dir, None, PROMPTS[:2], PARAMS[:2], max_num_batched_tokens=32)
    drafted, scheduler, _ = _run(model_dir, MTP, PROMPTS[:2], PARAMS[:2], max_num_batched_tokens=32,
                                 tensor_parallel_size=size)
    assert_same_outputs(drafted, plain)
    assert scheduler.drafting.num_draft_tokens > 0


def test_the_released_configs_lists_give_the_mtp_layers_kinds_heads_and_clamps(mtp_models, tmp_path):
    """StepFun's config runs its per-layer lists on over the MTP layers: the first's entries are its own (its q heads
    the sliding layers' where it is one), and `moe_layers_enum` says whether it has experts."""
    released = _released(mtp_models["full_attention", "dense"], tmp_path)
    raw = json.loads((released / "config.json").read_text())
    text = raw["text_config"]
    del text["mtp_layer_types"], text["mtp_mlp_layer_types"]  # (transformers' names of them)
    text.update({"layer_types": text["layer_types"][:4] + ["sliding_attention"],
                 "swiglu_limits": TEXT["swiglu_limits"] + [0.7], "swiglu_limits_shared": TEXT["swiglu_limits_shared"]
                 + [0], "num_nextn_predict_layers": 3})
    head = step3p7_mtp_config(raw, load_model_config(released))
    assert (head.eagle.mtp_layer, head.sliding_layers, head.layer_num_heads) == (4, {0}, (8,))
    assert head.moe.is_sparse(0) and head.step3p7.swiglu_limits == (0.7,) and head.step3p7.shared_swiglu_limits == (
        None,)
    text.update({"layer_types": text["layer_types"][:4] + ["full_attention"], "moe_layers_enum": "1,2,3"})
    head = step3p7_mtp_config(raw, load_model_config(released))
    assert (head.sliding_layers, head.layer_num_heads, head.moe.is_sparse(0)) == (set(), (4,), False)
    text["layer_types"] = text["layer_types"][:4]
    with pytest.raises(ValueError, match="layer_types names no kind for the MTP layer"):
        step3p7_mtp_config(raw, load_model_config(released))


def test_a_checkpoint_without_the_mtp_layer_is_refused(mtp_models, tmp_path):
    bare = shutil.copytree(mtp_models["full_attention", "dense"], tmp_path / "bare")
    (bare / "model.safetensors").unlink()
    shutil.copy(mtp_models["full_attention", "dense"].parent / "target-full_attention" / "model.safetensors", bare)
    with pytest.raises(ValueError, match=r"the checkpoint has no MTP layer \(model.layers.4.eh_proj.weight\)"):
        LLMEngine(EngineConfig(model=str(bare), num_kv_blocks=32, speculative=MTP))
