"""router/prefix/score.py: the cached-prefix score's bounds and the cooling that keeps a hot
instance from taking every request whose prefix it holds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.prefix.score import cached_prefix_scores

_fill = st.floats(min_value=-0.5, max_value=1.5, allow_nan=False)
_blocks = st.integers(min_value=0, max_value=200)


@given(cached=_blocks, prompt=_blocks, fill=_fill, hot=st.floats(0.0, 0.99))
def test_scores_are_in_unit_interval_and_zero_when_full(
    cached: int, prompt: int, fill: float, hot: float
) -> None:
    (score,) = cached_prefix_scores(["a"], {"a": cached}, prompt, {"a": fill}, hot_frac=hot)
    assert 0.0 <= score <= 1.0
    if fill >= 1.0 or prompt == 0 or cached == 0:
        assert score == 0.0


@given(low=_blocks, more=_blocks, prompt=_blocks, fill=_fill)
def test_more_cached_never_scores_less(low: int, more: int, prompt: int, fill: float) -> None:
    a, b = cached_prefix_scores(
        ["a", "b"], {"a": low, "b": low + more}, prompt, {"a": fill, "b": fill}
    )
    assert b >= a


@given(cached=_blocks, prompt=_blocks, fill=_fill, hotter=st.floats(0.0, 1.0))
def test_fuller_never_scores_more(cached: int, prompt: int, fill: float, hotter: float) -> None:
    cool, hot = cached_prefix_scores(
        ["a", "b"], {"a": cached, "b": cached}, prompt, {"a": fill, "b": fill + hotter}
    )
    assert hot <= cool


def test_no_lookup_or_no_index_scores_nothing() -> None:
    assert cached_prefix_scores(["a", "b"], None, 10, {"a": 0.1, "b": 0.1}) == [0.0, 0.0]
    assert cached_prefix_scores(["a", "b"], {"a": 5}, 10, {"a": 0.1, "b": 0.1}) == [0.5, 0.0]
    assert cached_prefix_scores(["a"], {"a": 5}, 10, {}) == [0.0]  # no telemetry: full


def test_a_hot_instance_loses_its_pull() -> None:
    # the whole prefix on a 90 %-full instance counts half; on a full one, nothing
    scores = cached_prefix_scores(
        ["a", "b", "c"], {"a": 8, "b": 8, "c": 8}, 8, {"a": 0.5, "b": 0.9, "c": 1.0}
    )
    assert scores == pytest.approx([1.0, 0.5, 0.0])
    with pytest.raises(ValueError):
        cached_prefix_scores(["a"], {}, 1, {}, hot_frac=1.0)
