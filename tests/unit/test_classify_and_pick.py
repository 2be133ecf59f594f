"""Classification rules, identity, and the filter -> score -> pick pipeline."""

from __future__ import annotations

import random

import pytest

from pools.allocation import plan_allocation
from pools.fleet import Fleet
from pools.launchers.base import InstanceSpec
from pools.telemetry import InstanceReading
from pools.testing.config import config_for_test
from router.admission.picking import Candidate, Picker, PickRequest, RunAffinity, default_picker
from router.errors import BadRequest, ClassNotAllowed, Unauthorized
from router.gateway.classify import classify, run_identity
from router.identity import Tenants

CONFIG = config_for_test(
    tenants=[
        {"name": "a", "api_key": "ka"},
        {"name": "b", "api_key": "kb", "default_class": "agent", "may_set_class": False},
    ],
)
TENANTS = Tenants.from_config(CONFIG.tenants)
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _cls(headers: dict[str, str], body: dict[str, object] | None = None, key: str = "ka") -> str:
    tenant = TENANTS.authenticate(f"Bearer {key}")
    return classify(
        headers, dict(body or BODY), tenant, CONFIG, request_id="r", now_s=0.0
    ).class_name


def test_rules_first_match_wins() -> None:
    assert _cls({}) == "normal"
    assert _cls({}, {**BODY, "tools": [{"type": "function"}]}) == "agent"
    assert _cls({}, {**BODY, "tools": []}) == "normal"
    assert _cls({"x-gpupool-run-id": "r1"}) == "agent"
    assert _cls({"x-gpupool-class": "normal"}, {**BODY, "tools": [{}]}) == "normal"
    assert _cls({}, key="kb") == "agent"  # tenant default


def test_header_class_checks() -> None:
    with pytest.raises(BadRequest, match="not a known class"):
        _cls({"x-gpupool-class": "vip"})
    with pytest.raises(BadRequest, match="not a known class"):  # empty is not absent
        _cls({"x-gpupool-class": ""})
    with pytest.raises(ClassNotAllowed):
        _cls({"x-gpupool-class": "normal"}, key="kb")


def test_run_identity_sources() -> None:
    for header in (
        "x-gpupool-run-id",
        "x-dynamo-trajectory-id",
        "x-claude-code-session-id",
        "session-id",
        "thread-id",
        "x-session-id",
    ):
        assert run_identity({header: "abc"}, {}) == "abc"
    assert run_identity({}, {"vllm_xargs": {"agentic_context": {"program_id": "p9"}}}) == "p9"
    assert run_identity({}, {"vllm_xargs": {"agentic_context": "p7"}}) == "p7"
    assert run_identity({}, {}) is None


def test_priority_and_deadline_headers() -> None:
    tenant = TENANTS.authenticate("Bearer ka")
    ctx = classify(
        {"x-gpupool-priority": "-1", "x-gpupool-deadline-ms": "1500"},
        dict(BODY),
        tenant,
        CONFIG,
        request_id="r",
        now_s=10.0,
    )
    assert ctx.priority == -1 and ctx.deadline_s == pytest.approx(11.5)
    with pytest.raises(BadRequest):
        classify(
            {"x-gpupool-priority": "high"}, dict(BODY), tenant, CONFIG, request_id="r", now_s=0.0
        )
    with pytest.raises(BadRequest):
        classify(
            {"x-gpupool-deadline-ms": "0"}, dict(BODY), tenant, CONFIG, request_id="r", now_s=0.0
        )
    with pytest.raises(BadRequest, match="64-bit integer"):  # empty is not absent
        classify(
            {"x-gpupool-deadline-ms": ""}, dict(BODY), tenant, CONFIG, request_id="r", now_s=0.0
        )


def test_authentication() -> None:
    with pytest.raises(Unauthorized):
        TENANTS.authenticate(None)
    with pytest.raises(Unauthorized):
        TENANTS.authenticate("Bearer nope")
    with pytest.raises(Unauthorized):
        TENANTS.authenticate("Basic ka")
    assert Tenants.from_config(()).authenticate(None).name == "default"


def _reading(kv: float, t: float = 0.0, waiting: int = 0) -> InstanceReading:
    return InstanceReading(t, kv, 0, waiting, 100, 16, 0, 0, 0, 0, 0, 0, 0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _picked(picker: Picker, req: PickRequest, cands: list[Candidate]) -> str:
    chosen = picker.pick(req, cands)
    assert chosen is not None, req
    return chosen.instance_id


def _fleet(clock: Clock) -> Fleet:
    specs = [InstanceSpec(f"e{i}", f"http://e{i}", 1) for i in range(3)]
    fleet = Fleet(specs, stale_after_s=5.0, unhealthy_after=2, clock=clock)
    for i in range(3):
        fleet.record_reading(f"e{i}", _reading(0.1 * i))
    return fleet


def test_picker_prefers_headroom_and_affinity_and_skips_unhealthy() -> None:
    clock = Clock()
    fleet = _fleet(clock)
    affinity = RunAffinity()
    picker = default_picker(fleet, affinity, random.Random(0))
    alloc = plan_allocation(fleet.capacity_gpus(), {"normal": 1.0})
    cands = picker.candidates(alloc, "normal")
    assert _picked(picker, PickRequest("normal", None), cands) == "e0"
    affinity.record("run", "e2")
    assert _picked(picker, PickRequest("normal", "run"), cands) == "e2"
    fleet.record_failure("e2", "refused", immediate=True)
    assert _picked(picker, PickRequest("normal", "run"), cands) == "e0"
    assert picker.pick(PickRequest("normal", None, frozenset({"e0", "e1"})), cands) is None


def test_stale_telemetry_counts_as_full_and_health_recovers() -> None:
    clock = Clock()
    fleet = _fleet(clock)
    state = fleet.get("e0")
    assert state is not None
    clock.now = 10.0
    assert fleet.kv_usage_frac(state) == 1.0
    fleet.record_failure("e0", "timeout")
    assert state.healthy
    fleet.record_failure("e0", "timeout")
    assert not state.healthy
    fleet.record_reading("e0", _reading(0.0, t=10.0))
    assert state.healthy and fleet.kv_usage_frac(state) == 0.0


@pytest.mark.coin
def test_ties_are_broken_at_random_but_reproducibly() -> None:
    clock = Clock()
    specs = [InstanceSpec(f"e{i}", f"http://e{i}", 1) for i in range(4)]
    fleet = Fleet(specs, clock=clock)
    for s in specs:
        fleet.record_reading(s.instance_id, _reading(0.0))
    alloc = plan_allocation(fleet.capacity_gpus(), {"normal": 1.0})

    def picks(seed: int) -> list[str]:
        picker = default_picker(fleet, RunAffinity(), random.Random(seed))
        cands = picker.candidates(alloc, "normal")
        return [_picked(picker, PickRequest("normal", None), cands) for _ in range(20)]

    assert picks(1) == picks(1)
    assert len(set(picks(1))) > 1
