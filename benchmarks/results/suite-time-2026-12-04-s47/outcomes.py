"""Compare what the OpenAPI property tests found at different case counts (`openapi_counts.sh`):
per run, the cases sent, the distinct (operation, status, error code) outcomes, the failures,
and the router/pools lines and branches covered (coverage.py JSON), each against the first
run given.

    python outcomes.py RUN_DIR [RUN_DIR ...]   # each with outcomes.jsonl and coverage.json
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def load(run: Path) -> tuple[list[dict[str, object]], set[tuple[str, str]]]:
    cases = [json.loads(line) for line in (run / "outcomes.jsonl").read_text().splitlines()]
    files = json.loads((run / "coverage.json").read_text())["files"]
    lines: set[tuple[str, str]] = {
        (name, str(n)) for name, f in files.items() for n in f["executed_lines"]
    }
    branches: set[tuple[str, str]] = {
        (name, f"{a}->{b}") for name, f in files.items() for a, b in f["executed_branches"]
    }
    return cases, lines | branches


def outcome(case: dict[str, object]) -> tuple[object, ...]:
    return (case["op"], case["status"], case["code"])


def main(runs: list[Path]) -> None:
    base_cases, base_lines = load(runs[0])
    base_outcomes = {outcome(c) for c in base_cases}
    for run in runs:
        cases, lines = load(run)
        outcomes = {outcome(c) for c in cases}
        phases = Counter(str(c["phase"]) for c in cases)
        failures = Counter(str(c["failure"]) for c in cases if c["failure"])
        print(
            f"{run.name}: {len(cases)} cases {dict(phases)}; {len(outcomes)} outcomes"
            f" ({len(outcomes - base_outcomes)} not in {runs[0].name},"
            f" {len(base_outcomes - outcomes)} of its missing); failures {dict(failures)};"
            f" {len(lines)} lines and branches covered"
            f" ({len(lines - base_lines)} not in {runs[0].name},"
            f" {len(base_lines - lines)} of its missing)"
        )
        for o in sorted(base_outcomes - outcomes, key=str):
            print("   missing outcome", o)
        for o in sorted(outcomes - base_outcomes, key=str):
            print("   new outcome", o)
        missing = Counter(name for name, _ in base_lines - lines)
        for name, count in missing.most_common():
            where = sorted(n for f, n in base_lines - lines if f == name)
            print(f"   missing {count} in {name}: {' '.join(where[:30])}")


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])
