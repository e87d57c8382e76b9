"""HTTP/1.1 on asyncio streams: as much as an OpenAI client needs, and every limit a listening
socket needs. No web framework: the project's runtime depends on none (fastapi and aiohttp are
only present through vLLM), and the requests here are few and simple.

What is understood: a request line, header lines (no obsolete folding), a body of Content-Length
bytes, keep-alive (HTTP/1.1's default, or `Connection: keep-alive` on 1.0), `Expect:
100-continue`. Refused: chunked request bodies (411), heads past `max_header_bytes` (431) or
slower than `header_timeout_s` (408), bodies past `max_body_bytes` (413, never read). A reply
either has a Content-Length or is a chunked stream (server-sent events).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 header names and methods
MAX_HEADERS = 100


@dataclass(frozen=True)
class Limits:
    """What one client may ask of the server: bytes and seconds (HTTP), tokens and choices (the API)."""

    max_header_bytes: int = 16 * 1024  # the request line and headers together
    max_body_bytes: int = 8 * 2**20
    header_timeout_s: float = 10.0  # from a request's first line to the end of its head
    body_timeout_s: float = 60.0  # to read a body, or to write a reply to a client that reads slowly
    idle_timeout_s: float = 75.0  # a kept-alive connection with no new request is closed after this
    max_connections: int = 256  # more are answered 503 and closed
    max_requests: int = 256  # requests being served at once; more are answered 429
    max_tokens: int = 4096  # per choice
    max_choices: int = 64  # choices per request (n times the prompts)


class HttpError(Exception):
    """A request answered with an error in OpenAI's shape; `close` when its body was not read."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, close: bool = False, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.close, self.headers = close, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    method: str
    path: str  # without the query string
    version: str
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    body: bytes = b""

    @property
    def has_body(self) -> bool:
        return self.headers.get("content-length", "0") != "0" or "transfer-encoding" in self.headers

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        return "keep-alive" in tokens if self.version == "HTTP/1.0" else "close" not in tokens


async def read_head(reader: asyncio.StreamReader, limits: Limits) -> Request | None:
    """The next request's line and headers; None when the client closed or idled between requests.
    From its first byte the whole head must come within `header_timeout_s`; the stream's `limit`
    (the server's `max_header_bytes`) bounds every line read."""
    try:
        async with asyncio.timeout(limits.idle_timeout_s):
            first = await reader.readexactly(1)
    except (TimeoutError, asyncio.IncompleteReadError):
        return None
    if not TOKEN.fullmatch(first):  # e.g. a TLS handshake: answered at once, not after a timeout
        raise HttpError(400, "this is not an HTTP/1.1 request (plain HTTP only, no TLS)", close=True)
    try:
        async with asyncio.timeout(limits.header_timeout_s):
            line = first + await _request_line_bytes(reader, limits)
            request = _request_line(line)
            request.headers = await _headers(reader, limits, len(line))
            return request
    except TimeoutError:
        raise HttpError(408, f"the request head did not arrive within {limits.header_timeout_s} s",
                        close=True) from None


async def _request_line_bytes(reader: asyncio.StreamReader, limits: Limits) -> bytes:
    try:
        return await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError:
        raise HttpError(400, "the request ended inside its request line", close=True) from None
    except (asyncio.LimitOverrunError, ValueError):
        raise HttpError(414, f"the request line is longer than {limits.max_header_bytes} bytes", close=True) from None


def _request_line(line: bytes) -> Request:
    parts = line.rstrip(b"\r\n").split(b" ")
    if len(parts) != 3 or not TOKEN.fullmatch(parts[0]) or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise HttpError(400, "not an HTTP/1.1 request line (METHOD /path HTTP/1.1)", close=True)
    target = parts[1].decode("latin-1")
    if not target.startswith("/"):
        raise HttpError(400, "the request target must be a path (/v1/...)", close=True)
    return Request(parts[0].decode(), target.split("?", 1)[0], parts[2].decode())


async def _headers(reader: asyncio.StreamReader, limits: Limits, used: int) -> dict[str, str]:
    headers: dict[str, str] = {}
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError:
            raise HttpError(400, "the request ended inside its headers", close=True) from None
        except (asyncio.LimitOverrunError, ValueError):
            line = b"x" * (limits.max_header_bytes + 1)  # one line past the limit: the head is too
        used += len(line)
        if used > limits.max_header_bytes or len(headers) >= MAX_HEADERS:
            raise HttpError(431, f"the request head is larger than {limits.max_header_bytes} bytes or "
                            f"{MAX_HEADERS} headers", close=True)
        if line in (b"\r\n", b"\n"):
            return headers
        name, sep, value = line.partition(b":")
        if not sep or not TOKEN.fullmatch(name):  # also refuses folded lines and a space before the colon
            raise HttpError(400, f"malformed header line {line[:40]!r}", close=True)
        key, text = name.decode().lower(), value.strip().decode("latin-1")
        if key == "content-length" and key in headers and headers[key] != text:
            raise HttpError(400, "conflicting Content-Length headers", close=True)
        headers[key] = f"{headers[key]}, {text}" if key in headers and key != "content-length" else text


def body_length(request: Request, limits: Limits) -> int:
    """The body's size from Content-Length, checked before a byte of it is read."""
    if "transfer-encoding" in request.headers:
        raise HttpError(411, "chunked request bodies are not supported: send the body with a Content-Length",
                        close=True)
    text = request.headers.get("content-length")
    if text is None:
        if request.method == "POST":
            raise HttpError(411, "a POST needs a Content-Length header", close=True)
        return 0
    if not text.isdigit() or len(text) > 18:
        raise HttpError(400, f"Content-Length {text[:20]!r} is not a number of bytes", close=True)
    if int(text) > limits.max_body_bytes:
        raise HttpError(413, f"the body is {int(text)} bytes; this server takes at most {limits.max_body_bytes}",
                        close=True)
    return int(text)


async def read_body(reader: asyncio.StreamReader, length: int, limits: Limits) -> bytes:
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            return await reader.readexactly(length)
    except TimeoutError:
        raise HttpError(408, f"the body did not arrive within {limits.body_timeout_s} s", close=True) from None
    except asyncio.IncompleteReadError:
        raise HttpError(400, f"the body ended before its Content-Length ({length} bytes)", close=True) from None


def response(status: int, payload: Any, *, keep_alive: bool, headers: dict[str, str] | None = None) -> bytes:
    """A whole JSON reply."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    extra = {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
    return _head(status, extra, keep_alive) + body


def stream_head(keep_alive: bool) -> bytes:
    """The head of a server-sent-events reply: chunks (`event`) follow, then `LAST_CHUNK`."""
    return _head(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                       "Transfer-Encoding": "chunked"}, keep_alive)


def event(payload: Any) -> bytes:
    """One server-sent event as one chunk; a str payload goes as it is (`[DONE]`)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    line = f"data: {data}\n\n".encode()
    return b"%x\r\n%s\r\n" % (len(line), line)


LAST_CHUNK = b"0\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _head(status: int, headers: dict[str, str], keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
             *(f"{k}: {v}" for k, v in headers.items()), f"Connection: {'keep-alive' if keep_alive else 'close'}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
