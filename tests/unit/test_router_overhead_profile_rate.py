"""The router-overhead benchmark's `--profile-rate` (issue 28): py-spy's samples per second go
into the plan, and the report names the rate its profile was taken at (250 Hz for runs made
before it was a setting)."""

from __future__ import annotations

import dataclasses

from benchmarks.router_overhead.cli import _parser
from benchmarks.router_overhead.plan import Plan
from benchmarks.router_overhead.report import _profile

_PROFILE = {"busy_samples": 4000, "components": [["gpupool (router/)", 4000, 1.0]]}


def test_the_rate_is_a_flag_and_the_plan_keeps_it() -> None:
    assert _parser().parse_args(["--out", "x"]).profile_rate is None
    args = _parser().parse_args(["--out", "x", "--profile-rate", "1000"])
    assert args.profile_rate == 1000
    assert dataclasses.replace(Plan(), profile_rate_hz=args.profile_rate).profile_rate_hz == 1000
    assert Plan().profile_rate_hz == 250


def test_the_report_names_the_rate_it_sampled_at() -> None:
    lines = _profile(_PROFILE, "non-streaming, c=64", 265.0, 1000)
    assert any("4000 busy samples at 1000 Hz" in line for line in lines)
    lines = _profile(_PROFILE, "non-streaming, c=64", 265.0)
    assert any("4000 busy samples at 250 Hz" in line for line in lines)
