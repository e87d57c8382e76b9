"""For the endpoint's tests (tests/serve/): raw HTTP exchanges, and the forward log-probs every
returned log-prob is checked against."""

from __future__ import annotations

import asyncio
import json

import torch


def forward_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """The model's log-probs of `tokens` after `prompt` at temperature 1, in one plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


async def exchange(port: int, data: bytes, *, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes; read one reply (status, headers, body). Status 0: the server closed the
    connection without a reply."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await read_reply(reader, timeout)
    finally:
        writer.close()


async def read_reply(reader: asyncio.StreamReader, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    async with asyncio.timeout(timeout):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return 0, {}, b""
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        return int(lines[0].split()[1]), headers, body


def post(path: str, payload, *, key: str | None = "key", extra: str = "") -> bytes:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body
