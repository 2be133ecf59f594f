"""`gpupool store migrate|status` and `gpupool runs` on a PostgreSQL store (a real server), and
the config's refusals of store settings that cannot work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pools.config import ConfigError, load_config, parse_config
from router.accounting.ledger import Ledger
from router.cli import main
from router.store import PostgresStore
from tests.postgres import PASSWORD, PostgresServer
from tests.unit.ledger_records import record

POOLS = (
    "pools:\n"
    "  agent: {classes: [agent], share: {initial_frac: 0.5}}\n"
    "  normal: {classes: [normal], share: {initial_frac: 0.5}}\n"
)
ENV = "GPUPOOL_TEST_STORE_PASSWORD"


def pg_config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "gpupool.yaml"
    path.write_text(POOLS + f"store: {{url: {json.dumps(url)}, password_env: {ENV}}}\n")
    return path


@pytest.fixture
def pg_url(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> str:
    return postgres_server.create_database(f"cli_{request.node.name[5:30].lower()}")


def test_migrate_then_status_on_postgres(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENV, PASSWORD)
    config = str(pg_config(tmp_path, pg_url))
    assert main(["store", "status", "--config", config]) == 0
    assert "ledger at 0 of 1 (1 to apply)" in capsys.readouterr().out
    assert main(["store", "migrate", "--config", config]) == 0
    out = capsys.readouterr().out
    assert "ledger 1:" in out and "governance 2:" in out and "rebalancer 4:" in out
    assert "admission 1:" in out
    assert PASSWORD not in out
    assert main(["store", "migrate", "--config", config]) == 0
    assert capsys.readouterr().out.strip().endswith("up to date")
    assert main(["store", "status", "--config", config]) == 0
    assert "rebalancer at 4 of 4 (up to date)" in capsys.readouterr().out


def test_an_unset_password_env_is_a_config_error(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert main(["store", "migrate", "--config", str(pg_config(tmp_path, pg_url))]) == 2
    assert f"store.password_env: environment variable {ENV!r} is not set" in capsys.readouterr().err


def test_a_wrong_password_exits_1_naming_the_cause(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENV, "wrong-secret")
    assert main(["store", "migrate", "--config", str(pg_config(tmp_path, pg_url))]) == 1
    err = capsys.readouterr().err
    assert "password authentication failed" in err and "wrong-secret" not in err


async def test_runs_reads_the_postgres_ledger(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = PostgresStore(pg_url, password=PASSWORD)
    store.open()
    ledger = Ledger(store)
    await ledger.start()
    for i in range(3):
        await ledger.commit(record(request_id=f"q{i}", run_id="shared-run"))
    await ledger.aclose()
    store.close()
    monkeypatch.setenv(ENV, PASSWORD)
    config = str(pg_config(tmp_path, pg_url))
    assert main(["runs", "--config", config, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ledger"]["requests"] == 3
    assert main(["runs", "show", "shared-run", "--config", config, "--json"]) == 0
    assert [r["step_index"] for r in json.loads(capsys.readouterr().out)["requests"]] == [0, 1, 2]


@pytest.mark.parametrize(
    ("store", "refusal"),
    [
        ({"url": "mysql://u@h/db"}, "must be a PostgreSQL URL"),
        ({"url": "postgresql://u:secret@h/db"}, "holds a password"),
        ({"url": "postgresql://u@h/"}, "names no database"),
        ({"url": "postgresql://u@/db"}, "names no host"),
        ({"url": "postgresql://u@h:99999/db"}, "not a URL"),
        ({"password_env": "X"}, "password_env without store.url"),
        (
            {"url": "postgresql://u@h/db", "pool_min_connections": 9},
            "pool_min_connections exceeds",
        ),
        ({"url": "postgresql://u@h/db", "password": "x"}, "password"),
    ],
)
def test_bad_store_settings_are_refused(store: dict[str, object], refusal: str) -> None:
    document = {
        "pools": {"agent": {"classes": ["agent"], "share": {"initial_frac": 1.0}}},
        "store": store,
    }
    with pytest.raises(ConfigError) as err:
        parse_config(document)
    assert refusal in " ".join(err.value.problems)
    if "secret" in json.dumps(store):
        assert "secret" not in " ".join(err.value.problems)


def test_a_file_setting_nothing_reads_with_a_shared_store_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        POOLS + "router: {ledger_path: l.sqlite}\nstore: {url: 'postgresql://u@h/db'}\n"
    )
    with pytest.raises(ConfigError, match="ledger_path names a file of the embedded store"):
        load_config(str(path))


def test_status_on_the_embedded_store_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`status` reads; the files appear with `migrate` (or the router's first start)."""
    config = tmp_path / "gpupool.yaml"
    config.write_text(
        POOLS
        + f"router: {{ledger_path: {json.dumps(str(tmp_path / 'db' / 'ledger.sqlite'))}}}\n"
        + f"rebalancer: {{decision_log_path: {json.dumps(str(tmp_path / 'db' / 'rb.sqlite'))}}}\n"
    )
    assert main(["store", "status", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.count("not created yet") == 4, out
    assert not (tmp_path / "db").exists()
    assert main(["store", "migrate", "--config", str(config)]) == 0
    assert len(list((tmp_path / "db").glob("*.sqlite"))) == 4
    capsys.readouterr()
    assert main(["store", "status", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "not created yet" not in out and "rebalancer at 4 of 4 (up to date)" in out, out
