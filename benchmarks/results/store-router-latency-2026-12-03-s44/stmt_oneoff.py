"""s44 one-off: the ledger's INSERT for a plain and a run's record, and the step-numbered
INSERT, on the loop's connection (tests' server, unix socket), 1 ms idle before each,
the kinds alternating; medians per round, microseconds."""
import asyncio, statistics, time, uuid, sys
from tests.postgres import start_postgres, PASSWORD
from router.store import PostgresStore, migrate
from router.store.loop_connection import LoopConnection
from router.accounting import ledger as L
from router.governance import store as G
from router.governance.shared import NEXT_STEP_SQL

def row(run):
    rid = uuid.uuid4().hex
    now = time.time()
    rec = L.RequestRecord(request_id=rid, run_id=run, step_index=None, tenant="plain", class_name="normal",
        pool="normal", instance="engine-0", model="tiny", started_at_s=now, ended_at_s=now,
        queue_s=0.0, ttft_s=None, tpot_s=None, prompt_tokens=5, completion_tokens=8,
        gpu_seconds=0.001, outcome="ok", status_code=200)
    return (*L._record_fields(rec),)

async def main(rounds=5, n=300):
    with start_postgres() as server:
        url = server.create_database("s44_oneoff")
        store = PostgresStore(url, password=PASSWORD); store.open()
        migrate(store, L.MIGRATIONS); migrate(store, G.MIGRATIONS)
        conn = LoopConnection(store, "oneoff", timeout_s=5); await conn.open()
        plain_sql = L._insert_rows_sql(1)
        num_sql = L._numbered_insert_sql(NEXT_STEP_SQL)
        kinds = {
            "plain INSERT": lambda k: (plain_sql, (*row(None), None)),
            "run INSERT (step given)": lambda k: (plain_sql, (*row(f"r-{k//10}"), k % 10)),
            "step upsert alone": lambda k: (NEXT_STEP_SQL, ("plain", f"s-{k//10}", time.time())),
            "run INSERT numbered by the step upsert": lambda k: (num_sql, ("plain", f"n-{k//10}", time.time(), *row(f"n-{k//10}"))),
        }
        res = {k: [] for k in kinds}
        for r in range(rounds + 1):
            took = {k: [] for k in kinds}
            for i in range(n):
                for name, make in kinds.items():
                    sql, params = make(r * n + i)
                    await asyncio.sleep(0.001)
                    t = time.perf_counter()
                    await conn.execute(sql, params)
                    took[name].append((time.perf_counter() - t) * 1e6)
            if r:  # the first round warms up
                for k in kinds:
                    res[k].append(statistics.median(took[k]))
        for k, v in res.items():
            print(f"{k:42s} " + " ".join(f"{x:5.0f}" for x in v))
        await conn.aclose(); store.close()

asyncio.run(main())
