"""KV events from engines gpupool does not reach through socket files (docs/prefix_cache.md):
Ray engines publish on TCP ports their actor picks and reports; static and Kubernetes engines
opt in with where they publish. Config validation, the engine's arguments and the specs the
router is handed; the real Ray path is tests/integration/test_ray_real.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from pools.config import ConfigError, KubernetesServiceConfig, parse_config
from pools.devmodel import make_dev_model
from pools.discovery.kubernetes import DnsSource, endpoints_from_slices
from pools.launchers.base import KvEventsSpec
from pools.launchers.engine_args import build_engine_command, engine_environ
from pools.launchers.ray import RayEngineSource, _free_ports, engine_settings, ray_kv_events
from pools.launchers.static import static_instances
from router.cli.stack import instances_without_launching
from tests.unit.test_ray_launcher import FakeActor, _get

FLAGS = frozenset({"--model", "--port", "--kv-events-config", "--prefix-caching-hash-algo"})
POOLS = {
    "agent": {"classes": ["agent"], "share": {"initial_frac": 0.25}},
    "normal": {"classes": ["normal"], "share": {"initial_frac": 0.75}},
}
URLS = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]


def _static(entries: list[dict[str, Any]], **engines: Any) -> Any:
    static = {"urls": URLS, "kv_events": entries}
    return parse_config(
        {"engines": {"launcher": "static", "static": static, **engines}, "pools": POOLS}
    )


# -- config ----------------------------------------------------------------------------------


def test_a_static_engine_opts_in_with_its_endpoints() -> None:
    entry = {
        "url": "http://10.0.0.6:8000/",
        "endpoint": "tcp://10.0.0.6:5557",
        "replay_endpoint": "tcp://10.0.0.6:5558",
        "hash_seed": "7",
    }
    config = _static([entry])
    assert config.engines.kv_events_on
    specs = instances_without_launching(config)
    assert [s.kv_events for s in specs] == [
        None,  # engine-0 publishes none the router knows of: placed as before
        KvEventsSpec("tcp://10.0.0.6:5557", "tcp://10.0.0.6:5558", hash_seed="7"),
    ]
    assert static_instances(config.engines.static) == specs
    off = _static([entry], kv_events=False)  # engines.kv_events: off wins over the entries
    assert not off.engines.kv_events_on
    assert [s.kv_events for s in instances_without_launching(off)] == [None, None]


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"url": "http://10.0.0.9:8000", "endpoint": "tcp://10.0.0.9:5557"}, "not one of"),
        ({"url": URLS[0], "endpoint": "tcp://*:5557"}, "names no host"),
        ({"url": URLS[0], "endpoint": "tcp://0.0.0.0:5557"}, "names no host"),
        ({"url": URLS[0], "endpoint": "tcp://10.0.0.5"}, "not tcp://"),
        ({"url": URLS[0], "endpoint": "http://10.0.0.5:5557"}, "not tcp://"),
        ({"url": URLS[0], "endpoint": "tcp://h:5557", "replay_endpoint": "tcp://*:1"}, "no host"),
        ({"url": URLS[0]}, "endpoint"),
    ],
)
def test_check_config_refuses_a_static_entry_that_cannot_work(
    entry: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        _static([entry])


def test_a_static_engine_listed_twice_is_refused() -> None:
    entry = {"url": URLS[0], "endpoint": "tcp://10.0.0.5:5557"}
    with pytest.raises(ConfigError, match="listed twice"):
        _static([entry, entry])


def test_kubernetes_is_on_when_a_service_opts_in() -> None:
    services = [{"name": "a"}, {"name": "b", "kv_events": {"port": 6000, "replay_port": None}}]
    engines = {"launcher": "kubernetes", "kubernetes": {"services": services}}
    config = parse_config({"engines": engines, "pools": POOLS})
    assert config.engines.kv_events_on
    events = config.engines.kubernetes.services[1].kv_events
    assert events is not None and (events.port, events.replay_port) == (6000, None)
    none = {"launcher": "kubernetes", "kubernetes": {"services": services[:1]}}
    assert not parse_config({"engines": none, "pools": POOLS}).engines.kv_events_on


# -- the engine's arguments ------------------------------------------------------------------


def test_a_tcp_spec_binds_every_interface_at_its_ports(tmp_path: Path) -> None:
    config = parse_config({"engines": {"launcher": "ray"}, "pools": POOLS})
    model = dataclasses.replace(config.model, path=make_dev_model(tmp_path / "tiny"))
    settings = engine_settings(config.engines.ray, port=8100, run_dir=tmp_path)
    spec = ray_kv_events("10.1.2.3", 41001, 41002, {})
    cmd = build_engine_command(
        model=model, local=settings, index=0, gpu_ids=None, flags=FLAGS, kv_events=spec
    )
    events = json.loads(cmd.argv[cmd.argv.index("--kv-events-config") + 1])
    assert (events["endpoint"], events["replay_endpoint"]) == ("tcp://*:41001", "tcp://*:41002")
    assert cmd.argv[cmd.argv.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    # the router connects to the node's address: what the command reports back
    assert cmd.kv_events == KvEventsSpec("tcp://10.1.2.3:41001", "tcp://10.1.2.3:41002")
    assert "PYTHONHASHSEED" not in engine_environ({"PYTHONHASHSEED": "3"}, cmd)
    old = build_engine_command(
        model=model, local=settings, index=0, gpu_ids=None, flags=frozenset(), kv_events=spec
    )
    assert "--kv-events-config" not in old.argv and old.kv_events is None  # cannot publish


def test_a_ray_engine_on_an_ipv6_node_and_its_seed() -> None:
    spec = ray_kv_events("fd00::7", 1, 2, {"PYTHONHASHSEED": "9"})
    assert spec == KvEventsSpec("tcp://[fd00::7]:1", "tcp://[fd00::7]:2", hash_seed="9")


# -- Ray: ports and what the source reports --------------------------------------------------


def test_an_engine_with_events_takes_three_distinct_ports_of_its_slots() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        base = s.getsockname()[1]
    ports = _free_ports(None, n=3)
    assert len(set(ports)) == 3
    try:
        ranged = _free_ports((base, base + 40), index=1, count=4, n=3)
    except Exception:  # another process holds too many of them: nothing to check
        pytest.skip("ports taken")
    assert len(set(ranged)) == 3 and all((p - base - 1) % 4 == 0 for p in ranged)


async def test_the_ray_source_hands_the_router_each_engines_endpoints() -> None:
    from pools.config import RayEnginesConfig

    spec = ray_kv_events("10.0.0.1", 40002, 40003, {})
    actors = [FakeActor("http://10.0.0.1:40001"), FakeActor("http://10.0.0.2:40004")]
    actors[0].kv_events = spec  # type: ignore[attr-defined]
    source = RayEngineSource(RayEnginesConfig(count=2), actors, "k", get=_get)
    specs = await source.poll()
    assert [(s.url, s.kv_events) for s in specs] == [
        ("http://10.0.0.1:40001", spec),
        ("http://10.0.0.2:40004", None),  # its vLLM cannot publish: placed as before
    ]


# -- Kubernetes: named ports, else the configured ones ---------------------------------------


def _service(**events: Any) -> KubernetesServiceConfig:
    return parse_config(
        {
            "engines": {
                "launcher": "kubernetes",
                "kubernetes": {"services": [{"name": "eng", "kv_events": events}]},
            },
            "pools": POOLS,
        }
    ).engines.kubernetes.services[0]


def test_kubernetes_engines_publish_on_the_services_named_ports() -> None:
    slice_ = {
        "addressType": "IPv4",
        "ports": [
            {"name": "http", "port": 8000},
            {"name": "kv-events", "port": 7001},
            {"name": "kv-replay", "port": 7002},
        ],
        "endpoints": [{"addresses": ["10.2.0.4"], "targetRef": {"kind": "Pod", "name": "eng-0"}}],
    }
    [spec] = endpoints_from_slices([slice_], _service(hash_seed="1"))
    assert spec.url == "http://10.2.0.4:8000"  # the http port, not one of the three
    assert spec.kv_events == KvEventsSpec("tcp://10.2.0.4:7001", "tcp://10.2.0.4:7002", "1")
    slice_["ports"] = slice_["ports"][:1]  # not named on the Service: the configured ones
    [spec] = endpoints_from_slices([slice_], _service())
    assert spec.kv_events == KvEventsSpec("tcp://10.2.0.4:5557", "tcp://10.2.0.4:5558")
    plain = KubernetesServiceConfig(name="eng")  # no opt-in: none
    assert endpoints_from_slices([slice_], plain)[0].kv_events is None


async def test_dns_discovery_uses_the_configured_ports() -> None:
    from pools.config import KubernetesEnginesConfig

    service = _service(port=6001, replay_port=None)
    config = KubernetesEnginesConfig(services=(service,))

    async def resolve(host: str, port: int) -> list[str]:
        return ["fd00::4"]

    [spec] = await DnsSource(config, namespace="llm", resolve=resolve).poll()
    assert spec.kv_events == KvEventsSpec("tcp://[fd00::4]:6001", None)
