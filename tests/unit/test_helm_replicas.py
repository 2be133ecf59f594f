"""The chart's router replicas (helm/gpupool/): `router.replicas` (2 by default with a shared
store, 1 without), a PodDisruptionBudget only over more than one router pod, the store's URL
given as a value or read from a Secret (`store.existingSecret` / `urlKey`), its password from
the same Secret (`passwordKey`, through `store.password_env`), and a render that fails for
several router pods without a shared store. Rendered by Helm's own engine (helm-python-sdk),
the manifests checked with kubernetes-validate, the router's config with check-config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]  # ships no type hints (no py.typed)
import pytest
import yaml

from pools.config import ConfigError
from pools.testing.config import config_for_test
from router.cli import main
from tests.unit.test_helm_chart import (
    CHART,
    KUBE_VERSIONS,
    OPEN,
    _by_kind,
    _documents,
    _named,
    _render,
)

URL = "postgresql://gpupool@db.example:5432/gpupool"
SECRET = {"existingSecret": "gpupool-store"}


def _docs(**values: Any) -> list[dict[str, Any]]:
    return list(_documents(_render({**OPEN, **values})))


def _router_env(docs: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = _named(docs, "Deployment", "-router")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("valueFrom", e.get("value")) for e in container["env"]}


def _config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    configmap = _named(docs, "ConfigMap", "-config")
    config: dict[str, Any] = yaml.safe_load(configmap["data"]["config.yaml"])
    return config


def _replicas(docs: list[dict[str, Any]]) -> int:
    return int(_named(docs, "Deployment", "-router")["spec"]["replicas"])


def test_without_a_store_one_router_and_no_disruption_budget() -> None:
    docs = _docs()
    assert _replicas(docs) == 1
    budgets = [d["metadata"]["name"] for d in _by_kind(docs, "PodDisruptionBudget")]
    assert budgets and not [n for n in budgets if n.endswith("-router")]  # the engines' only
    config = _config(docs)
    assert "store" not in config
    assert config["router"]["ledger_path"] == "/var/lib/gpupool/ledger.sqlite"


def test_several_routers_without_a_store_fail_the_render() -> None:
    with pytest.raises(helm.HelmError) as err:
        _render({"router": {"allowOpen": True, "replicas": 3}})
    assert "router.replicas: 3 router pods need a shared PostgreSQL store" in str(err.value)


def test_a_store_url_gives_two_routers_a_budget_and_the_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    docs = _docs(store={"url": URL, **SECRET})
    assert _replicas(docs) == 2
    pdb = _named(docs, "PodDisruptionBudget", "-router")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == _named(docs, "Deployment", "-router")["spec"]["selector"]
    config = _config(docs)
    # the ledger and the decision log are in PostgreSQL: no file of the embedded store
    assert "ledger_path" not in config["router"]
    assert config["store"] == {"url": URL, "password_env": "GPUPOOL_STORE_PASSWORD"}
    env = _router_env(docs)
    assert env["GPUPOOL_STORE_PASSWORD"] == {
        "secretKeyRef": {"name": "gpupool-store", "key": "password"}
    }
    assert "GPUPOOL_STORE_URL" not in env  # the URL is a value here
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)
    _check_config(docs, tmp_path, monkeypatch, capsys)


def test_the_url_and_password_from_a_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    values = {
        "store": {**SECRET, "urlKey": "dsn", "passwordKey": "pw"},
        "router": {"allowOpen": True, "replicas": 3},
        "config": {**_values_config(), "store": {"pool_max_connections": 4}},
    }
    docs = list(_documents(_render(values)))
    assert _replicas(docs) == 3
    env = _router_env(docs)
    assert env["GPUPOOL_STORE_URL"] == {"secretKeyRef": {"name": "gpupool-store", "key": "dsn"}}
    assert env["GPUPOOL_STORE_PASSWORD"] == {"secretKeyRef": {"name": "gpupool-store", "key": "pw"}}
    store = _config(docs)["store"]
    # the user's store settings pass through beside the chart's
    assert store == {
        "url_env": "GPUPOOL_STORE_URL",
        "password_env": "GPUPOOL_STORE_PASSWORD",
        "pool_max_connections": 4,
    }
    for version in KUBE_VERSIONS:
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{version}")
        assert [m for m in report["messages"] if m["severity"] >= 2] + report["errors"] == []
    _check_config(docs, tmp_path, monkeypatch, capsys)
    # the variable unset: check-config says which
    monkeypatch.delenv("GPUPOOL_STORE_URL")
    path = tmp_path / "config.yaml"
    assert main(["check-config", str(path)]) == 2
    assert "store.url_env: environment variable 'GPUPOOL_STORE_URL'" in capsys.readouterr().err


def test_a_password_in_the_url_fails_the_render() -> None:
    with pytest.raises(helm.HelmError) as err:
        _render({**OPEN, "store": {"url": "postgresql://gpupool:hunter2@db:5432/gpupool"}})
    assert "store.url holds a password" in str(err.value)
    assert "hunter2" not in str(err.value)


def _values_config() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    config: dict[str, Any] = values["config"]
    return config


def _check_config(
    docs: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The router's config passes `gpupool check-config` with the Deployment's environment."""
    path = tmp_path / "config.yaml"
    path.write_text(_named(docs, "ConfigMap", "-config")["data"]["config.yaml"])
    monkeypatch.setenv("GPUPOOL_ENGINE_KEY", "engine-key-for-the-test")
    monkeypatch.setenv("GPUPOOL_STORE_URL", URL)
    monkeypatch.setenv("GPUPOOL_STORE_PASSWORD", "store-password-for-the-test")
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err
    capsys.readouterr()


def test_the_config_reads_the_store_url_from_url_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_TEST_STORE_URL", URL)
    config = config_for_test(store={"url_env": "GPUPOOL_TEST_STORE_URL"})
    assert config.store.url == URL
    with pytest.raises(ConfigError, match=r"store\.url and store\.url_env both set"):
        config_for_test(store={"url": URL, "url_env": "GPUPOOL_TEST_STORE_URL"})
    monkeypatch.setenv("GPUPOOL_TEST_STORE_URL", "postgresql://u:secret@db:5432/x")
    with pytest.raises(ConfigError, match="holds a password") as err:
        config_for_test(store={"url_env": "GPUPOOL_TEST_STORE_URL"})
    assert "secret" not in str(err.value)
    monkeypatch.delenv("GPUPOOL_TEST_STORE_URL")
    with pytest.raises(ConfigError, match="'GPUPOOL_TEST_STORE_URL' is not set"):
        config_for_test(store={"url_env": "GPUPOOL_TEST_STORE_URL"})
