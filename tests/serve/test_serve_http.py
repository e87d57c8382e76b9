"""The endpoint under bad input: every malformed, hostile or unauthorised request gets a 4xx in
OpenAI's error shape (or its connection closed), and the server answers the next good one."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from asyncrl.models.tiny import build_tokenizer
from asyncrl.rollout.engine import SamplingParams
from asyncrl.serve import Limits, OpenAIServer
from tests.helpers.serve_http import exchange, post, read_reply
from tests.helpers.wait import until

GOOD = {"model": "m", "prompt": "sort 1 2", "max_tokens": 3}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "sort 1 2"}]}


class Echo:
    """A backend that answers `token` `max_tokens` times after `delay_s`."""

    params = SamplingParams()

    def __init__(self, token: int, delay_s: float = 0.0) -> None:
        self.token, self.delay_s, self.calls = token, delay_s, 0

    async def __call__(self, ids, max_tokens, sampling=None):
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        return [self.token] * max_tokens, [-0.5] * max_tokens, [1] * max_tokens


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


async def _server(tokenizer, delay_s: float = 0.0, **limits) -> OpenAIServer:
    backend = Echo(tokenizer.convert_tokens_to_ids("7"), delay_s)
    return await OpenAIServer(backend, tokenizer, model_name="m", api_key="key", context_length=64,
                              limits=Limits(**{"max_body_bytes": 4096, "header_timeout_s": 0.5, **limits})).start()


async def _still_serves(server: OpenAIServer) -> None:
    status, _, body = await exchange(server.port, post("/v1/completions", GOOD))
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "7 7 7"


def _chat(**fields) -> bytes:
    return post("/v1/chat/completions", {**CHAT, **fields})


def _text(**fields) -> bytes:
    return post("/v1/completions", {**GOOD, **fields})


BAD = {  # request -> (status, what the message must mention)
    "wrong key": (post("/v1/completions", GOOD, key="nope"), 401, "API key"),
    "missing key": (post("/v1/completions", GOOD, key=None), 401, "API key"),
    "unknown route": (post("/v1/embeddings", GOOD), 404, "/v1/chat/completions"),
    "wrong method": (b"GET /v1/completions HTTP/1.1\r\nAuthorization: Bearer key\r\n\r\n", 405, "POST"),
    "malformed JSON": (post("/v1/completions", b'{"model": "m", "prompt": '), 400, "not valid JSON"),
    "not an object": (post("/v1/completions", b"[1, 2]"), 400, "JSON object"),
    "unknown model": (_text(model="gpt-9"), 404, "serves 'm'"),
    "oversized body": (post("/v1/completions", {**GOOD, "prompt": "1 " * 4000}), 413, "at most 4096"),
    "chunked body": (b"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer key\r\nTransfer-Encoding: chunked\r\n"
                     b"\r\n5\r\nhello\r\n0\r\n\r\n", 411, "Content-Length"),
    "no length": (b"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer key\r\n\r\n", 411, "Content-Length"),
    "temperature a string": (_text(temperature="hot"), 400, "'temperature' must be a number from 0 to 2"),
    "n of zero": (_text(n=0), 400, "'n' must be an integer from 1"),
    "too many choices": (_text(n=65), 400, "at most 64 choices"),
    "negative max_tokens": (_text(max_tokens=-1), 400, "'max_tokens' must be an integer >= 1"),
    "past the context": (_text(max_tokens=100), 400, "context is 64 tokens"),
    "past the token limit": (_chat(max_completion_tokens=5000), 400, "at most 4096"),
    "stop not strings": (_text(stop=[1]), 400, "'stop'"),
    "top-k log-probs": (_text(logprobs=5), 400, "only the sampled token"),
    "chat top_logprobs": (_chat(logprobs=True, top_logprobs=3), 400, "'top_logprobs'"),
    "best_of": (_text(best_of=3), 400, "'best_of'"),
    "echo": (_text(echo=True), 400, "'echo'"),
    "suffix": (_text(suffix="x"), 400, "'suffix'"),
    "logit_bias": (_chat(logit_bias={"5": 10}), 400, "'logit_bias'"),
    "a json schema": (_chat(response_format={"type": "json_schema", "json_schema": {}}), 400, "'response_format'"),
    "forced tool call": (_chat(tool_choice="required"), 400, "'tool_choice'"),
    "token id out of range": (_text(prompt=[1, 10**9]), 400, "outside"),
    "an image part": (_chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "text parts"),
    "no messages": (_chat(messages=[]), 400, "'messages'"),
    "a bad role": (_chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0]"),
    "a prompt of nothing": (_text(prompt=[]), 400, "'prompt'"),
    "a prompt of no tokens": (_text(prompt=""), 400, "no tokens"),
    "a key and a chunked body": (b"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer nope\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 401, "API key"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_a_bad_request_gets_a_4xx_and_the_server_goes_on(tokenizer, case):
    data, want, mention = BAD[case]
    server = await _server(tokenizer)
    try:
        status, headers, body = await exchange(server.port, data)
        error = json.loads(body)["error"]
        assert status == want and mention in error["message"], (status, error)
        assert set(error) == {"message", "type", "param", "code"}
        await _still_serves(server)
    finally:
        await server.close()


@pytest.mark.parametrize("junk", [b"\x00\xff\xfe garbage \x01\r\n\r\n", b"GET\r\n\r\n", b"GET / HTTP/2.0\r\n\r\n",
                                  b"GET /v1/models HTTP/1.1\r\nbad header\r\n\r\n", b"\x16\x03\x01\x02\x00" * 50])
async def test_garbage_on_the_socket_is_refused(tokenizer, junk):
    server = await _server(tokenizer)
    try:
        status, _, _ = await exchange(server.port, junk)
        assert status in (0, 400)
        await _still_serves(server)
    finally:
        await server.close()


async def test_huge_headers_truncated_requests_and_slow_clients_are_cut_off(tokenizer):
    server = await _server(tokenizer, max_header_bytes=2048)
    try:
        huge = b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 100) for i in range(40))
        assert (await exchange(server.port, huge + b"\r\n"))[0] == 431
        assert (await exchange(server.port, b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n"))[0] == 414
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(post("/v1/completions", GOOD)[:-5])  # the body's last bytes never come
        writer.write_eof()
        assert (await read_reply(reader))[0] == 400
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nAuthor")  # then nothing: past header_timeout_s
        t0 = asyncio.get_running_loop().time()
        assert (await read_reply(reader))[0] == 408
        assert asyncio.get_running_loop().time() - t0 < 3
        writer.close()
        await _still_serves(server)
    finally:
        await server.close()


async def test_the_key_is_checked_before_the_body_is_read(tokenizer):
    server = await _server(tokenizer, max_body_bytes=2**30)
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer nope\r\nContent-Length: 1000000000\r\n\r\n"
        status, headers, _ = await exchange(server.port, head, timeout=2)  # no body sent: an answer at once
        assert status == 401 and headers["connection"] == "close" and headers["www-authenticate"] == "Bearer"
    finally:
        await server.close()


async def test_keep_alive_serves_several_requests_on_one_connection(tokenizer):
    server = await _server(tokenizer)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        models = b"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer key\r\n\r\n"
        writer.write(models + post("/v1/completions", GOOD) + models)  # pipelined
        replies = [await read_reply(reader) for _ in range(3)]
        assert [r[0] for r in replies] == [200, 200, 200]
        assert json.loads(replies[0][2])["data"][0]["id"] == "m"
        writer.write(post("/v1/completions", b"{", extra="Expect: 100-continue\r\n"))
        assert (await read_reply(reader))[0] == 100  # then the body's answer
        assert (await read_reply(reader))[0] == 400
        writer.close()
    finally:
        await server.close()


async def test_past_the_request_limit_a_client_gets_429_and_past_the_connection_limit_503(tokenizer):
    server = await _server(tokenizer, delay_s=0.5, max_requests=1, max_connections=3)
    try:
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": "Bearer key"}) as client:
            replies = await asyncio.gather(*(client.post("/completions", json=GOOD) for _ in range(2)))
            assert sorted(r.status_code for r in replies) == [200, 429]
            assert [r for r in replies if r.status_code == 429][0].json()["error"]["type"] == "rate_limit_error"
        await until(lambda: not server._connections, "the server to see those connections close")
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
        await until(lambda: len(server._connections) == 3, "the server to hold 3 connections")
        assert (await exchange(server.port, b""))[0] == 503
        for _, writer in held:
            writer.close()
        await until(lambda: not server._connections, "the held connections to close")
        await _still_serves(server)
    finally:
        await server.close()


async def test_a_server_stops_with_requests_in_flight(tokenizer):
    server = await _server(tokenizer, delay_s=30)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(post("/v1/completions", GOOD))
    await asyncio.sleep(0.1)
    await asyncio.wait_for(server.close(), 5)
    assert (await read_reply(reader))[0] == 0  # closed without a reply
    writer.close()
