import asyncio, os, statistics, time
from tests.postgres import start_postgres, PASSWORD
from tests.unit.test_governance_replicas import PASSWORD_ENV, T0, Clock, enter, replica, shared_config, tenant_of

async def main(server):
    url = server.create_database("measure")
    config = shared_config(url)
    wall = Clock(T0)
    async with replica(config, url, wall, "a") as a:
        await enter(a, "t")
        t = tenant_of(a, "t").tenant
        for name, fn in (("budget_now (read)", lambda: a.budget_now(t)), ):
            rounds = []
            for r in range(3):
                xs = []
                for _ in range(300):
                    s = time.perf_counter(); await fn(); xs.append((time.perf_counter() - s) * 1e3)
                xs.sort(); rounds.append((xs[150], xs[285]))
            print(name, ["p50 %.3f p95 %.3f" % x for x in rounds])
        rounds = []
        for r in range(3):
            xs = []
            for _ in range(3000):
                s = time.perf_counter(); a.budget(t); xs.append((time.perf_counter() - s) * 1e3)
            xs.sort(); rounds.append((xs[1500], xs[2850]))
        print("budget (learned, no read)", ["p50 %.4f p95 %.4f" % x for x in rounds])
        rounds = []
        for r in range(3):
            xs = []
            for _ in range(3000):
                s = time.perf_counter(); a.rate_headers("t"); xs.append((time.perf_counter() - s) * 1e6)
            xs.sort(); rounds.append((xs[1500], xs[2850]))
        print("rate_headers us", ["p50 %.1f p95 %.1f" % x for x in rounds])

os.environ[PASSWORD_ENV] = PASSWORD
with start_postgres() as server:
    asyncio.run(main(server))
