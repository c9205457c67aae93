"""A thinking budget (vLLM's thinking_token_budget): where a sequence thinks, how much of its budget
it has spent, and the close the sampler forces once it is spent, token by token."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.logits_processors import force_tokens
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative import SpeculativeConfig
from engine.thinking_budget import ThinkingBudget, ThinkingMarks

START, END = 90, 91  # "<think>", "</think>"
PHRASE = (80, 81)  # "Time to answer." before the close
VOCAB = 100


def budget(max_tokens: int, forced: tuple[int, ...] = ()) -> ThinkingBudget:
    return ThinkingBudget(max_tokens, (START,), (END,), forced)


def forced_along(marks: ThinkingMarks, prompt: list[int], output: list[int]) -> list[int | None]:
    """The forced token before each output token, then after the last."""
    tokens, forced = list(prompt), []
    for token in [*output, None]:
        forced.append(marks.forced_token(tokens))
        if token is not None:
            tokens.append(token)
    return forced


def test_the_close_is_forced_once_the_budget_is_spent_and_not_before():
    # The prompt opens the thinking and thinks one token (a template's "<think>\n"): it counts.
    forced = forced_along(ThinkingMarks(budget(3)), [1, 2, START, 5], [6, 7, END, 8])
    assert forced == [None, None, END, None, None]
    # Opened in the output, as Qwen3 opens it: the budget counts from there.
    forced = forced_along(ThinkingMarks(budget(2)), [1, 2], [3, START, 6, 7, END, 9])
    assert forced == [None, None, None, None, END, None, None]
    # Closed by the model in time: nothing forced; nor where nothing opens the thinking.
    assert forced_along(ThinkingMarks(budget(3)), [1, START], [6, END, 7, 8, 9]) == [None] * 6
    assert forced_along(ThinkingMarks(budget(0)), [1, 2], [3, 4, 5]) == [None] * 4
    # An earlier turn's thinking in the prompt, closed, opens none now.
    assert forced_along(ThinkingMarks(budget(0)), [START, 5, END, 1], [3, 4]) == [None] * 3


def test_a_budget_of_zero_closes_the_thinking_as_soon_as_it_opens():
    assert forced_along(ThinkingMarks(budget(0)), [1, START], [END, 3]) == [END, None, None]
    assert forced_along(ThinkingMarks(budget(0)), [1], [START, END, 3]) == [None, END, None, None]


def test_a_forced_close_with_a_phrase_is_written_whole_a_token_a_step():
    marks = ThinkingMarks(budget(2, forced=(*PHRASE, END)))
    assert forced_along(marks, [1, START], [5, 6, *PHRASE, END, 7]) == [None, None, *PHRASE, END, None, None]
    # A model that wrote the phrase's first token itself, over budget, goes on with the rest of it.
    marks = ThinkingMarks(budget(2, forced=(*PHRASE, END)))
    assert forced_along(marks, [1, START], [5, 6, PHRASE[0]])[-1] == PHRASE[1]
    # Thinking reopened after a close has a budget of its own again.
    marks = ThinkingMarks(budget(1))
    assert forced_along(marks, [1, START], [5, END, 3, START, 6]) == [None, END, None, None, None, END]


def test_multi_token_markers_are_found_across_steps_and_after_a_shrink():
    marks = ThinkingMarks(ThinkingBudget(1, (40, 41), (42, 43)))
    tokens = [1, 40]
    assert marks.forced_token(tokens) is None
    tokens.append(41)  # the opening completes across two steps
    assert marks.forced_token(tokens) is None
    tokens.append(5)
    assert marks.forced_token(tokens) == 42
    tokens.append(42)
    assert marks.forced_token(tokens) == 43
    tokens.append(43)
    assert marks.forced_token(tokens) is None
    # Rejected drafts take tokens away: what is left is looked at again.
    assert marks.forced_token([1, 40, 41]) is None and marks.forced_token([1, 40, 41, 9]) == 42


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=-1, start_token_ids=(1,), end_token_ids=(2,)), "max_tokens must be >= 0"),
    (dict(max_tokens=1, start_token_ids=(), end_token_ids=(2,)), "open and close"),
    (dict(max_tokens=1, start_token_ids=(1,), end_token_ids=(2,), forced_end_token_ids=(2, 3)), "must end with"),
    (dict(max_tokens=1, start_token_ids=(-1,), end_token_ids=(2,)), ">= 0"),
])
def test_a_budget_that_cannot_work_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ThinkingBudget(**kwargs)


def test_force_tokens_leaves_one_id_in_forced_rows_whatever_their_logits_and_others_alone():
    logits = torch.randn(3, 8)
    logits[0, 5] = float("-inf")  # banned by an earlier stage: forced all the same
    out = force_tokens(logits, [5, None, 2])
    assert out[0].argmax() == 5 and torch.isinf(out[0]).sum() == 7
    assert torch.equal(out[1], logits[1]) and out[2].argmax() == 2 and torch.isinf(out[2]).sum() == 7


def test_the_sampler_writes_the_close_in_greedy_and_random_rows_and_leaves_logprobs_raw():
    thinking = budget(1, forced=(*PHRASE, END))
    seqs = [Sequence("a", [1, START, 5], SamplingParams(temperature=0, logprobs=1, thinking_budget=thinking), 4),
            Sequence("b", [1, START, 5], SamplingParams(temperature=1.0, seed=3, thinking_budget=thinking), 4),
            Sequence("c", [1, START, 5], SamplingParams(temperature=0), 4)]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[:, PHRASE[0]] = -50.0
    sampler = Sampler(eos_token_ids=(2,))
    out = sampler(logits, seqs)
    assert out.token_ids == [PHRASE[0], PHRASE[0], int(logits[2].argmax())]
    assert out.logprobs[0][PHRASE[0]] == pytest.approx(float(logits[0].log_softmax(-1)[PHRASE[0]]), abs=1e-5)
    for seq, token in zip(seqs, out.token_ids):
        seq.append_token(token)
    assert sampler(logits, seqs).token_ids[:2] == [PHRASE[1], PHRASE[1]]
    # min_tokens bans the close's token here: the close is written all the same.
    banned = Sequence("d", [1, START], SamplingParams(temperature=0, min_tokens=4, stop_token_ids=(END,),
                                                      thinking_budget=budget(0)), 4)
    assert sampler(logits[:1], [banned]).token_ids == [END]


def _greedy(model_dir, params: SamplingParams, prompt: list[int], speculative=None) -> list[int]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, speculative=speculative))
    [out] = [out for out in engine.generate([prompt], params) if out.finished]
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    return out.token_ids


def test_the_engine_thinks_as_it_would_until_the_budget_then_closes_and_drafts_change_nothing(tiny_demo_model):
    start, end, phrase = (700,), (701,), (702, 703)
    prompt = [5, 6, 7, 8] * 30 + list(start)  # repeating: n-gram drafts are proposed, and some refused
    free = _greedy(tiny_demo_model, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), prompt)
    assert 701 not in free[:4]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                            thinking_budget=ThinkingBudget(4, start, end, (*phrase, *end)))
    budgeted = _greedy(tiny_demo_model, params, prompt)
    assert budgeted[:4] == free[:4] and budgeted[4:7] == [*phrase, *end]
    assert _greedy(tiny_demo_model, params, prompt, SpeculativeConfig(num_speculative_tokens=4)) == budgeted


def test_a_budget_outside_the_vocabulary_is_refused_by_the_engine(tiny_demo_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=16))
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="thinking budget: token id"):
        engine.add_request("r", [1, 2], SamplingParams(thinking_budget=ThinkingBudget(1, (1,), (vocab,))))
