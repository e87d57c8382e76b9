"""OpenAI request bodies to checked, typed requests; every refusal a 400 that names the field and
says what is allowed.

Supported: `model`, `n`, `temperature`, `top_p`, `top_k` (vLLM's), `seed`, `max_tokens` (chat
also `max_completion_tokens`), `stop`, `stream` (+ `stream_options.include_usage`), `user`;
completions: `prompt` (a string, token ids, or a list of either) and `logprobs` 0 or 1; chat:
`messages` (text content), `tools`, `tool_choice` "auto" or "none", `logprobs` with
`top_logprobs` 0. Log-probs are those of the sampled tokens only: the engines compute no
alternatives, so `top_logprobs` is null (completions) or empty (chat).

Fields that would change what is generated and are not implemented are refused (`REFUSED`);
every other unknown field is ignored, as OpenAI clients send extras.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.serve.backend import Sampling
from asyncrl.serve.http import HttpError, Limits

MAX_STOP = 16  # OpenAI allows 4; more cost only a search over the text
MAX_PROMPTS = 64
ROLES = ("system", "developer", "user", "assistant", "tool")

# field -> (a value that changes nothing, what to do instead)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "echo": (lambda v: v is False, "echo is not supported: the response carries prompt_token_ids"),
    "suffix": (lambda v: v in ("", None), "suffix (insertion) is not supported"),
    "best_of": (lambda v: v in (None, 1), "best_of is not supported: ask for n choices and pick"),
    "logit_bias": (lambda v: not v, "logit_bias is not supported"),
    "presence_penalty": (lambda v: v in (0, None), "presence_penalty is not supported (only 0)"),
    "frequency_penalty": (lambda v: v in (0, None), "frequency_penalty is not supported (only 0)"),
    "repetition_penalty": (lambda v: v in (1, None), "repetition_penalty is not supported (only 1)"),
    "min_tokens": (lambda v: v in (0, None), "min_tokens is not supported"),
    "ignore_eos": (lambda v: not v, "ignore_eos is not supported"),
    "response_format": (lambda v: v in (None, {"type": "text"}), "response_format other than text is not supported "
                        "(no constrained decoding)"),
    "functions": (lambda v: not v, "functions is not supported: pass tools"),
    "function_call": (lambda v: v in (None, "auto", "none"), "function_call is not supported: pass tools"),
    "guided_json": (lambda v: v is None, "guided decoding is not supported"),
    "guided_regex": (lambda v: v is None, "guided decoding is not supported"),
    "guided_choice": (lambda v: v is None, "guided decoding is not supported"),
    "structured_outputs": (lambda v: v is None, "structured outputs are not supported"),
}


@dataclass(frozen=True)
class Params:
    """What both endpoints ask of the backend, checked."""

    n: int
    max_tokens: int | None  # None: chat's default, what the context and `Limits.max_tokens` leave
    sampling: Sampling
    stop: tuple[str, ...]
    logprobs: bool
    stream: bool
    include_usage: bool
    user: str | None


@dataclass(frozen=True)
class CompletionRequest:
    params: Params
    prompts: list[str | list[int]]


@dataclass(frozen=True)
class ChatRequest:
    params: Params
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # None: none given, or tool_choice "none"


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise HttpError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise HttpError(400, f"the body must be a JSON object, not {type(value).__name__}")
    return value


def check_model(body: dict[str, Any], served: str) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise HttpError(400, f"'model' must be a string: this server serves {served!r}", param="model")
    if model != served:
        raise HttpError(404, f"The model {model[:100]!r} does not exist: this server serves {served!r}",
                        param="model", code="model_not_found")


def completion_request(body: dict[str, Any], limits: Limits) -> CompletionRequest:
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) or _token_ids(prompt) else prompt
    if (not isinstance(prompts, list) or not prompts or len(prompts) > MAX_PROMPTS
            or not all(isinstance(p, str) or _token_ids(p) for p in prompts)):
        raise HttpError(400, f"'prompt' must be a string, a non-empty list of token ids, or a list of up to "
                        f"{MAX_PROMPTS} of either", param="prompt")
    logprobs = _field(body, "logprobs", int, None, "null, 0 or 1 (alternatives are not computed: "
                      "only the sampled token's log-prob is returned)", lambda v: v in (0, 1))
    params = _params(body, limits, len(prompts), _field(body, "max_tokens", int, 16, "an integer >= 1",
                                                        lambda v: v >= 1), logprobs is not None)
    return CompletionRequest(params, prompts)


def chat_request(body: dict[str, Any], limits: Limits) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    messages = [_message(m, i) for i, m in enumerate(messages)]
    tools = _field(body, "tools", list, None, "a list of {type: function, function: {...}} objects",
                   lambda v: all(isinstance(t, dict) for t in v))
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise HttpError(400, "'tool_choice' must be 'auto' or 'none': forcing a call needs constrained decoding, "
                        "which is not supported", param="tool_choice")
    _field(body, "top_logprobs", int, 0, "0 (alternatives are not computed)", lambda v: v == 0)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(body, name, int, None, "an integer >= 1", lambda v: v >= 1)
    logprobs = _field(body, "logprobs", bool, False, "true or false")
    return ChatRequest(_params(body, limits, 1, max_tokens, logprobs), messages, None if choice == "none" else tools)


def _params(body: dict[str, Any], limits: Limits, prompts: int, max_tokens: int | None, logprobs: bool) -> Params:
    for name, (harmless, advice) in REFUSED.items():
        if name in body and not harmless(body[name]):
            raise HttpError(400, f"'{name}': {advice}", param=name)
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise HttpError(400, f"'max_tokens' is {max_tokens}; this server generates at most {limits.max_tokens} "
                        "tokens per choice", param="max_tokens")
    n = _field(body, "n", int, 1, f"an integer from 1 to {limits.max_choices // prompts} "
               f"(at most {limits.max_choices} choices per request)", lambda v: 1 <= v * prompts <= limits.max_choices)
    stream_options = _field(body, "stream_options", dict, {}, "an object like {\"include_usage\": true}")
    return Params(
        n=n, max_tokens=max_tokens, sampling=_sampling(body), stop=_stop(body), logprobs=logprobs,
        stream=_field(body, "stream", bool, False, "true or false"),
        include_usage=_field(stream_options, "include_usage", bool, False, "true or false"),
        user=_field(body, "user", str, None, "a string"))


def _sampling(body: dict[str, Any]) -> Sampling:
    return Sampling(
        temperature=_field(body, "temperature", float, None, "a number from 0 to 2", lambda v: 0 <= v <= 2),
        top_p=_field(body, "top_p", float, None, "a number in (0, 1]", lambda v: 0 < v <= 1),
        top_k=_field(body, "top_k", int, None, "an integer >= -1 (-1 or 0: off)", lambda v: v >= -1),
        seed=_field(body, "seed", int, None, "an integer from 0 to 2**63 - 1", lambda v: 0 <= v < 2**63))


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (not isinstance(stops, list) or len(stops) > MAX_STOP
            or not all(isinstance(s, str) and s for s in stops)):
        raise HttpError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", param="stop")
    return tuple(stops)


def _message(message: Any, i: int) -> dict[str, Any]:
    """A message as chat templates take it: text parts joined into one string, a tool call's
    JSON `arguments` parsed (templates format them as objects)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise HttpError(400, f"'{where}' must be an object with a role in {', '.join(ROLES)}", param=where)
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise HttpError(400, f"'{where}.content': only text parts ({{type: text, text: ...}}) are supported",
                            param=f"{where}.content")
        content = "".join(p["text"] for p in content)
    if not (isinstance(content, str) or content is None and message.get("tool_calls")):
        raise HttpError(400, f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content")
    out = {**message, "content": content}
    if isinstance(message.get("tool_calls"), list):
        out["tool_calls"] = [_parsed_arguments(c) for c in message["tool_calls"]]
    return out


def _parsed_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _token_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _field(body: dict[str, Any], name: str, kind: type, default: Any, allowed: str,
           check: Callable[[Any], bool] = lambda v: True) -> Any:
    """`body[name]` checked (`kind`, then `check`), or `default` when it is absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not _fits(value, kind) or not check(value):
        raise HttpError(400, f"'{name}' must be {allowed}; got {json.dumps(value)[:80]}", param=name)
    return float(value) if kind is float else value


def _fits(value: Any, kind: type) -> bool:
    if kind is float:  # JSON has one number type; NaN and infinities are refused
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))
