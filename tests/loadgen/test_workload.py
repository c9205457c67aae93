from __future__ import annotations

import numpy as np
import pytest

from loadgen.distributions import LengthDistribution
from loadgen.workload import WORDS, WorkloadConfig, build_workload


def config(**kwargs) -> WorkloadConfig:
    defaults = dict(num_requests=50, prompt_len=LengthDistribution.parse("uniform:10:40"),
                    output_len=LengthDistribution.parse("fixed:8"))
    return WorkloadConfig(**{**defaults, **kwargs})


def test_token_id_prompts_have_exact_lengths_and_ids_in_range():
    specs = build_workload(config(token_id_range=(100, 110)), np.random.default_rng(0))
    assert [s.index for s in specs] == list(range(50))
    for s in specs:
        assert len(s.prompt) == s.prompt_len and 10 <= s.prompt_len <= 40
        assert all(100 <= t < 110 for t in s.prompt)
        assert s.output_len == 8 and s.prefix_id is None and s.prefix_len == 0


def test_shared_prefixes_start_the_prompts():
    specs = build_workload(config(shared_prefix_ratio=0.5, num_prefixes=3), np.random.default_rng(0))
    longest = {}
    for s in specs:
        assert s.prefix_len == round(0.5 * s.prompt_len)
        assert len(s.prompt) == s.prompt_len
        longest.setdefault(s.prefix_id, s.prompt)
        if s.prefix_len > len(longest[s.prefix_id]):
            longest[s.prefix_id] = s.prompt
    assert set(longest) == {0, 1, 2}
    # Every prompt of a prefix agrees with the others of that prefix over its shared part.
    by_prefix: dict[int, list] = {}
    for s in specs:
        by_prefix.setdefault(s.prefix_id, []).append(s)
    for group in by_prefix.values():
        shortest = min(s.prefix_len for s in group)
        assert len({tuple(s.prompt[:shortest]) for s in group}) == 1
    # ...and the prefixes differ from one another.
    firsts = {tuple(group[0].prompt[:5]) for group in by_prefix.values()}
    assert len(firsts) == 3


def test_whole_prompt_shared_at_ratio_one():
    specs = build_workload(config(prompt_len=LengthDistribution.parse("fixed:16"), shared_prefix_ratio=1.0),
                           np.random.default_rng(0))
    assert len({tuple(s.prompt) for s in specs}) == 1


def test_text_prompts_are_words():
    specs = build_workload(config(prompt_format="text", prompt_len=LengthDistribution.parse("fixed:12")),
                           np.random.default_rng(0))
    for s in specs:
        words = s.prompt.split(" ")
        assert len(words) == 12 and all(w in WORDS for w in words)
    assert len(set(WORDS)) == len(WORDS) > 200


def test_same_seed_same_workload():
    assert build_workload(config(), np.random.default_rng(5)) == build_workload(config(), np.random.default_rng(5))
    assert build_workload(config(), np.random.default_rng(5)) != build_workload(config(), np.random.default_rng(6))


@pytest.mark.parametrize("kwargs", [dict(num_requests=0), dict(shared_prefix_ratio=1.5),
                                    dict(num_prefixes=0), dict(token_id_range=(5, 5))])
def test_config_rejects(kwargs):
    with pytest.raises(ValueError):
        config(**kwargs)
