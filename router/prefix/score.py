"""The cached-prefix score of each candidate instance for one request (pure; used by
`router/admission/picking.py`'s `score_cached_prefix`: one score in [0, 1] per candidate,
summed with the other scorers' by weight). The picker passes tokens for "blocks" (cached
prompt tokens, whole blocks × block size, over the prompt's tokens): only the ratio counts.

    score_i = hit_i * cool_i
    hit_i   = min(1, cached_blocks_i / prompt_blocks)             in [0, 1]
    cool_i  = 1                                  while fill_i <= hot_frac
            = (1 - fill_i) / (1 - hot_frac)      above it, down to 0 when full

`cached_blocks_i`: the leading blocks of the prompt the instance holds (`PrefixCache.
cached_blocks`); an instance without a usable index scores 0, like one holding nothing, and a
request with no lookup (`cached` None) scores 0 everywhere, so the other scorers decide as
before. `fill_i` in [0, 1]: how full the instance is for this pool, the larger of its KV use
and its running count over its operating-point limit (stale telemetry: 1).

Why the cooling: a router that sends every request to the instance holding its prefix makes
that instance the only one that ever holds it, fills it, and leaves the others idle (the
"cache affinity death spiral"). Past `hot_frac` the cache's pull fades linearly and is gone at
full, so a hot instance's prefix stops outweighing an idle instance's headroom; the request
then prefills elsewhere and that instance holds the prefix too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["DEFAULT_HOT_FRAC", "cached_prefix_scores"]

DEFAULT_HOT_FRAC = 0.8


def cached_prefix_scores(
    candidates: Sequence[str],
    cached: Mapping[str, int] | None,
    prompt_blocks: int,
    fill_frac: Mapping[str, float],
    *,
    hot_frac: float = DEFAULT_HOT_FRAC,
) -> list[float]:
    """One score in [0, 1] per candidate, in order (see the module's formula)."""
    if not 0.0 <= hot_frac < 1.0:
        raise ValueError("hot_frac must be in [0, 1)")
    if cached is None or prompt_blocks <= 0:
        return [0.0] * len(candidates)
    out = []
    for instance_id in candidates:
        hit = min(1.0, max(0, cached.get(instance_id, 0)) / prompt_blocks)
        fill = min(1.0, max(0.0, fill_frac.get(instance_id, 1.0)))
        cool = 1.0 if fill <= hot_frac else (1.0 - fill) / (1.0 - hot_frac)
        out.append(hit * cool)
    return out
