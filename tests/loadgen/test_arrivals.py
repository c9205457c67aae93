from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.arrivals import arrival_offsets


def test_poisson_gaps_have_the_rate_and_exponential_spread():
    offsets = arrival_offsets(20001, rate=4.0, burstiness=1.0, rng=np.random.default_rng(0))
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 0.25) < 0.01
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.03  # exponential: coefficient of variation 1
    # Poisson counts: arrivals per second have mean = variance = the rate.
    counts = np.bincount(offsets.astype(int))[:-1]
    assert abs(counts.mean() - 4) < 0.1 and abs(counts.var() - 4) < 0.4


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_rate_and_sets_the_spread(burstiness):
    gaps = np.diff(arrival_offsets(20001, rate=10.0, burstiness=burstiness, rng=np.random.default_rng(1)))
    assert abs(gaps.mean() - 0.1) < 0.005
    # Gamma(shape b): coefficient of variation 1 / sqrt(b).
    assert abs(gaps.std() / gaps.mean() - 1 / math.sqrt(burstiness)) < 0.05


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(3, math.inf, 1.0, np.random.default_rng(0)).tolist() == [0.0, 0.0, 0.0]


def test_seeded_schedule_repeats():
    a = arrival_offsets(10, 2.0, 1.0, np.random.default_rng(7))
    assert (a == arrival_offsets(10, 2.0, 1.0, np.random.default_rng(7))).all()


@pytest.mark.parametrize("n, rate, b", [(0, 1.0, 1.0), (5, 0.0, 1.0), (5, -1.0, 1.0), (5, 1.0, 0.0),
                                        (5, 1.0, math.inf)])
def test_rejects(n, rate, b):
    with pytest.raises(ValueError):
        arrival_offsets(n, rate, b, np.random.default_rng(0))
