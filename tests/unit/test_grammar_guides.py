"""Guided decoding by a context-free grammar (llguidance): a grammar of a regular language guides
token for token as its regex does, a nested one keeps its brackets, and a structural tag holds only
what follows its trigger. (Handed from a prefill engine to a decode engine: test_guided_decoding.py.)"""
from __future__ import annotations

import itertools
import json
import re
import shutil

import pytest
import torch

from engine.demo_model import make_demo_model
from engine.guided_decoding import guide_bias
from engine.sampling_params import SamplingParams
from services.gateway.structured_output import schema_guide, structural_tag_grammar
from tests.parity.conftest import shared_model_dirs
from tests.unit.test_disaggregation import assert_clean, finish
from tests.unit.test_engine import run_all
from tests.unit.test_guided_decoding import DATE, NESTED, PROMPT, make_engine, text
from tests.unit.test_weight_update import SHAPE

DATE_GRAMMARS = {"gbnf": 'root ::= [0-9]{4} "-" ("0" [1-9] | "1" [0-2]) "-" [0-3] [0-9]',
                 "lark": "start: /[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]/"}


def is_nested_prefix(s: str) -> bool:
    """`s` begins a text NESTED allows: brackets never closed before they open, only its characters."""
    depth = 0
    for c in s:
        depth += (c == "(") - (c == ")")
        if depth < 0 or c not in "()+0123456789":
            return False
    return s.startswith("(")


def is_nested(s: str) -> bool:
    while True:
        reduced = re.sub(r"\(([0-9])(\+[0-9])*\)", "0", s)
        if reduced == s:
            return s == "0"
        s = reduced


# Each syntax on the demo model, and one on each shared model (a second costs seconds of a large vocabulary).
GRAMMAR_MODELS = [("demo", "gbnf"), ("demo", "lark"),
                  *zip(shared_model_dirs(), itertools.cycle(sorted(DATE_GRAMMARS)), strict=False)]


@pytest.mark.parametrize(("model_dir", "syntax"), GRAMMAR_MODELS, ids=lambda d: getattr(d, "name", d))
def test_a_grammar_of_a_regular_language_guides_as_its_regex(model_dir, syntax, tiny_demo_model):
    """Both guides allow exactly the tokens that keep the text inside the language, so the same
    requests make the same tokens, greedy or sampled, batched with each other. But for a vocabulary
    with byte-fallback tokens: llguidance never lets one spell a character a piece spells (`<0x2D>` for
    "-"), outlines-core does, so the texts are the same language's, not the same tokens."""
    engine = make_engine(tiny_demo_model if model_dir == "demo" else model_dir)
    prompt = [t % engine.model_config.vocab_size for t in PROMPT]
    requests = {}
    for name, sampling in (("greedy", dict(temperature=0.0)), ("sampled", dict(temperature=1.0, seed=9))):
        requests[f"regex-{name}"] = (prompt, SamplingParams(max_tokens=30, guided_regex=DATE, **sampling))
        requests[f"grammar-{name}"] = (prompt, SamplingParams(max_tokens=30, guided_grammar=DATE_GRAMMARS[syntax],
                                                              **sampling))
    outs = run_all(engine, requests)
    for name in ("greedy", "sampled"):
        regex, grammar = outs[f"regex-{name}"], outs[f"grammar-{name}"]
        assert grammar.finish_reason == regex.finish_reason == "stop"
        assert re.fullmatch(DATE, text(engine, grammar.token_ids)) and re.fullmatch(DATE, text(engine, regex.token_ids))
        if not json.loads(engine.tokenizer.to_str())["model"].get("byte_fallback"):
            assert grammar.token_ids == regex.token_ids
    assert_clean(engine)


def test_a_nested_grammar_keeps_its_brackets(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    outs = run_all(engine, {f"s{seed}": (PROMPT, SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                                                                guided_grammar=NESTED)) for seed in range(6)})
    for out in outs.values():
        written = text(engine, out.token_ids)
        assert is_nested_prefix(written), written
        if out.finish_reason == "stop":
            assert out.token_ids[-1] in engine.eos_token_ids and is_nested(written), written
    assert any(out.finish_reason == "stop" for out in outs.values())
    assert not is_nested("(1+(2)") and not is_nested_prefix("(1))")  # the checks can fail
    assert_clean(engine)


def test_a_grammar_that_cannot_be_used_and_a_first_token_it_forbids_are_refused(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    with pytest.raises(ValueError, match="grammar cannot be read: Rule 'value' not found"):
        engine.add_request("gbnf", PROMPT, SamplingParams(guided_grammar='root ::= "[" value "]"'))
    with pytest.raises(ValueError, match=r'grammar cannot be compiled: at 1\(\d+\): unknown name: "value"'):
        engine.add_request("lark", PROMPT, SamplingParams(guided_grammar='start: "[" value "]"'))
    with pytest.raises(ValueError, match="guided_regex and guided_grammar cannot both be given"):
        SamplingParams(guided_regex=DATE, guided_grammar=NESTED)
    engine.reserve("first", len(PROMPT))
    with pytest.raises(ValueError, match="does not follow guided_grammar"):
        engine.add_prefilled_request("first", PROMPT, engine.tokenizer.token_to_id("x"),
                                     SamplingParams(guided_grammar=NESTED))
    engine.release_reservation("first")
    assert_clean(engine)


@pytest.mark.parametrize("syntax", sorted(DATE_GRAMMARS))
def test_a_grammar_guide_can_wait_for_the_end_of_thinking(tiny_demo_model, syntax):
    free = run_all(make_engine(tiny_demo_model), {"free": (PROMPT, SamplingParams(max_tokens=12, ignore_eos=True,
                                                                                  temperature=0.0))})["free"]
    after = free.token_ids[3]
    cut = free.token_ids.index(after) + 1
    engine = make_engine(tiny_demo_model)
    out = run_all(engine, {"r": (PROMPT, SamplingParams(max_tokens=40, temperature=0.0, guide_after_token_ids=(after,),
                                                        guided_grammar=DATE_GRAMMARS[syntax]))})["r"]
    assert out.token_ids[:cut] == free.token_ids[:cut]
    assert re.fullmatch(DATE, text(engine, out.token_ids[cut:])) and out.finish_reason == "stop"


def test_a_structural_tag_holds_the_text_after_its_trigger(tiny_demo_model):
    """vLLM's structural tag: the text is free until a trigger, then the structure beginning with it
    (the rest of its begin, JSON its schema allows with a space at most between tokens, its end), then free
    again. (Free text is valid UTF-8: a byte token that cannot go on a character is held back.)"""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    grammar = structural_tag_grammar({"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "schema": schema, "end": "</function>"}]})
    engine = make_engine(tiny_demo_model)
    said = engine.tokenizer.encode("Let me look. <function=", add_special_tokens=False).ids
    for seed in range(4):
        params = SamplingParams(max_tokens=80, temperature=1.0, seed=seed, guided_grammar=grammar)
        engine.add_request(f"s{seed}", PROMPT, params, output_token_ids=said)
    outs = finish(engine)
    for seed in range(4):
        out = outs[f"s{seed}"]
        assert out.token_ids[:len(said)] == said
        written = text(engine, out.token_ids[len(said):])
        assert written.startswith("get_weather>{"), written
        arguments, end, _ = written.removeprefix("get_weather>").partition("</function>")
        assert end and set(json.loads(arguments)) == {"city"} and len(json.loads(arguments)["city"]) <= 8, written
    assert_clean(engine)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "pets": {"type": "array", "items": {"type": "object", "properties": {
                                               "kind": {"enum": ["cat", "dog"]}}}}}, "required": ["name"]}


def follows(engine, grammar: str, text: str) -> bool:
    """Whether `text` (encoded by the model's tokenizer) is a whole text of `grammar`."""
    guide = engine.guides.guide(SamplingParams(guided_grammar=grammar))
    try:
        for token_id in engine.tokenizer.encode(text, add_special_tokens=False).ids:
            guide.advance(token_id)
    except ValueError:
        return False
    bias = guide_bias([guide], engine.model_config.vocab_size, torch.device("cpu"))
    return bool(bias[0, engine.eos_token_ids[0]] == 0)


def test_a_json_schema_guide_holds_objects_to_their_properties_at_any_depth(tiny_demo_model):
    """The gateway's guide of a JSON schema (llguidance's JSON grammar): objects that list their
    properties take no others (as outlines-core and xgrammar read them), an open object any, nested
    as deep as it likes; a space at most between tokens."""
    engine = make_engine(tiny_demo_model)
    person, anything = schema_guide(PERSON).grammar, schema_guide({"type": "object"}).grammar
    assert follows(engine, person, '{"name": "Ada", "age": 36, "pets": [{"kind": "cat"}]}')
    assert follows(engine, person, '{"name":"Ada"}')
    assert not follows(engine, person, '{"name": "Ada", "nickname": "A"}')  # not among its properties
    assert not follows(engine, person, '{"name": "Ada", "pets": [{"kind": "cat", "age": 2}]}')  # nor nested
    assert not follows(engine, person, '{"age": 36}')  # name is required
    assert not follows(engine, person, '{"name":  "Ada"}')  # two spaces
    assert follows(engine, anything, '{"a": {"b": {"c": {"d": {"e": {"f": [1, {"g": null}]}}}}}}')
    assert follows(engine, anything, '{"any": "key", "at": 1}')
    outs = run_all(engine, {f"s{seed}": (PROMPT, SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                                                guided_grammar=person)) for seed in range(4)})
    for out in outs.values():
        if out.finish_reason == "stop":
            written = json.loads(text(engine, out.token_ids))
            assert "name" in written and set(written) <= {"name", "age", "pets"}


def test_guides_serve_a_model_with_fewer_rows_than_its_tokenizer_has_tokens(tiny_demo_model, tmp_path):
    """DeepSeek's tiny test model reads the demo tokenizer's 1024 tokens with 512 rows: the masks cover
    the tokenizer's vocabulary, and only the model's rows are sampled."""
    model_dir = make_demo_model(tmp_path / "narrow", seed=3, **{**SHAPE, "vocab_size": 512})
    shutil.copy(tiny_demo_model / "tokenizer.json", model_dir / "tokenizer.json")
    engine = make_engine(model_dir)
    assert engine.tokenizer.get_vocab_size() > engine.model_config.vocab_size
    outs = run_all(engine, {"regex": (PROMPT[:8], SamplingParams(max_tokens=8, temperature=0.0, guided_regex="[a-z]+")),
                            "grammar": (PROMPT[:8], SamplingParams(max_tokens=8, temperature=0.0,
                                                                   guided_grammar="start: /[a-z]+/"))})
    for out in outs.values():
        assert all(t < 512 for t in out.token_ids)
        assert re.fullmatch("[a-z]+", text(engine, out.token_ids))
