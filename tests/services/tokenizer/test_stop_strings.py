from __future__ import annotations

import random

import pytest

from services.tokenizer.stop_strings import StopStringMatcher


def _feed(matcher, deltas):
    out = []
    for delta in deltas:
        text, stopped = matcher.add(delta)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.finish())
    return out, False


def test_stop_spanning_deltas_is_held_back_then_cut():
    m = StopStringMatcher(["</answer>"])
    assert m.add("The result is 42</") == ("The result is 42", False)  # "</" might start the stop
    assert m.add("ans") == ("", False)
    assert m.add("wer> and more") == ("", True)
    assert m.matched_stop == "</answer>" and m.is_stopped
    assert m.add("anything") == ("", True) and m.finish() == ""


def test_stop_at_the_very_start():
    m = StopStringMatcher(["STOP"])
    assert m.add("STOP right there") == ("", True)


def test_earliest_of_several_stops_wins():
    m = StopStringMatcher(["world", "lo w", "\n"])
    assert m.add("hel") == ("he", False)  # "l" may start "lo w"
    assert m.add("lo world\n") == ("l", True)
    assert m.matched_stop == "lo w"
    m = StopStringMatcher(["ab", "abc"])  # same start: the first listed
    assert m.add("xabc") == ("x", True) and m.matched_stop == "ab"


def test_held_back_prefix_is_released_when_it_does_not_match():
    m = StopStringMatcher(["<|end|>"])
    assert m.add("a <|en") == ("a ", False)
    assert m.add("d of line") == ("<|end of line", False)
    assert m.add(" <") == (" ", False)
    assert m.finish() == "<"  # generation ended some other way: nothing is lost


def test_overlapping_prefixes_hold_the_longest_candidate():
    m = StopStringMatcher(["aab"])
    assert m.add("xa") == ("x", False)
    assert m.add("a") == ("", False)
    assert m.add("a") == ("a", False)  # "aaa": only the last "aa" can still start "aab"
    assert m.add("b!") == ("", True)


def test_include_stop_str_in_output():
    m = StopStringMatcher(["</s>", "END"], include_stop_str_in_output=True)
    assert m.add("done </") == ("done ", False)
    assert m.add("s> trailing") == ("</s>", True)
    assert m.matched_stop == "</s>"


def test_no_stops_passes_everything_through():
    m = StopStringMatcher([])
    assert m.add("anything") == ("anything", False) and m.finish() == ""


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("include", [False, True])
def test_random_splits_equal_cutting_the_whole_text(seed, include):
    rng = random.Random(seed)
    stops = ["ab", "bca", "ccc"][: rng.randint(1, 3)]
    text = "".join(rng.choice("abcx") for _ in range(40))
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        start, stop = min(hits, key=lambda h: (h[0], stops.index(h[1])))
        expected = text[: start + len(stop) if include else start]
    else:
        expected = text
    out, stopped = _feed(StopStringMatcher(stops, include_stop_str_in_output=include), deltas)
    assert "".join(out) == expected and stopped == bool(hits)
