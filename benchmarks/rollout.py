"""Rollout engine decode throughput against HF `model.generate` (and vLLM) in the same run.

    python -m benchmarks.rollout [--batch 16] [--tokens 16] [--repeats 5] [--sample]
    python -m benchmarks.rollout --engine vllm [--device cuda --dtype bfloat16 --hidden 1536 ...]

Every side gets the same random-weight Llama, the same left-padded batch and the same decoding
(greedy by default, plain temperature-1 sampling with --sample), with EOS disabled so every row
produces exactly --tokens tokens. Throughput is generated tokens per second of wall time for the
whole call (prefill included), median over --repeats after one warm-up call each, the sides
timed in alternation.

With --engine vllm the vLLM backend (`asyncrl.rollout.vllm_engine`, as rollout.engine=vllm runs
it: in process, the model written to a temporary directory) joins the comparison, and the weight
sync is timed: seconds to load a full set of new weights into vLLM (`load_weights`, as after each
update) against an in-place copy of the same tensors into a model (`RolloutEngine.load_weights`,
the memory-bandwidth floor of any sync).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
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
    parser.add_argument("--engine", choices=("native", "vllm"), default="native",
                        help="vllm: add the vLLM backend and the weight-sync timing")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = build_model(args).to(device=args.device, dtype=getattr(torch, args.dtype))
    input_ids, attention_mask = (t.to(args.device) for t in left_padded_batch(args))
    engine = RolloutEngine(model, eos_token_id=[], pad_token_id=PAD, device=args.device)
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

    sides = [
        lambda: engine.generate(input_ids, attention_mask, params),
        lambda: model.generate(input_ids, **hf_kwargs),
    ]
    with contextlib.ExitStack() as stack:
        vllm = None
        if args.engine == "vllm":
            vllm = stack.enter_context(vllm_engine(model, args))
            sides.append(lambda: vllm.generate(input_ids, attention_mask, params))
        with torch.inference_mode():
            ours = engine.generate(input_ids, attention_mask, params)
            theirs = model.generate(input_ids, **hf_kwargs)[:, input_ids.shape[1] :]
            times = interleaved_medians(sides, args.repeats)
        engine_s, hf_s = times[:2]
        extra = {} if vllm is None else vllm_results(vllm, model, engine, ours, input_ids, attention_mask,
                                                     params, times, args)

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
        **extra,
    }
    print(json.dumps(result))


@contextlib.contextmanager
def vllm_engine(model: LlamaForCausalLM, args: argparse.Namespace):
    """The vLLM backend on this model (saved to a temporary directory, loaded as users load it)."""
    from asyncrl.rollout.vllm_engine import VLLMRolloutEngine

    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as tmp:
        model.save_pretrained(tmp)
        engine = VLLMRolloutEngine(
            tmp, eos_token_id=[], pad_token_id=PAD, device=args.device, dtype=args.dtype, seed=0,
            max_model_len=args.prompt_len + args.tokens, max_num_seqs=max(args.batch, 1),
            kv_cache_bytes=None if args.device.startswith("cuda") else 256 << 20)
        torch.set_num_threads(args.threads)
        try:
            yield engine
        finally:
            engine.shutdown()


def vllm_results(vllm, model, engine, ours, input_ids, attention_mask, params, times, args) -> dict:
    engine_s, hf_s, vllm_s = times
    generated = args.batch * args.tokens
    out = vllm.generate(input_ids, attention_mask, params)
    new = [(n, (p.detach() * 0.5).contiguous()) for n, p in model.named_parameters()]  # an "update"
    nbytes = sum(t.numel() * t.element_size() for _, t in new)
    sync_s, copy_s = interleaved_medians([lambda: vllm.load_weights(new), lambda: engine.load_weights(new)],
                                         args.repeats)
    return {
        "vllm_s": round(vllm_s, 4),
        "vllm_tokens_per_s": round(generated / vllm_s, 1),
        "vllm_speedup_vs_engine": round(engine_s / vllm_s, 3),
        "vllm_speedup_vs_hf": round(hf_s / vllm_s, 3),
        "greedy_vllm_matches_engine": None if args.sample else torch.equal(out["responses"].cpu(),
                                                                           ours["responses"].cpu()),
        "weight_bytes": nbytes,
        "vllm_weight_sync_s": round(sync_s, 4),
        "inplace_copy_sync_s": round(copy_s, 4),
        "sync_vs_copy": round(sync_s / copy_s, 2),
    }


if __name__ == "__main__":
    main()
