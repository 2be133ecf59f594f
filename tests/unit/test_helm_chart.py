"""The Helm chart (helm/gpupool/), rendered by Helm's own Go engine (helm-python-sdk binds
Helm v4's SDK; no helm binary, no cluster):

- every example values file passes values.schema.json and `helm lint --strict`, and renders;
- every rendered manifest is valid for two Kubernetes versions (kubernetes-validate, strict:
  unknown fields are errors); the ServiceMonitor (a CRD kind it has no schema for) is checked
  by hand;
- the rendered router ConfigMap passes `gpupool check-config`;
- each engine group's vLLM arguments are the ones the local launcher derives for the same
  settings (`build_engine_command`);
- bad values (negative replicas, an unknown GPU type, a pool floor above its ceiling) fail with
  a message naming the value;
- no tenants (a router open to every pod) fails the render unless `router.allowOpen: true`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]  # ships no type hints (no py.typed)
import pytest
import yaml

from kvcache_model.gpus import GPU_SPECS
from pools.config import LocalEnginesConfig, ModelConfig, parse_config
from pools.discovery.kubernetes import endpoints_from_slices
from pools.launchers.base import KvEventsSpec
from pools.launchers.engine_args import build_engine_command
from pools.launchers.engine_plan import EnginePlan
from router.cli import main
from tests.unit.test_engine_args import ALL_FLAGS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "gpupool"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
KUBE_VERSIONS = ("1.30.0", "1.37.0")  # the oldest and newest the chart is checked against
RELEASE, NAMESPACE = "gp", "llm"
# the chart's defaults have no tenant, which it refuses to render unless the router may be open
OPEN: dict[str, Any] = {"router": {"allowOpen": True}}


def _values(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def _render(values: dict[str, Any] | None) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        rendered: dict[str, str] = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return rendered


def _documents(rendered: dict[str, str]) -> Iterator[dict[str, Any]]:
    for name, text in rendered.items():
        if not name.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                yield doc


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _named(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    (doc,) = [d for d in _by_kind(docs, kind) if d["metadata"]["name"].endswith(suffix)]
    return doc


def _headless(service: dict[str, Any]) -> bool:
    return bool(service["spec"].get("clusterIP") == "None")


def test_the_examples_are_the_four_the_docs_name() -> None:
    assert [p.name for p in EXAMPLES] == [
        "cpu-dev.yaml",
        "eight-gpu-tp2.yaml",
        "one-gpu.yaml",
        "two-groups.yaml",
    ]


@pytest.mark.parametrize("example", [None, *EXAMPLES], ids=lambda p: p.stem if p else "defaults")
def test_schema_and_strict_lint_pass(example: Path | None) -> None:
    values = _values(example) if example else OPEN
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
    for version in KUBE_VERSIONS:
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{version}")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert problems == [], problems


@pytest.mark.parametrize("example", [None, *EXAMPLES], ids=lambda p: p.stem if p else "defaults")
def test_every_manifest_is_valid_kubernetes(example: Path | None) -> None:
    docs = list(_documents(_render(_values(example) if example else OPEN)))
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "Secret", "StatefulSet"} <= kinds
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue  # a CRD: checked in test_service_monitor_selects_the_router
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_catches_an_unknown_field() -> None:
    docs = list(_documents(_render(OPEN)))
    sts = _by_kind(docs, "StatefulSet")[0]
    sts["spec"]["replica"] = 2  # a typo of `replicas`
    for version in KUBE_VERSIONS:
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(sts, version, strict=True)


def _router_config(tmp_path: Path, values: dict[str, Any] | None) -> Path:
    docs = list(_documents(_render(values)))
    (configmap,) = [
        d for d in _by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")
    ]
    path = tmp_path / "config.yaml"
    path.write_text(configmap["data"]["config.yaml"])
    return path


@pytest.mark.parametrize("example", [None, *EXAMPLES], ids=lambda p: p.stem if p else "defaults")
def test_router_configmap_passes_check_config(
    example: Path | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    values = _values(example) if example else OPEN
    path = _router_config(tmp_path, values)
    # the keys the Deployment puts in the router's environment from its Secrets
    monkeypatch.setenv("GPUPOOL_ENGINE_KEY", "engine-key-for-the-test")
    for i, tenant in enumerate(values.get("tenants", [])):
        monkeypatch.setenv(f"GPUPOOL_TENANT_KEY_{i}", tenant["apiKey"])
    monkeypatch.setenv("GPUPOOL_ADMIN_KEY", "admin-key-for-the-test")
    monkeypatch.setenv("GPUPOOL_METRICS_KEY", "metrics-key-for-the-test")
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "ok;" in out and "(kubernetes)" in out


def test_router_config_names_every_engine_groups_headless_service(tmp_path: Path) -> None:
    values = _values(CHART / "examples" / "two-groups.yaml")
    config = yaml.safe_load(_router_config(tmp_path, values).read_text())
    k8s = config["engines"]["kubernetes"]
    assert config["engines"]["launcher"] == "kubernetes"
    events = {"port": 5557, "replay_port": 5558}  # engines.kvEvents, on by default
    assert k8s["services"] == [
        {
            "name": "gp-gpupool-engine-h100",
            "port": 8000,
            "gpus_per_instance": 1,
            "kv_events": events,
        },
        {
            "name": "gp-gpupool-engine-l40s",
            "port": 8000,
            "gpus_per_instance": 1,
            "kv_events": events,
        },
    ]
    assert (k8s["namespace"], k8s["discovery"]) == (NAMESPACE, "dns")
    docs = list(_documents(_render(values)))
    headless = {
        d["metadata"]["name"]: d
        for d in _by_kind(docs, "Service")
        if d["spec"].get("clusterIP") == "None"
    }
    assert set(headless) == {"gp-gpupool-engine-h100", "gp-gpupool-engine-l40s"}
    for sts in _by_kind(docs, "StatefulSet"):
        service = headless[sts["spec"]["serviceName"]]
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_eight_gpus_as_four_tp2_engines() -> None:
    docs = list(_documents(_render(_values(CHART / "examples" / "eight-gpu-tp2.yaml"))))
    (sts,) = _by_kind(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 4
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in pod["volumes"]
    # a model load may take 30 min before liveness counts
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == 1800


def test_service_monitor_selects_the_router() -> None:
    docs = list(_documents(_render(_values(CHART / "examples" / "eight-gpu-tp2.yaml"))))
    (monitor,) = _by_kind(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (router_svc,) = [d for d in _by_kind(docs, "Service") if d["spec"].get("clusterIP") != "None"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items()
        <= router_svc["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == router_svc["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # the engines' `instance` label, as the dashboard reads
    # Prometheus reads /metrics with the metrics key, from the chart's Secret
    secret = next(
        d for d in _by_kind(docs, "Secret") if d["metadata"]["name"] == "gp-gpupool-api-keys"
    )
    assert endpoint["authorization"]["credentials"] == {
        "name": "gp-gpupool-api-keys",
        "key": "metrics",
    }
    assert secret["stringData"]["metrics"] == "metrics-key-0123456789abcdef"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


def test_service_monitor_auto_needs_the_operators_crd() -> None:
    docs = list(_documents(_render(OPEN)))  # offline render: no monitoring.coreos.com API
    assert _by_kind(docs, "ServiceMonitor") == []


def test_dashboard_configmap_ships_the_projects_grafana_dashboard() -> None:
    docs = list(_documents(_render(OPEN)))
    board = _named(docs, "ConfigMap", "-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"  # Grafana's sidecar label
    shipped = json.loads(board["data"]["gpupool.json"])
    # the one dashboard (checked against live metrics by tests/unit/test_grafana_dashboard.py)
    assert shipped == json.loads((ROOT / "docs" / "grafana" / "gpupool.json").read_text())
    assert "gpupool_requests_total" in json.dumps(shipped)


def test_tenant_keys_reach_the_router_only_through_a_secret(tmp_path: Path) -> None:
    values = _values(CHART / "examples" / "eight-gpu-tp2.yaml")
    docs = list(_documents(_render(values)))
    config = yaml.safe_load(_router_config(tmp_path, values).read_text())
    assert "agents-key" not in json.dumps(config)
    assert [t["api_key_env"] for t in config["tenants"]] == [
        "GPUPOOL_TENANT_KEY_0",
        "GPUPOOL_TENANT_KEY_1",
    ]
    (deploy,) = _by_kind(docs, "Deployment")
    env = {e["name"]: e for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["GPUPOOL_TENANT_KEY_1"]["valueFrom"]["secretKeyRef"] == {
        "name": "gp-gpupool-api-keys",
        "key": "chat",
    }
    # the engines and the router share the engine key's Secret
    (sts,) = _by_kind(docs, "StatefulSet")
    engine_env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (
        engine_env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
        == env["GPUPOOL_ENGINE_KEY"]["valueFrom"]["secretKeyRef"]
    )
    engine_secret = next(
        d for d in _by_kind(docs, "Secret") if d["metadata"]["name"] == "gp-gpupool-engine-key"
    )
    assert len(base64.b64decode(engine_secret["data"]["key"])) == 40


def test_discovery_by_api_gets_a_read_only_role_and_dns_gets_none() -> None:
    docs = list(_documents(_render(OPEN)))
    (role,) = _by_kind(docs, "Role")
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    dns = list(_documents(_render(_values(CHART / "examples" / "two-groups.yaml"))))
    assert _by_kind(dns, "Role") == [] and _by_kind(dns, "RoleBinding") == []


# -- the engine arguments are the local launcher's -----------------------------------------

# vLLM >= 0.11's flags the chart uses: the local launcher's tests' set, and
# --enable-log-requests (present: requests are not logged unless asked, so no
# --disable-log-requests) and --max-log-len
_FLAGS = ALL_FLAGS | {"--max-log-len", "--enable-log-requests"}
_FLAGS |= {"--kv-events-config", "--prefix-caching-hash-algo"}
_POD_EVENTS = KvEventsSpec("tcp://10.2.0.4:5557", "tcp://10.2.0.4:5558")


def _plan(dtype: str, kv_cache_bytes: int | None, on_cpu: bool) -> EnginePlan:
    return EnginePlan(
        on_cpu=on_cpu,
        dtype=dtype,
        dtype_reason="test",
        kv_cache_bytes=kv_cache_bytes,
        kv_reason="test",
        kv_source="test",
        kv_is_default=False,
        block_size_tokens=16,
        max_model_len_tokens=None,
        capacity=None,
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_engine_args_are_the_local_launchers(example: Path, tmp_path: Path) -> None:
    values = _values(example)
    docs = list(_documents(_render(values)))
    chart_model = values["model"]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    if chart_model.get("devModel"):  # the local launcher recognises the dev model by this key
        (model_dir / "config.json").write_text('{"gpupool_dev_model_shape": "tiny"}')
    guard = bool(values["engines"].get("guardMiddleware"))
    flags = _FLAGS | ({"--middleware"} if guard else set())
    statefulsets = {d["metadata"]["name"]: d for d in _by_kind(docs, "StatefulSet")}
    for group in values["engines"]["groups"]:
        sts = statefulsets[f"gp-gpupool-engine-{group['name']}"]
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        on_cpu = group["gpuType"] == "cpu"
        dtype = "float32" if on_cpu and chart_model.get("dtype", "auto") == "auto" else "auto"
        local = LocalEnginesConfig(
            count=1,
            gpus_per_instance=group["gpusPerInstance"],
            host="0.0.0.0",
            base_port=8000,
            kv_cache_bytes=group.get("kvCacheBytes"),
            vllm_args=tuple(group.get("vllmArgs", [])),
            env=(),
            cpu_affinity=None,
            startup_timeout_s=600,
            restart_backoff_s=1,
            restart_backoff_max_s=1,
            stop_grace_s=1,
            run_dir=tmp_path,
        )
        model = ModelConfig(
            name=chart_model["name"],
            path=model_dir,
            max_model_len_tokens=chart_model.get("maxModelLenTokens"),
            load_format=chart_model.get("loadFormat", "auto"),
            dtype=chart_model.get("dtype", "auto"),
        )
        command = build_engine_command(
            model=model,
            local=local,
            index=0,
            gpu_ids=None if on_cpu else list(range(group["gpusPerInstance"])),
            flags=flags,
            python="python3",
            plan=_plan(dtype, group.get("kvCacheBytes"), on_cpu),
            api_key="k",
            kv_events=_POD_EVENTS,  # engines.kvEvents, on by default: every pod on TCP
        )
        expected = list(command.argv[3:])  # less `python3 -m vllm.entrypoints...`
        expected[expected.index("--model") + 1] = chart_model["path"]
        assert container["command"] == list(command.argv[:3])
        assert container["args"] == expected
        env = {e["name"]: e.get("value") for e in container["env"]}
        for key in ("OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING"):
            assert env.get(key) == command.env.get(key)


def test_engines_publish_kv_events_where_the_router_subscribes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """engines.kvEvents: each pod publishes on TCP ports its group's Service names, and the
    router's config opts each group in; what discovery makes of a slice of that Service is
    where the engine binds. Off: no flag, no port, no opt-in (the router places as before)."""
    values = {**OPEN, "engines": {"kvEvents": {"port": 6001, "replayPort": 6002}}}
    docs = list(_documents(_render(values)))
    (sts,) = _by_kind(docs, "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert (events["endpoint"], events["replay_endpoint"]) == ("tcp://*:6001", "tcp://*:6002")
    assert args[args.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "kv-events": 6001, "kv-replay": 6002}
    service = _named(docs, "Service", "-engine-main")
    named = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert named == {"http": 8000, "kv-events": 6001, "kv-replay": 6002}
    config = yaml.safe_load(_router_config(tmp_path, values).read_text())
    (entry,) = config["engines"]["kubernetes"]["services"]
    assert entry["kv_events"] == {"port": 6001, "replay_port": 6002}
    # an EndpointSlice of that Service, as the API server lists it
    slice_ = {"ports": service["spec"]["ports"], "endpoints": [{"addresses": ["10.2.0.4"]}]}
    monkeypatch.setenv("GPUPOOL_ENGINE_KEY", "k")
    service_config = parse_config(config).engines.kubernetes.services[0]
    (spec,) = endpoints_from_slices([slice_], service_config)
    assert (spec.url, spec.kv_events) == (
        "http://10.2.0.4:8000",
        KvEventsSpec("tcp://10.2.0.4:6001", "tcp://10.2.0.4:6002"),
    )
    off = {**OPEN, "engines": {"kvEvents": {"enabled": False}}}
    docs = list(_documents(_render(off)))
    (sts,) = _by_kind(docs, "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert "--kv-events-config" not in container["args"]
    assert [p["name"] for p in container["ports"]] == ["http"]
    config = yaml.safe_load(_router_config(tmp_path, off).read_text())
    assert "kv_events" not in config["engines"]["kubernetes"]["services"][0]


# -- bad values fail with a clear message ---------------------------------------------------


def _with_group(**changes: Any) -> dict[str, Any]:
    values = _values(CHART / "values.yaml")
    values["engines"]["groups"][0].update(changes)
    return values


def test_negative_replicas_fail_the_schema() -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(_with_group(replicas=-1))
    message = str(err.value)
    assert "replicas" in message and "minimum" in message.lower()


def test_unknown_gpu_type_fails_the_schema() -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(_with_group(gpuType="H900"))
    message = str(err.value)
    assert "gpuType" in message and "H100" in message  # names the allowed values


def test_gpu_types_are_kvcache_models_gpus_and_cpu() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    group = schema["properties"]["engines"]["properties"]["groups"]["items"]
    assert sorted(group["properties"]["gpuType"]["enum"]) == sorted([*GPU_SPECS, "cpu"])


def test_floor_above_ceiling_fails_the_render() -> None:
    values = _values(CHART / "values.yaml")
    values["config"]["pools"]["agent"]["share"] = {
        "initial_frac": 0.3,
        "floor_frac": 0.5,
        "ceiling_frac": 0.4,
    }
    with pytest.raises(helm.HelmError) as err:
        _render(values)
    assert "config.pools.agent.share: floor_frac 0.5 is above ceiling_frac 0.4" in str(err.value)


def test_bad_values_fail_lint_too() -> None:
    report = helm.lint(CHART, _with_group(replicas=-2), strict=True)
    errors = [m["error"] for m in report["messages"] if m["severity"] == 3]
    assert any("replicas" in e for e in errors), report


def test_engines_in_config_are_refused() -> None:
    values = _values(CHART / "values.yaml")
    values["config"]["engines"] = {"launcher": "local"}
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)


def test_no_tenants_fails_the_render_unless_the_router_may_be_open() -> None:
    """With `tenants: []` the router's /v1/* and /metrics are open to every pod that reaches
    its Service; the chart rendered that silently (issue 23)."""
    with pytest.raises(helm.HelmError) as err:
        _render(None)  # the chart's defaults
    assert "router.allowOpen: true" in str(err.value) and "tenants" in str(err.value)
    # said on purpose: an open router, and its config has no tenants
    config = _router_config_text(OPEN)
    assert config["tenants"] == []
    # a tenant closes it: no allowOpen needed
    closed = {"tenants": [{"name": "team-a", "apiKey": "k" * 32}]}
    assert [t["name"] for t in _router_config_text(closed)["tenants"]] == ["team-a"]
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"router": {"allowOpen": "yes"}})


def _router_config_text(values: dict[str, Any]) -> dict[str, Any]:
    docs = list(_documents(_render(values)))
    (configmap,) = [
        d for d in _by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")
    ]
    config: dict[str, Any] = yaml.safe_load(configmap["data"]["config.yaml"])
    return config


def test_tracing_settings_reach_the_routers_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    # `config.observability` and `config.router.log_format` pass through to the router's config
    values = {**OPEN, "config": {"observability": {"otlp_endpoint": "http://tempo:4318"}}}
    values["config"]["router"] = {"log_format": "json"}
    path = _router_config(tmp_path, values)
    config = yaml.safe_load(path.read_text())
    assert config["observability"] == {"otlp_endpoint": "http://tempo:4318"}
    assert config["router"]["log_format"] == "json"
    monkeypatch.setenv("GPUPOOL_ENGINE_KEY", "engine-key-for-the-test")
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err


def test_the_collectors_headers_come_from_a_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """`observability.headersSecret`: the collector's headers (a token) reach the router as an
    env var from that Secret, never through the ConfigMap; without a collector it is refused."""
    values: dict[str, Any] = {
        **OPEN,
        "observability": {"headersSecret": "tempo-auth"},
        "config": {"observability": {"otlp_endpoint": "http://tempo:4318"}},
    }
    docs = list(_documents(_render(values)))
    (container,) = _named(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("valueFrom") for e in container["env"]}
    assert env["GPUPOOL_OTLP_HEADERS"] == {"secretKeyRef": {"name": "tempo-auth", "key": "headers"}}
    assert _router_config_text(values)["observability"] == {
        "otlp_endpoint": "http://tempo:4318",
        "headers_env": "GPUPOOL_OTLP_HEADERS",
    }
    path = _router_config(tmp_path, values)
    monkeypatch.setenv("GPUPOOL_ENGINE_KEY", "engine-key-for-the-test")
    monkeypatch.setenv("GPUPOOL_OTLP_HEADERS", "authorization=Bearer t0ken")
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err
    assert "t0ken" not in capsys.readouterr().out
    for version in KUBE_VERSIONS:
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{version}")
        assert [m for m in report["messages"] if m["severity"] >= 2] + report["errors"] == []
    # the engines export vLLM's spans to the same collector, with the same Secret's headers
    for sts in _by_kind(docs, "StatefulSet"):
        (vllm,) = sts["spec"]["template"]["spec"]["containers"]
        args = vllm["args"]
        assert args[args.index("--otlp-traces-endpoint") + 1] == "http://tempo:4318/v1/traces"
        engine_env = {e["name"]: e.get("value", e.get("valueFrom")) for e in vllm["env"]}
        assert engine_env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        assert engine_env["OTEL_SERVICE_NAME"] == "gpupool-vllm"
        assert engine_env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == {
            "secretKeyRef": {"name": "tempo-auth", "key": "headers"}
        }
    off = {**values, "observability": {**values["observability"], "engineTraces": False}}
    for sts in _by_kind(list(_documents(_render(off))), "StatefulSet"):
        (vllm,) = sts["spec"]["template"]["spec"]["containers"]
        assert "--otlp-traces-endpoint" not in vllm["args"]
        assert "OTEL_SERVICE_NAME" not in {e["name"] for e in vllm["env"]}
    # without a collector the engines export nothing
    for sts in _by_kind(list(_documents(_render(OPEN))), "StatefulSet"):
        (vllm,) = sts["spec"]["template"]["spec"]["containers"]
        assert "--otlp-traces-endpoint" not in vllm["args"]
    # a Secret of headers and no collector to send them to
    with pytest.raises(helm.HelmError) as err:
        _render({**OPEN, "observability": {"headersSecret": "tempo-auth"}})
    assert "set config.observability.otlp_endpoint" in str(err.value)
    # both the chart's Secret and the user's own env var
    both = {**values, "config": {"observability": {"otlp_endpoint": "http://t:4318"}}}
    both["config"]["observability"]["headers_env"] = "MY_HEADERS"
    with pytest.raises(helm.HelmError) as err:
        _render(both)
    assert "set one of the two" in str(err.value)
