"""The OpenAPI 3.1 description of everything the router serves, at `GET /openapi.json`.

Built once per router from its config (the served model, the class names, which credentials
are configured), so it says exactly what this router accepts. The generation endpoints describe
the fields gpupool itself reads and validates; every other field passes through to vLLM
unchanged (`additionalProperties: true`), and vLLM's own 4xx answers pass through too. Every
error, the router's or the engine's, has OpenAI's shape `{"error": {"message", "type", "code",
"param"}}`; a method a path does not take answers 405 with `Allow`, an unknown path 404.

tests/unit/test_openapi.py holds the router to this document with schemathesis.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pools.config import Config
from router.identity import OperatorAccess
from router.rebalancer.routes import BoundsBody, EmptyBody, MoveBody, PinBody, UnpinBody

__all__ = ["INT64_MAX", "INT64_MIN", "openapi_document"]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

Schema = dict[str, Any]

_ANY: Schema = {}  # any JSON value: gpupool reads it leniently, the engine validates it

_ERROR_DESCRIPTIONS = {
    400: "Malformed JSON, a missing or mistyped field, a bad gpupool header or query parameter, "
    "a prompt alone over the model's context (context_length_exceeded), a sequence "
    "over every instance's KV cache (kv_capacity_exceeded), an unknown or lost "
    "previous_response_id (previous_response_not_found), or the engine's own 400, passed "
    "through",
    401: "No API key, a malformed Authorization header, or an unknown key",
    403: "The key is valid but may not do this (class choice, /admin/*, /metrics)",
    404: "Unknown path, model, or run (a run of another tenant looks unknown)",
    405: "The path exists but does not take this method; `Allow` lists the methods it takes",
    408: "The request body did not arrive within router.body_read_timeout_s",
    413: "The request body is larger than router.max_body_bytes",
    429: "Admission refused: the pool's queue is full or the deadline cannot be met. Retryable "
    "after `Retry-After` seconds",
    502: "The engine failed: refused after retries, died, or answered 5xx",
    503: "No healthy engine in the request's pool",
    504: "The request's deadline (x-gpupool-deadline-ms or the class timeout) passed",
}
# the Anthropic Messages API answers every error in Anthropic's shape; 529 for a full queue
_ANTHROPIC_STATUSES = (400, 401, 403, 404, 405, 408, 413, 429, 502, 503, 504, 529)


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Schema]:
    return {str(s): {"$ref": f"#/components/responses/Error{s}"} for s in statuses}


def _anthropic_errors(*statuses: int) -> dict[str, Schema]:
    return {str(s): {"$ref": f"#/components/responses/AnthropicError{s}"} for s in statuses}


def _obj(required: list[str], properties: dict[str, Schema], **extra: Any) -> Schema:
    return {
        "type": "object",
        "required": required,
        "properties": properties,
        "additionalProperties": True,
        **extra,
    }


_NUM: Schema = {"type": "number"}
_INT: Schema = {"type": "integer"}
_STR: Schema = {"type": "string"}
_STRS: Schema = {"type": "array", "items": _STR}
_OPT_NUM: Schema = {"type": ["number", "null"]}


def _schemas(config: Config) -> dict[str, Schema]:
    model = {
        "type": "string",
        "enum": [config.model.name],
        "description": "The served model; any other answers 404 model_not_found",
    }
    stream = {
        "type": ["boolean", "null"],
        "description": "Stream server-sent events. gpupool always asks the engine for the usage "
        "chunk and strips it again unless stream_options.include_usage is true",
    }
    read_for_estimate = (
        "Read for the admission estimate (a positive whole number counts); the engine validates"
    )
    common: dict[str, Schema] = {
        "model": model,
        "stream": stream,
        "stream_options": {
            "description": "Passed through; gpupool reads include_usage and, when streaming, "
            "sets include_usage on the upstream request"
        },
        "max_tokens": {"description": read_for_estimate},
        "min_tokens": {"description": read_for_estimate},
        "n": {"description": read_for_estimate},
        "best_of": {"description": read_for_estimate},
        "priority": {
            "description": "vLLM's scheduling priority; gpupool sets the pool's engine_priority "
            "when the body has none"
        },
        "vllm_xargs": {
            "description": "vllm-project/router's extra arguments; agentic_context (a string, "
            "or an object with id/program_id/session_id/trajectory_id) names the run"
        },
    }
    message: Schema = _obj(
        ["role"],
        {"role": _STR, "content": _ANY, "tool_calls": _ANY},
        description="A chat message; passed through, the engine validates it",
    )
    gpu_usage = {
        "gpu_seconds": {
            "type": "number",
            "minimum": 0,
            "description": "With x-gpupool-usage: 1, the GPU-seconds this request cost",
        }
    }
    return {
        "Error": _obj(
            ["error"],
            {
                "error": _obj(
                    ["message", "type", "code", "param"],
                    {
                        "message": _STR,
                        "type": _STR,
                        "code": {"type": ["string", "integer", "null"]},
                        "param": {"type": ["string", "null"]},
                        "retryable": {"type": "boolean"},
                        "retry_after_seconds": {"type": "integer", "minimum": 1},
                    },
                )
            },
            description="OpenAI's error shape; 429s add retryable and retry_after_seconds",
        ),
        "AnthropicError": _obj(
            ["type", "error"],
            {
                "type": {"const": "error"},
                "error": _obj(
                    ["type", "message"],
                    {
                        "type": _STR,
                        "message": _STR,
                        "code": {"type": ["string", "integer", "null"]},
                        "retry_after_seconds": {"type": "integer", "minimum": 1},
                    },
                ),
            },
            description="Anthropic's error shape (/v1/messages): error.type is "
            "invalid_request_error, authentication_error, permission_error, not_found_error, "
            "request_too_large, rate_limit_error, overloaded_error (529: queue full), "
            "timeout_error or api_error; gpupool adds its code",
        ),
        "ResponsesRequest": _obj(
            ["model", "input"],
            {
                "model": model,
                "stream": {"type": ["boolean", "null"], "description": "Stream SSE events"},
                "input": {
                    "anyOf": [_STR, {"type": "array"}],
                    "description": "Text or input items; read for the estimate, passed through",
                },
                "instructions": {"type": ["string", "null"]},
                "max_output_tokens": {
                    "type": ["integer", "null"],
                    "minimum": 1,
                    "description": read_for_estimate,
                },
                "previous_response_id": {
                    "type": ["string", "null"],
                    "description": "Continue a stored response: sent to the engine that "
                    "stored it; unknown or lost: 400 previous_response_not_found",
                },
                "tools": {"description": "A non-empty list classifies into the tools class"},
            },
        ),
        "Response": _obj(
            ["id", "object"],
            {"id": _STR, "object": {"const": "response"}, "usage": {"type": ["object", "null"]}},
            description="The engine's response, passed through",
        ),
        "MessagesRequest": _obj(
            ["model", "messages", "max_tokens"],
            {
                "model": model,
                "stream": {"type": ["boolean", "null"], "description": "Stream SSE events"},
                "messages": {
                    "type": "array",
                    "minItems": 1,
                    "description": "Passed through; the engine validates each message",
                },
                "max_tokens": {"type": "integer", "minimum": 1},
                "system": {
                    "anyOf": [_STR, {"type": "array"}, {"type": "null"}],
                    "description": "A string or text blocks; null is the same as absent",
                },
                "tools": {"description": "A non-empty list classifies into the tools class"},
            },
        ),
        "Message": _obj(
            ["id", "type", "content"],
            {"id": _STR, "type": {"const": "message"}, "content": {"type": "array"}},
            description="The engine's message, passed through",
        ),
        "CountTokensRequest": _obj(
            ["model", "messages"],
            {
                "model": model,
                "messages": {
                    "type": "array",
                    "minItems": 1,
                    "description": "Passed through; the engine validates each message",
                },
            },
        ),
        "TokenCount": _obj(["input_tokens"], {"input_tokens": _INT}),
        "ChatCompletionRequest": _obj(
            ["model", "messages"],
            {
                **common,
                "messages": {"type": "array", "minItems": 1, "items": message},
                "max_completion_tokens": {"description": read_for_estimate},
                "tools": {
                    "description": "A non-empty list classifies the request into the tools "
                    "class (classification.tools_class)"
                },
            },
        ),
        "CompletionRequest": _obj(
            ["model", "prompt"],
            {**common, "prompt": {"description": "Text, texts or token ids; passed through"}},
        ),
        "Usage": _obj(
            ["prompt_tokens", "completion_tokens"],
            {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT, **gpu_usage},
        ),
        "Completion": _obj(
            ["id", "object", "created", "model", "choices"],
            {
                "id": _STR,
                "object": _STR,
                "created": _INT,
                "model": _STR,
                "choices": {"type": "array", "items": {"type": "object"}},
                "usage": _ref("Usage"),
            },
            description="The engine's answer, passed through (usage gains gpu_seconds when "
            "asked with x-gpupool-usage)",
        ),
        "StreamEvent": _obj(
            ["data"],
            {"data": _STR, "event": _STR},
            description="One server-sent event: `data` is a JSON chunk of the engine's, the "
            "usage chunk (when asked for), an error object when the stream fails, or [DONE]",
        ),
        "ModelList": _obj(
            ["object", "data"],
            {
                "object": {"const": "list"},
                "data": {
                    "type": "array",
                    "items": _obj(
                        ["id", "object", "created", "owned_by"],
                        {
                            "id": _STR,
                            "object": {"const": "model"},
                            "created": _INT,
                            "owned_by": _STR,
                            "max_model_len": _INT,
                        },
                    ),
                },
            },
        ),
        "Run": _obj(
            ["run_id", "tenant", "requests", "gpu_seconds", "classes"],
            {
                "run_id": _STR,
                "tenant": _STR,
                "requests": _INT,
                "errors": _INT,
                "prompt_tokens": _INT,
                "completion_tokens": _INT,
                "gpu_seconds": _NUM,
                "queue_s": _NUM,
                "first_seen_s": _NUM,
                "last_seen_s": _NUM,
                "wall_s": _NUM,
                "classes": _STRS,
            },
        ),
        "RunList": _obj(
            ["object", "data"],
            {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Run")}},
        ),
        "Distribution": _obj(
            ["count", "p50", "p95", "max"],
            {"count": _INT, "p50": _OPT_NUM, "p95": _OPT_NUM, "max": _OPT_NUM},
        ),
        "RunSummary": _obj(
            ["object", "run_id", "tenants", "classes", "pools", "totals", "requests"],
            {
                "object": {"const": "gpupool.run"},
                "run_id": _STR,
                "tenants": _STRS,
                "classes": _STRS,
                "pools": _STRS,
                "first_seen_s": _NUM,
                "last_seen_s": _NUM,
                "totals": _obj(
                    ["requests", "gpu_seconds"],
                    {
                        "requests": _INT,
                        "outcomes": {"type": "object", "additionalProperties": _INT},
                        "prompt_tokens": _INT,
                        "completion_tokens": _INT,
                        "gpu_seconds": _NUM,
                        "wall_s": _NUM,
                        "queue_s": _NUM,
                        "exec_s": _NUM,
                        "between_steps_s": _NUM,
                    },
                ),
                "ttft_s": _ref("Distribution"),
                "tpot_s": _ref("Distribution"),
                "requests": {"type": "array", "items": {"type": "object"}},
            },
        ),
        "Accounting": _obj(
            ["object", "ledger", "top_runs", "live"],
            {
                "object": {"const": "gpupool.accounting"},
                "ledger": _obj(
                    ["object", "requests", "gpu_seconds", "by_pool", "by_class", "by_tenant"],
                    {
                        "object": {"const": "gpupool.accounting_totals"},
                        "requests": _INT,
                        "gpu_seconds": _NUM,
                        "idle_gpu_seconds": _NUM,
                        "capacity_gpu_seconds": _NUM,
                        "by_pool": {"type": "object"},
                        "by_class": {"type": "object"},
                        "by_tenant": {"type": "object"},
                    },
                ),
                "top_runs": {"type": "array", "items": _ref("Run")},
                "live": {
                    "type": ["object", "null"],
                    "description": "This process's conservation report: attributed + idle "
                    "GPU-seconds against capacity",
                },
            },
        ),
        "Pools": _obj(
            ["allocation_version", "admission", "pools", "instances"],
            {
                "allocation_version": _INT,
                "admission": _STR,
                "pools": {
                    "type": "object",
                    "additionalProperties": _obj(
                        ["classes", "share_frac", "instances", "healthy_instances", "queue"],
                        {
                            "classes": _STRS,
                            "share_frac": _NUM,
                            "instances": {"type": "object", "additionalProperties": _NUM},
                            "healthy_instances": _INT,
                            "queue": {"type": "object"},
                        },
                    ),
                },
                "instances": {
                    "type": "object",
                    "additionalProperties": _obj(
                        ["url", "gpus", "healthy", "inflight"],
                        {"url": _STR, "gpus": _INT, "healthy": {"type": "boolean"}},
                    ),
                },
            },
        ),
        "Gpus": _obj(
            ["object", "snapshot"],
            {"object": {"const": "gpupool.gpus"}, "snapshot": {"type": ["object", "null"]}},
        ),
        "History": _obj(
            ["object", "interval_s", "window_s", "samples"],
            {
                "object": {"const": "gpupool.history"},
                "interval_s": _NUM,
                "window_s": _NUM,
                "samples": {
                    "type": "array",
                    "items": _obj(
                        ["t_s", "pools", "instances", "latency", "rates"],
                        {"t_s": _NUM, "pools": {"type": "object"}, "latency": {"type": "object"}},
                    ),
                },
            },
        ),
        "Readiness": _obj(
            ["ready", "pools_without_healthy_instance"],
            {"ready": {"type": "boolean"}, "pools_without_healthy_instance": _STRS},
        ),
    }


def _header_parameters(config: Config) -> list[Schema]:
    def header(name: str, schema: Schema, description: str) -> Schema:
        return {
            "name": name,
            "in": "header",
            "required": False,
            "schema": schema,
            "description": description,
        }

    int64 = {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}
    return [
        header(
            "x-gpupool-class",
            {"type": "string", "enum": list(config.class_names)},
            "Choose the class (and so the pool), if the tenant may (else 403); unknown: 400",
        ),
        header(
            "x-gpupool-priority",
            int64,
            "Priority band in the admission queue, higher first (default: the class's)",
        ),
        header(
            "x-gpupool-deadline-ms",
            {**int64, "minimum": 1},
            "Deadline from arrival in milliseconds (default: the class timeout); past it: 504, "
            "or 429 deadline_unmeetable when admission can tell in advance",
        ),
        header(
            "x-gpupool-run-id",
            _STR,
            "The agent run this request is a step of (first 256 characters). Also read, in "
            "this order: x-dynamo-trajectory-id, x-claude-code-session-id, session-id, "
            "thread-id, x-session-id, and the body's vllm_xargs.agentic_context",
        ),
        header(
            "x-gpupool-wait-comments",
            {"type": "number", "minimum": 0, "maximum": 3600},
            "Streaming only: after this many seconds of waiting (tenant budget or queue) start "
            "the stream and send an SSE comment line each second until tokens come; a refusal "
            "after that is an error event, not a 429 (router/gateway/wait_comments.py)",
        ),
        header(
            "x-gpupool-usage",
            _STR,
            "1, true or yes: the usage (and the x-gpupool-gpu-seconds header, non-streaming) "
            "report the GPU-seconds the request cost; any other value is ignored",
        ),
    ]


_REPLICA_HEADER: Schema = {
    "description": "The router process that answered (host:pid:random), on every response: "
    "the replica id its logs, GET /admin/pools' replica.id and the store's leases carry",
    "schema": _STR,
    "required": True,
}


def _response_headers() -> dict[str, Schema]:
    def header(description: str, schema: Schema = _STR) -> Schema:
        return {"description": description, "schema": schema}

    return {
        "x-gpupool-replica": _REPLICA_HEADER,
        "x-gpupool-request-id": header("The router's id for this request"),
        "x-gpupool-pool": header("The pool that served it"),
        "x-gpupool-class": header("The class it was given"),
        "x-gpupool-priority": header("The priority it was queued with", _INT),
        "x-gpupool-instance": header("The engine instance that served it"),
        "x-gpupool-cached-tokens": header(
            "Prompt tokens the router expected that instance to hold in its prefix cache "
            "(whole blocks; absent when unknown)",
            {"type": "integer", "minimum": 0},
        ),
        "x-gpupool-gpu-seconds": header(
            "GPU-seconds it cost (non-streaming answers)", {"type": "number", "minimum": 0}
        ),
    }


_OPENAI_GENERATION_ERRORS = (400, 401, 403, 404, 408, 413, 429, 502, 503, 504)


def _generation(
    config: Config,
    security: list[Schema],
    *,
    operation: str,
    summary: str,
    description: str,
    request: str,
    answer: str,
    answer_description: str,
    errors: dict[str, Schema],
) -> Schema:
    """One generation endpoint (chat, completions, responses, messages): the same path, so the
    same parameters, headers and answer shapes; only names and error shapes differ."""
    return {
        "post": {
            "operationId": operation,
            "summary": summary,
            "description": description,
            "security": security,
            "parameters": _header_parameters(config),
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {
                "200": {
                    "description": f"{answer_description}: JSON, or server-sent events with "
                    '"stream": true (a failure mid-stream ends it with an error event)',
                    "headers": _response_headers(),
                    "content": {
                        "application/json": {"schema": _ref(answer)},
                        "text/event-stream": {"schema": _ref("StreamEvent")},
                    },
                },
                **errors,
            },
        }
    }


def _openai_generation(config: Config, security: list[Schema], *, chat: bool) -> Schema:
    what = "chat completion" if chat else "completion"
    return _generation(
        config,
        security,
        operation="createChatCompletion" if chat else "createCompletion",
        summary=f"Create a {what} through the pools",
        description="Classified, admitted (or queued, or refused with 429), proxied to "
        "an engine in the class's pool and accounted in GPU-seconds. Bytes pass through.",
        request="ChatCompletionRequest" if chat else "CompletionRequest",
        answer="Completion",
        answer_description=f"The engine's {what}",
        errors=_errors(*_OPENAI_GENERATION_ERRORS),
    )


def _agent_generation(config: Config, security: list[Schema], *, messages: bool) -> Schema:
    return _generation(
        config,
        security,
        operation="createMessage" if messages else "createResponse",
        summary="Create an Anthropic message through the pools"
        if messages
        else "Create an OpenAI response through the pools",
        description="The same path as chat completions: classified, admitted (or "
        "queued, or refused), proxied and accounted. Bytes pass through.",
        request="MessagesRequest" if messages else "ResponsesRequest",
        answer="Message" if messages else "Response",
        answer_description="The engine's answer",
        errors=_anthropic_errors(*_ANTHROPIC_STATUSES)
        if messages
        else _errors(*_OPENAI_GENERATION_ERRORS),
    )


def _engine_calls(security: list[Schema]) -> dict[str, Schema]:
    rid = [{"name": "response_id", "in": "path", "required": True, "schema": _STR}]
    count: Schema = {
        "post": {
            "operationId": "countMessageTokens",
            "summary": "Count a message's input tokens on an engine (no admission)",
            "security": security,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref("CountTokensRequest")}},
            },
            "responses": {
                "200": _json(_ref("TokenCount"), "The engine's count"),
                **_anthropic_errors(400, 401, 404, 408, 413, 502, 503),
            },
        }
    }
    get = _get(
        "getResponse",
        "A stored response, from the engine that stored it",
        _json(_ref("Response"), "The response"),
        401,
        404,
        502,
        security=security,
    )
    cancel = _post(
        "cancelResponse",
        "Cancel a background response on the engine that stored it",
        None,
        _json(_ref("Response"), "The response"),
        400,
        401,
        404,
        502,
        security=security,
    )
    return {
        "/v1/messages/count_tokens": count,
        "/v1/responses/{response_id}": {**get, "parameters": rid},
        "/v1/responses/{response_id}/cancel": {**cancel, "parameters": rid},
    }


def _get(
    operation_id: str,
    summary: str,
    ok: Schema,
    *errors: int,
    security: list[Schema] | None = None,
    parameters: list[Schema] | None = None,
    extra: dict[str, Schema] | None = None,
) -> Schema:
    operation: Schema = {
        "operationId": operation_id,
        "summary": summary,
        "security": security if security is not None else [],
        "responses": {"200": ok, **_errors(*errors), **(extra or {})},
    }
    if parameters:
        operation["parameters"] = parameters
    return {"get": operation}


def _post(
    operation_id: str,
    summary: str,
    body: Schema | None,
    ok: Schema,
    *errors: int,
    security: list[Schema],
) -> Schema:
    """A POST operation; `body` None: it takes no body (one is ignored)."""
    operation: Schema = {
        "operationId": operation_id,
        "summary": summary,
        "security": security,
        "responses": {"200": ok, **_errors(*errors)},
    }
    if body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body}},
        }
    return {"post": operation}


def _pools_admin(admin: list[Schema]) -> dict[str, Schema]:
    """The SREs' controls over the ratio (router/rebalancer/routes.py): bodies from its models."""
    view = _json({"type": "object"}, "The rebalancer's view after the change")
    controls: list[tuple[str, str, str, type[BaseModel]]] = [
        ("bounds", "setPoolBounds", "Set (or reset) a pool's floor and ceiling", BoundsBody),
        ("pin", "pinPools", "Pin the ratio, or an instance to a pool", PinBody),
        ("unpin", "unpinPools", "Unpin the ratio, or an instance", UnpinBody),
        ("freeze", "freezePools", "Freeze the rebalancing loop", EmptyBody),
        ("unfreeze", "unfreezePools", "Unfreeze the rebalancing loop", EmptyBody),
        ("move", "movePools", "Move share, or a whole instance, between pools", MoveBody),
    ]
    paths = {
        f"/admin/pools/{name}": _post(
            op,
            summary,
            model.model_json_schema(),
            view,
            400,
            401,
            403,
            404,
            security=admin,
        )
        for name, op, summary, model in controls
    }
    whole = {"type": "integer", "minimum": 1, "maximum": 1000}
    paths["/admin/pools/audit"] = _get(
        "adminPoolsAudit",
        "Who changed the SRE settings, when, and what, newest first",
        _json(_obj(["object", "data"], {"data": {"type": "array"}}), "The audit trail"),
        400,
        401,
        403,
        security=admin,
        parameters=[_query("limit", _or_empty(whole, 50), "At most this many entries")],
    )
    return paths


def _governance(tenant: list[Schema], admin: list[Schema]) -> dict[str, Schema]:
    """Budgets a tenant reads, runs it ends, and the admin's reload (docs/governance.md)."""
    end = _obj(
        ["object", "run_id", "reason", "steps"],
        {
            "object": {"const": "gpupool.run_end"},
            "run_id": _STR,
            "reason": {"type": ["string", "null"]},
            "steps": _INT,
            "tokens": _INT,
            "gpu_seconds": _NUM,
        },
    )
    return {
        "/v1/budget": _get(
            "getBudget",
            "The caller's budgets: tokens and requests left, concurrency, cost caps, refill times",
            _json(_obj(["object", "tenant"], {"object": {"const": "gpupool.budget"}}), "Budget"),
            401,
            security=tenant,
        ),
        "/v1/runs/{run_id}/end": {
            **_post(
                "endRun",
                "End one of the caller's runs: it stops counting against its concurrency",
                None,
                _json(end, "The ended run"),
                401,
                404,
                security=tenant,
            ),
            "parameters": [{"name": "run_id", "in": "path", "required": True, "schema": _STR}],
        },
        "/admin/governance/reload": _post(
            "reloadGovernance",
            "Re-read the config file: tenants' budgets, tiers, cost caps and run guards",
            None,
            _json(_obj(["object"], {"object": {"const": "gpupool.governance_reload"}}), "Done"),
            400,
            401,
            403,
            security=admin,
        ),
    }


def _query(name: str, schema: Schema, description: str) -> Schema:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": schema,
        "description": description,
    }


def _or_empty(schema: Schema, default: Any = None) -> Schema:
    """A query parameter's schema: an empty value counts as absent."""
    out: Schema = {"anyOf": [schema, {"type": "string", "maxLength": 0}]}
    if default is not None:
        out["default"] = default
    return out


def openapi_document(config: Config, access: OperatorAccess) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a router built from `config` with operator rules `access`."""
    bearer: Schema = {"bearerAuth": []}
    anyone: Schema = {}
    tenant = [bearer] if not access.tenants.open else [bearer, anyone]
    admin = [bearer] if access.any_key or not access.loopback else [bearer, anyone]
    metrics = [bearer] if access.any_key else [anyone]
    since = _or_empty({"type": "number", "minimum": -(2**53), "maximum": 2**53})
    since_s = _query("since_s", since, "Only runs with a request ending at or after it (s)")
    whole = {"type": "integer", "minimum": 1, "maximum": 1000}
    paths: dict[str, Schema] = {
        "/v1/chat/completions": _openai_generation(config, tenant, chat=True),
        "/v1/completions": _openai_generation(config, tenant, chat=False),
        "/v1/responses": _agent_generation(config, tenant, messages=False),
        "/v1/messages": _agent_generation(config, tenant, messages=True),
        **_engine_calls(tenant),
        "/v1/models": _get(
            "listModels",
            "The served model",
            _json(_ref("ModelList"), "The model list"),
            401,
            security=tenant,
        ),
        "/v1/runs": _get(
            "listRuns",
            "The caller's agent runs, newest first",
            _json(_ref("RunList"), "Runs with their totals"),
            400,
            401,
            security=tenant,
            parameters=[
                since_s,
                {
                    **_query(
                        "since",
                        _ANY,
                        "Older name of since_s, a finite number too; ignored when since_s is given",
                    ),
                    "deprecated": True,
                },
                _query("limit", _or_empty(whole, 50), "At most this many runs"),
                _query("class", _STR, "Only runs with a request of this class"),
            ],
        ),
        "/v1/runs/{run_id}": {
            **_get(
                "getRun",
                "One run of the caller: totals, TTFT/TPOT and every step",
                _json(_ref("RunSummary"), "The run"),
                401,
                404,
                security=tenant,
            ),
            "parameters": [{"name": "run_id", "in": "path", "required": True, "schema": _STR}],
        },
        "/health": _get(
            "health",
            "Liveness",
            _json(_obj(["status"], {"status": {"const": "ok"}}), "The router is up"),
        ),
        "/ready": _get(
            "ready",
            "Readiness: every pool has a healthy engine",
            _json(_ref("Readiness"), "Ready"),
            extra={"503": _json(_ref("Readiness"), "Some pool has no healthy engine")},
        ),
        "/metrics": _get(
            "metrics",
            "Prometheus metrics of the router process that answers (open while no key is "
            "configured; then the admin or scrape key); each process's own on "
            "router.metrics_port + i when set",
            {"description": "Prometheus text", "content": {"text/plain": {"schema": _STR}}},
            401,
            403,
            security=metrics,
        ),
        "/admin/pools": _get(
            "adminPools",
            "Pools, their shares, queues and instances",
            _json(_ref("Pools"), "The pools"),
            401,
            403,
            security=admin,
        ),
        "/admin/accounting": _get(
            "adminAccounting",
            "GPU-seconds: ledger totals, the costliest runs, the live conservation report",
            _json(_ref("Accounting"), "The accounting report"),
            400,
            401,
            403,
            security=admin,
            parameters=[
                _query("top", _or_empty(whole, 10), "How many of the costliest runs"),
                _query("tenant", _STR, "Only this tenant's runs"),
                _query("since_s", since, "Only requests ending at or after it (s)"),
            ],
        ),
        "/admin/decisions": _get(
            "adminDecisions",
            "The rebalancer's decision log, newest first (docs/rebalancer.md)",
            _json(
                _obj(
                    ["object", "data"],
                    {
                        "object": {"const": "list"},
                        "data": {"type": "array", "items": {"type": "object"}},
                    },
                ),
                "Decisions with the signals behind them",
            ),
            400,
            401,
            403,
            security=admin,
            parameters=[
                _query("limit", _or_empty(whole, 50), "At most this many decisions"),
                _query("since_s", since, "Only decisions at or after this unix time (s)"),
                _query("moves_only", _STR, "1: only decisions that moved share"),
            ],
        ),
        "/admin/gpus": _get(
            "adminGpus",
            "The latest GPU snapshot (null before the first sample)",
            _json(_ref("Gpus"), "The GPUs"),
            401,
            403,
            security=admin,
        ),
        "/admin/history": _get(
            "adminHistory",
            "The last hour for the status page: one sample every 5 s of shares, queues, each"
            " instance's KV use and load, and each interval's latency quantiles and rates",
            _json(_ref("History"), "Samples, oldest first"),
            400,
            401,
            403,
            security=admin,
            parameters=[_query("since_s", since, "Only samples taken after it (Unix s)")],
        ),
        "/openapi.json": _get(
            "openapi",
            "This document",
            _json({"type": "object"}, "The OpenAPI description"),
        ),
        **_pools_admin(admin),
        **_governance(tenant, admin),
    }
    responses: dict[str, Schema] = {}
    for status, description in _ERROR_DESCRIPTIONS.items():
        response = _json(_ref("Error"), description)
        if status == 405:
            response["headers"] = {
                "allow": {"schema": _STR, "required": True},
                "x-gpupool-replica": _REPLICA_HEADER,
            }
        elif status == 429:
            response["headers"] = {
                "retry-after": {"schema": _INT, "required": True},
                "x-gpupool-replica": _REPLICA_HEADER,
            }
        responses[f"Error{status}"] = response
    for status in _ANTHROPIC_STATUSES:
        description = _ERROR_DESCRIPTIONS.get(status, "The queue is full (overloaded)")
        response = _json(_ref("AnthropicError"), description)
        if status in (429, 529):
            response["headers"] = {
                "retry-after": {"schema": _INT, "required": True},
                "x-gpupool-replica": _REPLICA_HEADER,
            }
        responses[f"AnthropicError{status}"] = response
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpupool",
            "version": "1",
            "description": "An OpenAI-compatible endpoint in front of a pool of vLLM engines. "
            "Errors have OpenAI's shape; a method a path does not take answers 405 "
            "(components.responses.Error405) and an unknown path 404. Every response, errors "
            "and streams included, carries x-gpupool-replica: the router process that "
            "answered. With router.metrics_port P, router process i also listens on port P+i "
            "for /metrics, /health, /ready, /admin/* and /ui only (anything else there: 404 "
            "not_on_this_port), so each router process is scraped on its own.",
        },
        "paths": paths,
        "components": {
            "schemas": _schemas(config),
            "responses": responses,
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A tenant's API key; /admin/* takes the admin key, /metrics "
                    "the admin or the scrape key",
                }
            },
        },
    }
