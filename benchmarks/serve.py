"""The OpenAI endpoint's cost per request: the same generations through `asyncrl.serve` (HTTP,
JSON, the official `openai` client) against awaiting its backend directly.

    python -m benchmarks.serve
    python -m benchmarks.serve --tokens 64 --requests 40

The tiny quickstart-shaped model (hidden 64, 2 layers, built locally; one CPU thread) behind a
continuous batcher; no end token, so every request generates exactly `--tokens` tokens. One at a
time, the median latency of each path; and every tenth request `--concurrent` at once, the
median wall time of each path; the paths take turns, so a machine that slows down slows both. The last line is one JSON object: `overhead_ms` (endpoint median - direct median),
`latency_ratio` and `concurrent_ratio` (endpoint / direct).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

OUT = Path("outputs/bench-serve")


def build_backend(slots: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.agents.rollout import BatcherGenerator
    from asyncrl.model_server import FixedWeights
    from asyncrl.models.tiny import ensure_tiny_model
    from asyncrl.rollout.continuous import ContinuousBatcher
    from asyncrl.rollout.engine import RolloutEngine, SamplingParams

    path = ensure_tiny_model(OUT / "tiny", task="sort", hidden=64, layers=2, heads=4, sft_steps=0)
    tok = AutoTokenizer.from_pretrained(path)
    engine = RolloutEngine(AutoModelForCausalLM.from_pretrained(path), eos_token_id=-1, pad_token_id=tok.pad_token_id)
    return BatcherGenerator(ContinuousBatcher(engine, slots, FixedWeights(0)), SamplingParams(), None), tok


async def timed(calls) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*calls)
    return time.perf_counter() - t0


async def measure(args: argparse.Namespace) -> dict[str, float]:
    import openai

    from asyncrl.serve import OpenAIServer
    from asyncrl.serve.backend import Sampling

    backend, tok = build_backend(args.concurrent)
    prompt = tok.encode("sort 5 3 9 1 7", add_special_tokens=False)
    async with OpenAIServer(backend, tok, model_name="tiny", api_key="bench") as server:
        async with openai.AsyncOpenAI(base_url=server.url, api_key="bench", max_retries=0) as client:
            def direct(i: int):
                return backend(prompt, args.tokens, Sampling(seed=i))

            def endpoint(i: int):
                return client.completions.create(model="tiny", prompt=prompt, max_tokens=args.tokens, seed=i,
                                                  logprobs=0)

            await timed([direct(0), endpoint(0)])  # warm up both paths
            paths = {"direct": direct, "endpoint": endpoint}
            alone: dict[str, list[float]] = {name: [] for name in paths}
            together: dict[str, list[float]] = {name: [] for name in paths}
            for i in range(args.requests):  # interleaved: a machine that slows down slows both
                for name, call in paths.items():
                    alone[name].append(await timed([call(i)]))
                    if i % 10 == 0:
                        together[name].append(await timed([call(i + j) for j in range(args.concurrent)]))
            result = {}
            for name in paths:
                result[f"{name}_ms"] = 1e3 * statistics.median(alone[name])
                result[f"{name}_concurrent_s"] = statistics.median(together[name])
    result["overhead_ms"] = result["endpoint_ms"] - result["direct_ms"]
    result["latency_ratio"] = result["endpoint_ms"] / result["direct_ms"]
    result["concurrent_ratio"] = result["endpoint_concurrent_s"] / result["direct_concurrent_s"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--concurrent", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = asyncio.run(measure(args))
    for k, v in result.items():
        print(f"{k:24s} {v:.3f}")
    print(json.dumps({"tokens": args.tokens, **{k: round(v, 4) for k, v in result.items()}}))


if __name__ == "__main__":
    main()
