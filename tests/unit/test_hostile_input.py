"""Hostile input: whatever a client sends, the router answers a success or an error in OpenAI's
shape, never a 5xx, an exception or a hang; and what it echoes or forwards carries none of it.

- hypothesis: classification and authentication are total functions of arbitrary headers and
  bodies; arbitrary bytes as bodies, arbitrary header bytes (CR, LF, NUL included) as the
  gpupool headers and Authorization, straight into the ASGI app; arbitrary paths, methods and
  query strings on the rest of the API;
- bodies nested as deep as JSON parsers go;
- header injection: CR/LF in a value never reaches a response header, the server's parser
  (httptools) refuses malformed header bytes before the router sees them, no client header
  reaches an engine;
- 60 KiB headers through the server (431 over 64 KiB), oversized bodies (413 before the rest
  arrives), slow uploads (408 after `router.body_read_timeout_s`), the key checked before the
  body is read.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pools.testing.config import config_for_test
from router.errors import BadRequest, ClassNotAllowed, Forbidden, Unauthorized
from router.gateway.classify import RUN_ID_HEADERS, classify
from router.identity import OperatorAccess, Tenants
from tests.unit.test_hostile_rig import (
    ADMIN_KEY,
    CHAT,
    TENANT_KEY,
    LiveRouter,
    hostile_config,
    live_router,
)

MAX_BODY_BYTES = 64 * 1024
# long enough that "answered at once" and "answered after the body timeout" stay apart on a
# loaded machine (at 1 s the bounds below were fractions of a second)
BODY_TIMEOUT_S = 3.0
SHORT_DEADLINE_MS = 1000  # a 504 to a deadline this short is the client's own doing
FUZZ = settings(
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=False,
)
ERROR_STATUSES = {400, 401, 403, 404, 405, 408, 413, 429, 431}
GP_HEADERS = ("x-gpupool-class", "x-gpupool-priority", "x-gpupool-deadline-ms", "x-gpupool-usage")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    config = hostile_config(
        tmp_path_factory.mktemp("hostile"),
        max_body_bytes=MAX_BODY_BYTES,
        body_read_timeout_s=BODY_TIMEOUT_S,
    )
    with live_router(config) as router:
        yield router


# ------------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = (
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "tools",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "best_of",
    "priority",
    "vllm_xargs",
)
field_values = st.one_of(
    json_values,
    st.sampled_from(["tiny", True, False, 1, 2, 0, -1, 2**70, {"include_usage": True}]),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", 1]), "content": json_values})),
    st.fixed_dictionaries({"agentic_context": json_values}),
)
# objects near a valid request, so fuzzing gets past the first check
near_valid = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "tiny", "other", ""])},
    optional={name: field_values for name in FIELDS if name != "model"},
).map(lambda body: {**({"messages": CHAT["messages"]} if len(body) % 2 else {}), **body})
# a valid request with a few fields set to anything
valid_plus = st.dictionaries(st.sampled_from(FIELDS[3:]), field_values, max_size=2).map(
    lambda extra: {**CHAT, "prompt": "a b", **extra}
)
bodies = st.one_of(
    valid_plus.map(lambda v: json.dumps(v).encode()),
    near_valid.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
)
header_bytes = st.binary(max_size=40) | st.sampled_from(
    [b"agent", b"normal", b"1", b"0", b"-1", b"true", b"\r\nx-injected: 1", b"9" * 30]
)
VALID_KEYS = [f"Bearer {TENANT_KEY}".encode(), f"Bearer {ADMIN_KEY}".encode()]
authorizations = st.integers(0, 9).flatmap(
    lambda pick: (
        st.sampled_from(VALID_KEYS)
        if pick < 7  # mostly a valid key, so the fuzzing gets past authentication
        else st.one_of(
            st.none(), st.binary(max_size=60), st.binary(max_size=40).map(lambda b: b"Bearer " + b)
        )
    )
)
header_sets = st.dictionaries(
    st.sampled_from([*GP_HEADERS, *RUN_ID_HEADERS]), header_bytes, max_size=4
)


# ------------------------------------------------------------------------------------------------
# Checks on every answer
# ------------------------------------------------------------------------------------------------


def _assert_clean_headers(headers: list[tuple[bytes, bytes]]) -> None:
    for name, value in headers:
        assert not set(name + value) & {0, 10, 13}, (name, value)
        assert name != b"x-injected"


def _assert_openai_answer(
    status: int,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    sent: dict[str, bytes] | None = None,
) -> None:
    _assert_clean_headers(headers)
    ctype = dict(headers).get(b"content-type", b"")
    if status == 200:
        assert ctype in (b"application/json", b"text/event-stream"), ctype
        return
    assert ctype == b"application/json", (status, ctype, body[:200])
    error = orjson.loads(body)["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and "code" in error and "param" in error
    if status == 504:  # only the client's own short deadline passes before an answer
        deadline = (sent or {}).get("x-gpupool-deadline-ms", b"")
        assert error["code"] == "deadline_exceeded"
        assert deadline.strip().lstrip(b"+").isdigit(), deadline
        assert int(deadline) <= SHORT_DEADLINE_MS, deadline
        return
    assert status in ERROR_STATUSES, (status, body[:300])


# ------------------------------------------------------------------------------------------------
# Pure functions: classification and authentication are total
# ------------------------------------------------------------------------------------------------

CLASSIFY_CONFIG = config_for_test(
    tenants=[{"name": "fixed", "api_key_sha256": "0" * 64, "may_set_class": False}]
)
(FIXED_TENANT,) = CLASSIFY_CONFIG.tenants
TENANTS = [FIXED_TENANT, Tenants.from_config(()).authenticate(None)]


@FUZZ
@given(
    headers=st.dictionaries(
        st.sampled_from([*GP_HEADERS, *RUN_ID_HEADERS]),
        st.text(max_size=30) | st.integers().map(str),
        max_size=5,
    ),
    body=st.dictionaries(st.sampled_from(FIELDS), field_values, max_size=6),
    tenant=st.sampled_from(TENANTS),
)
def test_classification_is_total(
    headers: dict[str, str], body: dict[str, Any], tenant: Any
) -> None:
    try:
        ctx = classify(headers, body, tenant, CLASSIFY_CONFIG, request_id="r", now_s=100.0)
    except (BadRequest, ClassNotAllowed):
        return
    assert ctx.class_name in CLASSIFY_CONFIG.class_names
    assert ctx.pool in {"agent", "normal"}
    assert -(2**63) <= ctx.priority < 2**63
    assert 100.0 < ctx.deadline_s < float("inf")
    assert ctx.run_id is None or 0 < len(ctx.run_id) <= 256


@FUZZ
@given(authorization=st.none() | st.text(max_size=80) | st.just("Bearer k-fixed"))
def test_authentication_is_total(authorization: str | None) -> None:
    tenants = Tenants.from_config(CLASSIFY_CONFIG.tenants)
    access = OperatorAccess.from_config(tenants, CLASSIFY_CONFIG.router)
    for check in (tenants.authenticate, access.authorize_admin, access.authorize_metrics):
        with contextlib.suppress(Unauthorized, Forbidden):  # anything else fails the test
            check(authorization)


# ------------------------------------------------------------------------------------------------
# The whole app, as ASGI: any body, any header bytes
# ------------------------------------------------------------------------------------------------


@settings(FUZZ, max_examples=500)
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    body=bodies,
    headers=header_sets,
    authorization=authorizations,
)
def test_any_body_and_header_bytes_get_an_openai_answer(
    live: LiveRouter,
    path: str,
    body: bytes,
    headers: dict[str, bytes],
    authorization: bytes | None,
) -> None:
    raw = [(k.encode(), v) for k, v in headers.items()]
    if authorization is not None:
        raw.append((b"authorization", authorization))
    raw.append((b"content-type", b"application/json"))
    status, out_headers, out = live.asgi("POST", path, raw, body)
    event(f"status {status}")
    _assert_openai_answer(status, out_headers, out, headers)


@FUZZ
@given(
    method=st.sampled_from(["GET", "GET", "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"]),
    path=st.integers(0, 9).flatmap(
        lambda pick: (
            st.sampled_from(
                ["/v1/runs", "/admin/accounting", "/v1/models", "/metrics", "/admin/pools"]
            )
            if pick < 6
            else st.text(max_size=30).map(lambda t: ("/v1/runs/" if pick < 8 else "/") + t)
        )
    ),
    query=st.dictionaries(
        st.sampled_from(["limit", "since_s", "since", "top", "tenant", "class"])
        | st.text(max_size=5),
        st.text(max_size=20) | st.sampled_from(["nan", "inf", "-0", "1e400", "1e2", "2.5"]),
        max_size=3,
    ),
    authorization=authorizations,
)
def test_any_path_method_and_query_get_an_openai_answer(
    live: LiveRouter,
    method: str,
    path: str,
    query: dict[str, str],
    authorization: bytes | None,
) -> None:
    qs = "&".join(f"{quote(k)}={quote(v)}" for k, v in query.items())
    headers = [] if authorization is None else [(b"authorization", authorization)]
    status, out_headers, out = live.asgi(method, f"{path}?{qs}", headers)
    event(f"status {status}")
    if status in (200, 503) and not out.startswith(b'{"error"'):
        return  # a success: /ready answers 503 with its readiness body
    _assert_openai_answer(status, out_headers, out)  # (for HEAD, the server drops the body)


# ------------------------------------------------------------------------------------------------
# Bodies nested as deep as parsers go
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [100, 254, 255, 600, 1000, 1100])
@pytest.mark.parametrize("where", ["extra", "tools", "stream"])
def test_deeply_nested_bodies(live: LiveRouter, depth: int, where: str) -> None:
    nested = b"[" * depth + b"]" * depth
    field = b'"tools":[' + nested + b"]" if where == "tools" else b'"extra":' + nested
    stream = b',"stream":true' if where == "stream" else b""
    body = b'{"model":"tiny","messages":[{"role":"user","content":"x"}],' + field + stream + b"}"
    auth = [(b"authorization", f"Bearer {TENANT_KEY}".encode())]
    status, headers, out = live.asgi("POST", "/v1/chat/completions", auth, body)
    assert status in (200, 400), out[:300]
    _assert_openai_answer(status, headers, out)


# ------------------------------------------------------------------------------------------------
# Header injection
# ------------------------------------------------------------------------------------------------

INJECTED = b"run-1\r\nx-injected: 1\r\n\r\n<html>"


def test_crlf_in_header_values_reaches_no_response_header(live: LiveRouter) -> None:
    """As a server more lenient than httptools' parser would pass them: every value with CR/LF."""
    auth = (b"authorization", f"Bearer {TENANT_KEY}".encode())
    body = orjson.dumps(CHAT)
    for name in (*GP_HEADERS, *RUN_ID_HEADERS, "authorization"):
        if name == "authorization":
            headers = [(b"authorization", b"Bearer " + INJECTED)]
        else:
            headers = [auth, (name.encode(), INJECTED)]
        for stream in (False, True):
            raw = orjson.dumps({**CHAT, "stream": stream}) if stream else body
            status, out_headers, out = live.asgi("POST", "/v1/chat/completions", headers, raw)
            _assert_openai_answer(status, out_headers, out)
            assert b"x-injected" not in b"".join(v for _, v in out_headers)
    # the run id is kept as sent and comes back JSON-escaped
    run_id = INJECTED.decode()
    summary = httpx.get(
        f"{live.url}/v1/runs/{quote(run_id, safe='')}",
        headers={"authorization": f"Bearer {TENANT_KEY}"},
    )
    assert summary.status_code == 200, summary.text
    assert summary.json()["run_id"] == run_id
    assert b"\r\n" not in summary.content


def _raw_exchange(live: LiveRouter, data: bytes, timeout_s: float = 5.0) -> bytes:
    """Send `data` on a fresh connection; everything the router sends until it closes."""
    with socket.create_connection((live.host, live.port), timeout=timeout_s) as sock:
        sock.sendall(data)
        return _read_response(sock)


def _read_response(sock: socket.socket) -> bytes:
    """One response: its head and its body (de-chunked)."""
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = sock.recv(65536)
        if not chunk:
            return out
        out += chunk
    head, _, rest = out.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
    chunked = fields.get(b"transfer-encoding", b"").strip() == b"chunked"
    length = int(fields.get(b"content-length", b"0"))
    while (b"\r\n0\r\n\r\n" not in b"\r\n" + rest) if chunked else len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    if chunked:
        body = b""
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            body, rest = body + rest[:n], rest[n + 2 :]
            if n == 0:
                break
        rest = body
    return head + b"\r\n\r\n" + rest


def _request(live: LiveRouter, extra: bytes = b"", body: bytes | None = None) -> bytes:
    body = orjson.dumps(CHAT) if body is None else body
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "
        + TENANT_KEY.encode()
        + b"\r\n"
        + extra
        + b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


@pytest.mark.parametrize(
    "extra",
    [
        b"x-gpupool-run-id: a\rx-injected: 1\r\n",  # bare CR
        b"x-gpupool-run-id: a\nx-injected: 1\r\n",  # bare LF
        b"x-gpupool-run-id: a\r\n x-injected: 1\r\n",  # obsolete line folding
        b"x-gpupool-run-id: a\x00b\r\n",
        b"x-gpupool-run-id : a\r\n",  # space before the colon
        b"Transfer-Encoding: chunked\r\n",  # with Content-Length: a smuggling attempt
    ],
    ids=["bare-cr", "bare-lf", "obs-fold", "nul", "space-colon", "cl-and-te"],
)
def test_the_server_refuses_malformed_header_bytes(live: LiveRouter, extra: bytes) -> None:
    seen = len(live.engine_headers)
    answer = _raw_exchange(live, _request(live, extra))
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower()
    assert orjson.loads(body)["error"]["code"] == "invalid_http"  # OpenAI's shape
    assert b"x-injected" not in answer.lower()
    assert len(live.engine_headers) == seen  # nothing went upstream


def test_no_client_header_reaches_an_engine(live: LiveRouter) -> None:
    sent = {
        "authorization": f"Bearer {TENANT_KEY}",
        "x-gpupool-run-id": "run-forward",
        "cookie": "session=secret",
        "x-forwarded-for": "10.0.0.1",
        "x-request-id": "client-chosen",
        "x-extra": "client",
    }
    resp = httpx.post(f"{live.url}/v1/chat/completions", json=CHAT, headers=sent)
    assert resp.status_code == 200
    upstream = live.engine_headers[-1]
    allowed = {b"host", b"content-type", b"content-length", b"x-request-id", b"accept"}
    assert set(upstream) <= allowed | {b"accept-encoding", b"authorization"}
    assert b"authorization" not in upstream  # these engines take no key; the tenant's never goes
    assert upstream[b"x-request-id"] == resp.headers["x-gpupool-request-id"].encode()
    for value in sent.values():
        assert value.encode() not in upstream.values()


# ------------------------------------------------------------------------------------------------
# Oversized headers and bodies, slow uploads
# ------------------------------------------------------------------------------------------------

BIG_HEADER = 60 * 1024  # under router.max_header_bytes (64 KiB): reaches the router


@pytest.mark.parametrize(
    ("header", "status"),
    [
        ("x-gpupool-run-id", 200),  # kept, cut to 256 characters
        ("x-gpupool-deadline-ms", 400),
        ("x-gpupool-class", 400),
        ("x-gpupool-usage", 200),  # not "1"/"true"/"yes": ignored
        ("x-unknown", 200),
    ],
)
def test_big_headers_through_uvicorn(live: LiveRouter, header: str, status: int) -> None:
    value = ("9" if header == "x-gpupool-deadline-ms" else "h") * BIG_HEADER
    answer = _raw_exchange(live, _request(live, f"{header}: {value}\r\n".encode()))
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert len(head) < 1024  # nothing of it is echoed back
    if status != 200:
        assert len(body) < 1024, len(body)
        _assert_openai_answer(status, [(b"content-type", b"application/json")], body)


def test_a_head_over_max_header_bytes_is_a_431_in_openai_shape(live: LiveRouter) -> None:
    value = "h" * (live.gateway.config.router.max_header_bytes + 1)
    answer = _raw_exchange(live, _request(live, f"x-big: {value}\r\n".encode()))
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    _, _, body = answer.partition(b"\r\n\r\n")
    _assert_openai_answer(431, [(b"content-type", b"application/json")], body)
    assert orjson.loads(body)["error"]["code"] == "headers_too_large"


def test_big_authorization_is_a_401(live: LiveRouter) -> None:
    for path in ("/v1/models", "/admin/pools", "/metrics", "/v1/runs"):
        data = (
            f"GET {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {'k' * BIG_HEADER}\r\n\r\n"
        )
        answer = _raw_exchange(live, data.encode())
        assert answer.startswith(b"HTTP/1.1 401 "), (path, answer[:200])
        assert len(answer) < 1024


def test_big_run_id_is_kept_to_256_characters(live: LiveRouter) -> None:
    run_id = "r" * BIG_HEADER
    auth = {"authorization": f"Bearer {TENANT_KEY}"}
    resp = httpx.post(
        f"{live.url}/v1/chat/completions", json=CHAT, headers={**auth, "x-gpupool-run-id": run_id}
    )
    assert resp.status_code == 200
    summary = httpx.get(f"{live.url}/v1/runs/{run_id[:256]}", headers=auth)
    assert summary.status_code == 200 and summary.json()["run_id"] == run_id[:256]


def test_an_oversized_body_that_arrived_whole_is_a_413(live: LiveRouter) -> None:
    """Taken from the server's buffer at once (ClientLink.take_body), still bounded."""
    for size, status in ((MAX_BODY_BYTES + 1, b"413"), (MAX_BODY_BYTES, b"400")):
        with socket.create_connection((live.host, live.port), timeout=5) as sock:
            sock.sendall(_request(live, body=b" " * size))
            answer = _read_response(sock)
        assert answer.startswith(b"HTTP/1.1 " + status + b" "), answer[:200]


def test_oversized_body_is_a_413_before_the_rest_arrives(live: LiveRouter) -> None:
    head = _request(live, body=b"")
    head = head.replace(b"Content-Length: 0", f"Content-Length: {100 * 1024 * 1024}".encode())
    with socket.create_connection((live.host, live.port), timeout=5) as sock:
        sock.sendall(head + b" " * (MAX_BODY_BYTES + 1))
        start = time.perf_counter()
        answer = _read_response(sock)
        took_s = time.perf_counter() - start
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert took_s < BODY_TIMEOUT_S * 0.8  # at once, not after waiting for the rest
    body = answer.partition(b"\r\n\r\n")[2]
    assert orjson.loads(body)["error"]["code"] == "body_too_large"


@pytest.mark.parametrize("chunked", [False, True])
def test_body_size_limit_is_exact(live: LiveRouter, chunked: bool) -> None:
    raw = orjson.dumps(CHAT)
    auth = {"authorization": f"Bearer {TENANT_KEY}", "content-type": "application/json"}

    def send(size: int) -> int:
        body = raw + b" " * (size - len(raw))
        content: Any = iter([body[: size // 2], body[size // 2 :]]) if chunked else body
        url = f"{live.url}/v1/chat/completions"
        return httpx.post(url, content=content, headers=auth).status_code

    assert send(MAX_BODY_BYTES) == 200
    assert send(MAX_BODY_BYTES + 1) == 413


def test_slow_upload_is_a_408_after_body_read_timeout(live: LiveRouter) -> None:
    full = _request(live)
    with socket.create_connection((live.host, live.port), timeout=5) as sock:
        sock.sendall(full[:-10])  # all but the last bytes of the body
        start = time.perf_counter()
        answer = _read_response(sock)
        took_s = time.perf_counter() - start
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert BODY_TIMEOUT_S * 0.9 <= took_s <= BODY_TIMEOUT_S + 5.0, took_s  # not hanging
    assert orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "body_timeout"


def test_the_key_is_checked_before_the_body_is_read(live: LiveRouter) -> None:
    head = _request(live, body=b"").replace(TENANT_KEY.encode(), b"sk-wrong")
    head = head.replace(b"Content-Length: 0", f"Content-Length: {10 * MAX_BODY_BYTES}".encode())
    with socket.create_connection((live.host, live.port), timeout=5) as sock:
        sock.sendall(head)  # and no body at all
        start = time.perf_counter()
        answer = _read_response(sock)
        took_s = time.perf_counter() - start
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert took_s < BODY_TIMEOUT_S * 0.8  # not after waiting for the body
