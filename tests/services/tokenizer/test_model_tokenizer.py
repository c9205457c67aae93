from __future__ import annotations

import asyncio
import json
import shutil
import time

import pytest
from tokenizers import Tokenizer

from services.tokenizer.model_tokenizer import MAX_REQUEST_TEMPLATES, ContextLengthError, ModelTokenizer
from tests.services.tokenizer.conftest import shared_model_dir

TEXTS = ["Hello, world!", " leading space", "naïve café 你好 🌍🚀", "a\n\n  b\tc", ""]


def test_encode_decode_equal_tokenizers(model_dir):
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok = ModelTokenizer.from_dir(model_dir)
    for text in TEXTS:
        for add in (True, False):
            assert tok.encode(text, add_special_tokens=add) == raw.encode(text, add_special_tokens=add).ids
        ids = tok.encode(text)
        assert tok.decode(ids) == raw.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == raw.decode(ids, skip_special_tokens=False)


def test_pairs_encode_as_the_tokenizers_pair_template_joins_them(model_dir):
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok = ModelTokenizer.from_dir(model_dir)
    for first, second in zip(TEXTS, reversed(TEXTS)):
        assert tok.encode_pair(first, second) == raw.encode(first, second, add_special_tokens=True).ids


def test_a_long_encode_on_a_thread_leaves_the_event_loop_running(demo_model_dir):
    """A server encodes a long prompt on a thread so that its other requests go on meanwhile: not so
    where the encode holds the GIL throughout (`Tokenizer.encode` does: 1-3 loop turns in its 0.5 s)."""
    tok = ModelTokenizer.from_dir(demo_model_dir)
    text = "Some words to encode, over and over again. " * 25000

    async def loop_turns_while_encoding() -> tuple[int, float]:
        encoding = asyncio.ensure_future(asyncio.to_thread(tok.encode, text))
        turns, started = 0, time.monotonic()
        while not encoding.done():
            await asyncio.sleep(0.001)
            turns += 1
        return turns, time.monotonic() - started

    turns, took_s = asyncio.run(loop_turns_while_encoding())
    assert turns >= took_s * 1000 / 20, (turns, took_s)  # a turn a millisecond or so, 20x room


def test_demo_model_metadata(demo_model_dir):
    tok = ModelTokenizer.from_dir(demo_model_dir)
    assert tok.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    assert tok.eos_token_ids == (tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|im_end|>"))
    assert tok.max_model_len == 2048
    assert tok.has_chat_template


def test_shared_models_metadata():
    llama = ModelTokenizer.from_dir(shared_model_dir("tiny-llama2-spm"))
    assert llama.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert llama.eos_token_ids == (2,)
    assert llama.max_model_len == 4096  # config.json, not tokenizer_config's "no limit" sentinel
    qwen = ModelTokenizer.from_dir(shared_model_dir("tiny-qwen2.5-bpe"))
    assert qwen.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert set(qwen.eos_token_ids) >= {151645, 151643}


def _copy_model(src, dst, **tokenizer_config_changes):
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.update(tokenizer_config_changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_added_token_dicts_and_template_lists(demo_model_dir, tmp_path):
    bos = {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False, "normalized": False,
           "rstrip": False, "single_word": False, "special": True}
    templates = [{"name": "default", "template": "{{ bos_token }}D:{{ messages[0].content }}"},
                 {"name": "tool_use", "template": "{{ bos_token }}T:{{ messages[0].content }}"}]
    path = _copy_model(demo_model_dir, tmp_path / "m", bos_token=bos, pad_token=None, chat_template=templates)
    tok = ModelTokenizer.from_dir(path)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages)[0] == "<|begin_of_text|>D:x"
    assert tok.apply_chat_template(messages, tools=[{"type": "function"}])[0] == "<|begin_of_text|>T:x"
    assert "pad_token" not in tok.special_tokens


def test_chat_template_jinja_file_wins(demo_model_dir, tmp_path):
    path = _copy_model(demo_model_dir, tmp_path / "m")
    (path / "chat_template.jinja").write_text("FILE {{ messages | length }}")
    assert ModelTokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])[0] == "FILE 1"


def test_no_chat_template_is_a_clear_error(demo_model_dir, tmp_path):
    path = _copy_model(demo_model_dir, tmp_path / "m")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = ModelTokenizer.from_dir(path)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_check_context(demo_model_dir):
    tok = ModelTokenizer.from_dir(demo_model_dir)
    tok.check_context(2000, 48)  # exactly full is allowed
    with pytest.raises(ContextLengthError) as info:
        tok.check_context(2000, 49)
    assert isinstance(info.value, ValueError)
    assert str(info.value) == (
        "This model's maximum context length is 2048 tokens. However, you requested 2049 tokens "
        "(2000 in the prompt, 49 for the completion). Please reduce the length of the prompt or the completion.")


def test_max_model_len_override(demo_model_dir):
    tok = ModelTokenizer.from_dir(demo_model_dir, max_model_len=16)
    tok.check_context(8, 8)
    with pytest.raises(ContextLengthError, match="maximum context length is 16 tokens"):
        tok.check_context(8, 9)
    with pytest.raises(ValueError, match="max_model_len"):
        ModelTokenizer.from_dir(demo_model_dir, max_model_len=4096)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        ModelTokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_json_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid tokenizer\.json"):
        ModelTokenizer.from_dir(tmp_path)


def test_a_named_template_is_chosen_by_name_and_any_other_text_is_a_template(demo_model_dir, tmp_path):
    # As transformers takes `chat_template`: a name among several of the model's, else the template's source.
    templates = [{"name": "default", "template": "D:{{ messages[0].content }}"},
                 {"name": "rag", "template": "R:{{ documents | length }}:{{ messages[0].content }}"}]
    tok = ModelTokenizer.from_dir(_copy_model(demo_model_dir, tmp_path / "m", chat_template=templates))
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages, chat_template="rag", documents=[{"text": "a"}])[0] == "R:1:x"
    assert tok.apply_chat_template(messages, chat_template="Own:{{ messages[0].content }}")[0] == "Own:x"
    # With one template, a name is text like any other (transformers keeps a lone template as a string).
    single = ModelTokenizer.from_dir(demo_model_dir)
    assert single.apply_chat_template(messages, chat_template="default")[0] == "default"


def test_requests_templates_are_kept_compiled_up_to_a_bound(demo_model_dir):
    tok = ModelTokenizer.from_dir(demo_model_dir)
    messages = [{"role": "user", "content": "x"}]
    first = tok.chat_template(requested="0:{{ messages | length }}")
    assert tok.chat_template(requested="0:{{ messages | length }}") is first
    for i in range(1, MAX_REQUEST_TEMPLATES + 1):
        assert tok.apply_chat_template(messages, chat_template=f"{i}:{{{{ messages | length }}}}")[0] == f"{i}:1"
    assert tok.chat_template(requested="0:{{ messages | length }}") is not first  # the oldest was dropped


def test_a_server_template_replaces_the_models(demo_model_dir, tmp_path):
    templates = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    path = _copy_model(demo_model_dir, tmp_path / "m", chat_template=templates)
    tok = ModelTokenizer.from_dir(path, chat_template="S:{{ messages[0].content }}")
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages)[0] == "S:x"
    assert tok.apply_chat_template(messages, tools=[{"type": "function"}])[0] == "S:x"
