"""Prometheus metrics of tenant and run governance, on the router's registry.

Labels are bounded: tenant (from the config), reason / code (a fixed set); never a run id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["GovernanceMetrics", "TenantSeries"]


@dataclass(frozen=True, slots=True)
class TenantSeries:
    """One tenant's series of the gauges and counter every request updates, looked up once:
    `labels()` builds a key and takes a lock each time (~1.5 us; five per request)."""

    tokens_remaining: Any
    tokens_reserved: Any
    inflight: Any
    active_runs: Any
    tokens_settled: Any


_WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GovernanceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._tenants: dict[str, TenantSeries] = {}
        r = registry
        self.refusals = Counter(
            "gpupool_governance_refusals_total",
            "Requests refused by a tenant or run limit, by code (token_rate, request_rate,"
            " tenant_concurrency, cost_cap, run_steps, run_tokens, run_gpu_seconds,"
            " run_duration, run_loop)",
            ["tenant", "code"],
            registry=r,
        )
        self.waits = Counter(
            "gpupool_governance_waits_total",
            "Requests that waited for their tenant's bucket to refill, by reason"
            " (token_rate, request_rate)",
            ["tenant", "reason"],
            registry=r,
        )
        self.waiting = Gauge(
            "gpupool_governance_waiting",
            "Requests waiting now for their tenant's bucket, by reason",
            ["tenant", "reason"],
            registry=r,
        )
        self.wait_seconds = Histogram(
            "gpupool_governance_wait_seconds",
            "Time requests waited for their tenant's bucket (those that waited)",
            ["reason"],
            buckets=_WAIT_BUCKETS_S,
            registry=r,
        )
        self.tokens_remaining = Gauge(
            "gpupool_tenant_tokens_remaining",
            "Tokens left in the tenant's per-minute bucket",
            ["tenant"],
            registry=r,
        )
        self.tokens_reserved = Gauge(
            "gpupool_tenant_tokens_reserved",
            "Tokens reserved by the tenant's requests in flight, not yet settled",
            ["tenant"],
            registry=r,
        )
        self.tokens_settled = Counter(
            "gpupool_tenant_tokens_settled_total",
            "Tokens the tenant's requests used (prompt + completion), as settled",
            ["tenant"],
            registry=r,
        )
        self.borrowed = Counter(
            "gpupool_tenant_tokens_borrowed_total",
            "Tokens the tenant borrowed from idle tenants' budgets (borrow_max_frac)",
            ["tenant"],
            registry=r,
        )
        self.lent = Counter(
            "gpupool_tenant_tokens_lent_total",
            "Tokens other tenants borrowed from this tenant's idle budget",
            ["tenant"],
            registry=r,
        )
        self.active_runs = Gauge(
            "gpupool_tenant_active_runs", "Agent runs active now", ["tenant"], registry=r
        )
        self.inflight = Gauge(
            "gpupool_tenant_inflight_requests",
            "Requests of the tenant past governance and not finished",
            ["tenant"],
            registry=r,
        )
        self.cost_used_frac = Gauge(
            "gpupool_tenant_cost_cap_used_frac",
            "GPU-seconds of the last hour over the tenant's hourly cost cap",
            ["tenant"],
            registry=r,
        )
        self.cost_alerts = Counter(
            "gpupool_tenant_cost_alerts_total",
            "Times the tenant's last-hour GPU-seconds crossed governance.cost_alert_frac of its"
            " cap",
            ["tenant"],
            registry=r,
        )
        self.runs_ended = Counter(
            "gpupool_runs_ended_total",
            "Agent runs ended, by reason (client_end, idle_timeout, or the guard that stopped it)",
            ["tenant", "reason"],
            registry=r,
        )
        # shared budgets (store.url set: router/governance/replica.py)
        self.store_up = Gauge(
            "gpupool_governance_store_up",
            "1 while the shared store holding the budgets answers, 0 during an outage (only"
            " with store.url)",
            registry=r,
        )
        self.store_up.set(1)  # the embedded store is the process's own
        self.outage_requests = Counter(
            "gpupool_governance_outage_requests_total",
            "Budget or slot decisions made without the unreachable shared store, by"
            " store.budgets_on_outage (open: admitted on the replica's own buckets, closed:"
            " refused with 503)",
            ["tenant", "policy"],
            registry=r,
        )
        self.shared_reservations = Counter(
            "gpupool_governance_shared_reservations_total",
            "Chunks this replica took from a tenant's shared bucket (tokens, requests)",
            ["tenant", "bucket"],
            registry=r,
        )

        self.speculated = Counter(
            "gpupool_governance_step_speculated_total",
            "Agent steps sent on to an engine on the run's step number this replica knew,"
            " before the shared store's answer, by what the answer was: confirmed (as"
            " known), renumbered (another replica took steps: the store's number kept),"
            " refused (stopped, at max_steps or no concurrency slot: the engine request"
            " cancelled, the client refused as before), unanswered (the store failed"
            " meanwhile: the known number kept)",
            ["outcome"],
            registry=r,
        )
        self.speculated_awaited = Counter(
            "gpupool_governance_step_speculated_awaited_total",
            "Agent steps sent on before the shared store's answer whose response waited for"
            " that answer (the engine answered before the store did)",
            registry=r,
        )
        self.folded = Counter(
            "gpupool_governance_step_numbered_at_commit_total",
            "Agent steps sent on with no statement of their own and numbered by the statement"
            " that committed their ledger record (PostgreSQL, non-streaming), by the answer:"
            " confirmed (as known), renumbered (another replica took steps: the store's"
            " number kept), refused (stopped or at max_steps on another replica: the client"
            " refused after the engine's work), unanswered (the store failed: the known"
            " number kept)",
            ["outcome"],
            registry=r,
        )
        self.lease_steps = Counter(
            "gpupool_governance_run_lease_steps_total",
            "Agent steps this replica numbered from its memory while it held the run's lease"
            " (store.run_lease: no statement for the step)",
            registry=r,
        )
        self.lease_handovers = Counter(
            "gpupool_governance_run_lease_handovers_total",
            "Runs this replica held and handed over at once when another replica asked for"
            " them (a notification; else at the next sweep)",
            registry=r,
        )
        self.lease_moves = Counter(
            "gpupool_governance_run_lease_moves_total",
            "Agent steps that found their run held by another replica's lease and waited for"
            " it to hand the run over (at its next sweep) or for the lease to run out; many:"
            " a balancer that moves each request (turn store.run_lease off)",
            registry=r,
        )

    def tenant(self, name: str) -> TenantSeries:
        """`name`'s per-request series (tenants come from the config: the cache is bounded)."""
        series = self._tenants.get(name)
        if series is None:
            series = self._tenants[name] = TenantSeries(
                self.tokens_remaining.labels(name),
                self.tokens_reserved.labels(name),
                self.inflight.labels(name),
                self.active_runs.labels(name),
                self.tokens_settled.labels(name),
            )
        return series
