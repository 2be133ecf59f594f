"""The chart's per-pod metrics port (issue 25, helm/gpupool/): `router.metricsPort` becomes the
router's `router.metrics_port`, a container port `metrics`, a headless Service over the router
pods (one address per pod, so one scrape target per pod: each pod is one router replica), and
the ServiceMonitor's endpoint, which then selects only that Service; unset, nothing of it is
rendered and Prometheus scrapes each pod on `http` as before. The render fails for a metrics
port equal to the router's and for `config.router.metrics_port` set beside the chart's.
Rendered by Helm's own engine, validated with kubernetes-validate, the config checked with
check-config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]  # ships no type hints (no py.typed)
import pytest

from tests.unit.test_helm_chart import CHART, KUBE_VERSIONS, _by_kind, _documents, _named, _render
from tests.unit.test_helm_replicas import URL, _check_config, _config

STORE = {"url": URL, "existingSecret": "gpupool-store"}
MONITOR = {"serviceMonitor": {"enabled": True}}


def _docs(router: dict[str, Any]) -> list[dict[str, Any]]:
    values = {"router": {"allowOpen": True, **router}, "store": STORE, **MONITOR}
    return list(_documents(_render(values)))


def _router_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = _named(docs, "Deployment", "-router")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_without_a_metrics_port_each_pod_is_scraped_on_http() -> None:
    docs = _docs({})
    assert [p["name"] for p in _router_container(docs)["ports"]] == ["http"]
    assert not [d for d in _by_kind(docs, "Service") if d["metadata"]["name"].endswith("-metrics")]
    assert "metrics_port" not in _config(docs)["router"]
    (monitor,) = _by_kind(docs, "ServiceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http"]


def test_a_metrics_port_per_pod_scraped_through_a_headless_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    docs = _docs({"metricsPort": 9400, "replicas": 3})
    assert _config(docs)["router"]["metrics_port"] == 9400
    ports = {p["name"]: p["containerPort"] for p in _router_container(docs)["ports"]}
    assert ports == {"http": 8000, "metrics": 9400}
    service = _named(docs, "Service", "-router-metrics")
    assert service["spec"]["clusterIP"] == "None"  # an address per pod, nothing balanced
    pod_labels = _named(docs, "Deployment", "-router")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9400, "targetPort": "metrics"}]
    (monitor,) = _by_kind(docs, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    # the monitor selects the metrics Service, not the client one (whose port is http only)
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    selected = [
        s["metadata"]["name"]
        for s in _by_kind(docs, "Service")
        if selector <= s["metadata"]["labels"].items()
    ]
    assert selected == [service["metadata"]["name"]]
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)
    values = {"router": {"allowOpen": True, "metricsPort": 9400}, "store": STORE}
    for version in KUBE_VERSIONS:
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{version}")
        assert [m for m in report["messages"] if m["severity"] >= 2] + report["errors"] == []
    _check_config(docs, tmp_path, monkeypatch, capsys)


def test_a_metrics_port_that_is_the_router_port_fails_the_render() -> None:
    with pytest.raises(helm.HelmError) as err:
        _docs({"metricsPort": 8000})
    assert "router.metricsPort: 8000 is router.port" in str(err.value)


def test_the_metrics_port_is_the_charts_to_set() -> None:
    values = {
        "router": {"allowOpen": True},
        "config": {"router": {"metrics_port": 9400}},
    }
    with pytest.raises(helm.HelmError) as err:
        _render(values)
    assert "config.router.metrics_port: the chart sets it from router.metricsPort" in str(err.value)
    with pytest.raises(helm.HelmError, match="metricsPort"):
        _render({"router": {"allowOpen": True, "metricsPort": 80}})  # below 1024: the schema's
