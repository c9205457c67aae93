"""vLLM's --generation-config: which sampling defaults are read from where, and which are refused."""
from __future__ import annotations

import json

import pytest

from protos import common_pb2
from services.gateway.generation_defaults import GenerationDefaults

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    return tmp_path


def test_auto_reads_the_models_sampling_keys_and_vllm_reads_none(model_dir):
    defaults = GenerationDefaults.load("auto", model_dir)
    assert defaults == GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert defaults.describe() == "temperature=0.6, top_p=0.95, top_k=20"
    assert not GenerationDefaults.load("vllm", model_dir)
    assert not GenerationDefaults.load("auto", model_dir / "absent")  # a model without the file: none


def test_another_directory_and_overrides_over_it(model_dir, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "repetition_penalty": 1.05,
                                                               "max_new_tokens": 256}))
    defaults = GenerationDefaults.load(str(other), model_dir, {"temperature": 0, "min_p": 0.1})
    assert defaults == GenerationDefaults(temperature=0.0, repetition_penalty=1.05, min_p=0.1, max_new_tokens=256)


@pytest.mark.parametrize("source, overrides, message", [
    ("nowhere", None, "not a directory"),
    ("auto", {"temperature": -1}, "temperature must be >= 0"),
    ("auto", {"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ("auto", {"top_k": 2.5}, "top_k must be an integer"),
    ("auto", {"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ("auto", {"temperature": "hot"}, "temperature must be a number"),
    ("auto", {"do_sample": False}, "cannot override do_sample"),
])
def test_a_bad_source_or_value_is_refused_by_name(model_dir, source, overrides, message):
    with pytest.raises(ValueError, match=message):
        GenerationDefaults.load(source, model_dir, overrides)


def test_fill_sets_only_what_the_request_left_out():
    defaults = GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1)
    given = common_pb2.SamplingParams(temperature=1.0, top_k=5)
    defaults.fill(given, top_k_given=True, min_p_given=False)
    assert (given.temperature, given.top_k) == (1.0, 5)  # the request's
    assert given.top_p == pytest.approx(0.95) and given.min_p == pytest.approx(0.05)
    assert given.repetition_penalty == pytest.approx(1.1)
    greedy = common_pb2.SamplingParams(temperature=0.0)
    defaults.fill(greedy, top_k_given=False, min_p_given=False)
    assert greedy.HasField("temperature") and greedy.temperature == 0.0  # 0 given is kept: presence, not value
