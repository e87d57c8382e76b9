"""Rollout engine decode throughput against HF `model.generate` (and vLLM) in the same run.

    python -m benchmarks.rollout [--batch 16] [--tokens 16] [--repeats 5] [--sample]
    python -m benchmarks.rollout --engine vllm [--device cuda --dtype bfloat16 --hidden 1536 ...]
    python -m benchmarks.rollout --shape 0.5B --engine vllm   # Qwen2.5-0.5B's shape, 32 rows x 64 tokens

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

Every run also times the native engine with `decode="compiled"` (rollout.decode=compiled: a
static KV cache, the decode step compiled once; its first call, compilation included, is
`compile_call_s`) and sets both against the machine's own limits measured in the same run: the
memory bound (every decode step reads every weight once: rows x read bandwidth / weight bytes,
the bandwidth of summing a 1 GiB array) and the matmul bound (torch's measured matmul rate at the
decode's shape / 2 flops per parameter and token; oneDNN's packed kernels can beat it).

With --continuous the same call also goes through the continuous batches a split rollout pool
serves it from (`asyncrl.rollout.continuous`, a slot a row), eager and compiled. The last line
printed is one JSON object.
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
# Qwen2.5's shapes (as a Llama: the same matmuls, no attention biases): hidden, layers, heads, kv heads, MLP, vocab
SHAPES = {"0.5B": (896, 24, 14, 2, 4864, 151936), "1.5B": (1536, 28, 12, 2, 8960, 151936)}


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    hidden, layers, heads, kv_heads, mlp, vocab = SHAPES.get(
        args.shape, (args.hidden, args.layers, 8, 4, args.hidden * 4, args.vocab))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=args.shape is not None,
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
    input_ids = torch.randint(3, min(args.vocab, 4096), (args.batch, args.prompt_len), generator=g)
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="a real model's shape (defaults then: --batch 32 --tokens 64)")
    parser.add_argument("--batch", type=int, default=None, help="rows (default 16, 32 with --shape)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens a row (default 16, 64 with --shape)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=None, help="timed calls a side (default 5, 2 with --shape)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op threads (default: every core, what a rollout worker alone on its node gets; "
             "1: steadier on a shared machine)")
    parser.add_argument("--sample", action="store_true", help="temperature-1 sampling, not greedy")
    parser.add_argument("--engine", choices=("native", "vllm"), default="native",
                        help="vllm: add the vLLM backend and the weight-sync timing")
    parser.add_argument("--no-hf", action="store_true", help="leave Hugging Face generate out")
    parser.add_argument("--continuous", action="store_true",
                        help="also the calls through a continuous batch (a split rollout pool's), eager and compiled")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    shaped = args.shape is not None
    args.batch = args.batch or (32 if shaped else 16)
    args.tokens = args.tokens or (64 if shaped else 16)
    args.repeats = args.repeats or (2 if shaped else 5)
    return args


def main() -> None:
    args = parse_args()
    args.threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(args.threads)
    model = build_model(args).to(device=args.device, dtype=getattr(torch, args.dtype))
    input_ids, attention_mask = (t.to(args.device) for t in left_padded_batch(args))
    engine = RolloutEngine(model, eos_token_id=[], pad_token_id=PAD, device=args.device)
    compiled = RolloutEngine(model, eos_token_id=[], pad_token_id=PAD, device=args.device, decode="compiled")
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
    sides = {"engine": lambda: engine.generate(input_ids, attention_mask, params),
             "compiled": lambda: compiled.generate(input_ids, attention_mask, params)}
    if not args.no_hf:
        sides["hf"] = lambda: model.generate(input_ids, **hf_kwargs)
    batchers = continuous_sides(engine, compiled, args) if args.continuous else {}
    for name, batcher in batchers.items():
        sides[name] = lambda b=batcher: b.generate(input_ids, attention_mask, params)
    with contextlib.ExitStack() as stack:
        vllm = None
        if args.engine == "vllm":
            vllm = stack.enter_context(vllm_engine(model, args))
            sides["vllm"] = lambda: vllm.generate(input_ids, attention_mask, params)
        with torch.inference_mode():
            start = time.perf_counter()
            theirs = compiled.generate(input_ids, attention_mask, params)  # its first call compiles
            compile_call_s = time.perf_counter() - start
            ours = engine.generate(input_ids, attention_mask, params)
            hf_out = None if args.no_hf else model.generate(input_ids, **hf_kwargs)[:, input_ids.shape[1]:]
            times = dict(zip(sides, interleaved_medians(list(sides.values()), args.repeats), strict=True))
        # last: it loads other weights into the model the sides share
        extra = {} if vllm is None else vllm_results(vllm, model, engine, ours, input_ids, attention_mask,
                                                     params, times, args)
    result = {**decode_results(args, model, times, ours, theirs, compile_call_s), **extra}
    if batchers:
        result.update(continuous_results(args, times))
    if hf_out is not None:
        result.update(hf_results(args, times, ours, hf_out))
    print(json.dumps(result))


def decode_results(args, model, times: dict, ours: dict, compiled_out: dict, compile_call_s: float) -> dict:
    generated = args.batch * args.tokens
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    best = min(times["engine"], times["compiled"])
    memory_bound = args.batch * read_bandwidth(args.device) / weight_bytes  # tokens/s
    # every generated token costs 2 flops a parameter: tokens/s at the measured rate, whatever the rows
    matmul_bound = matmul_rate(args.batch, model.config.hidden_size, args.device, model.dtype) / (2 * params)
    return {
        "batch": args.batch,
        "tokens": args.tokens,
        "prompt_len": args.prompt_len,
        "model": args.shape or f"llama h{args.hidden} l{args.layers} v{args.vocab}",
        "params": params,
        "dtype": args.dtype,
        "mode": "sample" if args.sample else "greedy",
        "threads": torch.get_num_threads(),
        "engine_s": round(times["engine"], 4),
        "engine_tokens_per_s": round(generated / times["engine"], 1),
        "compiled_s": round(times["compiled"], 4),
        "compiled_tokens_per_s": round(generated / times["compiled"], 1),
        "compiled_vs_eager": round(times["engine"] / times["compiled"], 3),
        "compile_call_s": round(compile_call_s, 2),
        "greedy_identical": None if args.sample else torch.equal(ours["responses"], compiled_out["responses"]),
        "compiled_logprob_max_diff": float((ours["rollout_log_probs"] - compiled_out["rollout_log_probs"]).abs().max()),
        "memory_bound_tokens_per_s": round(memory_bound, 1),
        "memory_bound_fraction": round(generated / best / memory_bound, 4),
        "matmul_bound_tokens_per_s": round(matmul_bound, 1),
        "matmul_bound_fraction": round(generated / best / matmul_bound, 4),
    }


def continuous_sides(engine: RolloutEngine, compiled: RolloutEngine, args: argparse.Namespace) -> dict:
    """The continuous batches a split rollout pool runs (`continuous_batcher`), a slot a row."""
    from asyncrl.model_server import FixedWeights
    from asyncrl.rollout.continuous import continuous_batcher

    return {"batcher": continuous_batcher(engine, args.batch, FixedWeights(0)),
            "compiled_batcher": continuous_batcher(compiled, args.batch, FixedWeights(0))}


def continuous_results(args: argparse.Namespace, times: dict) -> dict:
    generated = args.batch * args.tokens
    out = {"batcher_tokens_per_s": round(generated / times["batcher"], 1),
           "compiled_batcher_tokens_per_s": round(generated / times["compiled_batcher"], 1),
           "compiled_batcher_vs_batcher": round(times["batcher"] / times["compiled_batcher"], 3),
           "compiled_batcher_vs_compiled": round(times["compiled"] / times["compiled_batcher"], 3)}
    if "vllm" in times:
        out["compiled_batcher_vs_vllm"] = round(times["vllm"] / times["compiled_batcher"], 3)
    return out


def hf_results(args, times: dict, ours: dict, theirs: torch.Tensor) -> dict:
    assert ours["responses"].shape == theirs.shape, (ours["responses"].shape, theirs.shape)
    return {
        "greedy_outputs_match": None if args.sample else torch.equal(ours["responses"], theirs),
        "hf_generate_s": round(times["hf"], 4),
        "hf_generate_tokens_per_s": round(args.batch * args.tokens / times["hf"], 1),
        "ratio": round(times["hf"] / times["engine"], 3),
    }


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_seconds(fn, device: str, repeats: int = 5, calls: int = 1) -> float:
    """The fastest of `repeats` timings of `calls` calls of `fn` (the device synchronised), per call."""
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def read_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes a second of reading a large array (its sum), best of 5."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / best_seconds(x.sum, device)


def matmul_rate(rows: int, hidden: int, device: str, dtype: torch.dtype) -> float:
    """Flops a second of [rows, hidden] x [hidden, 8 hidden], the shape of a decode step's MLP, best of 5."""
    a = torch.randn(rows, hidden, device=device, dtype=dtype)
    b = torch.randn(hidden, 8 * hidden, device=device, dtype=dtype)
    return 2 * rows * hidden * 8 * hidden / best_seconds(lambda: a @ b, device, calls=10)


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


def vllm_results(vllm, model, engine, ours, input_ids, attention_mask, params, times: dict, args) -> dict:
    engine_s, vllm_s = times["engine"], times["vllm"]
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
        "vllm_speedup_vs_hf": round(times["hf"] / vllm_s, 3) if "hf" in times else None,
        "compiled_vs_vllm": round(vllm_s / times["compiled"], 3),
        "greedy_vllm_matches_engine": None if args.sample else torch.equal(out["responses"].cpu(),
                                                                           ours["responses"].cpu()),
        "weight_bytes": nbytes,
        "vllm_weight_sync_s": round(sync_s, 4),
        "inplace_copy_sync_s": round(copy_s, 4),
        "sync_vs_copy": round(sync_s / copy_s, 2),
    }


if __name__ == "__main__":
    main()
