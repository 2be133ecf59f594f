"""Whether a valid configuration's numbers fit together (`gpupool check-config`).

`contract_problems` lists what does not fit (shares that cannot sum to 1, a class whose queue
wait and expected execution exceed its timeout, limits the engines cannot honour);
`not_yet_in_effect` lists settings that are valid but steer nothing in this config. Both
are pure functions of a `Config`; loading refuses only what `schema.py` declares invalid.
"""

from __future__ import annotations

from pools.config.schema import AdmissionConfig, Config, TenantConfig
from pools.rebalance import bounds_at

__all__ = ["contract_problems", "not_yet_in_effect"]


def not_yet_in_effect(config: Config) -> list[str]:
    """Settings that are validated but do not steer anything in this config (printed by
    check-config): with `rebalancer.enabled: false` the ratio moves only when an SRE moves it
    (`gpupool pools move` / `pin`), so the bounds bind only those moves."""
    notes = []
    if not config.rebalancer.enabled:
        bounded = [
            p.name
            for p in config.pools
            if p.share.floor_frac > 0 or p.share.ceiling_frac < 1 or p.share.schedule
        ]
        if bounded:
            notes.append(
                f"pools {', '.join(bounded)}: share bounds and schedules bind only SRE moves:"
                " rebalancer.enabled is false, so the ratio does not follow demand"
            )
    if config.rebalancer.borrow_max_frac > 0 and config.router.admission == "off":
        notes.append(
            "rebalancer.borrow_max_frac: no borrowing with router.admission off (every request"
            " goes to its own pool's instances at once)"
        )
    return notes


def _admission_problems(config: Config) -> list[str]:
    """The `admission` section steers nothing with `router.admission: off`."""
    given = config.admission
    if config.router.admission == "on" or given == AdmissionConfig():
        return []
    return [
        "admission: reserve forecast and prefill_hold_min_tokens steer admission, which"
        " router.admission: off turns off (every request goes at once): remove them or turn"
        " admission on"
    ]


def _rebalancer_problems(config: Config) -> list[str]:
    """Schedules keep floors summing to at most 1 and ceilings to at least 1 at every minute
    of the day; pinned instances exist (static and local launchers name them engine-N)."""
    problems: list[str] = []
    eps = 1e-6
    edges = sorted({0} | {w.start_min for p in config.pools for w in p.share.schedule})
    edges += sorted({w.end_min for p in config.pools for w in p.share.schedule})
    for minute in sorted(set(edges)):
        at = {p.name: bounds_at(p.share.bounds, p.share.schedule, minute) for p in config.pools}
        floors = sum(b.floor_frac for b in at.values())
        ceilings = sum(b.ceiling_frac for b in at.values())
        if floors > 1 + eps or ceilings < 1 - eps:
            problems.append(
                f"pools: at {minute // 60:02d}:{minute % 60:02d} UTC the scheduled floors sum to"
                f" {floors:.3f} and ceilings to {ceilings:.3f} (floors must sum to at most 1,"
                " ceilings to at least 1)"
            )
            break
    if config.engines.launcher in ("local", "static"):
        known = {f"engine-{i}" for i in range(config.engines.instance_count)}
        for pool in config.pools:
            for instance_id in pool.pinned_instances:
                if instance_id not in known:
                    problems.append(
                        f"pools.{pool.name}.pinned_instances: no instance {instance_id!r} (the"
                        f" {config.engines.launcher} launcher names engine-0 to"
                        f" engine-{config.engines.instance_count - 1})"
                    )
    return problems


def _replica_problems(config: Config) -> list[str]:
    """Several router processes (`router.replicas`, `--replicas`) share their state through a
    PostgreSQL store, over engines every one of them knows at start."""
    replicas = config.router.replicas
    if replicas == 1:
        return []
    problems = []
    if config.store.url is None:
        problems.append(
            f"router.replicas: {replicas} router processes need a PostgreSQL store (store.url):"
            " the embedded SQLite store serves one process, and separate ones would each spend"
            " every tenant's whole budget and move the pool ratio on their own"
        )
    if config.engines.launcher in ("kubernetes", "ray"):
        problems.append(
            f"router.replicas: the {config.engines.launcher} launcher's engines come and go,"
            " followed by one router process; run one router per pod or machine instead (the"
            " Helm chart's router.replicas)"
        )
    return problems


def _metrics_port_problems(config: Config) -> list[str]:
    """`router.metrics_port` + i for router process i: within 1-65535, apart from
    `router.port` and from the local engines' ports (after `--port` / `--replicas`)."""
    rc = config.router
    if rc.metrics_port is None:
        return []
    first, last = rc.metrics_port, rc.metrics_port + rc.replicas - 1
    ports = str(first) if first == last else f"{first}-{last} (one per router process)"
    problems = []
    if last > 65535:
        problems.append(
            f"router.metrics_port: {rc.replicas} router processes would listen on {first}-{last},"
            f" past 65535: give at most {65536 - rc.replicas}"
        )
    if first <= rc.port <= last:
        problems.append(
            f"router.metrics_port: {ports} takes router.port {rc.port}: the client API and the"
            " metrics port need ports of their own"
        )
    local = config.engines.local
    if config.engines.launcher == "local" and local.count:
        engines_last = local.base_port + local.count - 1
        if first <= engines_last and local.base_port <= last:
            problems.append(
                f"router.metrics_port: {ports} overlaps the local engines' ports"
                f" {local.base_port}-{engines_last} (engines.local.base_port + i)"
            )
    return problems


def _governance_problems(config: Config, tenant: TenantConfig) -> list[str]:
    """A tenant's limits that do not fit together, or that the engines cannot honour."""
    problems = []
    if tenant.borrow_max_frac and tenant.tokens_per_minute is None:
        problems.append(
            f"tenants.{tenant.name}.borrow_max_frac: borrowing extends a token budget; set"
            " tokens_per_minute too (it is the base quota the fraction is of)"
        )
    tier = config.governance.tier(tenant.tier)
    engine_seqs = config.engines.max_num_seqs * config.engines.instance_count
    if tier is not None and engine_seqs and tier.max_concurrent_requests > engine_seqs:
        problems.append(
            f"tenants.{tenant.name}.tier: tier {tier.name!r} allows"
            f" {tier.max_concurrent_requests} requests in flight, more than the engines run at"
            f" once ({engine_seqs}: --max-num-seqs x instances)"
        )
    return problems


def contract_problems(config: Config) -> list[str]:
    """Checks the numbers fit together. Returns human-readable problems; empty means consistent.

    - pool floors sum to at most 1 and ceilings to at least 1, initial shares sum to 1;
    - for every class: its pool's max queue wait + expected execution (TTFT target plus the
      expected output tokens at the TPOT target) fits the class timeout;
    - each pool can hold at least one instance's worth of capacity (ceiling >= 1/instances)
      when there is more than one instance;
    - a tenant's `borrow_max_frac` has a `tokens_per_minute` to be a fraction of (with a
      shared store it borrows across the replicas: docs/replicas.md);
    - `router.replicas` above 1 has a PostgreSQL store and engines known at start (not the
      kubernetes or ray launchers);
    - `router.metrics_port` (+ i per router process) fits in 1-65535, apart from `router.port`
      and the local engines' ports;
    - the `admission` section is left at its defaults when `router.admission` is off;
    - a class's run guard `max_duration_s` is not shorter than one request of it may take
      (`timeout_s`); a tenant's tier allows no more requests in flight than the engines run.
    """
    problems: list[str] = []
    eps = 1e-6
    floors = sum(p.share.floor_frac for p in config.pools)
    ceilings = sum(p.share.ceiling_frac for p in config.pools)
    initial = sum(p.share.initial_frac for p in config.pools)
    if floors > 1 + eps:
        problems.append(f"pools: floor_frac values sum to {floors:.3f}, more than 1")
    if ceilings < 1 - eps:
        problems.append(f"pools: ceiling_frac values sum to {ceilings:.3f}, less than 1")
    if abs(initial - 1) > 0.02:
        problems.append(f"pools: initial_frac values sum to {initial:.3f}, must sum to 1")
    for pool in config.pools:
        for cls_name in pool.classes:
            cls = config.class_config(cls_name)
            exec_s = (
                pool.slo.ttft_p95_ms + cls.expected_output_tokens * pool.slo.tpot_p95_ms
            ) / 1e3
            need_s = pool.queue.max_wait_s + exec_s
            if need_s > cls.timeout_s + eps:
                problems.append(
                    f"classes.{cls_name}: queue wait {pool.queue.max_wait_s:g} s + expected "
                    f"execution {exec_s:.1f} s (ttft {pool.slo.ttft_p95_ms:g} ms + "
                    f"{cls.expected_output_tokens} tokens x {pool.slo.tpot_p95_ms:g} ms) = "
                    f"{need_s:.1f} s exceeds timeout_s {cls.timeout_s:g}"
                )
    n = config.engines.instance_count
    if n > 1:
        for pool in config.pools:
            if pool.share.ceiling_frac * n < 1 - eps:
                problems.append(
                    f"pools.{pool.name}.share.ceiling_frac: {pool.share.ceiling_frac:g} of {n}"
                    f" instances is less than one instance ({1 / n:.3f})"
                )
    for tenant in config.tenants:
        problems.extend(_governance_problems(config, tenant))
    for cls in config.classes:
        guard_s = cls.run_guards.max_duration_s
        if guard_s is not None and guard_s < cls.timeout_s:
            problems.append(
                f"classes.{cls.name}.run_guards.max_duration_s: {guard_s:g} s is shorter than"
                f" one request's timeout_s {cls.timeout_s:g}: a single step could outlive its"
                " run"
            )
    problems.extend(_rebalancer_problems(config))
    problems.extend(_admission_problems(config))
    problems.extend(_replica_problems(config))
    problems.extend(_metrics_port_problems(config))
    affinity = config.engines.local.cpu_affinity
    if config.engines.launcher == "local" and affinity is not None and len(affinity) != n:
        problems.append(
            f"engines.local.cpu_affinity: {len(affinity)} CPU lists for {n} engines"
            f" (engines.local.count); give one list per engine, e.g."
            f" {[[i] for i in range(n)]}"
        )
    return problems
