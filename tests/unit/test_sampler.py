"""Sampler tests: each stage against a plain per-row formula, plus seeding,
distribution and logprob checks. CPU only, exact where the math allows."""
from __future__ import annotations

import random

import pytest
import torch

from engine.bad_words import BadWordEndings
from engine.logits_processors import (
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
    ban_tokens,
    keep_only,
    token_counts,
)
from engine.random_sampling import position_seed
from engine.sampled_logprobs import LOGPROB_FLOOR
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

NEG_INF = float("-inf")


def make_seq(prompt=(1, 2, 3), output=(), request_id="r", **params) -> Sequence:
    seq = Sequence(request_id, list(prompt), SamplingParams(**params), block_size=4)
    for t in output:
        seq.append_token(t)
    return seq


def position_draw(seed: int, position: int, vocab: int) -> torch.Tensor:
    """The Exp(1) noise a request seeded `seed` draws for output position `position`."""
    return torch.empty(vocab).exponential_(generator=torch.Generator().manual_seed(position_seed(seed, position)))


def random_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ---- reference formulas, one row at a time ----------------------------------


def ref_top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= row.numel():
        return row.clone()
    kth_largest = sorted(row.tolist(), reverse=True)[k - 1]
    return torch.where(row >= kth_largest, row, NEG_INF)


def ref_top_p(row: torch.Tensor, p: float) -> torch.Tensor:
    probs = row.softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept, cum = [], 0.0
    for token in order:  # smallest prefix whose mass reaches p
        kept.append(token)
        cum += probs[token].item()
        if cum >= p:
            break
    out = torch.full_like(row, NEG_INF)
    out[kept] = row[kept]
    return out


def ref_min_p(row: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = row.softmax(-1)
    return torch.where(probs >= min_p * probs.max(), row, NEG_INF)


def race_token(logits_row: torch.Tensor, q_row: torch.Tensor) -> int:
    return int((logits_row.softmax(-1) / q_row).argmax())


# ---- masking stages ----------------------------------------------------------

TOP_K = [0, 1, 3, 10, 49, 50, 5, 7]
TOP_P = [1.0, 0.9, 0.5, 0.99, 0.1, 1.0, 0.75, 0.3]
MIN_P = [0.0, 0.1, 0.5, 0.01, 0.0, 0.2, 0.05, 1.0]


def test_top_k_matches_formula():
    logits = random_logits(8, 50, seed=0)
    k = torch.tensor([kk if kk > 0 else 50 for kk in TOP_K])
    partial = apply_top_k(logits, k, max_k=49)  # the largest k below V
    by_sort = apply_top_k_top_p(logits, k, torch.ones(8))  # top_p = 1 is off
    for i, kk in enumerate(TOP_K):
        assert torch.equal(partial[i], ref_top_k(logits[i], kk)), i
        assert torch.equal(by_sort[i], ref_top_k(logits[i], kk)), i


def test_top_p_matches_formula():
    logits = random_logits(8, 50, seed=1)
    out = apply_top_k_top_p(logits, None, torch.tensor(TOP_P))
    for i, p in enumerate(TOP_P):
        assert torch.equal(out[i], ref_top_p(logits[i], p)), i


def test_top_k_then_top_p_matches_formula():
    logits = random_logits(8, 50, seed=2)
    k = torch.tensor([kk if kk > 0 else 50 for kk in TOP_K])
    out = apply_top_k_top_p(logits, k, torch.tensor(TOP_P))
    for i in range(8):
        expected = ref_top_p(ref_top_k(logits[i], TOP_K[i]), TOP_P[i])
        assert torch.equal(out[i], expected), i


def test_top_p_always_keeps_top_token():
    logits = torch.tensor([[10.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    out = apply_top_k_top_p(logits, None, torch.tensor([1e-9, 1e-9]))  # 1 - p rounds to 1 in fp32
    assert (out != NEG_INF).sum(-1).tolist() == [1, 1]
    assert out[0].tolist() == [10.0, NEG_INF, NEG_INF]


def test_min_p_matches_formula():
    logits = random_logits(8, 50, seed=3)
    out = apply_min_p(logits, torch.tensor(MIN_P))
    for i, m in enumerate(MIN_P):
        assert torch.equal(out[i], ref_min_p(logits[i], m)), i
    assert torch.equal(out[0], logits[0])  # min_p = 0 is off


# ---- penalties ---------------------------------------------------------------


def test_token_counts():
    counts = token_counts([[0, 2, 2], [], [3, 3, 3, 1]], vocab_size=4, device=torch.device("cpu"))
    assert counts.tolist() == [[1, 0, 2, 0], [0, 0, 0, 0], [0, 1, 0, 3]]


def test_penalties_match_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    prompt = token_counts([[0, 1]], 6, torch.device("cpu"))  # tokens 0, 1 in the prompt
    output = token_counts([[1, 2, 2]], 6, torch.device("cpu"))  # token 1 once, token 2 twice
    out = apply_penalties(
        logits, prompt, output,
        repetition_penalty=torch.tensor([2.0]),
        presence_penalty=torch.tensor([0.5]),
        frequency_penalty=torch.tensor([0.25]),
    )
    expected = [
        2.0 / 2,  # prompt only: repetition divides a positive logit
        -1.0 * 2 - 0.5 - 0.25 * 1,  # prompt + output: multiplies a negative one, then presence + frequency
        0.5 / 2 - 0.5 - 0.25 * 2,  # output twice
        3.0,  # unseen tokens are untouched
        -2.0,
        1.0,
    ]
    assert out[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert logits[0, 0].item() == 2.0  # input untouched


def test_penalties_leave_other_rows_alone_in_sampler():
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    # Row 0 has said token 0 twice; a frequency penalty of 1 makes token 1 win.
    penalized = make_seq(prompt=[2], output=[0, 0], temperature=0.0, frequency_penalty=1.0)
    plain = make_seq(prompt=[2], output=[0, 0], temperature=0.0)
    assert Sampler()(logits, [penalized, plain]).token_ids == [1, 0]
    # Repetition penalty counts prompt tokens too: 5 / 1.5 < 4.
    rep = make_seq(prompt=[0], temperature=0.0, repetition_penalty=1.5)
    assert Sampler()(logits[:1], [rep]).token_ids == [1]


# ---- greedy, temperature, the exponential race -------------------------------


def test_all_greedy_is_argmax():
    logits = random_logits(16, 100, seed=4)
    seqs = [make_seq(temperature=0.0) for _ in range(16)]
    out = Sampler()(logits, seqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16


def test_mixed_greedy_and_random_rows():
    logits = random_logits(8, 100, seed=5)
    seqs = [make_seq(temperature=0.0 if i % 2 == 0 else 1.0, top_k=3) for i in range(8)]
    torch.manual_seed(0)
    out = Sampler()(logits, seqs)
    argmax = logits.argmax(-1).tolist()
    top3 = logits.topk(3, dim=-1).indices.tolist()
    for i, token in enumerate(out.token_ids):
        if i % 2 == 0:
            assert token == argmax[i]
        else:
            assert token in top3[i]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_seeded_token_is_the_race_formula(temperature):
    """The whole random path equals argmax(softmax(masked(logits / T)) / q),
    with q drawn from the request's own stream, seeded for the position it draws for."""
    logits = random_logits(1, 64, seed=6)
    params = dict(temperature=temperature, top_k=20, top_p=0.9, min_p=0.02, seed=123)
    seq = make_seq(**params)
    got = []
    for _ in range(10):
        got.append(Sampler()(logits, [seq]).token_ids[0])
        seq.append_token(got[-1])

    row = logits[0] / temperature
    row = ref_top_p(ref_top_k(ref_min_p(row, 0.02), 20), 0.9)
    expected = [race_token(row, position_draw(123, i, 64)) for i in range(10)]
    assert got == expected


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temperature in (0.5, 2.0):
        seq = make_seq(temperature=temperature, seed=7)
        for position in range(20):
            token = Sampler()(logits, [seq]).token_ids[0]
            assert token == race_token(logits[0] / temperature, position_draw(7, position, 4))
            seq.append_token(token)


def test_seeded_request_is_independent_of_batch():
    vocab, steps = 200, 20
    step_logits = random_logits(steps, vocab, seed=8)  # the seeded request's logits per step
    target_params = dict(temperature=0.8, top_k=50, top_p=0.95, seed=42, presence_penalty=0.5)

    def run(batch_mates) -> list[int]:
        target = make_seq(request_id="target", **target_params)
        others = [make_seq(request_id=f"o{j}", **p) for j, p in enumerate(batch_mates)]
        noise = torch.Generator().manual_seed(len(batch_mates))
        tokens = []
        for step in range(steps):
            pos = step % (len(others) + 1)
            seqs = others[:pos] + [target] + others[pos:]
            logits = torch.randn(len(seqs), vocab, generator=noise) * 3
            logits[pos] = step_logits[step]
            token = Sampler()(logits, seqs).token_ids[pos]
            target.append_token(token)
            tokens.append(token)
        return tokens

    alone = run([])
    assert len(set(alone)) > 1  # actually random, not collapsed to argmax
    assert run([dict(temperature=1.0), dict(temperature=0.0)]) == alone
    assert run([dict(temperature=1.0, seed=42), dict(temperature=0.5, seed=7, top_p=0.5)]) == alone
    assert run([dict(temperature=0.0, logprobs=2), dict(), dict(seed=1, min_p=0.1), dict(top_k=5)]) == alone


# ---- distribution ------------------------------------------------------------


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unseeded_sampling_follows_the_distribution(temperature):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    num_samples = 20000
    logits = probs.log().expand(num_samples, 4).contiguous()
    seqs = [make_seq(temperature=temperature)] * num_samples
    torch.manual_seed(0)
    tokens = torch.tensor(Sampler()(logits, seqs).token_ids)
    expected = (probs.log() / temperature).softmax(-1).tolist()
    # df = 3: chi2 > 30 has probability ~1e-6 under the null.
    assert chi_square(torch.bincount(tokens, minlength=4).tolist(), expected) < 30


def test_seeded_sampling_follows_the_distribution():
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = torch.tensor([probs]).log()
    seq = make_seq(seed=2024)
    counts = [0] * 4
    for _ in range(4000):
        token = Sampler()(logits, [seq]).token_ids[0]
        counts[token] += 1
        seq.append_token(token)
    assert chi_square(counts, probs) < 30


def test_a_seeded_draw_depends_on_the_seed_and_position_alone():
    """A request given its output so far (one that moved to another engine) draws its next token as
    the request that made that output would have: nothing to replay."""
    logits = random_logits(1, 64, seed=11)
    made_here = make_seq(seed=5, temperature=1.0)
    for _ in range(6):
        made_here.append_token(Sampler()(logits, [made_here]).token_ids[0])
    moved = make_seq(seed=5, temperature=1.0, output=made_here.output_token_ids)
    assert Sampler()(logits, [moved]).token_ids == Sampler()(logits, [made_here]).token_ids
    other_seed = make_seq(seed=6, temperature=1.0, output=made_here.output_token_ids)
    nexts = {Sampler()(random_logits(1, 64, seed=n), [s]).token_ids[0] for n in range(8) for s in (moved, other_seed)}
    assert len(nexts) > 2  # the seed matters, not only the position


# ---- logprobs ----------------------------------------------------------------


def test_logprobs_come_from_raw_logits():
    logits = random_logits(4, 30, seed=9)
    seqs = [
        make_seq(temperature=0.7, top_k=5, repetition_penalty=1.3, output=[4, 5], logprobs=3, seed=1),
        make_seq(temperature=0.0, logprobs=0),
        make_seq(temperature=1.0),
        make_seq(temperature=2.0, min_p=0.1, logprobs=20),
    ]
    out = Sampler()(logits, seqs)
    raw = logits.log_softmax(-1)
    assert out.logprobs[2] is None
    for i, n in [(0, 3), (1, 0), (3, 20)]:
        entry, token = out.logprobs[i], out.token_ids[i]
        assert entry[token] == pytest.approx(raw[i, token].item(), abs=1e-6)
        top = sorted(range(30), key=lambda t: -raw[i, t].item())[:n]
        assert list(entry)[:n] == top  # top-n first, best first
        assert [entry[t] for t in top] == pytest.approx([raw[i, t].item() for t in top], abs=1e-6)
        assert set(entry) == set(top) | {token}
    assert out.logprobs[1] == {out.token_ids[1]: pytest.approx(raw[1].max().item(), abs=1e-6)}


def test_named_token_ids_logprobs_come_with_the_rest_under_the_raw_logits():
    logits = random_logits(2, 30, seed=4)
    named = (29, 3, 17)
    seqs = [make_seq(temperature=0.0, logprobs=0, logprob_token_ids=named),
            make_seq(temperature=0.9, top_k=4, logprobs=2, seed=3, logprob_token_ids=named)]
    out = Sampler()(logits, seqs)
    raw = logits.log_softmax(-1)
    for i, n in [(0, 0), (1, 2)]:
        entry = out.logprobs[i]
        assert [entry[t] for t in named] == pytest.approx([raw[i, t].item() for t in named], abs=1e-6)
        top = sorted(range(30), key=lambda t: -raw[i, t].item())[:n]
        assert set(entry) == set(top) | {out.token_ids[i]} | set(named)
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=(1,))  # logprobs not asked for
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprobs=0, logprob_token_ids=(-1,))


def test_processed_logprobs_are_those_the_token_was_drawn_from_and_logits_modes_report_logits():
    """vLLM's --logprobs-mode: processed rows report what penalties, temperature, top-k and top-p made of
    the logits (a masked token at the floor, not -inf); the *_logits modes the logits themselves."""
    logits = random_logits(3, 30, seed=5)
    seqs = [make_seq(temperature=0.5, top_k=3, logprobs=4, seed=2),
            make_seq(temperature=0.0, logprobs=2, logit_bias={7: 50.0}),
            make_seq(temperature=1.0, top_p=0.5, repetition_penalty=1.5, output=[1, 2], logprobs=1, seed=4)]
    shaped = [apply_top_k(logits[0:1] / 0.5, torch.tensor([3]), 3)[0],
              apply_logit_bias(logits[1:2], [((7, 50.0),)])[0],
              apply_top_k_top_p(apply_penalties(logits[2:3], *counts_of(seqs[2], 30), torch.tensor([1.5]),
                                                torch.tensor([0.0]), torch.tensor([0.0])),
                                None, torch.tensor([0.5]))[0]]
    for mode, expected in [("processed_logprobs", [row.log_softmax(-1) for row in shaped]),
                           ("processed_logits", shaped), ("raw_logits", list(logits))]:
        out = Sampler(logprobs_mode=mode)(logits, seqs)
        for i, row in enumerate(expected):
            entry = out.logprobs[i]
            assert entry == {t: pytest.approx(max(row[t].item(), LOGPROB_FLOOR), abs=1e-5) for t in entry}, mode
            assert out.token_ids[i] in entry
        if mode != "raw_logits":  # top-3 of 30: the fourth best is masked, floored
            assert sorted(out.logprobs[0].values())[0] == LOGPROB_FLOOR
    assert out.token_ids[1] == 7  # the bias: in the processed row, not the raw one
    # A greedy row reports the same alone as beside random rows (its own top-k does not shape it).
    greedy = make_seq(temperature=0.0, top_k=2, logprobs=3)
    alone = Sampler(logprobs_mode="processed_logprobs")(logits[:1], [greedy]).logprobs[0]
    beside = Sampler(logprobs_mode="processed_logprobs")(logits[:2], [greedy, seqs[0]]).logprobs[0]
    assert alone == pytest.approx(beside) and LOGPROB_FLOOR not in alone.values()
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        Sampler(logprobs_mode="processed")


def counts_of(seq, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_counts([seq.prompt_token_ids], vocab, torch.device("cpu")), \
        token_counts([seq.output_token_ids], vocab, torch.device("cpu"))


def test_logprobs_include_sampled_token_outside_top_n():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    seq = make_seq(prompt=[0], temperature=0.0, repetition_penalty=2.0, logprobs=1)
    out = Sampler()(logits, [seq])
    assert out.token_ids == [1]  # 5 / 2 < 4
    raw = logits.log_softmax(-1)[0]
    assert list(out.logprobs[0]) == [0, 1]
    assert out.logprobs[0][1] == pytest.approx(raw[1].item())  # raw, not penalized


def test_input_logits_are_not_modified():
    logits = random_logits(3, 40, seed=10)
    before = logits.clone()
    seqs = [
        make_seq(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1, repetition_penalty=1.2, output=[1]),
        make_seq(temperature=0.0, frequency_penalty=1.0, output=[2, 2]),
        make_seq(seed=3, logprobs=2),
    ]
    Sampler()(logits, seqs)
    assert torch.equal(logits, before)


# ---- logit bias --------------------------------------------------------------


def test_logit_bias_adds_to_its_rows_only_before_penalties():
    logits = random_logits(3, 20, seed=11)
    biased = apply_logit_bias(logits, [((2, 5.0), (7, -3.5)), (), ((0, 1.25),)])
    expected = logits.clone()
    expected[0, 2] += 5.0
    expected[0, 7] -= 3.5
    expected[2, 0] += 1.25
    assert torch.equal(biased, expected)
    # Bias first, then the repetition penalty divides the biased (positive) logit: vLLM's order.
    logits = torch.tensor([[1.0, 2.0, 0.0]])
    seq = make_seq(prompt=[0], temperature=0.0, repetition_penalty=5.0, logit_bias={0: 7.0})
    assert Sampler()(logits, [seq]).token_ids == [1]  # (1 + 7) / 5 < 2, where 1 / 5 + 7 would not be


def test_logit_bias_bans_and_forces_tokens_greedy_and_sampled():
    logits = random_logits(4, 30, seed=12)
    greedy_top = logits.argmax(-1).tolist()
    seqs = [
        make_seq(temperature=0.0, logit_bias={greedy_top[0]: -100.0}),
        make_seq(temperature=0.0, logit_bias={3: 100.0}),
        make_seq(temperature=1.5, seed=4, logit_bias={9: 100.0}),
        make_seq(temperature=0.0),  # no bias: argmax as ever
    ]
    out = Sampler()(logits, seqs)
    assert out.token_ids[0] == logits[0].topk(2).indices[1].item()  # the runner-up
    assert out.token_ids[1:] == [3, 9, greedy_top[3]]


def test_logprobs_of_a_biased_row_are_the_raw_ones():
    logits = torch.tensor([[3.0, 0.0, 1.0]])
    seq = make_seq(prompt=[0], temperature=0.0, logit_bias={1: 50.0}, logprobs=1)
    out = Sampler()(logits, [seq])
    raw = logits.log_softmax(-1)[0]
    assert out.token_ids == [1]
    assert out.logprobs[0] == {0: pytest.approx(raw[0].item()), 1: pytest.approx(raw[1].item())}


@pytest.mark.parametrize(("bias", "message"), [
    ({1: 100.5}, r"in \[-100, 100\]"), ({1: float("nan")}, r"in \[-100, 100\]"), ({-1: 1.0}, "negative"),
])
def test_a_logit_bias_out_of_range_is_refused(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={5: 1, 2: -100}).logit_bias == ((2, -100.0), (5, 1.0))


# ---- min_tokens --------------------------------------------------------------

EOS = (5, 6)


def test_ban_tokens_masks_its_rows_ids_only():
    logits = random_logits(3, 10, seed=13)
    banned = ban_tokens(logits, [(1, 4), (), (9,)])
    expected = logits.clone()
    expected[0, 1] = expected[0, 4] = expected[2, 9] = NEG_INF
    assert torch.equal(banned, expected)


def test_short_of_min_tokens_eos_and_stop_ids_are_not_sampled_then_they_are():
    # Greedy would pick EOS (5), then the stop id 7; a row short of min_tokens takes the runner-up.
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 9.0, 0.0, 8.0],
                           [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 8.0]])
    sampler = Sampler(eos_token_ids=EOS)
    short = make_seq(output=[2], temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    assert sampler(logits, [short, short]).token_ids == [1, 1]
    done = make_seq(output=[2, 3], temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    assert sampler(logits, [done, done]).token_ids == [5, 7]
    # EOS it ignores stays allowed; its stop ids do not.
    ignoring = make_seq(temperature=0.0, min_tokens=1, stop_token_ids=(7,), ignore_eos=True)
    assert sampler(logits, [ignoring, ignoring]).token_ids == [5, 1]


def test_min_tokens_bans_in_sampled_rows_and_leaves_other_rows_and_logprobs_alone():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 30.0, 29.0, 0.0]] * 2)
    sampler = Sampler(eos_token_ids=EOS)
    rows = [make_seq(temperature=1.0, seed=3, min_tokens=4, logprobs=1), make_seq(temperature=1.0, seed=3)]
    out = sampler(logits, rows)
    assert out.token_ids[0] not in EOS
    assert out.token_ids[1] in EOS
    assert set(out.logprobs[0]) == {5, out.token_ids[0]}  # the raw logits' top token, as with logit_bias


def test_min_tokens_over_max_tokens_is_refused():
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens=4\]"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


# ---- allowed_token_ids -------------------------------------------------------


def test_keep_only_masks_all_but_its_rows_ids_and_leaves_unrestricted_rows():
    logits = random_logits(3, 12, seed=14)
    kept = keep_only(logits, [(2, 7), (), (11,)])
    expected = torch.full_like(logits, NEG_INF)
    expected[0, [2, 7]] = logits[0, [2, 7]]
    expected[1] = logits[1]
    expected[2, 11] = logits[2, 11]
    assert torch.equal(kept, expected)


def test_allowed_token_ids_bound_greedy_and_sampled_rows_and_logprobs_stay_raw():
    logits = random_logits(3, 40, seed=15)
    allowed = (3, 17, 29)
    seqs = [make_seq(temperature=0.0, allowed_token_ids=allowed, logprobs=1),
            make_seq(temperature=1.3, seed=9, allowed_token_ids=allowed), make_seq(temperature=0.0)]
    out = Sampler()(logits, seqs)
    assert out.token_ids[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert out.token_ids[1] in allowed
    assert out.token_ids[2] == logits[2].argmax().item()
    raw = logits[0].log_softmax(-1)
    assert out.logprobs[0][out.token_ids[0]] == pytest.approx(raw[out.token_ids[0]].item())
    with pytest.raises(ValueError, match="negative"):
        SamplingParams(allowed_token_ids=(-1,))


def test_a_bad_words_last_token_is_banned_where_the_output_ends_with_the_rest_of_it():
    # Greedy picks 6, then 5: a one-token bad word bans its token always, a longer one only after its prefix
    # (in the output: a prompt that ends with it does not count).
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 8.0, 9.0, 0.0]])
    sampler = Sampler()
    assert sampler(logits, [make_seq(temperature=0.0, bad_words_token_ids=[(6,)])]).token_ids == [5]
    words = [(2, 3, 6), (4, 5)]
    assert sampler(logits, [make_seq(prompt=(2, 3), temperature=0.0, bad_words_token_ids=words)]).token_ids == [6]
    assert sampler(logits, [make_seq(output=(2, 3), temperature=0.0, bad_words_token_ids=words)]).token_ids == [5]
    assert sampler(logits, [make_seq(output=(9, 3), temperature=0.0, bad_words_token_ids=words)]).token_ids == [6]
    # Sampled rows too, each by its own output, the other rows untouched; logprobs stay the raw logits'.
    rows = [make_seq(output=(4,), temperature=1.0, seed=1, bad_words_token_ids=[(4, 6), (4, 5)], logprobs=1),
            make_seq(output=(4,), temperature=1.0, seed=1)]
    out = sampler(torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 30.0, 30.0, 0.0]] * 2), rows)
    assert out.token_ids[0] not in (5, 6) and out.token_ids[1] in (5, 6)
    assert set(out.logprobs[0]) >= {out.token_ids[0]} and len(out.logprobs[0]) == 2


def test_bad_words_indexed_once_ban_what_a_pass_over_every_word_bans():
    """Looked up by the tokens before their last (engine/bad_words.py) rather than read word by word each step:
    the same tokens banned, for random words, outputs and prompts."""
    rng = random.Random(5)
    for _ in range(200):
        words = [tuple(rng.randrange(4) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 12))]
        prompt = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
        output = [rng.randrange(4) for _ in range(rng.randint(0, 5))]
        tokens = prompt + output
        expected = {word[-1] for word in words
                    if len(word) == 1 or (len(word) - 1 <= len(output) and tuple(tokens[1 - len(word):]) == word[:-1])}
        assert set(BadWordEndings(words).banned(tokens, len(output))) == expected, (words, prompt, output)


@pytest.mark.parametrize("words", [[()], [(3, -1)]])
def test_bad_words_must_be_token_sequences(words):
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=words)
