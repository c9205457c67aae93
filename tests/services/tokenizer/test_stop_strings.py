from __future__ import annotations

import itertools
import random

import pytest
import regex

from services.tokenizer.stop_strings import StopRegexTimeout, StopStringMatcher


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


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("include", [False, True])
def test_many_stop_strings_prefixes_of_each_other_cut_as_the_earliest_does(seed, include):
    """Stop strings are looked up by length and prefix, not read one by one per delta: the same cut, the earliest
    match of the first text received that holds one and at one start the first given, from a few stops to
    thousands."""
    rng = random.Random(seed)
    stops = list(dict.fromkeys("".join(rng.choice("abc") for _ in range(rng.randint(1, 7)))
                               for _ in range(rng.choice([2, 6, 3000]))))
    stops = [stop for stop in stops if len(stop) > 2] or ["abca"]  # some text gets through
    text = "".join(rng.choice("abcx") for _ in range(60))
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    # The first text received that holds a match is cut at its earliest (a stop that begins sooner but is
    # whole only later does not wait: vLLM's streams stop alike).
    received = next((text[:end] for end in itertools.accumulate(map(len, deltas))
                     if any(stop in text[:end] for stop in stops)), text)
    hits = [(received.find(stop), i, stop) for i, stop in enumerate(stops) if stop in received]
    start, _, stop = min(hits) if hits else (len(text), 0, "")
    out, stopped = _feed(StopStringMatcher(stops, include_stop_str_in_output=include), deltas)
    assert "".join(out) == text[:start + len(stop) if include else start] and stopped == bool(hits)


def test_a_stop_regex_holds_back_what_may_begin_a_match_then_cuts_before_it():
    m = StopStringMatcher([regex.compile(r"\d+\.")])
    assert m.add("Step 1") == ("Step ", False)  # "1" may begin "1."
    assert m.add("2") == ("", False)
    assert m.add(" then") == ("12 then", False)  # it did not: released
    assert m.add(" 3") == (" ", False)
    assert m.add(". Done") == ("", True)
    assert m.matched_stop == r"\d+\." and m.add("more") == ("", True)
    kept = StopStringMatcher([regex.compile(r"\d+\.")], include_stop_str_in_output=True)
    assert kept.add("Step 12. Done") == ("Step 12.", True)


def test_a_stop_regex_sees_the_text_already_sent_for_its_anchors_and_lookbehinds():
    at_start = StopStringMatcher([regex.compile(r"^Answer")])
    assert at_start.add("My ") == ("My ", False)
    assert at_start.add("Answer") == ("Answer", False)  # not at the text's start
    after_newline = StopStringMatcher([regex.compile(r"(?<=\n)END")])
    assert after_newline.add("THE END\n") == ("THE END\n", False)
    assert after_newline.add("END of it") == ("", True)


def test_stop_strings_and_regexes_the_earliest_wins_and_at_one_start_the_string():
    m = StopStringMatcher(["stop", regex.compile(r"st[aeiou]p")])
    assert m.add("a step, a stop") == ("a ", True) and m.matched_stop == r"st[aeiou]p"
    m = StopStringMatcher(["stop", regex.compile(r"st[aeiou]p")])
    assert m.add("a stop") == ("a ", True) and m.matched_stop == "stop"


def test_regexes_that_search_too_long_fail_instead_of_stalling(monkeypatch):
    monkeypatch.setattr("services.tokenizer.stop_strings.SEARCH_BUDGET_S", 1e-9)
    m = StopStringMatcher([regex.compile(r"(a|aa)+$b")])
    with pytest.raises(StopRegexTimeout, match="took over"):
        m.add("a" * 5000)
    # The budget is the request's, not each search's: many quick searches use it up too.
    monkeypatch.setattr("services.tokenizer.stop_strings.SEARCH_BUDGET_S", 0.02)
    m = StopStringMatcher([regex.compile(r"x(?=y)")])
    with pytest.raises(StopRegexTimeout):
        for _ in range(10**6):
            m.add("a" * 100)


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("include", [False, True])
def test_random_splits_with_regexes_stop_at_the_first_text_received_that_holds_a_match(seed, include):
    """What streaming can know: the text ends at the earliest match in the first text received (at a
    delta's end) that holds one."""
    rng = random.Random(seed)
    patterns = [r"b+c", r"ca{2,}", r"(?<=x)ab", r"^ccc"][: rng.randint(1, 4)]
    stops = [regex.compile(p) for p in patterns] + (["xcb"] if seed % 2 else [])
    text = "".join(rng.choice("abcx") for _ in range(40))
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    expected, is_stopped = text, False
    for end in [*cuts, len(text)]:
        received = text[:end]
        hits = [(received.find(s), received.find(s) + len(s)) for s in stops if isinstance(s, str) and s in received]
        hits += [(m.start(), m.end()) for s in stops if not isinstance(s, str) and (m := s.search(received))]
        if hits:
            start, stop_end = min(hits, key=lambda hit: hit[0])
            expected, is_stopped = received[:stop_end if include else start], True
            break
    out, stopped = _feed(StopStringMatcher(stops, include_stop_str_in_output=include), deltas)
    assert "".join(out) == expected and stopped == is_stopped
