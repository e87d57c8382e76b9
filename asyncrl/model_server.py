"""`asyncrl serve`: a model directory (or a run's checkpoint) behind the OpenAI endpoint, on
the native engine with continuous batching, so concurrent requests share each forward. On a GPU
the engine decodes in waves instead (`WaveGenerator`: the requests waiting when a decode starts
go in together): the continuous batcher builds its inputs on the host and runs on CPU only so far.

The weights never change here: every token carries one policy version, the checkpoint's step
(0 for a plain model directory). Inside a training job the rollout workers serve the same
endpoint over their own batcher, whose versions move with the weights.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from asyncrl.serve.http import Limits
from asyncrl.serve.server import OpenAIServer
from transport.checks import ConfigError

EXPORT = re.compile(r"(?P<run>[^/]+)/checkpoints/step_(?P<step>\d+)/actor/hf$")  # asyncrl's HF export in a run
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class FixedWeights:
    """The `Weights` of a batcher whose weights never change."""

    interrupt = False

    def __init__(self, version: int) -> None:
        self.version = version

    def pending(self) -> bool:
        return False

    def apply(self) -> None:
        pass


def model_dir(path: str | Path) -> Path:
    """The HF directory to load: `path` itself (it has a config.json), a checkpoint step's or
    its actor's `hf` export, or a run directory's last complete checkpoint's."""
    from asyncrl.rundir import complete_checkpoints

    given = Path(path).expanduser().resolve()
    steps = complete_checkpoints(given)
    for candidate in (given, given / "hf", given / "actor" / "hf", *(s / "actor" / "hf" for s in steps[-1:])):
        if (candidate / "config.json").is_file():
            return candidate
    raise ConfigError(f"{path} is not a Hugging Face model directory (no config.json), a checkpoint with an "
                      "actor/hf export, or a run directory with a complete checkpoint; point at one of those")


def served_name(model: Path) -> tuple[str, int]:
    """(the model's name, its policy version): `run/step_N` and N for a run's export, else the
    directory's name and 0."""
    found = EXPORT.search(model.as_posix())
    if found:
        return f"{found['run']}/step_{found['step']}", int(found["step"])
    return model.name, 0


def load_backend(model: Path, version: int, slots: int, device: str, dtype: str,
                 decode: str = "eager") -> tuple[Any, Any, Any, int | None]:
    """(the backend over the model, its tokenizer, its engine, its context length)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.agents.rollout import BatcherGenerator, WaveGenerator
    from asyncrl.rollout.continuous import continuous_batcher
    from asyncrl.rollout.engine import RolloutEngine, SamplingParams
    from asyncrl.train.fsdp import compute_dtype

    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=compute_dtype(device, dtype))
    engine = RolloutEngine(lm, eos_token_id=end_token_ids(tokenizer, lm), device=device, decode=decode,
                           pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                           else tokenizer.eos_token_id)
    params, context = SamplingParams(temperature=1.0), getattr(lm.config, "max_position_embeddings", None)
    if engine.device.type == "cpu":
        backend = BatcherGenerator(continuous_batcher(engine, slots, FixedWeights(version)), params, None)
    else:
        backend = WaveGenerator(engine, params, None, version=lambda: version)
    return backend, tokenizer, engine, context


def end_token_ids(tokenizer: Any, lm: Any) -> list[int]:
    """The tokenizer's end of sequence and the generation config's (instruct models end a turn
    with a token of their own, e.g. Qwen's <|im_end|>)."""
    ids = getattr(getattr(lm, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return list(dict.fromkeys([tokenizer.eos_token_id, *ids]))


def serve(path: str, *, host: str, port: int, api_key: str | None, name: str | None, max_tokens: int,
          slots: int, device: str | None, dtype: str, decode: str = "eager") -> int:
    """Load, then serve until SIGINT or SIGTERM; prints the URL (and a generated key)."""
    from transport.loop import run

    model = model_dir(path)
    default_name, version = served_name(model)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend, tokenizer, engine, context = load_backend(model, version, slots, device, dtype, decode)
    key = api_key or os.environ.get("ASYNCRL_API_KEY") or secrets.token_urlsafe(24)
    server = OpenAIServer(backend, tokenizer, model_name=name or default_name, api_key=key, host=host, port=port,
                          limits=Limits(max_tokens=max_tokens), context_length=context,
                          end_token_ids=engine.eos_token_ids)

    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        async with server:
            print(f"asyncrl serve: {server.model_name} ({model}, {device}) at {server.url}", flush=True)
            if not (api_key or os.environ.get("ASYNCRL_API_KEY")):
                print(f"asyncrl serve: API key (generated; choose one with ASYNCRL_API_KEY): {key}", flush=True)
            if host not in LOOPBACK:
                print(f"asyncrl serve: listening on {host}, beyond this machine: the key travels in clear text "
                      "over plain HTTP (put a TLS proxy in front on an untrusted network)", file=sys.stderr)
            await stop.wait()
        print("asyncrl serve: stopped", flush=True)

    run(main())
    return 0
