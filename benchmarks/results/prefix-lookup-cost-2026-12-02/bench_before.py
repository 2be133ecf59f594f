"""The seen-prefix case of benchmarks.prefix_lookup_cost on the tree before the memos (a444ef1's
`router/`, extracted to /tmp/s27before, first on sys.path)."""

import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, "/tmp/s27before")
import router.prefix
from router.prefix import ChatPrompt
from router.prefix.hashing import DEFAULT_SEED, chain_keys

assert router.prefix.__file__ is not None and router.prefix.__file__.startswith("/tmp/s27before")
_RULE = "Rule 7: keep the tool output short and cite the file. "


def _body(chars: int, turn: int = 0, tenant: int = 0) -> dict[str, Any]:
    system = (f"You work for tenant {tenant}. " + _RULE * (chars // len(_RULE) + 1))[:chars]
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Where is the config parsed? (question {turn})"},
        ],
    }


def _new_tenant(chars: int, run: int) -> dict[str, Any]:
    return _body(chars, run, 1 + run)


def main() -> None:
    p = ChatPrompt.from_model_dir(Path("/work/main/.gpupool/models/tiny"))
    assert p is not None
    for chars in (2000, 8000, 32000):
        p.token_ids(_body(chars, -1))
        cases: list[tuple[str, Callable[[int], dict[str, Any]]]] = [
            ("never seen", functools.partial(_new_tenant, chars)),
            ("seen prefix + new user turn", functools.partial(_body, chars)),
        ]
        for name, make in cases:
            a: list[float] = []
            b: list[float] = []
            n = 0
            for r in range(15):
                t0 = time.perf_counter()
                ids = p.token_ids(make(r))
                t1 = time.perf_counter()
                assert ids is not None
                chain_keys(ids, 128, DEFAULT_SEED)
                a.append(t1 - t0)
                b.append(time.perf_counter() - t1)
                n = len(ids)
            print(
                f"BEFORE {chars} chars, {n} tokens, {name}: token ids"
                f" {statistics.median(a) * 1e3:.2f} ms, chain {statistics.median(b) * 1e3:.2f} ms"
            )


if __name__ == "__main__":
    main()
