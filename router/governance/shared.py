"""Budgets and concurrency slots kept in the store and changed atomically there, so router
processes sharing one database (replicas) can never spend a tenant's budget twice.

The database half of issue 25's "budgets and concurrency slots reserved and settled
atomically": each call is one short transaction, safe against any number of concurrent callers
on either backend (tests/unit/test_store_shared_budgets.py races two PostgreSQL clients). The
governor calls it through router/governance/replica.py when `store.url` is set (in chunks:
docs/replicas.md).

- `reserve(tenant, bucket, amount, now_s, capacity=..., rate_per_s=...)`: one conditional
  UPDATE: the bucket refills by the time since its last change (at `rate_per_s`, never above
  `capacity`), and gives `amount` only if it holds it (or, for an amount above the whole
  capacity, once it is full: the `TokenBucket` rule). True when given. A bucket not seen yet
  starts full.
- `reserve_up_to(tenant, bucket, least, most, now_s, ...)`: the same rule for `least`, but
  takes up to `most` when the bucket holds more (a replica's chunk): (taken, level after).
- `settle(tenant, bucket, reserved, used)`: gives back `reserved - used` (takes more when the
  request used more; the level may go below 0, never above capacity).
- `acquire_slot(tenant, holder, limit, now_s, lease_s, unit)`: one of at most `limit` slots, held
  by `holder` until `now_s + lease_s` unless renewed (`renew_slots`) or released
  (`release_slot`); the slots of a holder that died expire with their lease. The tenant's
  bucket row is locked first, so concurrent acquisitions are counted one after another.
  `unit` (default: the holder) is what the limit counts: holders of one unit (a run's slot
  on each replica its steps run on) take one slot together (migration 9).

- `next_step(tenant, run_id, now_s, span_s=, idle_s=)`: the run's next step number (0, 1,
  2, ...) and its home (`record_home`: the instance its latest answered step went to), one
  upsert; two replicas never hand out the same number. The same upsert counts the run's
  active time across replicas (`max_duration_s`, migration 11, `RUN_ACTIVE`): the row keeps
  the time of the run's latest event on the database's clock and the active seconds, and
  each event (a step arriving here, a step's end at the next sweep, `add_run_usage`) adds
  the time since the latest event when the replica's stretch (`span_s`: active there
  without a pause since) reaches back within `idle_s` of it, else only its own stretch.
- `session_step(tenant, step, now_s)`: a session's step (router/governance/runtable.py):
  its task anchor mapped to the session's run (the first replica to see an anchor gives it
  the session's next number; a step with no anchor joins the session's current run) and the
  step numbered in that run, one statement (PostgreSQL: `gpupool_session_step`, migration
  10); `forget_session_run` drops an ended run's anchors (its task's next step starts a new
  run).
- `borrow(tenant, need, lease, now_s, ...)`: borrowing between tenants across replicas
  (migration 12; 13: a debt paid off by the loan, as on one router, and the candidates
  joined to their rows): the borrower's own shared bucket gives what it holds, the shortfall comes
  from an idle lender's shared bucket (it keeps its reserve) and out of the borrower's shared
  allowance, in one statement (PostgreSQL: `gpupool_borrow`); the rules are
  router/governance/borrowing.py's. `reserve_up_to` marks its tenant active
  (`budget_buckets.active_at_s`) and `settle_many` marks the tenants a replica has requests
  of (its sweep): a lender is idle when no mark is recent.
- `levels(tenants, now_s)`: their `tokens` and `requests` buckets' levels refilled to `now_s`
  (`GET /v1/budget`'s read and the sweep's: docs/replicas.md).
- `publish_windows` / cost windows: each replica's hourly and daily GPU-seconds slices, one
  row per (tenant, replica), replaced every governance sweep; `others_windows` reads the other
  replicas' rows (a dead replica's spending keeps counting until it leaves the window).

Times are unix seconds (replicas share no monotonic clock); a clock that runs behind another
replica's never refills a bucket backwards.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.governance.borrowing import LenderView, Terms, idle, pick_lender, split
from router.store import Conn, Migration, Store, upsert

__all__ = [
    "ACQUIRE_SLOT",
    "ACQUIRE_SLOT_SQL",
    "ADMISSION_RESERVATIONS",
    "BORROWING",
    "BORROW_DEBT",
    "COST_WINDOWS",
    "HELD_ELSEWHERE",
    "LEASE_CHANNEL",
    "LEASE_SEPARATOR",
    "LEASE_STEP_SQL",
    "NEXT_STEP_SQL",
    "RECORD_HOME_SQL",
    "RELEASE_SLOT_SQL",
    "RUN_ACTIVE",
    "RUN_COUNTERS",
    "RUN_HOMES",
    "RUN_LEASE",
    "RUN_STEPS",
    "SESSION_RUNS",
    "SESSION_STEP_SQL",
    "SHARED_TABLES",
    "SLOT_AND_LEASE_STEP_SQL",
    "SLOT_AND_SESSION_STEP_SQL",
    "SLOT_AND_STEP_SQL",
    "WANT_HELD_SQL",
    "WRITE_HELD_SQL",
    "HeldRun",
    "Loan",
    "NextStep",
    "RunUsageRow",
    "SessionStep",
    "SharedBudgets",
    "SharedLevel",
    "Stretch",
    "leasable",
    "refilled",
]

_TABLES = """
CREATE TABLE IF NOT EXISTS budget_buckets (
    tenant TEXT NOT NULL,
    bucket TEXT NOT NULL,
    level {real} NOT NULL,
    capacity {real} NOT NULL,
    rate_per_s {real} NOT NULL,
    updated_at_s {real} NOT NULL,
    PRIMARY KEY (tenant, bucket)
);
CREATE TABLE IF NOT EXISTS concurrency_slots (
    tenant TEXT NOT NULL,
    holder TEXT NOT NULL,
    expires_at_s {real} NOT NULL,
    PRIMARY KEY (tenant, holder)
)
"""


def _migration(version: int, what: str, tables: str) -> Migration:
    """A governance migration whose two texts differ only in the float type."""
    return Migration(
        "governance",
        version,
        what,
        tables.format(real="REAL"),
        tables.format(real="DOUBLE PRECISION"),
    )


# governance's second migration (router/governance/store.py lists them all)
SHARED_TABLES = _migration(2, "budget_buckets, concurrency_slots (shared budgets)", _TABLES)

_COST_WINDOWS = """
CREATE TABLE IF NOT EXISTS cost_windows (
    tenant TEXT NOT NULL,
    replica TEXT NOT NULL,
    saved_at_s {real} NOT NULL,
    hour_slices TEXT NOT NULL,
    day_slices TEXT NOT NULL,
    PRIMARY KEY (tenant, replica)
)
"""
# governance's third migration: each replica's cost windows (cost caps across replicas)
COST_WINDOWS = _migration(3, "cost_windows (cost caps across replicas)", _COST_WINDOWS)

_RUN_STEPS = """
CREATE TABLE IF NOT EXISTS run_steps (
    tenant TEXT NOT NULL,
    run_id TEXT NOT NULL,
    next_step INTEGER NOT NULL,
    updated_at_s {real} NOT NULL,
    PRIMARY KEY (tenant, run_id)
)
"""
# governance's fourth migration: a run's step numbers, whichever replica serves the step
RUN_STEPS = _migration(4, "run_steps (step numbers across replicas)", _RUN_STEPS)

_ADMISSION_RESERVATIONS = """
CREATE TABLE IF NOT EXISTS admission_reservations (
    replica TEXT PRIMARY KEY,
    reservations TEXT NOT NULL,
    updated_at_s {real} NOT NULL
)
"""
# governance's fifth migration: each replica's KV and batch reservations per engine, which the
# other replicas' admission subtracts (router/admission/shared_reservations.py)
ADMISSION_RESERVATIONS = _migration(
    5, "admission_reservations (KV and batch reservations across replicas)", _ADMISSION_RESERVATIONS
)

_RUN_HOMES = """
ALTER TABLE run_steps ADD COLUMN home TEXT;
ALTER TABLE run_steps ADD COLUMN home_step INTEGER;
ALTER TABLE run_steps ADD COLUMN context_tokens INTEGER NOT NULL DEFAULT 0
"""
# governance's sixth migration: where each run's latest answered step went (its home), so its
# next step finds it on whichever replica it arrives
RUN_HOMES = _migration(6, "run_steps.home (run homes across replicas)", _RUN_HOMES)


# PostgreSQL's `acquire_slot` in one round trip: the same steps as the SQLite transaction in
# a function (each statement of a volatile PL/pgSQL function sees what other transactions
# committed before it, as the statements of a READ COMMITTED transaction do)
# The functions' first steps: lock the tenant's slots, drop the expired ones.
_LOCK_AND_EXPIRE = """DECLARE
    held INTEGER;
BEGIN
    -- the upsert locks the tenant's slot row: its acquisitions are counted in turn
    INSERT INTO budget_buckets (tenant, bucket, level, capacity, rate_per_s, updated_at_s)
        VALUES (p_tenant, '__slots__', 0, 0, 0, p_now)
        ON CONFLICT (tenant, bucket) DO UPDATE SET capacity = excluded.capacity;
    DELETE FROM concurrency_slots WHERE tenant = p_tenant AND expires_at_s <= p_now;
"""
_ACQUIRE_SLOT_FUNCTION = (
    """
CREATE OR REPLACE FUNCTION gpupool_acquire_slot(
    p_tenant TEXT, p_holder TEXT, p_limit INTEGER, p_now DOUBLE PRECISION,
    p_expires DOUBLE PRECISION
) RETURNS BOOLEAN LANGUAGE plpgsql AS $fn$
"""
    + _LOCK_AND_EXPIRE
    + """    SELECT COUNT(*) INTO held FROM concurrency_slots
        WHERE tenant = p_tenant AND holder <> p_holder;
    IF held >= p_limit THEN
        RETURN FALSE;
    END IF;
    INSERT INTO concurrency_slots (tenant, holder, expires_at_s)
        VALUES (p_tenant, p_holder, p_expires)
        ON CONFLICT (tenant, holder) DO UPDATE SET expires_at_s = excluded.expires_at_s;
    RETURN TRUE;
END
$fn$
"""
)


def _create_acquire_slot(conn: Conn) -> None:
    conn.execute(_ACQUIRE_SLOT_FUNCTION)  # one statement: its body holds `;`


def _nothing(conn: Conn) -> None:
    """SQLite: the slot is acquired in a transaction of the caller's (in-process, no trip)."""


# governance's seventh migration: PostgreSQL's slot acquisition as one call
ACQUIRE_SLOT = Migration(
    "governance", 7, "gpupool_acquire_slot (one round trip)", _nothing, _create_acquire_slot
)
_RUN_COUNTERS = """
ALTER TABLE run_steps ADD COLUMN tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE run_steps ADD COLUMN gpu_seconds {real} NOT NULL DEFAULT 0;
ALTER TABLE run_steps ADD COLUMN stop_code TEXT
"""
# governance's eighth migration: a run's settled tokens and GPU-seconds summed over the
# replicas, and the guard that stopped it on any of them (its guards across replicas)
RUN_COUNTERS = _migration(8, "run_steps tokens, gpu_seconds, stop_code (run guards)", _RUN_COUNTERS)
# governance's ninth migration: what a slot counts (`unit`) beside who holds it. A run's
# `max_concurrent_runs` slot is held per replica where its steps run (`<replica>:run:<id>`:
# each replica renews and releases its own), and counted once per run: the limit counts
# distinct units, and a run that holds a slot on one replica is admitted on another.
# Rows written before it (no unit) count by holder, as before. `acquire_slot` of older
# routers (migration 7's function) counts holders: a run on two replicas counts twice there,
# the cautious side.
_SLOT_UNITS = (
    """
CREATE OR REPLACE FUNCTION gpupool_acquire_unit_slot(
    p_tenant TEXT, p_holder TEXT, p_unit TEXT, p_limit INTEGER, p_now DOUBLE PRECISION,
    p_expires DOUBLE PRECISION
) RETURNS BOOLEAN LANGUAGE plpgsql AS $fn$
"""
    + _LOCK_AND_EXPIRE
    + """    SELECT COUNT(DISTINCT COALESCE(unit, holder)) INTO held FROM concurrency_slots
        WHERE tenant = p_tenant AND holder <> p_holder AND COALESCE(unit, holder) <> p_unit;
    IF held >= p_limit THEN
        RETURN FALSE;
    END IF;
    INSERT INTO concurrency_slots (tenant, holder, expires_at_s, unit)
        VALUES (p_tenant, p_holder, p_expires, p_unit)
        ON CONFLICT (tenant, holder) DO UPDATE
        SET expires_at_s = excluded.expires_at_s, unit = excluded.unit;
    RETURN TRUE;
END
$fn$
"""
)


def _add_unit(conn: Conn) -> None:
    conn.execute("ALTER TABLE concurrency_slots ADD COLUMN unit TEXT")


def _add_unit_and_function(conn: Conn) -> None:
    _add_unit(conn)
    conn.execute(_SLOT_UNITS)  # one statement: its body holds `;`


SLOT_UNITS = Migration(
    "governance",
    9,
    "concurrency_slots.unit (a run's slot counted once across replicas)",
    _add_unit,
    _add_unit_and_function,
)
ACQUIRE_SLOT_SQL = "SELECT gpupool_acquire_unit_slot(?, ?, ?, ?, ?, ?)"  # PostgreSQL only
RELEASE_SLOT_SQL = "DELETE FROM concurrency_slots WHERE tenant = ? AND holder = ?"
# A run's active time across replicas (migration 11): `run_steps.event_at_s` is the time of
# its latest event on the database's clock (replicas' clocks may differ; NULL: none yet) and
# `active_s` its active seconds. An event at `t` whose replica saw the run active for
# `span` before it (a step in flight, or gaps within its idle timeout) adds the time since
# the latest event when that stretch reaches back within `idle` of it (the gap counts: the
# run was not paused), else only the stretch (a pause before it); an event older than the
# latest adds nothing (concurrent steps on two replicas count the same wall time once: the
# latest of the event times, not a sum of per-replica gaps). A row without an event (a run
# numbered before the migration) takes the stretch.
_DB_NOW = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}


def _active_added(t: str, span: str, idle: str, last: str) -> str:
    """What an event at `t` with a stretch of `span` adds to a run's active seconds."""
    return (
        f"(CASE WHEN {last} IS NULL THEN {span} WHEN {t} <= {last} THEN 0"
        f" WHEN {t} - {span} - {last} <= {idle} THEN {t} - {last} ELSE {span} END)"
    )


def _latest(t: str, last: str) -> str:
    return f"(CASE WHEN {last} IS NULL OR {t} > {last} THEN {t} ELSE {last} END)"


_STEP_RETURNING = (
    " RETURNING next_step, home, home_step, context_tokens, tokens, gpu_seconds, stop_code,"
    " active_s"
)


def _step_upsert(dialect: str, values: str, idle: str = "?") -> str:
    """The step's upsert: `values` gives (tenant, run id, updated at, span); the event is
    now on the database's clock."""
    added = _active_added("excluded.event_at_s", "excluded.active_s", idle, "run_steps.event_at_s")
    return (
        "INSERT INTO run_steps (tenant, run_id, next_step, updated_at_s, active_s, event_at_s)"
        f" {values.format(now=_DB_NOW[dialect])} ON CONFLICT (tenant, run_id) DO UPDATE SET"
        " next_step = run_steps.next_step + 1, updated_at_s = excluded.updated_at_s,"
        f" active_s = run_steps.active_s + {added},"
        f" event_at_s = {_latest('excluded.event_at_s', 'run_steps.event_at_s')}"
        f"{_STEP_RETURNING}"
    )


# the run's next step (parameters: tenant, run id, now (unix), span_s, idle_s)
NEXT_STEP_SQL = _step_upsert("postgresql", "VALUES (?, ?, 1, ?, ?, {now})")
_NEXT_STEP_SQLITE = _step_upsert("sqlite", "VALUES (?, ?, 1, ?, ?, {now})")
RECORD_HOME_SQL = (
    "UPDATE run_steps SET home = ?, home_step = ?, context_tokens = ?"
    " WHERE tenant = ? AND run_id = ? AND (home_step IS NULL OR home_step < ?)"
)
# a request's slot and, when it gets one, its run's next step, in one round trip (PostgreSQL
# only: the slot function's row, then NEXT_STEP_SQL's columns, NULL when refused)
SLOT_AND_STEP_SQL = (
    "WITH slot AS (SELECT gpupool_acquire_unit_slot(?, ?, ?, ?, ?, ?) AS ok), step AS ("
    + _step_upsert(
        "postgresql",
        "SELECT CAST(? AS TEXT), CAST(? AS TEXT), 1, CAST(? AS DOUBLE PRECISION),"
        " CAST(? AS DOUBLE PRECISION), {now} FROM slot WHERE ok",
        "CAST(? AS DOUBLE PRECISION)",
    )
    + ") SELECT slot.ok, step.* FROM slot LEFT JOIN step ON TRUE"
)
# governance's fourteenth migration: a run's numbering under a lease (docs/replicas.md, s48).
# `holder` (a replica id) numbers the run's steps from its memory until `held_until_s` (the
# database's clock), and its sweep writes `next_step` and renews; `wanted_at_s`: another
# replica has a step of the run and asks the holder to hand it over (at its next sweep).
_RUN_LEASE = """
ALTER TABLE run_steps ADD COLUMN holder TEXT;
ALTER TABLE run_steps ADD COLUMN held_until_s {real};
ALTER TABLE run_steps ADD COLUMN wanted_at_s {real}
"""
RUN_LEASE = _migration(14, "run_steps holder, held_until_s, wanted_at_s (run leases)", _RUN_LEASE)
_PG_NOW = _DB_NOW["postgresql"]
# a lease taken over after it expired (its holder died or was cut off): its steps numbered
# since its last sweep are in the ledger only (the same database: the lease is on only when
# the ledger numbers steps with the store, router/settlement.py), so the count goes on past
# the highest number recorded there (a number is never given twice; gaps are possible)
_AFTER_LEDGER = (
    "GREATEST(run_steps.next_step, (SELECT COALESCE(MAX(r.step_index), -1) + 1 FROM requests r"
    " WHERE r.run_id = excluded.run_id AND r.tenant = excluded.tenant))"
)


def _lease_upsert(values: str) -> str:
    """The step's upsert under leases (PostgreSQL): `values` gives (tenant, run id, updated at,
    span, holder, lease seconds); it numbers the step only when the run is not held or its
    lease expired, and makes `holder` (None: nobody) its holder for `lease seconds` from now.
    A run held by a live lease (another replica's, or this replica's own while its sweep
    hands it over): no row."""
    added = _active_added(
        "excluded.event_at_s",
        "excluded.active_s",
        "CAST(? AS DOUBLE PRECISION)",
        "run_steps.event_at_s",
    )
    return (
        "INSERT INTO run_steps (tenant, run_id, next_step, updated_at_s, active_s, event_at_s,"
        f" holder, held_until_s) {values.format(now=_PG_NOW)}"
        " ON CONFLICT (tenant, run_id) DO UPDATE SET next_step = (CASE WHEN run_steps.holder"
        f" IS NULL THEN run_steps.next_step ELSE {_AFTER_LEDGER} END) + 1,"
        f" updated_at_s = excluded.updated_at_s, active_s = run_steps.active_s + {added},"
        f" event_at_s = {_latest('excluded.event_at_s', 'run_steps.event_at_s')},"
        " holder = excluded.holder, held_until_s = excluded.held_until_s, wanted_at_s = NULL"
        f" WHERE run_steps.holder IS NULL OR run_steps.held_until_s < {_PG_NOW}"
        f"{_STEP_RETURNING}"
    )


# NEXT_STEP_SQL under leases (parameters: tenant, run id, now (unix), span_s, holder or None,
# lease_s or None, idle_s)
LEASE_STEP_SQL = _lease_upsert(
    "VALUES (?, ?, 1, ?, ?, {now}, CAST(? AS TEXT), {now} + CAST(? AS DOUBLE PRECISION))"
)
# SLOT_AND_STEP_SQL under leases: the slot granted and the run held elsewhere: step's NULLs
SLOT_AND_LEASE_STEP_SQL = (
    "WITH slot AS (SELECT gpupool_acquire_unit_slot(?, ?, ?, ?, ?, ?) AS ok), step AS ("
    + _lease_upsert(
        "SELECT CAST(? AS TEXT), CAST(? AS TEXT), 1, CAST(? AS DOUBLE PRECISION),"
        " CAST(? AS DOUBLE PRECISION), {now}, CAST(? AS TEXT),"
        " {now} + CAST(? AS DOUBLE PRECISION) FROM slot WHERE ok"
    )
    + ") SELECT slot.ok, step.* FROM slot LEFT JOIN step ON TRUE"
)
# the holder's sweep: the run's next number, its home (the latest step answered here, as
# RECORD_HOME_SQL writes it; NULL: none since), the lease renewed (or released: holder and
# wanted cleared); its stop code (an operator's or a guard's on another replica) and whether
# another replica wants it. No row: the lease was lost (it expired and another took it).
# Parameters: next_step, (home step, home step, then each of home, home step, context
# tokens), release, release, lease_s, release, tenant, run id, holder.
_NEWER_HOME = "(CAST(? AS BIGINT) IS NOT NULL AND (home_step IS NULL OR home_step < ?))"
WRITE_HELD_SQL = (
    "UPDATE run_steps SET next_step = ?,"
    f" home = CASE WHEN {_NEWER_HOME} THEN ? ELSE home END,"
    f" home_step = CASE WHEN {_NEWER_HOME} THEN ? ELSE home_step END,"
    f" context_tokens = CASE WHEN {_NEWER_HOME} THEN ? ELSE context_tokens END,"
    " holder = CASE WHEN ? THEN NULL ELSE holder END,"
    f" held_until_s = CASE WHEN ? THEN NULL ELSE {_PG_NOW} + CAST(? AS DOUBLE PRECISION) END,"
    " wanted_at_s = CASE WHEN ? THEN NULL ELSE wanted_at_s END"
    " WHERE tenant = ? AND run_id = ? AND holder = ?"
    " RETURNING stop_code, wanted_at_s IS NOT NULL"
)
# a replica with a step of a run another holds: ask the holder to hand it over, marked on
# the row (read by the holder's sweep) and told at once (a notification on LEASE_CHANNEL,
# `<holder> US <tenant> US <run id>`, US the unit separator, read by its listener)
LEASE_CHANNEL = "gpupool_run_lease"
LEASE_SEPARATOR = "\x1f"
WANT_HELD_SQL = (
    f"WITH w AS (UPDATE run_steps SET wanted_at_s = {_PG_NOW}"
    " WHERE tenant = ? AND run_id = ? AND holder IS NOT NULL RETURNING holder, tenant, run_id)"
    f" SELECT pg_notify('{LEASE_CHANNEL}', holder || chr(31) || tenant || chr(31) || run_id)"
    " FROM w"
)
SESSION_FRESH_S = 10.0  # a session's rows rewritten by a step only when older than this
# governance's tenth migration: a session's runs numbered across replicas. One row per
# session (the highest run number given, its current run) and one per task anchor (the run
# it maps to, when last seen: at most `MAX_ANCHORS` per session, the newest kept). On
# PostgreSQL `gpupool_session_step` maps a step's anchor and numbers the step in one call:
# the upsert of the session's row locks it, so a session's steps are mapped one after
# another, and each later statement of the function (a volatile PL/pgSQL function: each
# statement sees what other transactions committed before it) reads the anchors as the
# step before it left them. `p_run`: the run the step went on as (a replica that knew it:
# the step is numbered there whatever the anchor maps to); `p_floor`: the highest number
# the replica gave on its own during a store outage (new runs are numbered past it). A
# task's later step whose anchor maps to the current run, both rows written within
# SESSION_FRESH_S, reads them and writes nothing but its step (no lock: nothing changes).
_SESSION_TABLES = """
CREATE TABLE IF NOT EXISTS session_runs (
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    last_run BIGINT NOT NULL,
    current_run BIGINT NOT NULL,
    updated_at_s {real} NOT NULL,
    PRIMARY KEY (tenant, session_id)
);
CREATE TABLE IF NOT EXISTS session_anchors (
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    anchor TEXT NOT NULL,
    run BIGINT NOT NULL,
    seen_at_s {real} NOT NULL,
    PRIMARY KEY (tenant, session_id, anchor)
)
"""
_SESSION_STEP_FUNCTION = """
CREATE OR REPLACE FUNCTION gpupool_session_step(
    p_tenant TEXT, p_session TEXT, p_anchor TEXT, p_now DOUBLE PRECISION, p_run BIGINT,
    p_floor BIGINT, p_max_anchors INTEGER
) RETURNS TABLE (
    o_next_step INTEGER, o_home TEXT, o_home_step INTEGER, o_context_tokens INTEGER,
    o_tokens BIGINT, o_gpu_seconds DOUBLE PRECISION, o_stop_code TEXT, o_run BIGINT
) LANGUAGE plpgsql AS $fn$
DECLARE
    v_last BIGINT;
    v_current BIGINT;
    v_updated DOUBLE PRECISION;
    v_run BIGINT;
    v_seen DOUBLE PRECISION;
BEGIN
    -- a task's later step: its anchor's run is the session's current one and both rows were
    -- written in the last FRESH_S: nothing changes, nothing is written (read, not locked)
    SELECT s.last_run, s.current_run, s.updated_at_s INTO v_last, v_current, v_updated
        FROM session_runs s WHERE s.tenant = p_tenant AND s.session_id = p_session;
    IF p_anchor IS NULL THEN
        v_run := NULLIF(v_current, 0);
        v_seen := p_now;
    ELSE
        SELECT a.run, a.seen_at_s INTO v_run, v_seen FROM session_anchors a
            WHERE a.tenant = p_tenant AND a.session_id = p_session AND a.anchor = p_anchor;
    END IF;
    IF v_run IS NULL OR v_run IS DISTINCT FROM v_current OR p_now - v_updated > {fresh}
            OR p_now - v_seen > {fresh} THEN
        -- the upsert of the session's row locks it: its steps are mapped one after another,
        -- and each statement below sees what the step before committed
        INSERT INTO session_runs AS s (tenant, session_id, last_run, current_run, updated_at_s)
            VALUES (p_tenant, p_session, 0, 0, p_now)
            ON CONFLICT (tenant, session_id) DO UPDATE
            SET updated_at_s = GREATEST(s.updated_at_s, excluded.updated_at_s)
            RETURNING s.last_run, s.current_run INTO v_last, v_current;
        v_run := NULL;
        IF p_anchor IS NULL THEN
            v_run := NULLIF(v_current, 0);
        ELSE
            SELECT a.run INTO v_run FROM session_anchors a
                WHERE a.tenant = p_tenant AND a.session_id = p_session AND a.anchor = p_anchor;
        END IF;
        IF v_run IS NULL THEN  -- a new task (or no current run): the session's next number
            IF p_run IS NOT NULL AND p_run > v_last THEN
                v_run := p_run;  -- numbered by the replica during an outage: kept
            ELSE
                v_run := GREATEST(v_last, COALESCE(p_floor, 0)) + 1;
            END IF;
            IF p_anchor IS NOT NULL THEN  -- room for it: the oldest others beyond the bound go
                DELETE FROM session_anchors a
                    WHERE a.tenant = p_tenant AND a.session_id = p_session AND a.anchor IN (
                        SELECT b.anchor FROM session_anchors b
                        WHERE b.tenant = p_tenant AND b.session_id = p_session
                            AND b.anchor <> p_anchor
                        ORDER BY b.seen_at_s DESC, b.anchor OFFSET p_max_anchors - 1);
            END IF;
        END IF;
        UPDATE session_runs SET last_run = GREATEST(last_run, v_run), current_run = v_run
            WHERE tenant = p_tenant AND session_id = p_session;
        IF p_anchor IS NOT NULL THEN
            INSERT INTO session_anchors AS a (tenant, session_id, anchor, run, seen_at_s)
                VALUES (p_tenant, p_session, p_anchor, v_run, p_now)
                ON CONFLICT (tenant, session_id, anchor) DO UPDATE
                SET run = excluded.run, seen_at_s = excluded.seen_at_s;
        END IF;
    END IF;
    RETURN QUERY INSERT INTO run_steps AS r (tenant, run_id, next_step, updated_at_s)
        VALUES (p_tenant, p_session || ':' || COALESCE(p_run, v_run), 1, p_now)
        ON CONFLICT (tenant, run_id) DO UPDATE
        SET next_step = r.next_step + 1, updated_at_s = excluded.updated_at_s
        RETURNING r.next_step, r.home, r.home_step, r.context_tokens, r.tokens,
            r.gpu_seconds, r.stop_code, v_run;
END
$fn$
"""


def _session_tables(real: str) -> Callable[[Conn], None]:
    def apply(conn: Conn) -> None:
        for statement in _SESSION_TABLES.format(real=real).split(";"):
            conn.execute(statement)
        if real != "REAL":  # PostgreSQL: the step's function (one statement: its body holds `;`)
            conn.execute(_SESSION_STEP_FUNCTION.replace("{fresh}", repr(SESSION_FRESH_S)))

    return apply


SESSION_RUNS = Migration(
    "governance",
    10,
    "session_runs, session_anchors, gpupool_session_step (a session's runs across replicas)",
    _session_tables("REAL"),
    _session_tables("DOUBLE PRECISION"),
)
# governance's eleventh migration: a run's active time (`max_duration_s`) counted across
# replicas, in the statements that number its steps (see `_active_added`). Rows numbered
# before it have no event yet: their next event starts them at that event's stretch.
# `gpupool_session_step` gains the step's stretch and the replica's idle timeout (a new
# overload of nine arguments; migration 10's seven-argument one stays for routers started
# before it, whose steps then count no active time in the store).
_SESSION_STEP_ACTIVE_FUNCTION = (
    _SESSION_STEP_FUNCTION.replace(
        "p_floor BIGINT, p_max_anchors INTEGER\n)",
        "p_floor BIGINT, p_max_anchors INTEGER, p_span DOUBLE PRECISION,"
        " p_idle DOUBLE PRECISION\n)",
    )
    .replace(
        "o_stop_code TEXT, o_run BIGINT",
        "o_stop_code TEXT, o_active_s DOUBLE PRECISION, o_run BIGINT",
    )
    .replace(
        """    RETURN QUERY INSERT INTO run_steps AS r (tenant, run_id, next_step, updated_at_s)
        VALUES (p_tenant, p_session || ':' || COALESCE(p_run, v_run), 1, p_now)
        ON CONFLICT (tenant, run_id) DO UPDATE
        SET next_step = r.next_step + 1, updated_at_s = excluded.updated_at_s
        RETURNING r.next_step, r.home, r.home_step, r.context_tokens, r.tokens,
            r.gpu_seconds, r.stop_code, v_run;""",
        f"""    RETURN QUERY INSERT INTO run_steps AS r (tenant, run_id, next_step, updated_at_s,
            active_s, event_at_s)
        VALUES (p_tenant, p_session || ':' || COALESCE(p_run, v_run), 1, p_now, p_span,
            {_DB_NOW["postgresql"]})
        ON CONFLICT (tenant, run_id) DO UPDATE
        SET next_step = r.next_step + 1, updated_at_s = excluded.updated_at_s,
            active_s = r.active_s + {
            _active_added("excluded.event_at_s", "excluded.active_s", "p_idle", "r.event_at_s")
        },
            event_at_s = {_latest("excluded.event_at_s", "r.event_at_s")}
        RETURNING r.next_step, r.home, r.home_step, r.context_tokens, r.tokens,
            r.gpu_seconds, r.stop_code, r.active_s, v_run;""",
    )
    .replace("{fresh}", repr(SESSION_FRESH_S))
)
assert "p_span" in _SESSION_STEP_ACTIVE_FUNCTION and "r.active_s" in _SESSION_STEP_ACTIVE_FUNCTION
_RUN_ACTIVE = """
ALTER TABLE run_steps ADD COLUMN active_s {real} NOT NULL DEFAULT 0;
ALTER TABLE run_steps ADD COLUMN event_at_s {real}
"""


def _run_active(real: str) -> Callable[[Conn], None]:
    def apply(conn: Conn) -> None:
        for statement in _RUN_ACTIVE.format(real=real).split(";"):
            conn.execute(statement)
        if real != "REAL":  # PostgreSQL: the session step's function, with the active time
            conn.execute(_SESSION_STEP_ACTIVE_FUNCTION)

    return apply


RUN_ACTIVE = Migration(
    "governance",
    11,
    "run_steps active_s, event_at_s (a run's active time across replicas)",
    _run_active("REAL"),
    _run_active("DOUBLE PRECISION"),
)
# governance's twelfth migration: borrowing between tenants across replicas. A tenant's
# `tokens` row gains `active_at_s`: the latest time (unix, the marking replica's clock) a
# replica had demand of it, written by its lease top-ups (`reserve_up_to`, the upsert that
# opens the transaction anyway) and, for the tenants with a request in flight or waiting
# there, by each replica's governance sweep (`settle_many`). A borrower's allowance is its
# `allowance` row (capacity `borrow_max_frac` x its tokens per minute, refilled a minute).
# `gpupool_borrow` (PostgreSQL: one round trip) locks the borrower's allowance row (its
# borrows on every replica are counted one after another), then its tokens row, splits the
# need as `borrowing.split` does, and takes the shortfall from the idle lender with the most
# to lend above its reserve (`borrowing.pick_lender`; ties: the first name), re-checked on
# the lender's row under its lock (a lender another replica just lent from or marked active
# is passed over for the next). Nothing: no row.


def _refill(row: str, now: str) -> str:
    """A `budget_buckets` row's level refilled to `now` (`refilled`'s rule, in SQL)."""
    return (
        f"(CASE WHEN {now} > {row}.updated_at_s THEN LEAST({row}.capacity, {row}.level"
        f" + ({now} - {row}.updated_at_s) * {row}.rate_per_s) ELSE {row}.level END)"
    )


_LENDER_IDLE = "(l.active_at_s IS NULL OR l.active_at_s < p_idle_before)"
_LENDABLE = f"{_refill('l', 'p_now')} - p_reserve_frac * l.capacity"
# a candidate's lendable tokens: its row's, or (never used: no row) all above its reserve
_CANDIDATE = f"COALESCE({_LENDABLE}, u.c - p_reserve_frac * u.c)"
_BORROW_FUNCTION = f"""
CREATE OR REPLACE FUNCTION gpupool_borrow(
    p_tenant TEXT, p_need DOUBLE PRECISION, p_lease DOUBLE PRECISION, p_now DOUBLE PRECISION,
    p_capacity DOUBLE PRECISION, p_rate DOUBLE PRECISION, p_allow_capacity DOUBLE PRECISION,
    p_allow_rate DOUBLE PRECISION, p_lenders TEXT[], p_capacities DOUBLE PRECISION[],
    p_rates DOUBLE PRECISION[], p_idle_before DOUBLE PRECISION,
    p_reserve_frac DOUBLE PRECISION
) RETURNS TABLE (o_lender TEXT, o_short DOUBLE PRECISION, o_own DOUBLE PRECISION)
LANGUAGE plpgsql AS $fn$
DECLARE
    v_allowance DOUBLE PRECISION;
    v_own DOUBLE PRECISION;
    v_lease DOUBLE PRECISION;
    v_take DOUBLE PRECISION;
    v_short DOUBLE PRECISION;
    v_lender TEXT;
    v_missing BOOLEAN;
    v_cap DOUBLE PRECISION;
    v_rate DOUBLE PRECISION;
BEGIN
    -- the borrower's allowance, then its own bucket (marked active: it has demand), locked
    INSERT INTO budget_buckets AS b (tenant, bucket, level, capacity, rate_per_s, updated_at_s)
        VALUES (p_tenant, 'allowance', p_allow_capacity, p_allow_capacity, p_allow_rate, p_now)
        ON CONFLICT (tenant, bucket) DO UPDATE
        SET capacity = excluded.capacity, rate_per_s = excluded.rate_per_s
        RETURNING {_refill("b", "p_now")} INTO v_allowance;
    INSERT INTO budget_buckets AS b (tenant, bucket, level, capacity, rate_per_s, updated_at_s,
            active_at_s)
        VALUES (p_tenant, 'tokens', p_capacity, p_capacity, p_rate, p_now, p_now)
        ON CONFLICT (tenant, bucket) DO UPDATE
        SET capacity = excluded.capacity, rate_per_s = excluded.rate_per_s,
            active_at_s = GREATEST(b.active_at_s, excluded.active_at_s)
        RETURNING {_refill("b", "p_now")} INTO v_own;
    -- borrowing.split: the lease first, then the own bucket, each down to 0 (a debt in
    -- either is paid off by the loan, as one router's), the rest short
    v_lease := LEAST(p_lease, p_need);
    v_take := LEAST(v_own, p_need - v_lease);
    v_short := p_need - v_lease - v_take;
    IF v_short <= 0 OR v_short > v_allowance OR v_short > p_allow_capacity THEN
        RETURN;
    END IF;
    -- the candidates joined to their rows (a hash join: one pass over each, where
    -- `tenant = ANY(p_lenders)` compared every row with every name); a lender never used has
    -- no row yet: it starts full (and idle), its row made only if it lends
    FOR v_lender, v_missing, v_cap, v_rate IN
        SELECT u.n, l.tenant IS NULL, u.c, u.r
        FROM unnest(p_lenders, p_capacities, p_rates) AS u(n, c, r)
        LEFT JOIN budget_buckets l ON l.tenant = u.n AND l.bucket = 'tokens'
        WHERE u.n <> p_tenant AND {_LENDER_IDLE} AND {_CANDIDATE} >= v_short
        ORDER BY {_CANDIDATE} DESC, u.n
    LOOP
        IF v_missing THEN
            INSERT INTO budget_buckets (tenant, bucket, level, capacity, rate_per_s,
                updated_at_s) VALUES (v_lender, 'tokens', v_cap, v_cap, v_rate, p_now)
                ON CONFLICT (tenant, bucket) DO NOTHING;
        END IF;
        -- re-checked on the row under its lock (another replica may have lent or marked it)
        UPDATE budget_buckets AS l SET level = {_refill("l", "p_now")} - v_short,
            updated_at_s = GREATEST(l.updated_at_s, p_now)
            WHERE l.tenant = v_lender AND l.bucket = 'tokens' AND {_LENDER_IDLE}
                AND {_LENDABLE} >= v_short;
        IF FOUND THEN
            UPDATE budget_buckets AS b SET level = {_refill("b", "p_now")} - v_take,
                updated_at_s = GREATEST(b.updated_at_s, p_now)
                WHERE b.tenant = p_tenant AND b.bucket = 'tokens';
            UPDATE budget_buckets AS b SET level = {_refill("b", "p_now")} - v_short,
                updated_at_s = GREATEST(b.updated_at_s, p_now)
                WHERE b.tenant = p_tenant AND b.bucket = 'allowance';
            RETURN QUERY SELECT v_lender, v_short, v_take;
            RETURN;
        END IF;
    END LOOP;
END
$fn$
"""
BORROW_SQL = (  # PostgreSQL only (parameters: `SharedBudgets.borrow`'s, in order)
    "SELECT o_lender, o_short, o_own FROM gpupool_borrow(?, ?, ?, ?, ?, ?, ?, ?,"
    " CAST(? AS TEXT[]), CAST(? AS DOUBLE PRECISION[]), CAST(? AS DOUBLE PRECISION[]), ?, ?)"
)


def _borrowing(real: str) -> Callable[[Conn], None]:
    def apply(conn: Conn) -> None:
        conn.execute(f"ALTER TABLE budget_buckets ADD COLUMN active_at_s {real}")
        if real != "REAL":  # PostgreSQL: the borrow's function (one statement: its body holds `;`)
            conn.execute(_BORROW_FUNCTION)

    return apply


BORROWING = Migration(
    "governance",
    12,
    "budget_buckets.active_at_s, gpupool_borrow (borrowing between tenants across replicas)",
    _borrowing("REAL"),
    _borrowing("DOUBLE PRECISION"),
)
# governance's thirteenth migration (s48): `gpupool_borrow` replaced (same arguments and
# answer): a debt in the borrower's lease or own bucket is paid off by the loan, as one
# router's is (`borrowing.split`), and the candidate lenders are joined to their rows instead
# of every row compared with every name (`= ANY`), a never-used lender's row made only when
# it lends (a borrow with 1,000 tenants: 8-11 ms before, 3-4 ms after, with the array
# literals of `_pg_array`: benchmarks/results/borrow-replicas-2026-12-04-s48). Migration 12
# installs the same (current) body on a fresh database; a database at 12 gets it here.


def _borrow_function(conn: Conn) -> None:
    conn.execute(_BORROW_FUNCTION)


BORROW_DEBT = Migration(
    "governance",
    13,
    "gpupool_borrow: a debt paid off by the loan (one router's rule), candidates joined",
    lambda conn: None,
    _borrow_function,
)
_SESSION_COLUMNS = (
    "o_next_step AS next_step, o_home AS home, o_home_step AS home_step,"
    " o_context_tokens AS context_tokens, o_tokens AS tokens, o_gpu_seconds AS gpu_seconds,"
    " o_stop_code AS stop_code, o_active_s AS active_s, o_run AS run"
)
# a session's step: its run (the anchor mapped) and its number, NEXT_STEP_SQL's columns and
# the run's number (PostgreSQL only; parameters: `SessionStep.params`)
SESSION_STEP_SQL = f"SELECT {_SESSION_COLUMNS} FROM gpupool_session_step(?, ?, ?, ?, ?, ?, ?, ?, ?)"
# SLOT_AND_STEP_SQL for a session's step: the function is called only when the slot was
# granted (its time argument depends on the slot's row, so it runs after the filter)
SLOT_AND_SESSION_STEP_SQL = (
    "WITH slot AS (SELECT gpupool_acquire_unit_slot(?, ?, ?, ?, ?, ?) AS ok),"
    f" step AS (SELECT {_SESSION_COLUMNS} FROM slot, LATERAL gpupool_session_step(?, ?, ?,"
    " CASE WHEN slot.ok THEN CAST(? AS DOUBLE PRECISION) END, ?, ?, ?, ?, ?) WHERE slot.ok)"
    " SELECT slot.ok, step.* FROM slot LEFT JOIN step ON TRUE"
)
FORGET_ANCHORS_SQL = "DELETE FROM session_anchors WHERE tenant = ? AND session_id = ? AND run = ?"
FORGET_CURRENT_SQL = (
    "UPDATE session_runs SET current_run = 0"
    " WHERE tenant = ? AND session_id = ? AND current_run = ?"
)


@dataclass(frozen=True, slots=True)
class SessionStep:
    """A session's step, for the store to map to a run (`session_step`): the session, the
    step's task anchor (None: it joins the current run), the run it went on as (None: the
    store's mapping decides), and the highest number the replica gave during an outage."""

    session_id: str
    anchor: str | None
    run: int | None = None
    floor: int = 0

    def params(
        self, tenant: str, now_s: float, max_anchors: int, stretch: Stretch
    ) -> tuple[object, ...]:
        """`SESSION_STEP_SQL`'s parameters."""
        head = (tenant, self.session_id, self.anchor, now_s, self.run, self.floor, max_anchors)
        return (*head, *stretch.params())


def _finite(idle_s: float) -> float:
    """An idle timeout as a parameter (no limit: a number larger than any gap)."""
    return min(idle_s, 1e18)


@dataclass(frozen=True, slots=True)
class Stretch:
    """What a replica tells the store with an event of a run, for its active time across
    replicas: how long the run has been active there without a pause up to the event
    (`span_s`: a step in flight, or gaps within the idle timeout; 0 after a pause) and that
    replica's `governance.run_idle_timeout_s` (`idle_s`)."""

    span_s: float = 0.0
    idle_s: float = math.inf

    def params(self) -> tuple[float, float]:
        return self.span_s, _finite(self.idle_s)


NO_STRETCH = Stretch()  # an event after a pause (or a caller that does not count time)


def _add_run_usage_sql(dialect: str) -> str:
    """A run's settled usage and an event of it (a step's end `age_s` ago, with its replica's
    stretch): tokens, GPU-seconds, age, span, idle, tenant, run id."""
    added = _active_added("e.t", "e.span", "e.idle", "run_steps.event_at_s")
    return (
        "UPDATE run_steps SET tokens = tokens + ?, gpu_seconds = gpu_seconds + ?,"
        f" active_s = active_s + {added}, event_at_s = {_latest('e.t', 'run_steps.event_at_s')}"
        f" FROM (SELECT {_DB_NOW[dialect]} - CAST(? AS DOUBLE PRECISION) AS t,"
        " CAST(? AS DOUBLE PRECISION) AS span, CAST(? AS DOUBLE PRECISION) AS idle) AS e"
        " WHERE run_steps.tenant = ? AND run_steps.run_id = ?"
    )


_ADD_RUN_USAGE = {dialect: _add_run_usage_sql(dialect) for dialect in _DB_NOW}


@dataclass(frozen=True, slots=True)
class RunUsageRow:
    """What a replica settled of a run since its last sweep, for the shared counters: tokens,
    GPU-seconds, and the run's latest event here (a step's end `age_s` before the statement,
    this replica's stretch then `span_s`, its idle timeout `idle_s`), for its active time."""

    tenant: str
    run_id: str
    tokens: int
    gpu_seconds: float
    age_s: float = 0.0
    span_s: float = 0.0
    idle_s: float = math.inf

    def params(self) -> tuple[object, ...]:
        return (
            self.tokens,
            self.gpu_seconds,
            max(0.0, self.age_s),
            self.span_s,
            _finite(self.idle_s),
            self.tenant,
            self.run_id,
        )


@dataclass(frozen=True, slots=True)
class NextStep:
    """A run's step number from the store, and its home then: the instance its latest
    answered step (number `home_step`) went to, with that step's prompt + completion tokens;
    `home` None: no step of it answered yet (or none recorded)."""

    step: int
    home: str | None = None
    home_step: int | None = None
    context_tokens: int = 0
    # the run's settled usage as the replicas' sweeps added it (each up to one sweep late)
    tokens: int = 0
    gpu_seconds: float = 0.0
    stop_code: str | None = None  # a guard stopped the run on some replica
    # its active seconds across replicas, this step's arrival counted (`max_duration_s`)
    active_s: float = 0.0
    # a session's step (`SESSION_STEP_SQL`): the run its task anchor maps to in the store
    run: int | None = None
    # not numbered: another replica's lease holds the run (`LEASE_STEP_SQL`: no row)
    held_elsewhere: bool = False

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> NextStep:
        """From `NEXT_STEP_SQL`'s row (or `SESSION_STEP_SQL`'s: the same and the run)."""
        after, home, home_step, context, tokens, gpu_seconds, stop_code, active, *run = row
        return cls(
            int(after) - 1,
            None if home is None else str(home),
            None if home_step is None else int(home_step),
            int(context or 0),
            int(tokens or 0),
            float(gpu_seconds or 0.0),
            None if stop_code is None else str(stop_code),
            float(active or 0.0),
            int(run[0]) if run and run[0] is not None else None,
        )


HELD_ELSEWHERE = NextStep(-1, held_elsewhere=True)


def leasable(run_id: str) -> bool:
    """Whether a run may be held under a lease: not one shaped as a session's run
    (`<session>:<n>`, numbered by `gpupool_session_step`, which knows no lease; an explicit
    run id of that shape is numbered as without leases)."""
    _, colon, number = run_id.rpartition(":")
    return not (colon and number.isdigit())


@dataclass(frozen=True, slots=True)
class HeldRun:
    """A run this replica holds, as its sweep writes it (`write_held`): the next step number
    (its count), and whether it lets the run go (`release`) or renews its lease for
    `lease_s`."""

    tenant: str
    run_id: str
    next_step: int
    release: bool = False
    # the run's latest step answered here since the last write: (instance, step, its prompt
    # + completion tokens), for its home on any replica (None: none)
    home: tuple[str, int, int] | None = None

    def params(self, holder: str, lease_s: float) -> tuple[object, ...]:
        r = self.release
        home, step, context = (None, None, None) if self.home is None else self.home
        homes = (step, step, home, step, step, step, step, step, context)
        return (self.next_step, *homes, r, r, lease_s, r, self.tenant, self.run_id, holder)


Slices = list[tuple[float, float]]  # (unix start, GPU-seconds), oldest first

# the level refilled to `now` (parameters: now, now), never above capacity, never backwards
_REFILLED = (
    "(CASE WHEN level + (CASE WHEN ? > updated_at_s THEN ? - updated_at_s ELSE 0 END)"
    " * rate_per_s > capacity THEN capacity"
    " ELSE level + (CASE WHEN ? > updated_at_s THEN ? - updated_at_s ELSE 0 END) * rate_per_s"
    " END)"
)
_CREATE = (
    "INSERT INTO budget_buckets (tenant, bucket, level, capacity, rate_per_s, updated_at_s)"
    " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, bucket) DO UPDATE SET"
    " capacity = excluded.capacity, rate_per_s = excluded.rate_per_s"
)
_RESERVE = (
    f"UPDATE budget_buckets SET level = {_REFILLED} - ?,"
    " updated_at_s = CASE WHEN ? > updated_at_s THEN ? ELSE updated_at_s END"
    f" WHERE tenant = ? AND bucket = ? AND ({_REFILLED} >= ? OR ({_REFILLED} >= capacity"
    " AND ? > capacity))"
)
_SETTLE = (
    "UPDATE budget_buckets SET level = CASE WHEN level + ? > capacity THEN capacity"
    " ELSE level + ? END WHERE tenant = ? AND bucket = ?"
)
# a top-up's upsert, which also marks its tenant active (a lender is idle when no mark is
# recent: migration 12)
_CREATE_ACTIVE = (
    "INSERT INTO budget_buckets (tenant, bucket, level, capacity, rate_per_s, updated_at_s,"
    " active_at_s) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, bucket) DO UPDATE SET"
    " capacity = excluded.capacity, rate_per_s = excluded.rate_per_s,"
    " active_at_s = CASE WHEN budget_buckets.active_at_s IS NULL"
    " OR budget_buckets.active_at_s < excluded.active_at_s THEN excluded.active_at_s"
    " ELSE budget_buckets.active_at_s END"
)
# the sweep's: a lease given back (0: none) and, when the time is not NULL, the tenant marked
# active then
_SETTLE_AND_MARK = (
    "UPDATE budget_buckets SET level = CASE WHEN level + ? > capacity THEN capacity"
    " ELSE level + ? END, active_at_s = CASE WHEN CAST(? AS DOUBLE PRECISION)"
    " > COALESCE(active_at_s, -1) THEN CAST(? AS DOUBLE PRECISION) ELSE active_at_s END"
    " WHERE tenant = ? AND bucket = ?"
)
_SLOT_BUCKET = "__slots__"  # the row locked while a tenant's slots are counted


_LEVELS_PER_READ = 200  # tenants whose levels one statement reads (`levels`)


def refilled(level: float, at_s: float, capacity: float, rate_per_s: float, now_s: float) -> float:
    """A stored bucket's level at `now_s`: refilled since `at_s`, never above `capacity`, never
    backwards (a clock behind the row's)."""
    level = float(level)
    if now_s > at_s:
        level = min(float(capacity), level + (now_s - float(at_s)) * float(rate_per_s))
    return level


@dataclass(frozen=True, slots=True)
class Loan:
    """A borrow's answer: `short` tokens from `lender`'s bucket (and out of the borrower's
    allowance), `own` from the borrower's own shared bucket, `from_lease` from the replica's
    lease (the caller's, subtracted by it); together the request's need."""

    lender: str
    short: float
    own: float
    from_lease: float


@dataclass(frozen=True, slots=True)
class SharedLevel:
    """A shared bucket's level as a replica learned it: `level` at unix `at_s` (refilled to
    then), with the bucket's `capacity` and `rate_per_s` to refill it further."""

    level: float
    at_s: float
    capacity: float
    rate_per_s: float

    def at(self, now_s: float) -> float:
        return refilled(self.level, self.at_s, self.capacity, self.rate_per_s, now_s)


def _quoted(name: str) -> str:
    """`name` as an element of a PostgreSQL array literal."""
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _pg_array(elements: list[str]) -> str:
    """A PostgreSQL array literal of `elements` (formatted: `_quoted` names, `repr` floats),
    sent as one text parameter: psycopg's list adaptation took ~7 ms for a borrow's three
    lists of 1,000 tenants (s48), the literal ~0.1 ms."""
    return "{" + ",".join(elements) + "}"


class SharedBudgets:
    """Sync, thread-safe (each call takes its own connection); call it off the event loop."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def reserve(
        self,
        tenant: str,
        bucket: str,
        amount: float,
        now_s: float,
        *,
        capacity: float,
        rate_per_s: float,
    ) -> bool:
        with self.store.connection() as conn, conn.transaction():
            conn.execute(_CREATE, (tenant, bucket, capacity, capacity, rate_per_s, now_s))
            now4 = (now_s,) * 4
            cur = conn.execute(
                _RESERVE,
                (*now4, amount, now_s, now_s, tenant, bucket, *now4, amount, *now4, amount),
            )
            return cur.rowcount == 1

    def reserve_up_to(
        self,
        tenant: str,
        bucket: str,
        least: float,
        most: float,
        now_s: float,
        *,
        capacity: float,
        rate_per_s: float,
    ) -> tuple[float, float]:
        """Take at least `least` (by `reserve`'s rule) and up to `most` when the bucket holds
        it. Returns (taken, level after): taken 0.0 when refused (the level then says how
        far it is from `least`)."""
        with self.store.connection() as conn, conn.transaction():
            # the upsert locks the row (and marks the tenant active): the read and the write
            # below are one step
            conn.execute(
                _CREATE_ACTIVE, (tenant, bucket, capacity, capacity, rate_per_s, now_s, now_s)
            )
            level, at_s, cap, rate = conn.execute(
                "SELECT level, updated_at_s, capacity, rate_per_s FROM budget_buckets"
                " WHERE tenant = ? AND bucket = ?",
                (tenant, bucket),
            ).fetchone()
            level, cap = refilled(level, at_s, cap, rate, now_s), float(cap)
            if least > cap:
                taken = least if level >= cap else 0.0
            else:
                taken = min(max(most, least), level) if level >= least else 0.0
            if taken > 0.0:
                level -= taken
                conn.execute(
                    "UPDATE budget_buckets SET level = ?, updated_at_s = ? WHERE tenant = ?"
                    " AND bucket = ?",
                    (level, max(now_s, float(at_s)), tenant, bucket),
                )
            return taken, level

    def settle_many(
        self,
        amounts: Sequence[tuple[str, str, float]],
        active: Sequence[str] = (),
        now_s: float | None = None,
    ) -> None:
        """`settle` of many (tenant, bucket, given back: negative takes) in one transaction;
        the `active` tenants' `tokens` rows marked active at `now_s` besides (a replica's
        demand, for borrowing). Rows are written in (tenant, bucket) order, so two replicas'
        sweeps never wait for each other's rows in opposite orders."""
        rows: dict[tuple[str, str], list[Any]] = {}
        for t, b, a in amounts:
            rows.setdefault((t, b), [0.0, None])[0] += a
        if now_s is not None:
            for t in active:
                rows.setdefault((t, "tokens"), [0.0, None])[1] = now_s
        if not rows:
            return
        with self.store.connection() as conn, conn.transaction():
            conn.executemany(
                _SETTLE_AND_MARK,
                [(a, a, at, at, t, b) for (t, b), (a, at) in sorted(rows.items())],
            )

    def borrow(
        self, tenant: str, need: float, lease: float, now_s: float, terms: Terms
    ) -> Loan | None:
        """`need` tokens for `tenant` whose lease holds `lease`: its own shared bucket gives
        what it holds (a debt in it or in the lease is paid off by the loan, as on one
        router) and the shortfall is borrowed from the idle lender (among
        `terms.lenders`) with the most to lend above its reserve, out of the borrower's
        allowance, all or nothing (router/governance/borrowing.py's rules). A lender is idle
        when no replica marked it active in the last `terms.idle_after_s`. None: nothing
        short, the allowance cannot hold it or no lender can. One statement on PostgreSQL;
        SQLite, one transaction."""
        lenders = [(n, float(c), float(r)) for n, c, r in terms.lenders if n != tenant]
        from_lease = min(lease, need)  # negative: the lease's debt, paid off by the loan
        own_bucket = (tenant, "tokens", terms.capacity, terms.capacity, terms.rate_per_s, now_s)
        if self.store.dialect == "postgresql":
            with self.store.connection() as conn:
                row = conn.execute(
                    BORROW_SQL,
                    (
                        *(tenant, need, lease, now_s, terms.capacity, terms.rate_per_s),
                        *(terms.allowance_capacity, terms.allowance_rate_per_s),
                        _pg_array([_quoted(n) for n, _, _ in lenders]),
                        _pg_array([repr(c) for _, c, _ in lenders]),
                        _pg_array([repr(r) for _, _, r in lenders]),
                        now_s - terms.idle_after_s,
                        terms.reserve_frac,
                    ),
                ).fetchone()
            if row is None:
                return None
            return Loan(str(row[0]), float(row[1]), float(row[2]), from_lease)
        with self.store.connection() as conn, conn.transaction():
            cap, rate = terms.allowance_capacity, terms.allowance_rate_per_s
            conn.execute(_CREATE_ACTIVE, (tenant, "allowance", cap, cap, rate, now_s, None))
            conn.execute(_CREATE_ACTIVE, (*own_bucket, now_s))
            allow_level, own_level = (
                self._refilled_in(conn, tenant, bucket, now_s) for bucket in ("allowance", "tokens")
            )
            parts = split(need, lease, own_level, allow_level, cap)
            if parts is None:
                return None
            views, missing = [], {}
            for name, capacity, rate_per_s in sorted(lenders):  # ties: the first name, as in SQL
                row = conn.execute(
                    "SELECT level, updated_at_s, capacity, rate_per_s, active_at_s"
                    " FROM budget_buckets WHERE tenant = ? AND bucket = 'tokens'",
                    (name,),
                ).fetchone()
                if row is None:  # never used: full (and idle), its row made only if it lends
                    missing[name] = (name, capacity, capacity, rate_per_s, now_s)
                    views.append(LenderView(name, capacity, capacity, True))
                    continue
                level, at_s, capacity, rate_per_s, active_at_s = row
                views.append(
                    LenderView(
                        name,
                        refilled(level, at_s, capacity, rate_per_s, now_s),
                        float(capacity),
                        idle(active_at_s, now_s, terms.idle_after_s),
                    )
                )
            lender = pick_lender(parts.short, views, terms.reserve_frac)
            if lender is None:
                return None
            if lender in missing:
                conn.execute(
                    "INSERT INTO budget_buckets (tenant, bucket, level, capacity, rate_per_s,"
                    " updated_at_s) VALUES (?, 'tokens', ?, ?, ?, ?)",
                    missing[lender],
                )
            for name, bucket, amount in (
                (lender, "tokens", parts.short),
                (tenant, "tokens", parts.own),
                (tenant, "allowance", parts.short),
            ):
                level = self._refilled_in(conn, name, bucket, now_s)
                conn.execute(
                    "UPDATE budget_buckets SET level = ?, updated_at_s = CASE WHEN"
                    " updated_at_s > ? THEN updated_at_s ELSE ? END"
                    " WHERE tenant = ? AND bucket = ?",
                    (level - amount, now_s, now_s, name, bucket),
                )
            return Loan(lender, parts.short, parts.own, from_lease)

    @staticmethod
    def _refilled_in(conn: Conn, tenant: str, bucket: str, now_s: float) -> float:
        level, at_s, cap, rate = conn.execute(
            "SELECT level, updated_at_s, capacity, rate_per_s FROM budget_buckets"
            " WHERE tenant = ? AND bucket = ?",
            (tenant, bucket),
        ).fetchone()
        return refilled(level, at_s, cap, rate, now_s)

    def active_at(self, tenant: str) -> float | None:
        """When a replica last marked the tenant active (None: never; tests, tools)."""
        with self.store.connection() as conn:
            row = conn.execute(
                "SELECT active_at_s FROM budget_buckets WHERE tenant = ? AND bucket = 'tokens'",
                (tenant,),
            ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def settle(self, tenant: str, bucket: str, reserved: float, used: float) -> None:
        back = reserved - used
        with self.store.connection() as conn:
            conn.execute(_SETTLE, (back, back, tenant, bucket))

    def level(self, tenant: str, bucket: str) -> float | None:
        """The stored level (as of its last change; None: never used)."""
        with self.store.connection() as conn:
            row = conn.execute(
                "SELECT level FROM budget_buckets WHERE tenant = ? AND bucket = ?",
                (tenant, bucket),
            ).fetchone()
        return None if row is None else float(row[0])

    def levels(self, tenants: Sequence[str], now_s: float) -> dict[tuple[str, str], SharedLevel]:
        """The `tenants`' `tokens` and `requests` buckets' levels refilled to `now_s`, one read
        per `_LEVELS_PER_READ` tenants; a bucket never used has no row (it starts full)."""
        out: dict[tuple[str, str], SharedLevel] = {}
        names = sorted(set(tenants))
        with self.store.connection() as conn:
            for i in range(0, len(names), _LEVELS_PER_READ):
                part = names[i : i + _LEVELS_PER_READ]
                rows = conn.execute(
                    "SELECT tenant, bucket, level, updated_at_s, capacity, rate_per_s"
                    " FROM budget_buckets WHERE bucket IN ('tokens', 'requests')"
                    f" AND tenant IN ({', '.join('?' * len(part))})",
                    part,
                ).fetchall()
                for t, b, level, at_s, cap, rate in rows:
                    refill = refilled(level, at_s, cap, rate, now_s)
                    out[(str(t), str(b))] = SharedLevel(refill, now_s, float(cap), float(rate))
        return out

    def acquire_slot(
        self,
        tenant: str,
        holder: str,
        limit: int,
        now_s: float,
        *,
        lease_s: float,
        unit: str | None = None,
    ) -> bool:
        """`unit`: what the slot counts (None: the holder). Holders of one unit (a run's
        steps on several replicas) take one of the `limit` slots together."""
        unit = holder if unit is None else unit
        if self.store.dialect == "postgresql":  # one call, one round trip (ACQUIRE_SLOT)
            with self.store.connection() as conn:
                (got,) = conn.execute(
                    ACQUIRE_SLOT_SQL, (tenant, holder, unit, limit, now_s, now_s + lease_s)
                ).fetchone()
            return bool(got)
        with self.store.connection() as conn, conn.transaction():
            # the upsert locks the tenant's slot row: its acquisitions are counted in turn
            conn.execute(_CREATE, (tenant, _SLOT_BUCKET, 0.0, 0.0, 0.0, now_s))
            conn.execute(
                "DELETE FROM concurrency_slots WHERE tenant = ? AND expires_at_s <= ?",
                (tenant, now_s),
            )
            (held,) = conn.execute(
                "SELECT COUNT(DISTINCT COALESCE(unit, holder)) FROM concurrency_slots"
                " WHERE tenant = ? AND holder <> ? AND COALESCE(unit, holder) <> ?",
                (tenant, holder, unit),
            ).fetchone()
            if int(held) >= limit:
                return False
            conn.execute(
                "INSERT INTO concurrency_slots (tenant, holder, expires_at_s, unit)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (tenant, holder) DO UPDATE"
                " SET expires_at_s = excluded.expires_at_s, unit = excluded.unit",
                (tenant, holder, now_s + lease_s, unit),
            )
            return True

    def release_slot(self, tenant: str, holder: str) -> None:
        with self.store.connection() as conn:
            conn.execute(RELEASE_SLOT_SQL, (tenant, holder))

    def renew_slots(self, holder_prefix: str, now_s: float, lease_s: float) -> int:
        """Extend the leases of every slot whose holder starts with `holder_prefix` (one
        replica's, e.g. `"<replica id>:"`). Returns how many."""
        with self.store.connection() as conn:
            cur = conn.execute(
                "UPDATE concurrency_slots SET expires_at_s = ? WHERE substr(holder, 1, ?) = ?",
                (now_s + lease_s, len(holder_prefix), holder_prefix),
            )
            return int(cur.rowcount)

    def release_slots(self, holder_prefix: str) -> None:
        """Give back every slot whose holder starts with `holder_prefix` (a replica leaving)."""
        with self.store.connection() as conn:
            conn.execute(
                "DELETE FROM concurrency_slots WHERE substr(holder, 1, ?) = ?",
                (len(holder_prefix), holder_prefix),
            )

    def publish_windows(
        self, replica: str, now_s: float, windows: Sequence[tuple[str, Slices, Slices]]
    ) -> dict[str, tuple[Slices, Slices]]:
        """Replace this replica's (tenant, hour slices, day slices) rows and return the other
        replicas' slices per tenant (hour, day), summed per slice start. Rows not written
        for a day are deleted."""
        with self.store.connection() as conn:
            with conn.transaction():
                conn.executemany(
                    upsert(
                        "cost_windows",
                        ("tenant", "replica"),
                        ("saved_at_s", "hour_slices", "day_slices"),
                    ),
                    [
                        (t, replica, now_s, json.dumps(hour), json.dumps(day))
                        for t, hour, day in windows
                    ],
                )
                conn.execute("DELETE FROM cost_windows WHERE saved_at_s < ?", (now_s - 86_400,))
            rows = conn.execute(
                "SELECT tenant, hour_slices, day_slices FROM cost_windows WHERE replica <> ?",
                (replica,),
            ).fetchall()
        merged: dict[str, tuple[dict[float, float], dict[float, float]]] = {}
        for tenant, hour, day in rows:
            into = merged.setdefault(str(tenant), ({}, {}))
            for slices, sums in ((hour, into[0]), (day, into[1])):
                for start, amount in json.loads(slices):
                    sums[float(start)] = sums.get(float(start), 0.0) + float(amount)
        return {t: (sorted(h.items()), sorted(d.items())) for t, (h, d) in merged.items()}

    def next_step(
        self, tenant: str, run_id: str, now_s: float, stretch: Stretch = NO_STRETCH
    ) -> NextStep:
        """The run's next step number: 0 for its first, then 1, 2, ..., with its home as
        recorded by `record_home` on any replica (one statement), and its active seconds
        with this step's arrival counted (`stretch`: the replica's, see `_active_added`)."""
        sql = NEXT_STEP_SQL if self.store.dialect == "postgresql" else _NEXT_STEP_SQLITE
        with self.store.connection() as conn:
            row = conn.execute(sql, (tenant, run_id, now_s, *stretch.params())).fetchone()
        return NextStep.from_row(row)

    def lease_step(
        self,
        tenant: str,
        run_id: str,
        now_s: float,
        holder: str | None,
        lease_s: float | None,
        stretch: Stretch = NO_STRETCH,
    ) -> NextStep:
        """`next_step` under leases (PostgreSQL): numbered only when no live lease holds the
        run (`HELD_ELSEWHERE` otherwise), and then held by `holder` for `lease_s` (None:
        by nobody)."""
        span_s, idle_s = stretch.params()
        params = (tenant, run_id, now_s, span_s, holder, lease_s, idle_s)
        with self.store.connection() as conn:
            row = conn.execute(LEASE_STEP_SQL, params).fetchone()
        return HELD_ELSEWHERE if row is None else NextStep.from_row(row)

    def write_held(
        self, holder: str, lease_s: float, runs: Sequence[HeldRun]
    ) -> list[tuple[str | None, bool] | None]:
        """The holder's sweep (one transaction): each held run's count written and its lease
        renewed or released. Per run: (its stop code, another replica wants it), or None
        when the lease was lost (it expired and another replica took the run)."""
        answers: list[tuple[str | None, bool] | None] = []
        if not runs:
            return answers
        with self.store.connection() as conn, conn.transaction():
            for run in runs:
                row = conn.execute(WRITE_HELD_SQL, run.params(holder, lease_s)).fetchone()
                answers.append(None if row is None else (row[0], bool(row[1])))
        return answers

    def want_held(self, tenant: str, run_id: str) -> None:
        """Ask the run's holder to hand it over at its next sweep."""
        with self.store.connection() as conn:
            conn.execute(WANT_HELD_SQL, (tenant, run_id))

    def session_step(
        self,
        tenant: str,
        step: SessionStep,
        now_s: float,
        *,
        max_anchors: int,
        stretch: Stretch = NO_STRETCH,
    ) -> NextStep:
        """A session's step: its anchor mapped to the session's run (a new anchor gets the
        session's next number, once, whoever asks at the same time) and the step numbered in
        `step.run` when given, else in that run; `NextStep.run` is the run the anchor maps to.
        One statement on PostgreSQL; on SQLite the same steps in one transaction."""
        if self.store.dialect == "postgresql":
            with self.store.connection() as conn:
                row = conn.execute(
                    SESSION_STEP_SQL, step.params(tenant, now_s, max_anchors, stretch)
                ).fetchone()
            return NextStep.from_row(row)
        key = (tenant, step.session_id)
        with self.store.connection() as conn, conn.transaction():
            conn.execute(
                "INSERT INTO session_runs (tenant, session_id, last_run, current_run,"
                " updated_at_s) VALUES (?, ?, 0, 0, ?) ON CONFLICT (tenant, session_id)"
                " DO UPDATE SET updated_at_s = excluded.updated_at_s",
                (*key, now_s),
            )
            last, current = conn.execute(
                "SELECT last_run, current_run FROM session_runs"
                " WHERE tenant = ? AND session_id = ?",
                key,
            ).fetchone()
            run: int | None = int(current) or None
            if step.anchor is not None:
                found = conn.execute(
                    "SELECT run FROM session_anchors WHERE tenant = ? AND session_id = ?"
                    " AND anchor = ?",
                    (*key, step.anchor),
                ).fetchone()
                run = None if found is None else int(found[0])
            if run is None:
                given = step.run is not None and step.run > int(last)
                run = step.run if given and step.run is not None else max(last, step.floor) + 1
                if step.anchor is not None:
                    conn.execute(
                        "DELETE FROM session_anchors WHERE tenant = ? AND session_id = ?"
                        " AND anchor IN (SELECT anchor FROM session_anchors WHERE tenant = ?"
                        " AND session_id = ? AND anchor <> ? ORDER BY seen_at_s DESC, anchor"
                        " LIMIT -1 OFFSET ?)",
                        (*key, *key, step.anchor, max_anchors - 1),
                    )
            conn.execute(
                "UPDATE session_runs SET last_run = MAX(last_run, ?), current_run = ?"
                " WHERE tenant = ? AND session_id = ?",
                (run, run, *key),
            )
            if step.anchor is not None:
                conn.execute(
                    upsert(
                        "session_anchors", ("tenant", "session_id", "anchor"), ("run", "seen_at_s")
                    ),
                    (*key, step.anchor, run, now_s),
                )
            number = run if step.run is None else step.run
            row = conn.execute(
                _NEXT_STEP_SQLITE,
                (tenant, f"{step.session_id}:{number}", now_s, *stretch.params()),
            ).fetchone()
        return NextStep.from_row((*row, run))

    def forget_session_run(self, tenant: str, session_id: str, run: int) -> None:
        """The session's run `run` ended: its anchors are forgotten (its task's next step
        starts a new run), and it is no longer the session's current run."""
        with self.store.connection() as conn, conn.transaction():
            conn.execute(FORGET_ANCHORS_SQL, (tenant, session_id, run))
            conn.execute(FORGET_CURRENT_SQL, (tenant, session_id, run))

    def adopt_session_runs(
        self, runs: Sequence[tuple[str, str, int, Sequence[tuple[str, int]]]], now_s: float
    ) -> None:
        """What a replica numbered on its own during an outage, (tenant, session, the highest
        run number it gave, (anchor, run) of the tasks it numbered), in one transaction: the
        session's highest number rises to it (the store numbers new runs past it), and each
        anchor the store does not map yet maps to the replica's run."""
        if not runs:
            return
        with self.store.connection() as conn, conn.transaction():
            conn.executemany(
                "INSERT INTO session_runs (tenant, session_id, last_run, current_run,"
                " updated_at_s) VALUES (?, ?, ?, 0, ?) ON CONFLICT (tenant, session_id) DO UPDATE"
                " SET last_run = CASE WHEN session_runs.last_run > excluded.last_run"
                " THEN session_runs.last_run ELSE excluded.last_run END,"
                " updated_at_s = excluded.updated_at_s",
                [(t, s, floor, now_s) for t, s, floor, _ in runs],
            )
            conn.executemany(
                "INSERT INTO session_anchors (tenant, session_id, anchor, run, seen_at_s)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, session_id, anchor) DO NOTHING",
                [(t, s, a, n, now_s) for t, s, _, anchors in runs for a, n in anchors],
            )

    def session_anchors(self, tenant: str, session_id: str) -> dict[str, int]:
        """The session's anchors and their runs (what the store keeps; tests, tools)."""
        with self.store.connection() as conn:
            rows = conn.execute(
                "SELECT anchor, run FROM session_anchors WHERE tenant = ? AND session_id = ?",
                (tenant, session_id),
            ).fetchall()
        return {str(a): int(r) for a, r in rows}

    def add_run_usage(self, usage: Sequence[RunUsageRow]) -> None:
        """Add each run's tokens and GPU-seconds to its shared counters and its event to its
        active time, in one transaction, in order (a run without a row, never numbered, is
        skipped)."""
        if not usage:
            return
        with self.store.connection() as conn, conn.transaction():
            conn.executemany(_ADD_RUN_USAGE[self.store.dialect], [u.params() for u in usage])

    def active_s(self, tenant: str, run_id: str) -> float | None:
        """The run's active seconds across replicas as stored (None: no row; tests, tools)."""
        with self.store.connection() as conn:
            row = conn.execute(
                "SELECT active_s FROM run_steps WHERE tenant = ? AND run_id = ?", (tenant, run_id)
            ).fetchone()
        return None if row is None else float(row[0])

    def mark_run(self, tenant: str, run_id: str, stop_code: str | None) -> None:
        """A guard stopped the run (`stop_code`), or None: it ended and its id starts afresh
        (its counters and stop are cleared; its step numbers go on)."""
        with self.store.connection() as conn:
            if stop_code is None:
                conn.execute(
                    "UPDATE run_steps SET tokens = 0, gpu_seconds = 0, stop_code = NULL,"
                    " active_s = 0, event_at_s = NULL WHERE tenant = ? AND run_id = ?",
                    (tenant, run_id),
                )
            else:
                conn.execute(
                    "UPDATE run_steps SET stop_code = ? WHERE tenant = ? AND run_id = ?",
                    (stop_code, tenant, run_id),
                )

    def record_home(
        self, tenant: str, run_id: str, home: str, step: int, context_tokens: int
    ) -> bool:
        """Step `step` of the run was answered by `home`: its home, unless a later step's
        home is recorded already (replicas may record out of order). True: recorded."""
        with self.store.connection() as conn:
            return (
                conn.execute(
                    RECORD_HOME_SQL, (home, step, context_tokens, tenant, run_id, step)
                ).rowcount
                == 1
            )
