"""Guided decoding: every output a guided regex allows, greedy or sampled, colocated or handed
from a prefill engine to a decode engine; the vocabulary's bytes as the tokenizer decodes them."""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
from outlines_core.json_schema import build_regex_from_schema
from tokenizers import Tokenizer

from engine import guided_decoding
from engine.config import EngineConfig
from engine.guided_decoding import GrammarGuide, GuideFactory, RegexGuide, token_bytes
from engine.llm_engine import LLMEngine
from engine.regex_size import unrolled_positions
from engine.sampling_params import SamplingParams
from tests.cuda import DEVICES
from tests.parity.conftest import shared_model_dirs
from tests.unit.test_disaggregation import assert_clean, finish
from tests.unit.test_engine import run_all

PROMPT = [(17 * j) % 900 + 5 for j in range(30)]
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"
# A grammar (tests/unit/test_grammar_guides.py): not regular, every "(" closed, a sum inside.
NESTED = 'root ::= "(" sum ")"\nsum ::= term ("+" term)*\nterm ::= [0-9] | "(" sum ")"'
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0}}, "required": ["name", "age"]}


def make_engine(model_dir, device: str = "cpu") -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=256, max_num_batched_tokens=64, device=device))


def text(engine: LLMEngine, token_ids: list[int]) -> str:
    return engine.tokenizer.decode([t for t in token_ids if t not in engine.eos_token_ids])


@pytest.mark.parametrize("model_dir", ["demo", *shared_model_dirs()], ids=lambda d: getattr(d, "name", d))
def test_token_bytes_are_what_the_tokenizer_decodes(model_dir, tiny_demo_model):
    tokenizer = Tokenizer.from_file(str((tiny_demo_model if model_dir == "demo" else model_dir) / "tokenizer.json"))
    table = token_bytes(tokenizer)
    rng = random.Random(3)
    ids = sorted(table)
    for _ in range(50):
        sample = [rng.choice(ids) for _ in range(12)]
        joined = b"".join(table[t] for t in sample).decode(errors="replace")
        # SentencePiece's decoder drops the text's one leading space; a lone byte may not be whole UTF-8.
        assert tokenizer.decode(sample) in (joined, joined.removeprefix(" "))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=7)])
def test_guided_output_matches_its_regex_and_ends_there(tiny_demo_model, sampling, device):
    engine = make_engine(tiny_demo_model, device)
    person = build_regex_from_schema(json.dumps(PERSON))
    outs = run_all(engine, {
        "date": (PROMPT, SamplingParams(max_tokens=40, guided_regex=DATE, ignore_eos=True, **sampling)),
        "person": (PROMPT, SamplingParams(max_tokens=60, guided_regex=person, **sampling)),
        "free": (PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, **sampling)),
    })
    date = outs["date"]
    assert re.fullmatch(DATE, text(engine, date.token_ids)) and date.finish_reason == "stop"  # ignore_eos or not
    parsed = json.loads(text(engine, outs["person"].token_ids))
    assert isinstance(parsed["name"], str) and isinstance(parsed["age"], int) and parsed["age"] >= 0
    free = SamplingParams(max_tokens=8, ignore_eos=True, **sampling)
    alone = run_all(make_engine(tiny_demo_model, device), {"free": (PROMPT, free)})
    assert outs["free"].token_ids == alone["free"].token_ids  # batched with guided rows, untouched
    assert_clean(engine)


@pytest.mark.parametrize("guide", [dict(guided_regex=DATE), dict(guided_grammar=NESTED)], ids=["regex", "grammar"])
def test_a_handed_off_guided_request_goes_on_as_in_one_engine(tiny_demo_model, guide):
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=5, **guide)
    expected = run_all(make_engine(tiny_demo_model), {"r": (PROMPT, params)})["r"].token_ids
    prefill, decode = make_engine(tiny_demo_model), make_engine(tiny_demo_model)
    prefill.add_request("r", PROMPT, params, prefill_only=True)
    first = finish(prefill)["r"]
    src = prefill.held_block_ids("r")
    dst = decode.reserve("r", len(PROMPT))
    decode.runner.kv_pool.tensor[:, :, :, dst] = prefill.runner.kv_pool.tensor[:, :, :, src]
    prefill.release("r")
    decode.add_prefilled_request("r", PROMPT, first.token_ids[0], params)
    outs = finish(decode)
    assert outs["r"].token_ids == expected
    assert_clean(decode)


def test_a_regex_that_does_not_compile_and_a_first_token_it_forbids_are_refused(tiny_demo_model):
    engine = make_engine(tiny_demo_model)
    with pytest.raises(ValueError, match="guided_regex cannot be compiled"):
        engine.add_request("bad", PROMPT, SamplingParams(guided_regex="(unclosed"))
    digit = engine.tokenizer.token_to_id("7")
    letter = engine.tokenizer.token_to_id("x")
    engine.reserve("first", len(PROMPT))
    with pytest.raises(ValueError, match="does not follow guided_regex"):
        engine.add_prefilled_request("first", PROMPT, letter, SamplingParams(guided_regex=DATE))
    engine.release_reservation("first")
    engine.reserve("ok", len(PROMPT))
    engine.add_prefilled_request("ok", PROMPT, digit, SamplingParams(guided_regex=DATE, temperature=0.0))
    outs = finish(engine)
    assert outs["ok"].token_ids[0] == digit and re.fullmatch(DATE, text(engine, outs["ok"].token_ids))


def test_a_guide_after_a_token_leaves_the_text_before_it_free(tiny_demo_model):
    free = run_all(make_engine(tiny_demo_model), {"free": (PROMPT, SamplingParams(max_tokens=12, ignore_eos=True,
                                                                                  temperature=0.0))})["free"]
    after = free.token_ids[3]  # the end of a "thinking" the unguided model writes anyway
    cut = free.token_ids.index(after) + 1
    params = SamplingParams(max_tokens=40, temperature=0.0, guided_regex=DATE, guide_after_token_ids=(after,))
    engine = make_engine(tiny_demo_model)
    out = run_all(engine, {"r": (PROMPT, params)})["r"]
    assert out.token_ids[:cut] == free.token_ids[:cut]  # free up to and with the token, as unguided
    assert re.fullmatch(DATE, text(engine, out.token_ids[cut:])) and out.finish_reason == "stop"
    assert_clean(engine)

    # Handed off with its first token free, the decode engine's guide waits on as one engine's would.
    prefill, decode = make_engine(tiny_demo_model), make_engine(tiny_demo_model)
    prefill.add_request("r", PROMPT, params, prefill_only=True)
    first = finish(prefill)["r"].token_ids[0]
    src, dst = prefill.held_block_ids("r"), decode.reserve("r", len(PROMPT))
    decode.runner.kv_pool.tensor[:, :, :, dst] = prefill.runner.kv_pool.tensor[:, :, :, src]
    prefill.release("r")
    decode.add_prefilled_request("r", PROMPT, first, params)
    assert finish(decode)["r"].token_ids == out.token_ids

    # Handed off with the token itself first, the decode engine's guide holds from the next.
    first_is_it = SamplingParams(max_tokens=40, temperature=0.0, guided_regex=DATE, guide_after_token_ids=(first,))
    decode.reserve("s", len(PROMPT))
    decode.add_prefilled_request("s", PROMPT, first, first_is_it)
    assert re.fullmatch(DATE, text(decode, finish(decode)["s"].token_ids[1:]))


def test_a_guide_after_a_run_of_tokens_waits_for_the_whole_run(tiny_demo_model):
    """gpt-oss's answer starts after `<|channel|>final<|message|>`: the guide holds from the token after
    the output's first run of the tokens, not after any one of them alone."""
    free = run_all(make_engine(tiny_demo_model), {"free": (PROMPT, SamplingParams(max_tokens=12, ignore_eos=True,
                                                                                  temperature=0.0))})["free"]
    ids = free.token_ids
    run = (ids[2], ids[3])
    cut = next(i + 2 for i in range(len(ids) - 1) if (ids[i], ids[i + 1]) == run)
    engine = make_engine(tiny_demo_model)
    params = SamplingParams(max_tokens=40, temperature=0.0, guided_regex=DATE, guide_after_token_ids=run)
    out = run_all(engine, {"r": (PROMPT, params)})["r"]
    assert out.token_ids[:cut] == ids[:cut] and re.fullmatch(DATE, text(engine, out.token_ids[cut:]))
    # A run the free output never writes: the guide never holds, the output is the free one.
    never = next((a, b) for a in ids for b in ids if all((ids[i], ids[i + 1]) != (a, b) for i in range(len(ids) - 1)))
    waiting = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, guided_regex=DATE,
                             guide_after_token_ids=never)
    assert run_all(engine, {"w": (PROMPT, waiting)})["w"].token_ids == ids
    assert_clean(engine)


def test_a_guide_after_a_token_is_checked():
    with pytest.raises(ValueError, match="guide_after_token_ids needs a guided_regex"):
        SamplingParams(guide_after_token_ids=(5,))
    with pytest.raises(ValueError, match="guide_after_token_ids needs a guided_regex or guided_grammar and ids >= 0"):
        SamplingParams(guided_regex=DATE, guide_after_token_ids=(3, -1))


def test_min_tokens_holds_a_guided_text_that_ignores_eos(tiny_demo_model):
    """A guided text ends at EOS even with ignore_eos (its guide says it is complete), so short of
    min_tokens EOS is banned for it as for any other request."""
    engine = make_engine(tiny_demo_model)
    requests = {f"r{seed}": (PROMPT, SamplingParams(max_tokens=400, min_tokens=400, temperature=1.0, seed=seed,
                                                    guided_regex="[a-z ]+", ignore_eos=True))
                for seed in range(6)}
    outs = run_all(engine, requests)
    assert {out.finish_reason for out in outs.values()} == {"length"}
    assert all(re.fullmatch("[a-z ]+", text(engine, out.token_ids)) for out in outs.values())


def test_any_of_the_models_eos_ends_a_guided_text_where_its_guide_allows_eos(tiny_demo_model):
    """The guide knows the model's first EOS (1 here); its others (3) end a complete text too, as Llama 3's
    chat turns end with its second, `<|eot_id|>`. Short of a complete text, none is allowed."""
    engine = make_engine(tiny_demo_model)
    assert engine.eos_token_ids == (1, 3)
    favoured = {3: 100.0}  # the model all but forced to write its second EOS
    outs = run_all(engine, {
        "second": (PROMPT, SamplingParams(max_tokens=20, temperature=0, guided_regex="[a-z]+", logit_bias=favoured)),
        "date": (PROMPT, SamplingParams(max_tokens=20, temperature=0, guided_regex=DATE, logit_bias=favoured))})
    second, date = outs["second"], outs["date"]
    assert len(second.token_ids) == 2 and second.token_ids[-1] == 3 and second.finish_reason == "stop"
    assert re.fullmatch("[a-z]+", text(engine, second.token_ids))
    assert date.token_ids[-1] == 3 and re.fullmatch(DATE, text(engine, date.token_ids))


def test_a_complete_guided_text_short_of_min_tokens_ends_with_eos_not_a_token_from_nothing(tiny_demo_model):
    """Its guide allows only EOS, which min_tokens bans: nothing is left, and the text ends there with EOS
    (greedy or sampled), its guided text whole."""
    engine = make_engine(tiny_demo_model)
    outs = run_all(engine, {
        f"t{temperature}": (PROMPT, SamplingParams(max_tokens=6, min_tokens=4, temperature=temperature, seed=1,
                                                   guided_regex="(yes|no)"))
        for temperature in (0.0, 1.0)})
    for out in outs.values():
        assert out.token_ids[-1] in engine.eos_token_ids and out.finish_reason == "stop", out
        assert text(engine, out.token_ids) in ("yes", "no")
        assert all(t not in engine.eos_token_ids for t in out.token_ids[:-1])


@pytest.mark.parametrize("regex, positions", [
    ("abc", 3), (DATE, 12), ("[a-z]+", 2), ("(ab|cde){3}", 15), ("x{100000}", 100_000),
    ("(x{1000}){1000}", 1_000_000), (".{0,1000}", 1000), (r"\p{L}+", None), ("a{99999999999}", None)])
def test_a_regexs_positions_are_counted_with_its_repetitions_unrolled(regex, positions):
    assert unrolled_positions(regex) == positions


def masks_along(factory: GuideFactory, params: SamplingParams, path: list[int]) -> list[list[int]]:
    """The tokens allowed at each step of `path` (then advanced by it), from a new guide of `params`."""
    guide = factory.guide(params)
    words = np.zeros(guide.num_words, dtype="<i4")
    masks = []
    for token_id in [*path, None]:
        words[:] = 0
        guide.write_mask_into(words)
        masks.append(np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")).tolist())
        if token_id is not None:
            guide.advance(token_id)
    return masks


def test_a_regex_too_large_to_index_is_guided_by_llguidance_to_the_same_tokens(tiny_demo_model, monkeypatch):
    """outlines-core indexes a regex's whole automaton before the first token: `x{100000}` took minutes and
    `.{0,100000}` tens of GB. Past the budget llguidance guides it as it goes; where both can, they allow the
    same tokens step by step."""
    tokenizer = Tokenizer.from_file(str(tiny_demo_model / "tokenizer.json"))
    factory = GuideFactory(tokenizer, eos_token_id=0)
    huge = SamplingParams(guided_regex="x{100000}")
    assert not factory.is_indexed(huge.guided_regex) and factory.is_indexed(DATE)
    factory.compile(huge)  # at once: nothing built ahead
    x = tokenizer.token_to_id("x")
    assert isinstance(factory.guide(huge), GrammarGuide)
    allowed = masks_along(factory, huge, [x, x])
    assert x in allowed[0] and allowed[0] == allowed[2]
    assert all(set(tokenizer.decode([t]).strip()) <= {"x"} for t in allowed[0])
    path = [tokenizer.token_to_id(c) for c in "2024-0"]
    indexed = masks_along(factory, SamplingParams(guided_regex=DATE), path)
    monkeypatch.setattr(guided_decoding, "INDEXED_REGEX_BUDGET", 0)
    assert isinstance(factory.guide(SamplingParams(guided_regex=DATE)), GrammarGuide)
    assert masks_along(factory, SamplingParams(guided_regex=DATE), path) == indexed
    with pytest.raises(ValueError, match="guided_regex cannot be compiled"):
        factory.compile(SamplingParams(guided_regex="(unclosed"))


def test_a_regex_whose_index_is_not_built_in_time_is_guided_by_llguidance_until_it_is(tiny_demo_model, monkeypatch):
    """`(a|b)*a(a|b){n}` has few positions, yet its automaton doubles with n (1.4 s to index at 12 here; minutes
    at 20): the request waits out the deadline, not the build, and the index serves the regex once built."""
    tokenizer = Tokenizer.from_file(str(tiny_demo_model / "tokenizer.json"))
    factory = GuideFactory(tokenizer, eos_token_id=0)
    monkeypatch.setattr(guided_decoding, "INDEX_DEADLINE_S", 0.05)
    blowup = SamplingParams(guided_regex="(a|b)*a(a|b){12}")
    assert factory.is_indexed(blowup.guided_regex)
    factory.compile(blowup)
    assert isinstance(factory.guide(blowup), GrammarGuide)
    path = [tokenizer.token_to_id(c) for c in "ab"]
    meanwhile = masks_along(factory, blowup, path)
    factory.compile(blowup)  # the same build, not another: waited for again
    monkeypatch.setattr(guided_decoding, "INDEX_DEADLINE_S", 60)
    factory.compile(blowup)
    assert isinstance(factory.guide(blowup), RegexGuide)
    assert masks_along(factory, blowup, path) == meanwhile
