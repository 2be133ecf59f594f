"""The workload plan: every arrival, size, prompt text, tool result and tool wait of a scenario,
drawn up front from its seed, so each target in a comparison gets the identical workload.

Each class draws from its own generator (seeded by the scenario seed and the class name), so
adding a class does not change the others' draws. Agent runs carry their tools, first prompt
and per-step plan; the assistant turns are whatever the target generates, so only they differ
between targets (their token counts do not: requests set `ignore_eos` and `max_tokens`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from router.simulate.distributions import sample_ints
from router.simulate.prompts import PromptMaker
from router.simulate.scenario import ClassSpec, Scenario

__all__ = ["AgentRunPlan", "ChatRequestPlan", "Plan", "StepPlan", "build_plan", "make_tools"]

_TOOL_NAMES = (
    "search",
    "read_file",
    "run_python",
    "list_dir",
    "http_get",
    "write_file",
    "grep",
    "calculator",
)


@dataclass(frozen=True)
class ChatRequestPlan:
    class_name: str
    index: int
    t_s: float
    prompt_text: str
    prompt_tokens: int  # the planned prompt size, chat template included
    output_tokens: int
    tenant: int | None = None  # whose shared prefix the prompt starts with (None: none)
    prefix_tokens: int = 0  # that prefix's planned tokens, included in prompt_tokens


@dataclass(frozen=True)
class StepPlan:
    output_tokens: int
    tool_result_tokens: int
    tool_result_text: str  # appended after this step's answer, before the next step
    tool_wait_s: float  # after this step's answer, before the next step
    tool_name: str


@dataclass(frozen=True)
class AgentRunPlan:
    class_name: str
    index: int
    t_s: float
    system_text: str
    user_text: str
    prompt_tokens: int  # the first step's planned prompt, tools included
    steps: tuple[StepPlan, ...]
    tools: tuple[dict[str, Any], ...]
    max_context_tokens: int
    tenant: int | None = None  # whose shared prefix the system prompt is (None: none)
    prefix_tokens: int = 0  # that prefix's planned tokens, included in prompt_tokens


@dataclass(frozen=True)
class Plan:
    scenario: Scenario
    chat: tuple[ChatRequestPlan, ...]
    runs: tuple[AgentRunPlan, ...]

    @property
    def total_requests(self) -> int:
        return len(self.chat) + sum(len(r.steps) for r in self.runs)

    def class_spec(self, name: str) -> ClassSpec:
        return next(c for c in self.scenario.classes if c.name == name)


def make_tools(n: int) -> tuple[dict[str, Any], ...]:
    """`n` OpenAI function-tool definitions (names cycle through a fixed list)."""
    tools = []
    for i in range(n):
        name = _TOOL_NAMES[i % len(_TOOL_NAMES)] + ("" if i < len(_TOOL_NAMES) else f"_{i}")
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": f"Call {name} with one string argument and get its result.",
                    "parameters": {
                        "type": "object",
                        "properties": {"arg": {"type": "string"}},
                        "required": ["arg"],
                    },
                },
            }
        )
    return tuple(tools)


def _class_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _sizes(
    spec: ClassSpec, rng: np.random.Generator, n: int, trace: list[int | None], which: str
) -> list[int]:
    dist = spec.prompt_tokens if which == "prompt" else spec.output_tokens
    if dist is not None:
        return sample_ints(dist, rng, n, minimum=1)
    return [max(1, t or 1) for t in trace]


class _Tenants:
    """A class's shared prefixes (`shared_prefix`), drawn from a generator of their own so a
    class without them draws exactly what it did before."""

    def __init__(self, spec: ClassSpec, seed: int, prompts: PromptMaker) -> None:
        shared = spec.shared_prefix
        self.rng = _class_rng(seed, spec.name + "/shared_prefix")
        sizes = sample_ints(shared.tokens, self.rng, shared.tenants, 1) if shared else []
        self.sizes = sizes
        self.texts = [prompts.text(self.rng, size) for size in sizes]

    def pick(self) -> tuple[int | None, int, str]:
        """A request's tenant, its prefix's tokens and text; (None, 0, "") without any."""
        if not self.sizes:
            return None, 0, ""
        t = int(self.rng.integers(0, len(self.sizes)))
        return t, self.sizes[t], self.texts[t]


def _chat_plans(
    spec: ClassSpec,
    scenario: Scenario,
    rng: np.random.Generator,
    prompts: PromptMaker,
    tenants: _Tenants,
) -> list[ChatRequestPlan]:
    arrivals = spec.arrivals.arrivals(rng, scenario.duration_s)
    n = len(arrivals)
    prompt_sizes = _sizes(spec, rng, n, [a.prompt_tokens for a in arrivals], "prompt")
    output_sizes = _sizes(spec, rng, n, [a.output_tokens for a in arrivals], "output")
    plans = []
    for i, (a, p, o) in enumerate(zip(arrivals, prompt_sizes, output_sizes, strict=True)):
        text = prompts.text(rng, prompts.content_tokens(p))
        tenant, prefix, prefix_text = tenants.pick()
        if tenant is not None:
            text = prefix_text + "\n\n" + text
        plans.append(ChatRequestPlan(spec.name, i, a.t_s, text, p + prefix, o, tenant, prefix))
    return plans


def _run_plans(
    spec: ClassSpec,
    scenario: Scenario,
    rng: np.random.Generator,
    prompts: PromptMaker,
    tenants: _Tenants,
) -> list[AgentRunPlan]:
    assert spec.steps is not None and spec.tool_result_tokens is not None
    assert spec.tool_wait_ms is not None
    arrivals = spec.arrivals.arrivals(rng, scenario.duration_s)
    n = len(arrivals)
    tools = make_tools(spec.tools)
    tools_tokens = prompts.count_tokens(orjson.dumps(list(tools)).decode()) + 8 if tools else 0
    prompt_sizes = _sizes(spec, rng, n, [a.prompt_tokens for a in arrivals], "prompt")
    step_counts = sample_ints(spec.steps, rng, n, minimum=1)
    runs = []
    for i, (a, prompt_size, n_steps) in enumerate(
        zip(arrivals, prompt_sizes, step_counts, strict=True)
    ):
        if spec.output_tokens is not None:
            outs = sample_ints(spec.output_tokens, rng, n_steps, minimum=1)
        else:
            outs = [max(1, a.output_tokens or 1)] * n_steps
        results = sample_ints(spec.tool_result_tokens, rng, n_steps, minimum=1)
        waits_s = [max(0.0, float(w)) / 1e3 for w in spec.tool_wait_ms.sample(rng, n_steps)]
        names = [
            str(tools[int(j)]["function"]["name"]) if tools else "tool"
            for j in rng.integers(0, max(1, len(tools)), size=n_steps)
        ]
        steps = tuple(
            StepPlan(o, r, prompts.text(rng, r), w, name)
            for o, r, w, name in zip(outs, results, waits_s, names, strict=True)
        )
        system_text = "You are a careful agent. Use the tools to finish the task. " + (f"Run {i}.")
        user_tokens = max(1, prompts.content_tokens(prompt_size, messages=2) - tools_tokens - 16)
        user_text = prompts.text(rng, user_tokens)
        tenant, prefix, prefix_text = tenants.pick()
        runs.append(
            AgentRunPlan(
                spec.name,
                i,
                a.t_s,
                system_text if tenant is None else prefix_text,
                user_text,
                prompt_size + prefix,
                steps,
                tools,
                spec.max_context_tokens,
                tenant,
                prefix,
            )
        )
    return runs


def build_plan(scenario: Scenario, prompts: PromptMaker, seed: int | None = None) -> Plan:
    """Draw the whole workload; `seed` overrides the scenario's."""
    seed = scenario.seed if seed is None else seed
    chat: list[ChatRequestPlan] = []
    runs: list[AgentRunPlan] = []
    for spec in scenario.classes:
        rng = _class_rng(seed, spec.name)
        tenants = _Tenants(spec, seed, prompts)
        if spec.kind == "chat":
            chat.extend(_chat_plans(spec, scenario, rng, prompts, tenants))
        else:
            runs.extend(_run_plans(spec, scenario, rng, prompts, tenants))
    chat.sort(key=lambda c: c.t_s)
    runs.sort(key=lambda r: r.t_s)
    return Plan(scenario, tuple(chat), tuple(runs))
