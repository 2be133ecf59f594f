"""Priority is the tenant's to give (issue 23): `x-gpupool-priority` (higher goes first in
gpupool's queue bands) and the body's vLLM `priority` (lower goes first in the engine) are
clamped to the tenant's `max_priority`, and the engine sees the clamped value."""

from __future__ import annotations

from typing import Any

import pytest

from pools.config import Config, ConfigError
from pools.testing.config import config_for_test, even_pools
from router.errors import BadRequest
from router.gateway.classify import classify
from router.request import RequestContext

BODY: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _config(**extra: Any) -> Any:
    tenants = [
        {"name": "plain", "api_key_sha256": "0" * 64},
        {"name": "vip", "api_key_sha256": "1" * 64, "max_priority": 5},
    ]
    return config_for_test(tenants=tenants, **extra)


def _ctx(
    config: Config, tenant: str, headers: dict[str, str], body: dict[str, Any] | None = None
) -> RequestContext:
    t = next(x for x in config.tenants if x.name == tenant)
    return classify(headers, body or dict(BODY), t, config, request_id="r", now_s=0.0)


@pytest.mark.parametrize(
    ("tenant", "asked", "applied"),
    [
        ("plain", None, 0),  # the class's default
        ("plain", "9", 0),  # above max_priority 0: clamped
        ("plain", "-3", -3),  # lower (sheddable) is always allowed
        ("vip", "9", 5),
        ("vip", "3", 3),
    ],
)
def test_the_header_priority_is_clamped_to_the_tenants_max(
    tenant: str, asked: str | None, applied: int
) -> None:
    headers = {} if asked is None else {"x-gpupool-priority": asked}
    assert _ctx(_config(), tenant, headers).priority == applied


def test_asking_for_the_class_default_is_never_a_demotion() -> None:
    config = _config(classes={"normal": {"default_priority": 2}})
    assert _ctx(config, "plain", {}).priority == 2
    assert _ctx(config, "plain", {"x-gpupool-priority": "2"}).priority == 2
    assert _ctx(config, "plain", {"x-gpupool-priority": "7"}).priority == 2


def test_the_body_priority_is_clamped_for_the_engine() -> None:
    config = _config()
    for tenant, asked, sent in (("plain", -10, 0), ("plain", 4, 4), ("vip", -10, -5)):
        body = {**BODY, "priority": asked}
        _ctx(config, tenant, {}, body)
        assert body["priority"] == sent, (tenant, asked)
    with_policy = _config(
        engines={"local": {"vllm_args": ["--scheduling-policy", "priority"]}},
        pools=even_pools(normal={"engine_priority": 10}),
    )
    body = {**BODY, "priority": 0}
    _ctx(with_policy, "plain", {}, body)
    assert body["priority"] == 10  # no better than what the router sends for the pool
    for bad in ("high", 1.5, True, None):
        with pytest.raises(BadRequest) as err:
            _ctx(config, "plain", {}, {**BODY, "priority": bad})
        assert err.value.param == "priority"


def test_check_config_refuses_a_max_priority_that_is_not_a_64_bit_integer() -> None:
    for bad in ("high", 2**64, 1.5):
        with pytest.raises(ConfigError, match="max_priority"):
            config_for_test(tenants=[{"name": "t", "max_priority": bad}])
