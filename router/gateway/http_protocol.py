"""What the request path sees of gpupool's HTTP server (router/gateway/server.py): a request's
`ClientLink` in its scope, and the server's own answers, OpenAI-shaped JSON like every other
gpupool error.

Each request's scope carries a `ClientLink` (`scope[CLIENT_LINK]`): the request path registers
its task there and is cancelled when the client's connection is lost before the response is
complete, and can ask whether the whole body has already arrived. That is what lets it serve a
request in the server's own task, with no disconnect-watching task beside it. A stream's chunks
may go through `ClientLink.write_more` (straight to the connection in chunked framing) and a
whole response through `ClientLink.respond` (status line, headers and body in one write, where
a start and a body message through `send` would make two) whenever `send` would write them at
once; when the client reads slowly (the transport paused writing) they answer False and the
caller `send`s, which waits.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

__all__ = ["CLIENT_LINK", "ClientLink"]

CLIENT_LINK = "gpupool.client_link"  # the scope key of a request's ClientLink


def _error_body(message: str, code: str, kind: str = "invalid_request_error") -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "code": code, "param": None}})


_OVERLOADED = _error_body(
    "the router is at router.max_connections; retry shortly", "too_many_connections", "overloaded"
)


def _error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole answer that ends the connection."""
    body = _error_body(message, code)
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode("ascii") + body


class ClientLink:
    """One request's tie to its client connection. `task`, set by the request path while it
    serves, is cancelled when the connection is lost before the response is complete (then
    `lost` is True). The server implements the rest (router/gateway/server.py)."""

    __slots__ = ("lost", "task")

    def __init__(self) -> None:
        self.lost = False
        self.task: asyncio.Task[Any] | None = None

    @property
    def body_arrived(self) -> bool:
        """True once the request's whole body has been received."""
        raise NotImplementedError

    def take_body(self) -> bytes | None:
        """The request's whole body once it has arrived, handed over as `receive` would
        (reading resumed, the buffer emptied) without its coroutine and message; None when it
        must be read through `receive` instead: more is to come, the client left, or it waits
        for a `100 Continue`."""
        raise NotImplementedError

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """The whole response in one write, as `send` of a start message (`headers`, no
        content-length among them) and one body message would write it (the server's default
        headers, `send`'s header checks, `connection: close` when the connection ends, the
        exchange then complete and the connection ready for the next request), with a
        content-length: True when written. False, having written nothing, when the caller
        must `send` instead: the response started already, the client left or reads slowly,
        the request is a HEAD, or a header would be refused."""
        raise NotImplementedError

    def write_more(self, body: bytes) -> bool:
        """Write `body`, not the last, to this request's started streaming (chunked) response,
        as `send` of `{"type": "http.response.body", "body": body, "more_body": True}` would,
        without its per-message work: True when written. False, having written nothing, when
        the caller must `send` it instead: the client's socket is full (`send` waits for it to
        drain: the slow-client bound), the client left, or the response is not a started
        chunked one."""
        raise NotImplementedError

    def _connection_lost(self) -> None:
        self.lost = True
        if self.task is not None:
            self.task.cancel()
