"""The README's claims about what is in effect, checked against the code (issue 23): its "Not
in effect yet" paragraph still said the ratio never moves, `router.state_path` is unread and
tenant `tokens_per_minute` / `max_concurrent_runs` are refused, while all are implemented; and
it did not warn that a router without tenants is open to anyone who reaches it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pools.config import RebalancerConfig, not_yet_in_effect
from pools.launchers.base import InstanceSpec
from pools.testing.config import config_for_test
from router.gateway.app import create_app

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _config(tmp_path: Path, **extra: Any) -> Any:
    state_path = str(tmp_path / "sre" / "state.json")
    return config_for_test(tmp_path, router={"state_path": state_path}, **extra)


def test_the_readme_no_longer_says_what_is_implemented_is_not() -> None:
    for stale in (
        "Not in effect yet",
        "until the rebalancer lands",
        "nothing reads `router.state_path`",
        "refused until they are enforced",
    ):
        assert stale not in README, stale


def test_what_the_readme_says_instead_holds(tmp_path: Path) -> None:
    # "The rebalancer is off unless `rebalancer.enabled: true` ... `check-config` prints a note"
    assert "The rebalancer is off unless `rebalancer.enabled: true`" in README
    assert RebalancerConfig().enabled is False
    notes = not_yet_in_effect(_config(tmp_path))
    assert any("rebalancer.enabled is false" in n for n in notes), notes
    # "`router.state_path` holds the SRE settings ... with the decision log next to it"
    config = _config(tmp_path)
    gateway = create_app(config, [InstanceSpec("e", "http://127.0.0.1:9", 1)], scrape=False)
    assert gateway.rebalancer.state_path == config.router.state_path
    assert config.rebalancer.decision_log_path.parent == config.router.state_path.parent
    # "Tenant `tokens_per_minute` and `max_concurrent_runs` are enforced": accepted, and held
    # by the governor (tests/unit/test_governance_router.py refuses past them)
    tenant = {"name": "a", "api_key_sha256": "ab" * 32, "tokens_per_minute": 600}
    tenant |= {"max_concurrent_runs": 2}
    (parsed,) = _config(tmp_path, tenants=[tenant]).tenants
    assert (parsed.tokens_per_minute, parsed.max_concurrent_runs) == (600, 2)


def test_the_readme_warns_that_no_tenants_means_open() -> None:
    assert "**No tenants, no lock.**" in README
    assert "(`no API keys configured: the router\nis open to anyone" in README  # the log line
