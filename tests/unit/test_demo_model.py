"""The demo model is a valid Hugging Face Llama directory, made reproducibly."""
from __future__ import annotations

import json
import subprocess
import sys
import sysconfig

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from engine.demo_model import ensure_demo_model, make_demo_model
from engine.demo_model_dir import default_demo_model_dir, is_demo_model_dir
from engine.demo_tokenizer import CHAT_TEMPLATE

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=2048)
TEXTS = [
    "The baton passes from prefill to decode.",
    "def f(x):\n    return x ** 2  # squared\n",
    "  leading spaces, tabs\tand trailing newline\n",
    "Unicode: wörld, 日本語, emoji 🎉",
    "",
]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("demo") / "small", **SMALL)


def _read_json(path):
    return json.loads(path.read_text())


def test_config_fields(small_model):
    config = _read_json(small_model / "config.json")
    tok = Tokenizer.from_file(str(small_model / "tokenizer.json"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["intermediate_size"] == 192  # 8/3 * 64 = 170.7, rounded up to a multiple of 64
    assert config["vocab_size"] == 2048 >= tok.get_vocab_size()
    assert config["tie_word_embeddings"] is False
    assert config["rope_theta"] == 10000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert config["bos_token_id"] == tok.token_to_id("<|begin_of_text|>") == 0
    assert config["eos_token_id"] == tok.token_to_id("<|end_of_text|>") == 1

    generation = _read_json(small_model / "generation_config.json")
    assert generation == {"bos_token_id": 0, "eos_token_id": [1, tok.token_to_id("<|im_end|>")]}
    tok_config = _read_json(small_model / "tokenizer_config.json")
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert tok_config["chat_template"] == CHAT_TEMPLATE


def test_weights_have_hf_names_and_shapes(small_model):
    with safe_open(str(small_model / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        assert f.metadata() == {"format": "pt"}
    expected = {"model.embed_tokens.weight": (2048, 64), "model.norm.weight": (64,), "lm_head.weight": (2048, 64)}
    for i in range(2):
        p = f"model.layers.{i}."
        expected |= {
            p + "input_layernorm.weight": (64,),
            p + "post_attention_layernorm.weight": (64,),
            p + "self_attn.q_proj.weight": (64, 64),
            p + "self_attn.k_proj.weight": (32, 64),
            p + "self_attn.v_proj.weight": (32, 64),
            p + "self_attn.o_proj.weight": (64, 64),
            p + "mlp.gate_proj.weight": (192, 64),
            p + "mlp.up_proj.weight": (192, 64),
            p + "mlp.down_proj.weight": (64, 192),
        }
    assert shapes == expected


def test_loads_in_transformers_and_greedy_does_not_collapse(small_model):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        small_model, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    tokenizer = transformers.AutoTokenizer.from_pretrained(small_model)
    ids = tokenizer("The baton passes from prefill to decode", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=48, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    new_ids = out.sequences[0, ids.shape[1]:].tolist()
    assert len(set(new_ids)) > 24, new_ids  # a random model, not a stuck one
    top2 = torch.stack(out.scores)[:, 0].topk(2).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.1  # greedy picks are not coin flips at float noise


def test_tokenizer_round_trips_and_prepends_bos(small_model):
    tok = Tokenizer.from_file(str(small_model / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(small_model)
    assert (hf.bos_token_id, hf.eos_token_id) == (0, 1)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=True).ids
        assert ids[0] == 0 and 0 not in ids[1:]
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert hf(text).input_ids == ids
        assert hf.decode(ids, skip_special_tokens=True) == text
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False).ids[::2] == [2, 3]


def test_chat_template_renders_in_transformers(small_model):
    hf = transformers.AutoTokenizer.from_pretrained(small_model)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    turns = ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
             "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n")
    assert hf.apply_chat_template(messages, tokenize=False) == turns
    prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == turns + "<|im_start|>assistant\n"
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids[:2] == [0, 2] and ids.count(0) == 1  # one bos: the template's, none added on encode
    assert hf.decode(ids) == prompt


def test_same_seed_same_bytes_other_seed_other_weights(small_model, tmp_path):
    again = make_demo_model(tmp_path / "again", **SMALL)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (again / name).read_bytes() == (small_model / name).read_bytes(), name
    other = make_demo_model(tmp_path / "other", **SMALL, seed=1)
    assert (other / "model.safetensors").read_bytes() != (small_model / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (small_model / "tokenizer.json").read_bytes()


def test_bfloat16_weights(tmp_path):
    path = make_demo_model(tmp_path / "bf16", **SMALL, dtype="bfloat16")
    assert _read_json(path / "config.json")["torch_dtype"] == "bfloat16"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hidden_size=60, num_heads=8), "multiple of num_heads"),
        (dict(num_heads=4, num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(hidden_size=12, num_heads=4), "even for RoPE"),
        (dict(vocab_size=100), "vocab_size"),
        (dict(num_layers=0), "num_layers"),
        (dict(dtype="int8"), "dtype"),
    ],
)
def test_rejects_bad_shapes(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_demo_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


def test_default_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.delenv("BATON_DEMO_MODEL", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_demo_model_dir() == tmp_path / ".cache" / "baton" / "demo-model"
    monkeypatch.setenv("BATON_DEMO_MODEL", str(tmp_path / "elsewhere"))
    assert default_demo_model_dir() == tmp_path / "elsewhere"


def test_ensure_demo_model_makes_the_default_model_once(monkeypatch, tmp_path):
    target = tmp_path / "cache" / "demo-model"
    monkeypatch.setenv("BATON_DEMO_MODEL", str(target))
    assert ensure_demo_model() == target
    assert is_demo_model_dir(target)
    assert [p.name for p in target.parent.iterdir()] == ["demo-model"]  # no temp dir left behind
    config = _read_json(target / "config.json")
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (256, 4, 704)
    assert Tokenizer.from_file(str(target / "tokenizer.json")).get_vocab_size() == config["vocab_size"] == 8192

    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model() == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime  # found, not remade


def test_ensure_demo_model_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="not a complete demo model"):
        ensure_demo_model(tmp_path)


def test_does_not_import_transformers():
    code = "import sys, engine.demo_model; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_tokenizer_is_the_shipped_ones_first_tokens_whatever_the_python(tmp_path, monkeypatch):
    """The demo model is the same on every Python: its tokenizer is not trained on the running one's
    standard library (here an empty one) but cut from the shipped one, trained on Python 3.11's."""
    from engine import demo_tokenizer as module

    made = [Tokenizer.from_file(str(make_demo_model(tmp_path / str(n), **{**SMALL, "vocab_size": n})
                                     / "tokenizer.json")).to_str() for n in (1024, 8192)]
    empty = tmp_path / "empty-stdlib"
    empty.mkdir()
    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda *args, **kwargs: {**paths, "stdlib": str(empty)})
    with pytest.raises(RuntimeError, match="no Python sources found"):  # training would need one
        module.train_tokenizer(1024)
    assert [module.demo_tokenizer(n).to_str() for n in (1024, 8192)] == made
    assert module.demo_tokenizer(1024).get_vocab_size() == 1024


@pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                    reason="the shipped tokenizer was trained on Python 3.11's library")
def test_the_shipped_tokenizers_first_tokens_are_a_smaller_one_trained_on_the_same_library():
    from engine.demo_tokenizer import SHIPPED_VOCAB_SIZE, demo_tokenizer, train_tokenizer

    for vocab_size in (300, 1024, 5000, SHIPPED_VOCAB_SIZE):
        assert demo_tokenizer(vocab_size).to_str() == train_tokenizer(vocab_size).to_str()
