from __future__ import annotations

import numpy as np
import pytest

from loadgen.distributions import LengthDistribution


def test_parse_names_every_kind():
    assert LengthDistribution.parse("128") == LengthDistribution("fixed", (128.0,))
    assert LengthDistribution.parse("fixed:7") == LengthDistribution("fixed", (7.0,))
    assert LengthDistribution.parse("uniform:64:256") == LengthDistribution("uniform", (64.0, 256.0))
    assert LengthDistribution.parse("normal:128:32") == LengthDistribution("normal", (128.0, 32.0))
    assert str(LengthDistribution.parse("lognormal:100:0.5")) == "lognormal:100:0.5"


@pytest.mark.parametrize("text", ["", "zipf:3", "fixed", "fixed:1:2", "fixed:0", "fixed:1.5", "uniform:9:3",
                                  "uniform:0:3", "normal:10:-1", "normal:nan:1", "uniform:a:b"])
def test_parse_rejects(text):
    with pytest.raises(ValueError):
        LengthDistribution.parse(text)


def test_fixed_and_uniform_samples():
    rng = np.random.default_rng(0)
    assert LengthDistribution.parse("fixed:5").sample(rng, 4).tolist() == [5, 5, 5, 5]
    samples = LengthDistribution.parse("uniform:3:5").sample(rng, 3000)
    assert samples.dtype == np.int64
    assert set(samples.tolist()) == {3, 4, 5}  # both ends inclusive
    assert abs(samples.mean() - 4) < 0.1


def test_normal_is_rounded_and_clipped_to_one():
    samples = LengthDistribution.parse("normal:2:10").sample(np.random.default_rng(0), 2000)
    assert samples.min() == 1
    wide = LengthDistribution.parse("normal:128:16").sample(np.random.default_rng(0), 20000)
    assert abs(wide.mean() - 128) < 1 and abs(wide.std() - 16) < 1


def test_lognormal_median():
    samples = LengthDistribution.parse("lognormal:100:0.5").sample(np.random.default_rng(0), 20000)
    assert abs(np.median(samples) - 100) < 3
    assert samples.min() >= 1


def test_same_seed_same_samples():
    dist = LengthDistribution.parse("uniform:1:1000")
    assert (dist.sample(np.random.default_rng(3), 50) == dist.sample(np.random.default_rng(3), 50)).all()
