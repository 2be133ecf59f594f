"""Distributions for workload sizes and waits: shape, clamping, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest

from router.simulate.distributions import (
    Distribution,
    Empirical,
    Exponential,
    Fixed,
    LogNormal,
    Uniform,
    sample_ints,
)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_fixed_is_constant() -> None:
    assert Fixed(32).sample(rng(), 5).tolist() == [32.0] * 5
    assert Fixed(32).mean() == 32.0


def test_uniform_stays_in_bounds() -> None:
    values = Uniform(100, 400).sample(rng(), 10_000)
    assert values.min() >= 100 and values.max() <= 400
    assert abs(values.mean() - 250) < 5


def test_lognormal_median_and_clamp() -> None:
    dist = LogNormal(median=200, sigma=0.8)
    values = dist.sample(rng(), 50_000)
    assert abs(np.median(values) - 200) / 200 < 0.03
    assert abs(values.mean() - dist.mean()) / dist.mean() < 0.03
    clamped = LogNormal(median=200, sigma=2.0, min=16, max=1024).sample(rng(), 10_000)
    assert clamped.min() == 16 and clamped.max() == 1024


def test_exponential_mean() -> None:
    values = Exponential(500).sample(rng(), 50_000)
    assert abs(values.mean() - 500) / 500 < 0.03


def test_empirical_follows_weights() -> None:
    dist = Empirical((1.0, 10.0, 100.0), (0.7, 0.2, 0.1))
    values = dist.sample(rng(), 20_000)
    assert set(np.unique(values).tolist()) == {1.0, 10.0, 100.0}
    assert abs((values == 1.0).mean() - 0.7) < 0.02
    assert math.isclose(dist.mean(), 0.7 + 2.0 + 10.0)
    assert Empirical((3.0, 5.0)).mean() == 4.0


@pytest.mark.parametrize(
    "dist", [Uniform(1, 9), LogNormal(50, 0.5), Exponential(3), Empirical((1.0, 2.0))]
)
def test_same_seed_same_draws(dist: Distribution) -> None:
    a = dist.sample(rng(42), 100)
    b = dist.sample(rng(42), 100)
    assert a.tolist() == b.tolist()


def test_sample_ints_rounds_and_floors() -> None:
    assert sample_ints(Fixed(2.6), rng(), 3) == [3, 3, 3]
    assert sample_ints(Fixed(0.2), rng(), 2, minimum=1) == [1, 1]
