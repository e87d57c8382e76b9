"""Rollout engine decode throughput against HF `model.generate` in the same run.

    python -m benchmarks.rollout [--batch 16] [--tokens 16] [--repeats 5] [--sample]

Both sides get the same random-weight Llama, the same left-padded batch and the same decoding
(greedy by default, plain temperature-1 sampling with --sample), with EOS disabled so every row
produces exactly --tokens tokens. Throughput is generated tokens per second of wall time for the
whole call (prefill included), median over --repeats after one warm-up call each, the two
sides timed in alternation.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.rollout import RolloutEngine, SamplingParams

PAD = 0


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # no early stop: both sides make --tokens each
    return model


def left_padded_batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.prompt_len // 4, args.prompt_len + 1, (args.batch,), generator=g)
    input_ids = torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=g)
    attention_mask = (torch.arange(args.prompt_len) >= args.prompt_len - lengths[:, None]).long()
    return input_ids.masked_fill(attention_mask == 0, PAD), attention_mask


def interleaved_medians(fns: list, repeats: int) -> list[float]:
    """Median wall time of each fn, timed in alternation so that load from other processes on a
    shared machine hits both sides alike."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    return [statistics.median(bucket) for bucket in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: steadier when shared)"
    )
    parser.add_argument("--sample", action="store_true", help="temperature-1 sampling, not greedy")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = build_model(args)
    input_ids, attention_mask = left_padded_batch(args)
    engine = RolloutEngine(model, eos_token_id=[], pad_token_id=PAD)
    params = SamplingParams(greedy=not args.sample, max_tokens=args.tokens, seed=0)
    hf_kwargs = dict(
        attention_mask=attention_mask,
        max_new_tokens=args.tokens,
        pad_token_id=PAD,
        do_sample=args.sample,
        # HF's defaults would add top-k 50 when sampling; keep the two sides doing the same work
        top_k=None,
        top_p=None,
        temperature=None,
    )

    with torch.inference_mode():
        ours = engine.generate(input_ids, attention_mask, params)
        theirs = model.generate(input_ids, **hf_kwargs)[:, input_ids.shape[1] :]
        engine_s, hf_s = interleaved_medians(
            [
                lambda: engine.generate(input_ids, attention_mask, params),
                lambda: model.generate(input_ids, **hf_kwargs),
            ],
            args.repeats,
        )

    generated = args.batch * args.tokens
    assert ours["responses"].shape == theirs.shape, (ours["responses"].shape, theirs.shape)
    result = {
        "batch": args.batch,
        "tokens": args.tokens,
        "prompt_len": args.prompt_len,
        "model": f"llama h{args.hidden} l{args.layers} v{args.vocab}",
        "mode": "sample" if args.sample else "greedy",
        "threads": torch.get_num_threads(),
        "greedy_outputs_match": None if args.sample else torch.equal(ours["responses"], theirs),
        "engine_s": round(engine_s, 4),
        "hf_generate_s": round(hf_s, 4),
        "engine_tokens_per_s": round(generated / engine_s, 1),
        "hf_generate_tokens_per_s": round(generated / hf_s, 1),
        "ratio": round(hf_s / engine_s, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
