"""The OpenAI-compatible endpoint: `GET /v1/models`, `POST /v1/completions`, `POST
/v1/chat/completions` over a `Backend`, every choice reported to a `Recorder`.

Safety, in the order a request meets it: at most `max_connections` connections; the head within
`max_header_bytes` and `header_timeout_s`; the API key (`Authorization: Bearer`, compared in
constant time) before a byte of the body is read, let alone held; the body's Content-Length
against `max_body_bytes`; at most `max_requests` in service (429 beyond); then the fields. A
malformed request is answered (or its connection closed) and harms nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from asyncrl.serve import api, choices
from asyncrl.serve.backend import Backend, ChoiceRecord, Recorder
from asyncrl.serve.http import (
    CONTINUE,
    LAST_CHUNK,
    HttpError,
    Limits,
    Request,
    body_length,
    event,
    read_body,
    read_head,
    response,
    stream_head,
)

log = logging.getLogger("asyncrl.serve")
MAX_TRAJECTORY_ID = 256
ROUTES = {"/v1/models": "GET", "/v1/completions": "POST", "/v1/chat/completions": "POST"}


class OpenAIServer:
    """Serves `backend` as `model_name` on http://host:port/v1 to clients holding `api_key`.

    `tokenizer` renders chat messages (its chat template, with `tools`), encodes text prompts
    and decodes choices; `context_length` bounds prompt + max_tokens; `end_token_ids` (default:
    the tokenizer's end of sequence) tell a finished choice ("stop") from a cut one ("length")."""

    def __init__(self, backend: Backend, tokenizer: Any, *, model_name: str, api_key: str,
                 host: str = "127.0.0.1", port: int = 0, limits: Limits | None = None,
                 recorder: Recorder | None = None, context_length: int | None = None,
                 end_token_ids: Sequence[int] | None = None) -> None:
        if not api_key:
            raise ValueError("an API key is required: every listening socket is authenticated")
        self.backend, self.tokenizer, self.model_name = backend, tokenizer, model_name
        self.host, self.port, self.limits, self.recorder = host, port, limits or Limits(), recorder
        self.context_length = context_length
        self.end_token_ids = list(end_token_ids if end_token_ids is not None else [tokenizer.eos_token_id])
        self._key = api_key.encode()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._active = 0  # requests in service

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def start(self) -> OpenAIServer:
        self._server = await asyncio.start_server(self._connection, self.host, self.port,
                                                  limit=self.limits.max_header_bytes)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("serving %s at %s", self.model_name, self.url)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> OpenAIServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # connections ----------------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        try:
            if len(self._connections) >= self.limits.max_connections:
                await self._send(writer, response(503, HttpError(503, "too many connections", kind="server_error")
                                                  .body(), keep_alive=False))
                return
            self._connections.add(task)
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away, or stopped reading its reply
        except asyncio.CancelledError:
            pass  # `close`: asyncio's stream callback would report a cancelled connection as an error
        finally:
            self._connections.discard(task)
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve the connection's next request; False when the connection is to be closed."""
        request = None
        try:
            request = await read_head(reader, self.limits)
            if request is None:
                return False
            return await self._serve(request, reader, writer)
        except HttpError as e:
            keep = request is not None and request.keep_alive and not e.close
            await self._send(writer, response(e.status, e.body(), keep_alive=keep, headers=e.headers))
            return keep

    async def _serve(self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            self._authorize(request)
            handler = self._route(request)
            length = body_length(request, self.limits)
        except HttpError as e:  # answered before its body is read: the connection cannot go on after one
            e.close = e.close or request.has_body
            raise
        if length and "100-continue" in request.headers.get("expect", "").lower():
            await self._send(writer, CONTINUE)
        request.body = await read_body(reader, length, self.limits) if length else b""
        if self._active >= self.limits.max_requests:
            raise HttpError(429, f"{self._active} requests are being served, the most this server takes at once; "
                            "retry shortly", kind="rate_limit_error", code="rate_limit_exceeded",
                            headers={"Retry-After": "1"})
        self._active += 1
        try:
            reply = await self._reply(handler, request)
            if isinstance(reply, dict):
                await self._send(writer, response(200, reply, keep_alive=request.keep_alive))
            else:
                await self._stream(writer, reply, request.keep_alive)
        finally:
            self._active -= 1
        return request.keep_alive

    async def _reply(self, handler: Any, request: Request) -> dict[str, Any] | AsyncIterator[Any]:
        try:
            return await handler(request)
        except HttpError:
            raise
        except Exception as e:  # the server's fault, not the request's: say so, keep serving
            log.exception("%s %s failed", request.method, request.path)
            raise HttpError(500, f"the server failed: {type(e).__name__}: {e}", kind="server_error") from e

    async def _stream(self, writer: asyncio.StreamWriter, events: AsyncIterator[Any], keep_alive: bool) -> None:
        await self._send(writer, stream_head(keep_alive))
        try:
            async with contextlib.aclosing(events):
                async for payload in events:
                    await self._send(writer, event(payload))
        except (ConnectionError, TimeoutError):
            raise
        except Exception as e:  # the head is sent: the error goes as the stream's last event
            log.exception("a stream failed")
            await self._send(writer, event(HttpError(500, f"the server failed: {type(e).__name__}: {e}",
                                                     kind="server_error").body()))
        await self._send(writer, LAST_CHUNK)

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        async with asyncio.timeout(self.limits.body_timeout_s):
            await writer.drain()

    def _authorize(self, request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise HttpError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _route(self, request: Request) -> Any:
        path = request.path.rstrip("/")
        method = ROUTES.get(path) or ("GET" if path.startswith("/v1/models/") else None)
        if method is None:
            raise HttpError(404, f"no route {request.path[:100]}: this server answers "
                            f"{', '.join(f'{m} {p}' for p, m in ROUTES.items())}", code="unknown_url")
        if request.method != method:
            raise HttpError(405, f"{path} takes {method}, not {request.method}", headers={"Allow": method})
        if path.startswith("/v1/models"):
            return self._models
        return self._completions if path == "/v1/completions" else self._chat

    # the OpenAI layer -----------------------------------------------------------------------------
    async def _models(self, request: Request) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "asyncrl",
                "max_model_len": self.context_length}
        wanted = request.path.rstrip("/").removeprefix("/v1/models").removeprefix("/")
        if wanted and wanted != self.model_name:
            raise HttpError(404, f"The model {wanted[:100]!r} does not exist: this server serves "
                            f"{self.model_name!r}", code="model_not_found")
        return card if wanted else {"object": "list", "data": [card]}

    async def _completions(self, request: Request) -> dict[str, Any] | AsyncIterator[Any]:
        body = api.parse_json(request.body)
        api.check_model(body, self.model_name)
        req = api.completion_request(body, self.limits)
        prompts = [self._encode(p) for p in req.prompts]
        budget = self._budget(prompts, req.params.max_tokens, "prompt")
        return await self._generate("text_completion", prompts, req.params, budget, self._trajectory(request, req))

    async def _chat(self, request: Request) -> dict[str, Any] | AsyncIterator[Any]:
        body = api.parse_json(request.body)
        api.check_model(body, self.model_name)
        req = api.chat_request(body, self.limits)
        prompt = self._render(req)
        budget = self._budget([prompt], req.params.max_tokens, "messages")
        return await self._generate("chat.completion", [prompt], req.params, budget, self._trajectory(request, req))

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        vocab = len(self.tokenizer)
        if not all(0 <= t < vocab for t in prompt):
            raise HttpError(400, f"'prompt' holds token ids outside [0, {vocab})", param="prompt")
        return list(prompt)

    def _render(self, req: api.ChatRequest) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(req.messages, tools=req.tools, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as e:  # jinja raises on roles or shapes the template does not know
            raise HttpError(400, f"the model's chat template cannot render these messages: {e}",
                            param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _budget(self, prompts: list[list[int]], asked: int | None, param: str) -> int:
        """max_tokens, checked against the context; chat's default is all the context leaves."""
        if not all(prompts):
            raise HttpError(400, "the prompt encodes to no tokens", param=param)
        if self.context_length is None:
            return asked if asked is not None else self.limits.max_tokens
        longest = max(map(len, prompts))
        room = self.context_length - longest
        if room < 1 or (asked or 0) > room:
            raise HttpError(400, f"this model's context is {self.context_length} tokens; the prompt has {longest} "
                            f"and max_tokens asks for {asked or 1} more", param=param)
        return asked if asked is not None else min(room, self.limits.max_tokens)

    def _trajectory(self, request: Request, req: api.CompletionRequest | api.ChatRequest) -> str | None:
        trajectory = request.headers.get("x-trajectory-id") or req.params.user
        if trajectory is not None and len(trajectory) > MAX_TRAJECTORY_ID:
            raise HttpError(400, f"the trajectory id (X-Trajectory-Id or 'user') is longer than {MAX_TRAJECTORY_ID} "
                            "characters", param="user")
        return trajectory

    async def _generate(self, kind: str, prompts: list[list[int]], params: api.Params, budget: int,
                        trajectory: str | None) -> dict[str, Any] | AsyncIterator[Any]:
        head = {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{secrets.token_hex(12)}",
                "object": kind, "created": int(time.time()), "model": self.model_name}
        tasks = [asyncio.ensure_future(self._choice(head["id"], prompts, p, p * params.n + j, params, budget,
                                                    trajectory))
                 for p in range(len(prompts)) for j in range(params.n)]
        if params.stream:
            return self._events(head, prompts, params, tasks)
        try:
            done = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        out = {**head, "choices": [self._choice_json(kind, c, params, prompts) for c in done],
               "usage": choices.usage(prompts, done)}
        return {**out, "prompt_token_ids": prompts[0]} if len(prompts) == 1 else out

    async def _choice(self, request_id: str, prompts: list[list[int]], prompt: int, index: int, params: api.Params,
                      budget: int, trajectory: str | None) -> choices.Choice:
        """One sample (choice i with a seed samples with seed + i), finished and recorded."""
        sampling = params.sampling
        if sampling.seed is not None:
            sampling = replace(sampling, seed=(sampling.seed + index) % 2**63)
        generation = await self.backend(prompts[prompt], budget, sampling)
        choice = choices.finish(generation, index, prompt, budget, params.stop, self.end_token_ids, self._decode)
        if self.recorder is not None:
            record = ChoiceRecord(trajectory, request_id, index, self.model_name, prompts[prompt], choice.token_ids,
                                  choice.logprobs, choice.versions, choice.finish_reason,
                                  sampling.apply(self.backend.params).logprob_temperature)
            if inspect.isawaitable(result := self.recorder(record)):
                await result
        return choice

    async def _events(self, head: dict[str, Any], prompts: list[list[int]], params: api.Params,
                      tasks: list[asyncio.Future]) -> AsyncIterator[Any]:
        """Each choice's chunks as it finishes, then usage (when asked) and [DONE]."""
        kind, done = f"{head['object']}.chunk" if head["object"] == "chat.completion" else head["object"], []
        try:
            for next_done in asyncio.as_completed(tasks):
                choice = await next_done
                done.append(choice)
                logprobs = self._logprobs(head["object"], choice, params)
                if kind == "text_completion":
                    parts = choices.text_chunk_choices(choice, logprobs, prompts[choice.prompt])
                else:
                    parts = choices.chat_chunk_choices(choice, logprobs)
                for i, part in enumerate(parts):
                    extra = {"prompt_token_ids": prompts[choice.prompt]} if i == 0 else {}
                    yield {**head, "object": kind, "choices": [part], **extra}
        finally:  # a client gone, or a choice failed: the others are not delivered, so not recorded
            for task in tasks:
                task.cancel()
        if params.include_usage:
            yield {**head, "object": kind, "choices": [], "usage": choices.usage(prompts, done)}
        yield "[DONE]"

    def _choice_json(self, kind: str, choice: choices.Choice, params: api.Params,
                     prompts: list[list[int]]) -> dict[str, Any]:
        logprobs = self._logprobs(kind, choice, params)
        if kind == "chat.completion":
            return choices.chat_choice(choice, logprobs)
        return choices.text_choice(choice, logprobs, prompts[choice.prompt])

    def _logprobs(self, kind: str, choice: choices.Choice, params: api.Params) -> dict[str, Any] | None:
        if not params.logprobs:
            return None
        shape = choices.chat_logprobs if kind == "chat.completion" else choices.completion_logprobs
        return shape(choice, self._token_text)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])
