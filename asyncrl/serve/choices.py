"""A backend's generation as an OpenAI choice: the text, the stop-string cut, the finish reason,
and the JSON of chat and text completions (whole or as stream chunks) with asyncrl's extras:
`token_ids` and `policy_versions` on every choice, `prompt_token_ids` on the response."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.serve.backend import Generation


@dataclass(frozen=True)
class Choice:
    index: int
    prompt: int  # which of the request's prompts
    text: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


def kept_tokens(ids: Sequence[int], kept: str, decode: Callable[[Sequence[int]], str]) -> int:
    """How many leading `ids` to keep when the text is cut to `kept`: the longest prefix whose
    decoded text is a prefix of `kept`. A token that reaches into the stop string is dropped with
    everything after it, so `decode(ids[:k])` is `kept` or `kept` short of the straddling token's
    first characters (with a word-level tokenizer, the space its decoder puts between words).

    A binary search on the decoded length (decoding a longer prefix gives longer text), then a
    step back while the prefix is not `kept`'s: a few decodes, not one per token."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(decode(ids[:mid])) <= len(kept) else (lo, mid - 1)
    while lo > 0 and not kept.startswith(decode(ids[:lo])):
        lo -= 1
    return lo


def finish(generation: Generation, index: int, prompt: int, max_tokens: int, stop: Sequence[str],
           end_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> Choice:
    """The choice for one generation: text cut before the earliest stop string (`kept_tokens`
    cuts ids, log-probs and versions to match); "stop" when an end token or a stop string ended
    it, "length" when the budget did."""
    ids, logprobs, versions = generation
    text = decode(ids)
    cuts = [at for s in stop if (at := text.find(s)) >= 0]
    if cuts:
        text = text[:min(cuts)]
        k = kept_tokens(ids, text, decode)
        return Choice(index, prompt, text, list(ids[:k]), list(logprobs[:k]), list(versions[:k]), "stop")
    ended = len(ids) < max_tokens or (bool(ids) and ids[-1] in end_ids)
    return Choice(index, prompt, text, list(ids), list(logprobs), list(versions), "stop" if ended else "length")


def usage(prompts: Sequence[Sequence[int]], choices: Sequence[Choice]) -> dict[str, int]:
    """Each prompt counted once (as OpenAI does with n > 1), every choice's tokens."""
    p, c = sum(map(len, prompts)), sum(len(ch.token_ids) for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def chat_logprobs(choice: Choice, token_text: Callable[[int], str]) -> dict[str, Any]:
    content = []
    for t, lp in zip(choice.token_ids, choice.logprobs, strict=True):
        text = token_text(t)
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


def completion_logprobs(choice: Choice, token_text: Callable[[int], str]) -> dict[str, Any]:
    """The legacy shape; `top_logprobs` null (alternatives are not computed) and no
    `text_offset` (a word-level decoder's spaces belong to no token)."""
    return {"tokens": [token_text(t) for t in choice.token_ids], "token_logprobs": choice.logprobs,
            "top_logprobs": None}


def extras(choice: Choice) -> dict[str, Any]:
    return {"token_ids": choice.token_ids, "policy_versions": choice.versions}


def chat_choice(choice: Choice, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
            "logprobs": logprobs, "finish_reason": choice.finish_reason, **extras(choice)}


def text_choice(choice: Choice, logprobs: dict[str, Any] | None, prompt_ids: list[int]) -> dict[str, Any]:
    return {"index": choice.index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason,
            "prompt_token_ids": prompt_ids, **extras(choice)}


def chat_chunk_choices(choice: Choice, logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A finished choice as stream chunks: its role and whole text in one delta (the backend
    returns whole generations), then its finish reason."""
    delta = {"role": "assistant", "content": choice.text}
    return [{"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": None, **extras(choice)},
            {"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": choice.finish_reason}]


def text_chunk_choices(choice: Choice, logprobs: dict[str, Any] | None, prompt_ids: list[int]) -> list[dict[str, Any]]:
    return [{**text_choice(choice, logprobs, prompt_ids), "finish_reason": None},
            {"index": choice.index, "text": "", "logprobs": None, "finish_reason": choice.finish_reason}]
