"""The workload plan: deterministic from the seed, sizes as asked, agent runs fully planned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from router.simulate.prompts import PromptMaker
from router.simulate.scenario import parse_scenario
from router.simulate.workload import build_plan, make_tools

TOKENIZER = Path(__file__).resolve().parents[2] / ".gpupool" / "models" / "tiny" / "tokenizer.json"


def scenario_dict(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "w",
        "seed": 5,
        "duration_s": 60,
        "classes": {
            "normal": {
                "kind": "chat",
                "arrivals": {"process": "poisson", "rate_per_s": 2},
                "prompt_tokens": {
                    "dist": "lognormal",
                    "median": 100,
                    "sigma": 0.4,
                    "min": 20,
                    "max": 400,
                },
                "output_tokens": {"dist": "fixed", "value": 16},
            },
            "agent": {
                "kind": "agent",
                "arrivals": {"process": "poisson", "rate_per_s": 0.2},
                "steps": {"dist": "uniform", "low": 2, "high": 5},
                "prompt_tokens": {"dist": "fixed", "value": 300},
                "output_tokens": {"dist": "fixed", "value": 20},
                "tool_result_tokens": {"dist": "fixed", "value": 40},
                "tool_wait_ms": {"dist": "fixed", "value": 250},
                "tools": 2,
            },
        },
    }
    data.update(over)
    return data


@pytest.fixture(scope="module")
def prompts() -> PromptMaker:
    return PromptMaker(str(TOKENIZER)) if TOKENIZER.is_file() else PromptMaker(None)


def test_same_seed_same_plan(prompts: PromptMaker) -> None:
    a = build_plan(parse_scenario(scenario_dict()), prompts)
    b = build_plan(parse_scenario(scenario_dict()), prompts)
    assert a.chat == b.chat and a.runs == b.runs
    c = build_plan(parse_scenario(scenario_dict()), prompts, seed=6)
    assert c.chat != a.chat


def test_classes_draw_independently(prompts: PromptMaker) -> None:
    """Removing one class leaves the other's draws unchanged."""
    full = build_plan(parse_scenario(scenario_dict()), prompts)
    data = scenario_dict()
    del data["classes"]["agent"]
    only_chat = build_plan(parse_scenario(data), prompts)
    assert only_chat.chat == full.chat


def test_chat_plan_sizes_and_times(prompts: PromptMaker) -> None:
    plan = build_plan(parse_scenario(scenario_dict()), prompts)
    assert 80 < len(plan.chat) < 160
    assert all(0 <= c.t_s < 60 for c in plan.chat)
    assert [c.t_s for c in plan.chat] == sorted(c.t_s for c in plan.chat)
    assert all(20 <= c.prompt_tokens <= 400 and c.output_tokens == 16 for c in plan.chat)
    assert len({c.prompt_text[:40] for c in plan.chat}) == len(plan.chat)  # no shared prefixes
    if prompts.exact:
        for c in plan.chat[:20]:
            assert prompts.count_tokens(c.prompt_text) == prompts.content_tokens(c.prompt_tokens)


def test_agent_runs_are_fully_planned(prompts: PromptMaker) -> None:
    plan = build_plan(parse_scenario(scenario_dict()), prompts)
    assert plan.runs
    for run in plan.runs:
        assert 2 <= len(run.steps) <= 5
        assert len(run.tools) == 2
        assert all(s.output_tokens == 20 and s.tool_result_tokens == 40 for s in run.steps)
        assert all(s.tool_wait_s == 0.25 for s in run.steps)
        assert all(s.tool_name in ("search", "read_file") for s in run.steps)
    assert plan.total_requests == len(plan.chat) + sum(len(r.steps) for r in plan.runs)


def test_trace_sizes_flow_into_the_plan(tmp_path: Path, prompts: PromptMaker) -> None:
    (tmp_path / "t.jsonl").write_text(
        '{"timestamp": 0, "input_length": 50, "output_length": 5}\n'
        '{"timestamp": 500, "input_length": 60, "output_length": 6}\n'
    )
    data = {
        "name": "tr",
        "duration_s": 5,
        "classes": {
            "c": {
                "kind": "chat",
                "arrivals": {"process": "trace", "path": "t.jsonl", "format": "mooncake"},
            }
        },
    }
    plan = build_plan(parse_scenario(data, base_dir=tmp_path), prompts)
    assert [(c.t_s, c.prompt_tokens, c.output_tokens) for c in plan.chat] == [
        (0.0, 50, 5),
        (0.5, 60, 6),
    ]


def test_prompt_maker_without_tokenizer_uses_words() -> None:
    maker = PromptMaker(None, tokens_per_word=2.0)
    text = maker.text(np.random.default_rng(0), 100)
    assert len(text.split()) == 50
    assert maker.count_tokens(text) == 100
    assert not maker.exact


@pytest.mark.skipif(not TOKENIZER.is_file(), reason="dev model not made")
def test_prompt_maker_with_tokenizer_is_exact() -> None:
    maker = PromptMaker(str(TOKENIZER))
    rng = np.random.default_rng(1)
    for n in (1, 7, 128, 2000):
        assert maker.count_tokens(maker.text(rng, n)) == n


def test_make_tools_names_are_unique() -> None:
    names = [t["function"]["name"] for t in make_tools(12)]
    assert len(set(names)) == 12
