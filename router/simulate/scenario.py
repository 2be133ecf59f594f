"""Benchmark scenarios: the YAML schema (pydantic, validated once at the edge) and the frozen
`Scenario` the harness reads. `load_scenario(path)` raises `ScenarioError` with one message per
problem, each naming the field (`classes.agent.steps.median: Input should be greater than 0`).

A scenario is a set of traffic classes, each with its own arrival process, sizes and SLOs:

    name: smoke
    seed: 7
    duration_s: 12            # arrivals happen in [0, duration_s)
    drain_timeout_s: 30       # then in-flight work gets this long before it is cancelled
    classes:
      chat:
        kind: chat            # single-turn requests
        arrivals: {process: poisson, rate_per_s: 1.0}
        prompt_tokens: {dist: lognormal, median: 128, sigma: 0.5, min: 16, max: 1024}
        output_tokens: {dist: fixed, value: 32}
        slo: {ttft_ms: 2000, tpot_ms: 200, e2e_ms: 10000}
      agent:
        kind: agent           # multi-step tool-using runs with a growing context
        arrivals: {process: schedule, segments: [{start_s: 0, rate_per_s: 0.1}]}
        steps: {dist: fixed, value: 3}
        prompt_tokens: {dist: fixed, value: 256}      # the first step's prompt
        output_tokens: {dist: fixed, value: 32}       # each step's output
        tool_result_tokens: {dist: lognormal, median: 128, sigma: 0.6}
        tool_wait_ms: {dist: lognormal, median: 500, sigma: 0.5}
        slo: {ttft_ms: 5000, tpot_ms: 300, e2e_ms: 30000}    # per step

Distributions: `fixed {value}`, `uniform {low, high}`, `lognormal {median, sigma, min?, max?}`,
`exponential {mean, min?, max?}`, `empirical {values, weights?}`. Arrival processes: `poisson
{rate_per_s}`, `gamma {rate_per_s, cv}`, `constant {rate_per_s}`, `schedule {segments:
[{start_s, rate_per_s}], cv?}`, `trace {path, format: azure|mooncake, speedup?, offset_s?,
length_scale?}`. With `trace` arrivals, `prompt_tokens`/`output_tokens` may be left out and
come from the trace.

`shared_prefix: {tenants: N, tokens: DIST}` (either kind): each request starts with one of N
tenants' prefixes (each drawn once, DIST tokens), picked uniformly: a chat prompt begins with
it, an agent run's system prompt is it; `prompt_tokens` is then what follows the prefix. It is
what prefix-cache placement acts on (router/simulate/prefix.py, `gpupool simulate
--prefix-cache`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pools.config import validation_problems
from router.simulate.arrivals import ArrivalProcess, RateSegment, RenewalArrivals, TraceArrivals
from router.simulate.distributions import (
    Distribution,
    Empirical,
    Exponential,
    Fixed,
    LogNormal,
    Uniform,
)
from router.simulate.traces import TraceError, load_trace

__all__ = [
    "ClassSpec",
    "Scenario",
    "ScenarioError",
    "SharedPrefix",
    "Slo",
    "load_scenario",
    "parse_scenario",
    "scale_rates",
]


class ScenarioError(Exception):
    """The scenario is invalid. `problems` lists one message per offending field."""

    def __init__(self, problems: list[str], source: str = "scenario") -> None:
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# The external schema. Unknown keys are errors: a typo must not pass silently.
# ---------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FixedSchema(_Strict):
    dist: Literal["fixed"]
    value: float = Field(ge=0)


class UniformSchema(_Strict):
    dist: Literal["uniform"]
    low: float = Field(ge=0)
    high: float = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> UniformSchema:
        if self.high < self.low:
            raise ValueError("high must be >= low")
        return self


class LogNormalSchema(_Strict):
    dist: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(ge=0, le=5)
    min: float | None = Field(default=None, ge=0)
    max: float | None = Field(default=None, gt=0)


class ExponentialSchema(_Strict):
    dist: Literal["exponential"]
    mean: float = Field(gt=0)
    min: float | None = Field(default=None, ge=0)
    max: float | None = Field(default=None, gt=0)


class EmpiricalSchema(_Strict):
    dist: Literal["empirical"]
    values: list[float] = Field(min_length=1)
    weights: list[float] = Field(default_factory=list)  # empty: equally likely

    @model_validator(mode="after")
    def _weights(self) -> EmpiricalSchema:
        if any(v < 0 for v in self.values):
            raise ValueError("values must be >= 0")
        if self.weights:
            if len(self.weights) != len(self.values):
                raise ValueError("weights must have one entry per value")
            if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
                raise ValueError("weights must be >= 0 with a positive sum")
        return self


DistSchema = Annotated[
    FixedSchema | UniformSchema | LogNormalSchema | ExponentialSchema | EmpiricalSchema,
    Field(discriminator="dist"),
]


class PoissonSchema(_Strict):
    process: Literal["poisson"]
    rate_per_s: float = Field(gt=0)


class GammaSchema(_Strict):
    process: Literal["gamma"]
    rate_per_s: float = Field(gt=0)
    cv: float = Field(gt=0, le=20)  # coefficient of variation of gaps; vllm's burstiness = 1/cv²


class ConstantSchema(_Strict):
    process: Literal["constant"]
    rate_per_s: float = Field(gt=0)


class SegmentSchema(_Strict):
    start_s: float = Field(ge=0)
    rate_per_s: float = Field(ge=0)


class ScheduleSchema(_Strict):
    process: Literal["schedule"]
    segments: list[SegmentSchema] = Field(min_length=1)
    cv: float = Field(default=1.0, ge=0, le=20)

    @model_validator(mode="after")
    def _sorted(self) -> ScheduleSchema:
        starts = [s.start_s for s in self.segments]
        if starts[0] != 0:
            raise ValueError("the first segment must start at start_s: 0")
        if any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError("segments must have increasing start_s")
        return self


class TraceSchema(_Strict):
    process: Literal["trace"]
    path: str  # relative to the scenario file
    format: Literal["azure", "mooncake"]
    speedup: float = Field(default=1.0, gt=0)
    offset_s: float = Field(default=0.0, ge=0)
    length_scale: float = Field(default=1.0, gt=0)


ArrivalSchema = Annotated[
    PoissonSchema | GammaSchema | ConstantSchema | ScheduleSchema | TraceSchema,
    Field(discriminator="process"),
]


class SloSchema(_Strict):
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2e_ms: float | None = Field(default=None, gt=0)


class SharedPrefixSchema(_Strict):
    tenants: int = Field(ge=1, le=100_000)
    tokens: DistSchema  # each tenant's prefix size, drawn once per tenant


class ClassSchema(_Strict):
    kind: Literal["chat", "agent"]
    arrivals: ArrivalSchema
    prompt_tokens: DistSchema | None = None  # chat: the prompt; agent: the first step's prompt
    output_tokens: DistSchema | None = None  # per request (agent: per step)
    slo: SloSchema = SloSchema()
    headers: dict[str, str] = Field(default_factory=dict)  # extra request headers
    # agent only
    steps: DistSchema | None = None
    tool_result_tokens: DistSchema | None = None
    tool_wait_ms: DistSchema | None = None
    tools: int = Field(default=3, ge=0, le=64)  # tool definitions sent in `tools`
    max_context_tokens: int = Field(default=3500, gt=0)  # a run stops before outgrowing this
    # each request starts with one of `tenants` prefixes (chat: its prompt's start; agent: the
    # system prompt), picked uniformly; prompt_tokens is what follows the prefix
    shared_prefix: SharedPrefixSchema | None = None

    @model_validator(mode="after")
    def _complete(self) -> ClassSchema:
        missing = []
        if self.arrivals.process != "trace":
            missing += [n for n in ("prompt_tokens", "output_tokens") if getattr(self, n) is None]
        if self.kind == "agent":
            missing += [
                n
                for n in ("steps", "tool_result_tokens", "tool_wait_ms")
                if getattr(self, n) is None
            ]
        elif any(
            getattr(self, n) is not None for n in ("steps", "tool_result_tokens", "tool_wait_ms")
        ):
            raise ValueError("steps, tool_result_tokens and tool_wait_ms are for kind: agent")
        if missing:
            raise ValueError(
                f"missing {', '.join(missing)} (required for kind: {self.kind}"
                f"{'' if self.kind == 'agent' else ' without trace arrivals'})"
            )
        return self


class ScenarioSchema(_Strict):
    name: str = Field(min_length=1)
    description: str = ""
    seed: int = 0
    duration_s: float = Field(gt=0, le=86400)
    drain_timeout_s: float = Field(default=60.0, ge=0)
    request_timeout_s: float = Field(default=300.0, gt=0)
    model: str = "tiny"  # sent as "model"; `--model` overrides
    tokenizer: str | None = None  # tokenizer.json for prompt sizing; relative to the file
    classes: dict[str, ClassSchema] = Field(min_length=1)


# ---------------------------------------------------------------------------------------------
# The internal, frozen form.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slo:
    """Per-request targets; None: not part of this class's contract."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {
            k: v
            for k, v in (
                ("ttft_ms", self.ttft_ms),
                ("tpot_ms", self.tpot_ms),
                ("e2e_ms", self.e2e_ms),
            )
            if v is not None
        }


@dataclass(frozen=True)
class ClassSpec:
    name: str
    kind: Literal["chat", "agent"]
    arrivals: ArrivalProcess
    prompt_tokens: Distribution | None  # None: from the trace
    output_tokens: Distribution | None
    slo: Slo
    headers: tuple[tuple[str, str], ...] = ()
    steps: Distribution | None = None
    tool_result_tokens: Distribution | None = None
    tool_wait_ms: Distribution | None = None
    tools: int = 3
    max_context_tokens: int = 3500
    shared_prefix: SharedPrefix | None = None


@dataclass(frozen=True)
class SharedPrefix:
    tenants: int
    tokens: Distribution


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int
    duration_s: float
    drain_timeout_s: float
    request_timeout_s: float
    model: str
    classes: tuple[ClassSpec, ...]
    description: str = ""
    tokenizer_path: str | None = None
    source: str = "scenario"
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


def _dist(schema: Any) -> Distribution | None:
    if schema is None:
        return None
    if isinstance(schema, FixedSchema):
        return Fixed(schema.value)
    if isinstance(schema, UniformSchema):
        return Uniform(schema.low, schema.high)
    if isinstance(schema, LogNormalSchema):
        return LogNormal(schema.median, schema.sigma, schema.min, schema.max)
    if isinstance(schema, ExponentialSchema):
        return Exponential(schema.mean, schema.min, schema.max)
    assert isinstance(schema, EmpiricalSchema)
    return Empirical(tuple(schema.values), tuple(schema.weights))


def _dist_required(schema: Any) -> Distribution:
    dist = _dist(schema)
    assert dist is not None
    return dist


def _arrivals(schema: Any, base_dir: Path, where: str) -> ArrivalProcess:
    if isinstance(schema, PoissonSchema):
        return RenewalArrivals.poisson(schema.rate_per_s)
    if isinstance(schema, GammaSchema):
        return RenewalArrivals((RateSegment(0.0, schema.rate_per_s),), schema.cv)
    if isinstance(schema, ConstantSchema):
        return RenewalArrivals((RateSegment(0.0, schema.rate_per_s),), 0.0)
    if isinstance(schema, ScheduleSchema):
        segs = tuple(RateSegment(s.start_s, s.rate_per_s) for s in schema.segments)
        return RenewalArrivals(segs, schema.cv)
    assert isinstance(schema, TraceSchema)
    path = Path(schema.path)
    if not path.is_absolute():
        path = base_dir / path
    try:
        rows = load_trace(path, schema.format)
    except (OSError, TraceError) as err:
        raise ScenarioError([f"{where}.path: {err}"]) from err
    if not rows:
        raise ScenarioError([f"{where}.path: trace {path} has no rows"])
    return TraceArrivals(rows, schema.speedup, schema.offset_s, schema.length_scale)


def parse_scenario(data: Any, source: str = "scenario", base_dir: Path | None = None) -> Scenario:
    """Validate a parsed YAML document and build the frozen `Scenario`."""
    if not isinstance(data, dict):
        raise ScenarioError(["(top level): a scenario is a mapping"], source)
    try:
        schema = ScenarioSchema.model_validate(data)
    except ValidationError as err:
        raise ScenarioError(validation_problems(err), source) from err
    base = base_dir or Path.cwd()
    classes = []
    for name, c in schema.classes.items():
        try:
            arrivals = _arrivals(c.arrivals, base, f"classes.{name}.arrivals")
        except ScenarioError as err:
            raise ScenarioError(err.problems, source) from err
        classes.append(
            ClassSpec(
                name=name,
                kind=c.kind,
                arrivals=arrivals,
                prompt_tokens=_dist(c.prompt_tokens),
                output_tokens=_dist(c.output_tokens),
                slo=Slo(c.slo.ttft_ms, c.slo.tpot_ms, c.slo.e2e_ms),
                headers=tuple(sorted(c.headers.items())),
                steps=_dist(c.steps),
                tool_result_tokens=_dist(c.tool_result_tokens),
                tool_wait_ms=_dist(c.tool_wait_ms),
                tools=c.tools,
                max_context_tokens=c.max_context_tokens,
                shared_prefix=None
                if c.shared_prefix is None
                else SharedPrefix(c.shared_prefix.tenants, _dist_required(c.shared_prefix.tokens)),
            )
        )
    tokenizer = None
    if schema.tokenizer:
        tok = Path(schema.tokenizer)
        tokenizer = str(tok if tok.is_absolute() else base / tok)
    return Scenario(
        name=schema.name,
        seed=schema.seed,
        duration_s=schema.duration_s,
        drain_timeout_s=schema.drain_timeout_s,
        request_timeout_s=schema.request_timeout_s,
        model=schema.model,
        classes=tuple(classes),
        description=schema.description,
        tokenizer_path=tokenizer,
        source=source,
        raw=data,
    )


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ScenarioError([f"cannot read: {err.strerror}"], str(path)) from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ScenarioError([f"not valid YAML: {err}"], str(path)) from err
    return parse_scenario(data, str(path), path.parent)


def scale_rates(scenario: Scenario, factor: float) -> Scenario:
    """Every class's arrival rates multiplied by `factor` (a trace replays `factor` times
    faster); sizes, SLOs and the schedule's phase times stay. For fleets bigger than the one a
    scenario was sized for."""
    if factor <= 0:
        raise ScenarioError([f"rate scale must be > 0, got {factor}"], scenario.source)
    classes = tuple(replace(c, arrivals=c.arrivals.scaled(factor)) for c in scenario.classes)
    return replace(scenario, classes=classes)
