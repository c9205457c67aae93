"""Sampling parameters from their protobuf message: as the engine's defaults fill them, refused
as the engine refuses them, and memoized by the message's bytes."""
from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from engine.thinking_budget import ThinkingBudget
from protos import common_pb2
from services.common import converters
from services.common.converters import sampling_params_from_proto


def test_absent_fields_take_the_engines_defaults_and_set_ones_are_kept():
    assert sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    given = common_pb2.SamplingParams(max_tokens=7, temperature=0.0, top_p=0.5, top_k=3, seed=11, logprobs=2,
                                      stop_token_ids=[5, 6], ignore_eos=True, min_tokens=4,
                                      bad_words=[common_pb2.TokenIds(token_ids=[8]),
                                                 common_pb2.TokenIds(token_ids=[9, 10])])
    assert sampling_params_from_proto(given) == SamplingParams(max_tokens=7, temperature=0.0, top_p=0.5, top_k=3,
                                                               seed=11, logprobs=2, stop_token_ids=(5, 6),
                                                               ignore_eos=True, min_tokens=4,
                                                               bad_words_token_ids=((8,), (9, 10)))
    # A temperature set to 0 is not an absent one (the default is 1).
    assert sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0)).temperature == 0.0
    assert sampling_params_from_proto(common_pb2.SamplingParams(cache_salt="s", lora_name="x")) == \
        SamplingParams(cache_salt="s", lora_name="x")
    with pytest.raises(ValueError, match="cache_salt"):  # given, but empty
        sampling_params_from_proto(common_pb2.SamplingParams(cache_salt=""))


def test_a_guide_waits_for_one_token_or_a_run_of_them():
    """The gRPC API's guide_after_token_id is a run of one; guide_after_token_ids, when given, is the run."""
    one = common_pb2.SamplingParams(guided_regex="x+", guide_after_token_id=7)
    assert sampling_params_from_proto(one).guide_after_token_ids == (7,)
    run = common_pb2.SamplingParams(guided_regex="x+", guide_after_token_id=7, guide_after_token_ids=[3, 4, 5])
    assert sampling_params_from_proto(run).guide_after_token_ids == (3, 4, 5)
    assert sampling_params_from_proto(common_pb2.SamplingParams(guided_regex="x+")).guide_after_token_ids == ()


def test_a_thinking_budget_comes_across_whole_zero_included():
    given = common_pb2.SamplingParams(thinking_budget=common_pb2.ThinkingBudget(
        max_tokens=0, start_token_ids=[5], end_token_ids=[6], forced_end_token_ids=[7, 6]))
    assert sampling_params_from_proto(given).thinking_budget == ThinkingBudget(0, (5,), (6,), (7, 6))
    assert sampling_params_from_proto(common_pb2.SamplingParams()).thinking_budget is None
    with pytest.raises(ValueError, match="open and close"):
        sampling_params_from_proto(common_pb2.SamplingParams(thinking_budget=common_pb2.ThinkingBudget(max_tokens=3)))


def test_equal_messages_share_params_and_a_refused_one_is_refused_every_time():
    first = sampling_params_from_proto(common_pb2.SamplingParams(max_tokens=3, temperature=0.0))
    again = sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0, max_tokens=3))
    assert again is first
    other = sampling_params_from_proto(common_pb2.SamplingParams(max_tokens=4, temperature=0.0))
    assert other is not first and other.max_tokens == 4
    for _ in range(2):
        with pytest.raises(ValueError, match="top_p"):
            sampling_params_from_proto(common_pb2.SamplingParams(top_p=1.5))


def test_the_memo_keeps_at_most_its_size_oldest_dropped_first():
    first = common_pb2.SamplingParams(max_tokens=100_000)
    remembered = sampling_params_from_proto(first)
    for n in range(converters.SAMPLING_MEMO_SIZE):
        sampling_params_from_proto(common_pb2.SamplingParams(max_tokens=100_001 + n))
    assert len(converters._sampling_memo) <= converters.SAMPLING_MEMO_SIZE
    assert sampling_params_from_proto(first) == remembered  # made again: the same values
    assert sampling_params_from_proto(first) is not remembered
