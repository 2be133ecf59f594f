"""The features that keep state in the store, the same cases on both backends (embedded SQLite
and a real PostgreSQL server): the ledger (durable commits, batches, malformed rows, queries,
retention, step numbering after a restart), governance's saved state, the rebalancer's SRE
settings (with the JSON file of gpupool before the store imported once), audit and decisions,
and where stored responses live."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import TypedDict, Unpack

import pytest

from router.accounting.ledger import Ledger
from router.gateway.response_placement import ResponsePlacement, StoredResponse
from router.governance.store import GovernanceStore, RunRow, SessionRow, TenantRow
from router.rebalancer.store import DecisionLog, SreSettings
from router.store import Store
from tests.unit.ledger_records import T0, record

DAY_S = 86_400.0


class _LedgerOptions(TypedDict, total=False):  # Ledger's that these tests set
    durable: bool


def _ledger(store: Store, **options: Unpack[_LedgerOptions]) -> Ledger:
    return Ledger(store, clock=lambda: T0 + 10.0, **options)


async def test_the_ledger_writes_and_reads_the_same_on_both(any_store: Store) -> None:
    ledger = _ledger(any_store)
    await ledger.start()
    try:
        assert await ledger.commit(record(request_id="a", run_id="r1"))
        ledger.submit(record(request_id="b", run_id="r1", outcome="aborted", status_code=499))
        ledger.submit(record(request_id="c", run_id="r2", class_name="normal", pool="normal"))
        ledger.submit(record(request_id="d", run_id=None, tenant="team-b"))
        ledger.submit_run_end(
            tenant="team-a",
            run_id="r1",
            reason="client_end",
            ended_at_s=T0 + 3,
            steps=2,
            tokens=240,
            gpu_seconds=3.0,
        )
        run = await ledger.run_summary("r1", "team-a")
        assert run is not None
        assert [r["request_id"] for r in run["requests"]] == ["a", "b"]
        assert [r["step_index"] for r in run["requests"]] == [0, 1]
        assert run["totals"]["outcomes"] == {"ok": 1, "aborted": 1}
        assert run["totals"]["prompt_tokens"] == 200
        assert run["end"]["reason"] == "client_end"
        assert await ledger.run_summary("r1", "team-b") is None
        runs = await ledger.list_runs(None)
        assert [(r["run_id"], r["requests"], r["errors"], r["classes"]) for r in runs] == [
            ("r1", 2, 1, ["agent"]),  # both ended at T0 + 2: by run id
            ("r2", 1, 0, ["normal"]),
        ]
        assert [r["run_id"] for r in await ledger.list_runs(None, class_name="normal")] == ["r2"]
        totals = await ledger.totals()
        assert (totals["requests"], totals["prompt_tokens"], totals["completion_tokens"]) == (
            4,
            400,
            80,
        )
        assert totals["gpu_seconds"] == pytest.approx(6.0)
        assert totals["by_tenant"]["team-b"]["requests"] == 1
        assert isinstance(totals["by_pool"]["agent"]["prompt_tokens"], int)
        json.dumps(await ledger.admin_report())  # JSON-ready on both backends
    finally:
        await ledger.aclose()


async def test_a_malformed_record_is_skipped_on_both(any_store: Store) -> None:
    ledger = _ledger(any_store, durable=False)
    await ledger.start()
    try:
        ledger.submit(record(request_id="good-1"))
        ledger.submit(record(request_id="bad", prompt_tokens=object()))
        ledger.submit(record(request_id="good-2"))
        assert await ledger.flush() == 2
        assert ledger.dropped_records == 1
        assert (await ledger.totals())["requests"] == 2
    finally:
        await ledger.aclose()


async def test_steps_continue_after_a_restart_and_retention_deletes(any_store: Store) -> None:
    ledger = _ledger(any_store)
    await ledger.start()
    await ledger.commit(record(request_id="s0", run_id="long"))
    await ledger.commit(record(request_id="s1", run_id="long"))
    await ledger.commit(
        record(
            request_id="old", run_id="old", started_at_s=T0 - 40 * DAY_S, ended_at_s=T0 - 40 * DAY_S
        )
    )
    await ledger.aclose()
    again = _ledger(any_store)  # a new process: numbering continues from the store
    await again.start()  # and retention deleted the 40-day-old request
    try:
        assert again.next_step_index("team-a", "long") == 2
        assert await again.run_summary("old", None) is None
    finally:
        await again.aclose()


def test_governance_state_round_trips(any_store: Store) -> None:
    store = GovernanceStore(any_store)
    store.open()
    tenant = TenantRow("team-a", T0, 10.5, 3.0, None, [(T0, 1.5)], [])
    run = RunRow("team-a", "r1", T0, T0 + 5, {"max_steps": 10}, 3, 400, 2.5, None, None, None)
    session = SessionRow("team-a", "sess", T0, 2, 2, [("task", 2)])
    store.save([tenant], [run], [session])
    store.save([TenantRow("team-a", T0 + 1, 9.0, 2.0, 1.0, [], [])], [], [])  # replaces
    tenants, runs = store.load()
    assert tenants == [TenantRow("team-a", T0 + 1, 9.0, 2.0, 1.0, [], [])]
    assert runs == [run]
    assert store.load_sessions() == [session]
    store.forget_runs_before(T0 + 10)
    assert store.load()[1] == [] and store.load_sessions() == []
    store.close()


async def test_sre_settings_audit_and_decisions(any_store: Store, tmp_path: Path) -> None:
    legacy = tmp_path / "state.json"
    old = SreSettings(frozen=True, bounds={"agent": (0.1, 0.5)})
    legacy.write_text(json.dumps(old.to_json()))
    log = DecisionLog(any_store)
    await log.start()
    try:
        assert await log.load_settings(legacy) == old  # imported once ...
        legacy.unlink()
        assert await log.load_settings(legacy) == old  # ... and kept in the store
        new = SreSettings(pinned_shares={"agent": 0.3, "normal": 0.7})
        await log.save_settings(new)
        assert await log.load_settings(legacy) == new
        await log.record_audit(T0, "sre", "pin", {"shares": {"agent": 0.3}})
        await log.record_decision(T0, {"reason": "hold", "shares": {"agent": 0.3}, "move": None})
        await log.record_decision(
            T0 + 1,
            {
                "reason": "move",
                "shares": {"agent": 0.4},
                "move": {"from_pool": "normal", "to_pool": "agent", "share_frac": 0.1},
            },
        )
        assert [a["action"] for a in await log.audit()] == ["pin"]
        assert [d["reason"] for d in await log.decisions()] == ["move", "hold"]
        assert [d["reason"] for d in await log.decisions(moves_only=True)] == ["move"]
    finally:
        await log.aclose()


async def test_response_placements_survive_a_restart_bounded(any_store: Store) -> None:
    first = ResponsePlacement(any_store, max_entries=3)
    await first.start()
    for i in range(4):
        first.remember(f"resp-{i}", StoredResponse("team-a", f"engine-{i % 2}", "resp-0", 10 * i))
    first.remember("resp-1", StoredResponse("team-a", "engine-1", "resp-0", 99))  # again: newest
    await first.aclose()
    again = ResponsePlacement(any_store, max_entries=3)
    await again.start()
    try:
        assert again.get("resp-0") is None  # the oldest beyond the bound
        assert again.get("resp-1") == StoredResponse("team-a", "engine-1", "resp-0", 99)
        assert again.get("resp-3") == StoredResponse("team-a", "engine-1", "resp-0", 30)
        assert len(again) == 3
    finally:
        await again.aclose()


async def test_files_of_gpupool_before_the_store_are_adopted(tmp_path: Path) -> None:
    """A ledger (user_version 1) and a governance file without the columns added later, as
    gpupool wrote them before migrations: opened, migrated, data kept."""
    ledger_path = tmp_path / "ledger.sqlite"
    with sqlite3.connect(ledger_path) as raw:
        raw.executescript(
            "CREATE TABLE requests (request_id TEXT PRIMARY KEY, run_id TEXT, step_index INTEGER,"
            " tenant TEXT NOT NULL, class_name TEXT NOT NULL, pool TEXT NOT NULL, instance TEXT,"
            " model TEXT NOT NULL, started_at_s REAL NOT NULL, ended_at_s REAL NOT NULL,"
            " queue_s REAL NOT NULL, ttft_s REAL, tpot_s REAL, prompt_tokens INTEGER NOT NULL,"
            " completion_tokens INTEGER NOT NULL, gpu_seconds REAL NOT NULL,"
            " outcome TEXT NOT NULL, status_code INTEGER NOT NULL);"
            "INSERT INTO requests VALUES ('old', 'r', 0, 'team-a', 'agent', 'agent', 'i0', 'tiny',"
            f" {T0}, {T0 + 1}, 0, NULL, NULL, 7, 3, 0.5, 'ok', 200);"
            "PRAGMA user_version = 1;"
        )
    governance_path = tmp_path / "ledger.governance.sqlite"
    with sqlite3.connect(governance_path) as raw:
        raw.executescript(
            "CREATE TABLE runs (tenant TEXT NOT NULL, run_id TEXT NOT NULL, started_at_s REAL"
            " NOT NULL, last_seen_s REAL NOT NULL, limits TEXT NOT NULL, steps INTEGER NOT NULL,"
            " tokens INTEGER NOT NULL, gpu_seconds REAL NOT NULL, stop_code TEXT,"
            " stop_message TEXT, ended TEXT, PRIMARY KEY (tenant, run_id));"
            f"INSERT INTO runs VALUES ('team-a', 'r', {T0}, {T0}, '{{}}', 2, 10, 1.0, NULL,"
            " NULL, NULL);"
        )
    ledger = Ledger(ledger_path, clock=lambda: T0 + 10.0)
    await ledger.start()
    try:
        assert (await ledger.totals())["prompt_tokens"] == 7
        assert ledger.next_step_index("team-a", "r") == 1
    finally:
        await ledger.aclose()
    governance = GovernanceStore(governance_path)
    governance.open()
    try:
        (run,) = governance.load()[1]
        assert (run.run_id, run.steps, run.active_s, run.settings) == ("r", 2, 0.0, {})
    finally:
        governance.close()
