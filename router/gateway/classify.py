"""Classification: which class (and so which pool) a request belongs to, and what else the
router must know about it (tenant, priority, deadline, run id, request id).

Rules come from config and are tried in order, first match wins; each rule is a small function
`(headers, body, tenant, config) -> class name | None`:
- `header`: an explicit `x-gpupool-class` (only if the tenant may set it; unknown class: 400);
- `tenant_default`: the tenant's default class;
- `tools`: a body with a non-empty `tools` list;
- `run_id`: a run identity is present;
and the configured default class (`normal`) when none matches.

Priority: `x-gpupool-priority` (higher goes first) and the body's vLLM `priority` (lower goes
first) are clamped to the tenant's `max_priority` (default 0), so no caller jumps the queue
past what its tenant was given.

Run identity, so agent clients work with gpupool as with other routers: `x-gpupool-run-id`
(one run, as given), or a session identity: `x-dynamo-trajectory-id`, `x-claude-code-session-id`,
Codex's `session-id` / `thread-id`, `x-session-id`, or vllm-project/router's
`vllm_xargs.agentic_context` in the body. A session holds many runs, one per task: classify
names the session and the user message the step belongs to (`router.governance.boundary`,
which needs the request's `protocol`); the governor then numbers the run, `<session>:<n>`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pools.config import ClassConfig, Config, TenantConfig
from router.errors import BadRequest, ClassNotAllowed
from router.governance.boundary import PROTOCOLS, anchor
from router.request import RequestContext

__all__ = ["RUN_ID_HEADERS", "RequestContext", "classify", "run_identity", "session_identity"]

EXPLICIT_RUN_HEADER = "x-gpupool-run-id"

RUN_ID_HEADERS = (
    "x-gpupool-run-id",
    "x-dynamo-trajectory-id",
    "x-claude-code-session-id",
    "session-id",
    "thread-id",
    "x-session-id",
)

Headers = Mapping[str, str]
Rule = Callable[[Headers, dict[str, Any], TenantConfig, Config, str | None], str | None]


def run_identity(headers: Headers, body: dict[str, Any]) -> str | None:
    """The request's run or session identity, as given (at most 256 characters)."""
    for name in RUN_ID_HEADERS:
        value = headers.get(name)
        if value:
            return value[:256]
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        ctx = xargs.get("agentic_context")
        if isinstance(ctx, str) and ctx:
            return ctx[:256]
        if isinstance(ctx, dict):
            for key in ("id", "program_id", "session_id", "trajectory_id"):
                value = ctx.get(key)
                if isinstance(value, str | int) and str(value):
                    return str(value)[:256]
    return None


def session_identity(headers: Headers, body: dict[str, Any]) -> str | None:
    """The identity when it names a session (anything but `x-gpupool-run-id`), else None."""
    if headers.get(EXPLICIT_RUN_HEADER):
        return None
    return run_identity(headers, body)


def _rule_header(
    headers: Headers, body: dict[str, Any], tenant: TenantConfig, config: Config, run: str | None
) -> str | None:
    wanted = headers.get("x-gpupool-class")
    if wanted is None:  # empty is not absent: a 400 like any other unknown class
        return None
    if wanted not in config.class_names:
        raise BadRequest(
            f"x-gpupool-class {wanted[:40]!r} is not a known class (known: "
            f"{', '.join(config.class_names)})",
            "unknown_class",
            param="x-gpupool-class",
        )
    if not tenant.may_set_class:
        raise ClassNotAllowed(
            f"tenant {tenant.name!r} may not choose its class with x-gpupool-class",
            "class_not_allowed",
        )
    return wanted


def _rule_tenant_default(
    headers: Headers, body: dict[str, Any], tenant: TenantConfig, config: Config, run: str | None
) -> str | None:
    return tenant.default_class


def _rule_tools(
    headers: Headers, body: dict[str, Any], tenant: TenantConfig, config: Config, run: str | None
) -> str | None:
    tools = body.get("tools")
    return config.classification.tools_class if isinstance(tools, list) and tools else None


def _rule_run_id(
    headers: Headers, body: dict[str, Any], tenant: TenantConfig, config: Config, run: str | None
) -> str | None:
    return config.classification.run_class if run else None


RULES: dict[str, Rule] = {
    "header": _rule_header,
    "tenant_default": _rule_tenant_default,
    "tools": _rule_tools,
    "run_id": _rule_run_id,
}


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _int_header(headers: Headers, name: str) -> int | None:
    """A signed 64-bit whole number from a header; None when absent. Raises `BadRequest`
    (an empty value too: the OpenAPI description says integer)."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not _INT64_MIN <= value <= _INT64_MAX:
        raise BadRequest(
            f"{name} must be a 64-bit integer, got {raw[:40]!r}", "invalid_header", param=name
        )
    return value


def _clamped_priority(requested: int | None, tenant: TenantConfig, cls: ClassConfig) -> int:
    """The queue priority a request gets (higher goes first): its class's default, or what it
    asked for, no better than its tenant's `max_priority` (or the class's default, if higher:
    asking for the default is never a demotion)."""
    if requested is None:
        return cls.default_priority
    return min(requested, max(tenant.max_priority, cls.default_priority))


def _clamp_engine_priority(
    body: dict[str, Any], tenant: TenantConfig, engine_priority: int | None
) -> None:
    """Clamp the body's vLLM `priority` (lower goes first inside the engine) to no better than
    the pool's `engine_priority` (0, vLLM's default, when unset) minus the tenant's
    `max_priority`, in place. Raises `BadRequest` for a value that is not an integer."""
    if "priority" not in body:
        return
    value = body["priority"]
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest("'priority' must be an integer", "invalid_field", param="priority")
    best = (engine_priority or 0) - tenant.max_priority
    if value < best:
        body["priority"] = best


def classify(
    headers: Headers,
    body: dict[str, Any],
    tenant: TenantConfig,
    config: Config,
    *,
    request_id: str,
    now_s: float,
    protocol: str = "chat",
) -> RequestContext:
    """Decide class, pool, priority, deadline and run id. `protocol`: chat, completions,
    responses or messages (how the body's turns read). Clamps the priority asked for (the
    `x-gpupool-priority` header, and the body's vLLM `priority`, in place) to the tenant's
    `max_priority`. Raises `BadRequest`/`ClassNotAllowed`."""
    assert protocol in PROTOCOLS, protocol
    run = run_identity(headers, body)
    session = None if headers.get(EXPLICIT_RUN_HEADER) else run  # session_identity, once
    turn = anchor(body, protocol) if session is not None else None
    class_name: str | None = None
    for rule_name in config.classification.rules:
        class_name = RULES[rule_name](headers, body, tenant, config, run)
        if class_name is not None:
            break
    if class_name is None:
        class_name = config.classification.default_class
    pool = config.pool_for_class(class_name)
    assert pool is not None, "config validation guarantees every class has a pool"
    cls = config.class_config(class_name)
    priority = _clamped_priority(_int_header(headers, "x-gpupool-priority"), tenant, cls)
    _clamp_engine_priority(body, tenant, pool.engine_priority)
    deadline_ms = _int_header(headers, "x-gpupool-deadline-ms")
    if deadline_ms is not None and deadline_ms <= 0:
        raise BadRequest(
            "x-gpupool-deadline-ms must be positive",
            "invalid_header",
            param="x-gpupool-deadline-ms",
        )
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    return RequestContext(
        request_id=request_id,
        tenant=tenant.name,
        class_name=class_name,
        pool=pool.name,
        priority=priority,
        deadline_s=now_s + (deadline_ms / 1e3 if deadline_ms is not None else cls.timeout_s),
        run_id=run,
        model=str(body.get("model")),
        stream=stream,
        client_wants_usage=stream
        and isinstance(options, dict)
        and bool(options.get("include_usage")),
        received_at_s=now_s,
        want_gpu_usage=headers.get("x-gpupool-usage", "").lower() in ("1", "true", "yes"),
        tenant_weight=tenant.weight,
        session_id=session,
        session_turn=None if turn is None else turn.key,
    )
