"""Every router replica observable (issue 25): `router.metrics_port` checked against the
client port, the port range and the local engines' ports (after `--port` / `--replicas`);
gpupool's server writing its constant headers (the router's `x-gpupool-replica`) on every
answer (a whole response, a stream, the application's failure, the server's own 400 and 503);
and a further listener answering only the operators' paths, through the one lifespan and the
one shutdown. On real sockets; `gpupool serve --replicas 2` itself is
test_replica_metrics_serve.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from pools.config import ConfigError, contract_problems, load_config
from pools.launchers import LauncherError
from pools.testing.config import config_data, config_for_test
from pools.testing.router_process import free_port
from router.cli.commands._config import stack_config
from router.cli.replicas import _Router
from router.cli.stack import METRICS_PORT_PATHS, _bind_or_close
from router.gateway.server import PathListener, Server, ServerSettings
from tests.unit.test_server import _listener

REPLICA = (b"x-gpupool-replica", b"box:4242:a1b2c3")
SHARED = {"url": "postgresql://u@db/x"}


def _metrics_problems(**router: Any) -> list[str]:
    config = config_for_test(router=router, store=SHARED)
    return [p for p in contract_problems(config) if p.startswith("router.metrics_port")]


def test_one_router_on_a_metrics_port_of_its_own_is_consistent() -> None:
    assert _metrics_problems(metrics_port=9400) == []
    assert _metrics_problems(metrics_port=9400, replicas=3) == []
    assert config_for_test().router.metrics_port is None  # none unless asked for


def test_a_metrics_port_that_takes_the_client_port_is_refused() -> None:
    (problem,) = _metrics_problems(port=8000, metrics_port=8000)
    assert problem == (
        "router.metrics_port: 8000 takes router.port 8000: the client API and the metrics port"
        " need ports of their own"
    )
    # router process i listens on metrics_port + i: 7999 and 8000 for two
    (problem,) = _metrics_problems(port=8000, metrics_port=7999, replicas=2)
    assert problem.startswith("router.metrics_port: 7999-8000 (one per router process) takes")
    assert _metrics_problems(port=8000, metrics_port=7998, replicas=2) == []


def test_metrics_ports_past_65535_are_refused() -> None:
    (problem,) = _metrics_problems(metrics_port=65535, replicas=2)
    assert problem == (
        "router.metrics_port: 2 router processes would listen on 65535-65536, past 65535:"
        " give at most 65534"
    )
    assert _metrics_problems(metrics_port=65534, replicas=2) == []


def test_metrics_ports_among_the_local_engines_are_refused() -> None:
    config = config_for_test(
        router={"metrics_port": 8101},
        engines={"launcher": "local", "local": {"count": 2, "base_port": 8100}},
    )
    assert [p for p in contract_problems(config) if p.startswith("router.metrics_port")] == [
        "router.metrics_port: 8101 overlaps the local engines' ports 8100-8101"
        " (engines.local.base_port + i)"
    ]


def test_the_port_and_replicas_flags_are_checked_against_the_metrics_port(
    tmp_path: Path,
) -> None:
    path = tmp_path / "config.json"
    data = config_data(tmp_path, router={"metrics_port": 9400})
    path.write_text(json.dumps(data, default=str))
    args = argparse.Namespace(config=str(path), port=9401, replicas=2, verbose=False)
    config = stack_config(args)
    assert config is not None
    assert [p for p in contract_problems(config) if p.startswith("router.metrics_port")] == [
        "router.metrics_port: 9400-9401 (one per router process) takes router.port 9401:"
        " the client API and the metrics port need ports of their own"
    ]


@pytest.mark.parametrize("port", [0, 65536, "metrics"])
def test_a_metrics_port_that_is_no_port_is_a_config_error(tmp_path: Path, port: object) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_data(tmp_path, router={"metrics_port": port}), default=str))
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert any("router.metrics_port" in p for p in err.value.problems), err.value.problems


# ------------------------------------------------------------------------------- the server


class _App:
    """An application with a lifespan (counted), a whole response, a stream, a failure."""

    def __init__(self) -> None:
        self.lifespans = 0
        self.paths: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            self.lifespans += 1
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        self.paths.append(path)
        if path == "/fail":
            raise RuntimeError("the application failed")
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for part in (b"data: 1\n\n", b"data: [DONE]\n\n"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        headers = [(b"content-length", b"2")]
        status = 401 if path == "/v1/denied" else 200
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})


async def _raw(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


async def test_every_answer_names_the_replica() -> None:
    app = _App()
    sock, port = _listener()
    server = Server(app, ServerSettings(max_connections=2), headers=[REPLICA])
    await server.start(sock)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for path in ("/v1/chat/completions", "/v1/denied", "/stream", "/fail"):
                response = await client.get(path)
                assert response.headers["x-gpupool-replica"] == "box:4242:a1b2c3", path
                assert response.headers.get_list("x-gpupool-replica") == ["box:4242:a1b2c3"]
            assert (await client.get("/stream")).headers["transfer-encoding"] == "chunked"
            assert (await client.get("/fail")).status_code == 500
        # the server's own answers: bytes that are not HTTP, and one past max_connections
        bad = await _raw(port, b"NOT HTTP\r\n\r\n")
        assert bad.startswith(b"HTTP/1.1 400 ") and b"\r\nx-gpupool-replica: box:4242" in bad
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)  # one of two
        over = await _raw(port, b"GET / HTTP/1.1\r\nhost: r\r\n\r\n")
        assert over.startswith(b"HTTP/1.1 503 ") and b"\r\nx-gpupool-replica: box:4242" in over
        writer.close()
    finally:
        await server.aclose()
        sock.close()


async def test_without_headers_nothing_is_added() -> None:
    sock, port = _listener()
    server = Server(_App(), ServerSettings())
    await server.start(sock)
    try:
        answer = await _raw(port, b"GET /x HTTP/1.1\r\nhost: r\r\nconnection: close\r\n\r\n")
        head = answer.split(b"\r\n\r\n")[0].split(b"\r\n")
        assert [line.split(b":")[0] for line in head[1:]] == [
            b"date",
            b"content-length",
            b"connection",
        ]
    finally:
        await server.aclose()
        sock.close()


def test_a_header_send_would_refuse_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="not a valid response header"):
        Server(_App(), ServerSettings(), headers=[(b"x-gpupool-replica", b"a\r\nb")])
    with pytest.raises(ValueError, match="not a valid response header"):
        Server(_App(), ServerSettings(), headers=[(b"bad name", b"v")])
    with pytest.raises(ValueError, match="absolute paths"):
        PathListener(socket.socket(), ())


async def test_the_metrics_listener_answers_only_the_operators_paths() -> None:
    app = _App()
    main, main_port = _listener()
    side, side_port = _listener()
    server = Server(app, ServerSettings(), headers=[REPLICA])
    await server.start(main, also=[PathListener(side, METRICS_PORT_PATHS)])
    assert app.lifespans == 1  # one application, one lifespan, two listeners
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{side_port}") as client:
            for path in ("/metrics", "/health", "/ready", "/admin/pools", "/ui", "/ui/app.js"):
                response = await client.get(path)
                assert response.status_code == 200, path
                assert response.headers["x-gpupool-replica"] == "box:4242:a1b2c3"
            for path in ("/v1/chat/completions", "/v1/models", "/metrics/x", "/admin", "/"):
                post = path.startswith("/v1/c")
                response = await (client.post(path) if post else client.get(path))
                assert response.status_code == 404, path
                error = response.json()["error"]
                assert error["code"] == "not_on_this_port", path
                assert response.headers["x-gpupool-replica"] == "box:4242:a1b2c3"
        served = ["/metrics", "/health", "/ready", "/admin/pools", "/ui", "/ui/app.js"]
        assert app.paths == served  # the refused ones never reached the application
        # the client port still serves everything
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{main_port}") as client:
            assert (await client.get("/v1/models")).status_code == 200
        # a connection kept open on each: the shutdown closes both, then the lifespan ends
        async with httpx.AsyncClient() as client:
            await client.get(f"http://127.0.0.1:{side_port}/health")
            await client.get(f"http://127.0.0.1:{main_port}/health")
            assert server.connections == 2
            await server.aclose()
            assert server.connections == 0
        for port in (main_port, side_port):
            with pytest.raises(httpx.ConnectError):
                async with httpx.AsyncClient() as client:
                    await client.get(f"http://127.0.0.1:{port}/health")
    finally:
        await server.aclose()
        main.close()
        side.close()


def test_a_metrics_port_already_taken_is_refused_naming_the_setting() -> None:
    taken, port = _listener()
    try:
        # one router (router/cli/stack.py): the client port's socket is closed again
        client, _ = _listener()
        with pytest.raises(LauncherError) as err:
            _bind_or_close(client, "127.0.0.1", port)
        assert str(err.value) == (
            f"cannot listen on 127.0.0.1:{port}: Address already in use"
            " (set router.metrics_port in the config)"
        )
        assert client.fileno() == -1
        # router process 1 of the supervisor's (metrics_port + 1 taken): refused before its
        # process is started, and its place's socket on the shared port is closed again
        shared_port = free_port()
        config = config_for_test(router={"port": shared_port, "metrics_port": port - 1})
        with pytest.raises(LauncherError, match=f"127.0.0.1:{port}: Address already in use"):
            _Router(multiprocessing.get_context("forkserver"), 1, config)
        with socket.socket() as probe:  # no socket of the failed place holds the shared port
            probe.bind(("127.0.0.1", shared_port))
    finally:
        taken.close()
