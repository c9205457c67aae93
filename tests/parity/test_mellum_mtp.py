"""Speculative decoding with Mellum 2's multi-token prediction layer (engine/models/mellum_mtp.py), `{"method":
"mtp"}`, against transformers' own MtpModel (`generate(use_mtp=True)`'s) reading the same checkpoint: each draft is
its layer's greedy pick over transformers' hidden states of the target, the layer's output chained into the next draft
as transformers chains its layers; for each kind of layer config.json may name. The tokens are plain decoding's, beside
a target split across ranks too; a checkpoint with more layers than one is refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.speculative import SpeculativeConfig
from tests.draft_models import with_mellum_mtp_layer
from tests.parity.test_mtp import PARAMS, PROMPTS, check_first_drafts, mtp_model_drafts
from tests.unit.test_draft_model import _run
from tests.unit.test_speculative import assert_same_outputs

pytestmark = pytest.mark.usefixtures("forked_ranks")  # (tests/parity/conftest.py)

MTP = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 3})
KINDS = [("sliding_attention", "sparse"), ("full_attention", "dense")]  # (the first: transformers' default)


@pytest.fixture(scope="module")
def mtp_models(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("mellum-mtp")
    return {kinds: with_mellum_mtp_layer(tiny_model_dirs["mellum"], root / "-".join(kinds), *kinds)
            for kinds in KINDS}


@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("length", [37, 3, 70])  # 70: past the window of 48
def test_the_mtp_layers_drafts_are_transformers_mtp_models(mtp_models, kinds, length):
    from transformers import AutoModelForCausalLM

    prompt = [(13 * j) % 400 + 5 for j in range(length)]
    target = AutoModelForCausalLM.from_pretrained(mtp_models[kinds], dtype=torch.float32).eval()
    check_first_drafts(mtp_models[kinds], prompt, mtp_model_drafts(target, prompt, 3))


@pytest.mark.parametrize("size", [1, 2])
def test_the_mtp_layer_changes_how_many_tokens_a_step_makes_never_which(mtp_models, size):
    model_dir = mtp_models[KINDS[0]]
    plain, _, _ = _run(model_dir, None, PROMPTS[:2], PARAMS[:2], max_num_batched_tokens=32)
    drafted, scheduler, _ = _run(model_dir, MTP, PROMPTS[:2], PARAMS[:2], max_num_batched_tokens=32,
                                 tensor_parallel_size=size)
    assert_same_outputs(drafted, plain)
    assert scheduler.drafting.num_draft_tokens > 0


def test_an_mtp_layer_baton_does_not_read_is_refused(tiny_model_dirs, mtp_models, tmp_path):
    with pytest.raises(ValueError, match=r"the checkpoint has no MTP layer \(mtp.fc.weight\)"):
        LLMEngine(EngineConfig(model=str(tiny_model_dirs["mellum"]), num_kv_blocks=32, speculative=MTP))
    several = shutil.copytree(mtp_models[KINDS[0]], tmp_path / "several")
    config = json.loads((several / "config.json").read_text())
    (several / "config.json").write_text(json.dumps({**config, "num_mtp_layers": 2}))
    with pytest.raises(ValueError, match="num_mtp_layers is 2; Mellum's checkpoints carry one MTP layer"):
        LLMEngine(EngineConfig(model=str(several), num_kv_blocks=32, speculative=MTP))
