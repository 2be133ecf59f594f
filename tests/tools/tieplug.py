"""A pytest plugin that forces random choices to one end, to find tests that lean on a coin.

The picker breaks ties between equally scored instances at random (`Picker.pick`); a test
whose outcome depends on which way the coin falls fails now and then in CI. Run the suite with
the coin forced each way; a test that passes both times does not lean on it:

    TIE=first PYTHONPATH=tests/tools .venv/bin/pytest -p tieplug -n 3 --dist loadfile tests/unit
    TIE=last  PYTHONPATH=tests/tools .venv/bin/pytest -p tieplug -n 3 --dist loadfile tests/unit

(`make unit-tie` runs both.) `random.Random.choice` (so every `Random` and `SystemRandom`) and
`random.choice` return the sequence's first or last element when the caller is in a module
named by `TIE_SCOPE`: comma-separated module prefixes, a `-` before one leaves it out; by
default gpupool's packages less `pools.devmodel` (whose seeded draws write the dev model's
tokenizer corpus: forced, the corpus is one word and the tokenizer another). `all` forces every
caller, the standard library's, Hypothesis's and the tests' own data generators
too (where a forced choice is no coin: a golden input list of one word, Hypothesis never
finishing a search). Tests marked `coin` (they check the tie-break itself, or pin what a seeded
one drew) are skipped.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable
from typing import Any

import pytest

PRODUCT = "router,pools,gpu_probe,kvcache_model,-pools.devmodel"
MODE = pytest.StashKey[str]()


def in_scope(module: str, scope: str) -> bool:
    """Whether `module` is named by `scope` (see the module's doc): "router" names router and
    router.x, not routers."""
    if scope == "all":
        return True
    names = [n.strip() for n in scope.split(",") if n.strip()]
    module += "."
    if any(module.startswith(n[1:] + ".") for n in names if n.startswith("-")):
        return False
    return any(module.startswith(n + ".") for n in names if not n.startswith("-"))


def forced_choice(original: Callable[..., Any], end: int, scope: str) -> Callable[..., Any]:
    """`choice` that returns `seq[end]` for a caller in `scope`; `original` is the unbound
    `Random.choice(self, seq)` or the bound `random.choice(seq)`."""

    def choice(*args: Any) -> Any:
        seq = args[-1]  # `Random.choice(self, seq)` or the bound `random.choice(seq)`
        if len(seq) and in_scope(sys._getframe(1).f_globals.get("__name__", ""), scope):
            return seq[end]
        return original(*args)

    return choice


def pytest_configure(config: pytest.Config) -> None:
    mode = os.environ.get("TIE", "")
    if mode not in ("first", "last"):
        raise pytest.UsageError(f"tieplug: TIE must be 'first' or 'last', not {mode!r}")
    scope = os.environ.get("TIE_SCOPE", PRODUCT)
    end = 0 if mode == "first" else -1
    random.Random.choice = forced_choice(random.Random.choice, end, scope)  # type: ignore[method-assign]
    random.choice = forced_choice(random.choice, end, scope)
    config.stash[MODE] = f"TIE={mode} TIE_SCOPE={scope}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="tieplug: checks or pins the coin that is forced here")
    for item in items:
        if item.get_closest_marker("coin") is not None:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    return f"tieplug: random choices forced, {config.stash[MODE]}"
