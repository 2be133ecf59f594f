"""Value distributions for workload sizes and waits: fixed, uniform, lognormal, exponential and
empirical, each a frozen dataclass with `sample(rng, n) -> np.ndarray[float]`.

Every draw goes through the caller's `numpy.random.Generator`, so a scenario with a seed gives
the same values on every run. `min`/`max` clamp the draws (a lognormal has a long tail; a
token count must stay inside the model's context). Integer quantities (tokens, steps) are
rounded by the caller with `sample_ints`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "Distribution",
    "Empirical",
    "Exponential",
    "Fixed",
    "LogNormal",
    "Uniform",
    "sample_ints",
]

FloatArray = npt.NDArray[np.float64]


class Distribution(Protocol):
    """Anything that draws `n` floats from an rng."""

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray: ...

    def mean(self) -> float:
        """The expected value before clamping (used to size scenarios and report plans)."""
        ...


def _clamp(values: FloatArray, lo: float | None, hi: float | None) -> FloatArray:
    if lo is None and hi is None:
        return values
    return np.clip(values, -math.inf if lo is None else lo, math.inf if hi is None else hi)


@dataclass(frozen=True)
class Fixed:
    value: float

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        return np.full(n, float(self.value), dtype=np.float64)

    def mean(self) -> float:
        return float(self.value)


@dataclass(frozen=True)
class Uniform:
    low: float
    high: float

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        return rng.uniform(self.low, self.high, size=n).astype(np.float64)

    def mean(self) -> float:
        return (self.low + self.high) / 2.0


@dataclass(frozen=True)
class LogNormal:
    """exp(N(ln(median), sigma²)), clamped to [min, max]. Mean = median·exp(sigma²/2)."""

    median: float
    sigma: float
    min: float | None = None
    max: float | None = None

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        values = rng.lognormal(math.log(self.median), self.sigma, size=n).astype(np.float64)
        return _clamp(values, self.min, self.max)

    def mean(self) -> float:
        return self.median * math.exp(self.sigma**2 / 2.0)


@dataclass(frozen=True)
class Exponential:
    mean_value: float
    min: float | None = None
    max: float | None = None

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        values = rng.exponential(self.mean_value, size=n).astype(np.float64)
        return _clamp(values, self.min, self.max)

    def mean(self) -> float:
        return self.mean_value


@dataclass(frozen=True)
class Empirical:
    """Draws from `values` with probabilities proportional to `weights` (uniform if empty)."""

    values: tuple[float, ...]
    weights: tuple[float, ...] = ()

    def _probs(self) -> FloatArray | None:
        if not self.weights:
            return None
        w = np.asarray(self.weights, dtype=np.float64)
        probs: FloatArray = w / w.sum()
        return probs

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        values = np.asarray(self.values, dtype=np.float64)
        return rng.choice(values, size=n, replace=True, p=self._probs()).astype(np.float64)

    def mean(self) -> float:
        probs = self._probs()
        values = np.asarray(self.values, dtype=np.float64)
        return float(values.mean() if probs is None else (values * probs).sum())


def sample_ints(
    dist: Distribution, rng: np.random.Generator, n: int, minimum: int = 0
) -> list[int]:
    """Draw `n` values and round them to integers no smaller than `minimum`."""
    return [max(minimum, round(float(v))) for v in dist.sample(rng, n)]
