"""One prepared run on one GPU: asyncrl's decode, training and weight sync against the device's
own limits measured in the same run. Prints one JSON object last.

    python -m benchmarks.device             # one H100 / H200: about 6 minutes
    python -m benchmarks.device --smoke     # CPU, tiny shapes: the same code paths in a minute

Sections, each in its own try (a failure is recorded as its error and the next one runs) and
skipped once `--budget-s` is spent:
- `limits`: the bf16 matmul rate (8192^3), the bandwidth of reading a 1 GiB array (its sum) and
  of copying it;
- `decode`: the native engine at Qwen2.5-0.5B and 1.5B shapes (random weights, bf16) x 64 and
  256 rows, 128-token prompts, 64 tokens each, eager and `decode="compiled"` (inductor):
  tokens/s, the memory bound (rows x read bandwidth / weight bytes: a decode step reads every
  weight once) and the fraction reached, the compiled call's first (compiling) call;
- `train`: an RL update step of the 1.5B shape with each backend (FSDP2, Megatron), 8 rows x 1,024
  tokens, in micro-batches of 2 rows and of the whole batch: model FLOP/s (6 N tokens + attention)
  over the measured bf16 matmul rate (MFU) and peak memory;
- `weight_sync`: loading a full 1.5B bf16 state into the rollout engine (`load_weights`, what a
  split pool's worker does per update) against one `torch._foreach_copy_` of the same bytes;
- `grpo_step`: `python -m benchmarks.speed` on this device (the quickstart's phases; a subprocess).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
import traceback
from argparse import Namespace
from pathlib import Path

import torch

from asyncrl.rollout import RolloutEngine, SamplingParams
from benchmarks import megatron as mb
from benchmarks import rollout as rb

SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2}


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def copy_seconds(nbytes: int, device: str) -> float:
    x = torch.ones(nbytes // 4, device=device)
    y = torch.empty_like(x)
    return rb.best_seconds(lambda: y.copy_(x), device)


def limits(device: str, smoke: bool) -> dict:
    nbytes = (64 << 20) if smoke else (1 << 30)
    out = {"read_gb_per_s": round(rb.read_bandwidth(device, nbytes) / 1e9, 1),
           "copy_gb_per_s": round(2 * nbytes / copy_seconds(nbytes, device) / 1e9, 1)}  # read + write
    if device.startswith("cuda"):
        out["bf16_matmul_tflops"] = round(mb.matmul_tflops(device), 1)
    return out


def decode_case(shape: str, rows: int, device: str, dtype: str, smoke: bool, read_bw: float) -> dict:
    """Eager and compiled decode of one shape and row count: tokens/s, their memory bound's fraction."""
    args = Namespace(shape=None if smoke else shape, hidden=64, layers=2, vocab=512, batch=rows,
                     prompt_len=16 if smoke else 128, tokens=8 if smoke else 64)
    model = rb.build_model(args).to(device=device, dtype=getattr(torch, dtype))
    ids, mask = (t.to(device) for t in rb.left_padded_batch(args))
    params = SamplingParams(greedy=True, max_tokens=args.tokens)
    out: dict = {}
    outputs = {}
    for decode in ("eager", "compiled"):
        engine = RolloutEngine(model, eos_token_id=[], pad_token_id=rb.PAD, device=device, decode=decode)
        start = time.perf_counter()
        engine.generate(ids, mask, params)
        rb.synchronize(device)
        first = time.perf_counter() - start
        times = []
        for _ in range(2):
            start = time.perf_counter()
            outputs[decode] = engine.generate(ids, mask, params)
            rb.synchronize(device)
            times.append(time.perf_counter() - start)
        tokens_per_s = rows * args.tokens / min(times)
        out[decode] = {"tokens_per_s": round(tokens_per_s, 1), "first_call_s": round(first, 2)}
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = rows * read_bw / weight_bytes
    for decode in ("eager", "compiled"):
        out[decode]["memory_bound_fraction"] = round(out[decode]["tokens_per_s"] / bound, 4)
    out["memory_bound_tokens_per_s"] = round(bound, 1)
    out["compiled_vs_eager"] = round(out["compiled"]["tokens_per_s"] / out["eager"]["tokens_per_s"], 3)
    out["greedy_identical"] = torch.equal(outputs["eager"]["responses"], outputs["compiled"]["responses"])
    del model, outputs
    free(device)
    return out


def train(tmp: Path, device: str, smoke: bool, matmul_tflops: float | None) -> dict:
    """An update step of the 1.5B shape per backend, in micro-batches of 2 rows and of all 8."""
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(), 1)
    shape = SMOKE_SHAPE if smoke else mb.SHAPES["1.5B"]
    vocab = 512 if smoke else mb.VOCAB
    rows, prompt, response = 8, (16 if smoke else 512), (16 if smoke else 512)
    path = tmp / "train"
    hf = mb.qwen2(shape, vocab=vocab, device=device)
    params = sum(p.numel() for p in hf.parameters())
    hf.save_pretrained(path)
    del hf
    free(device)
    batch = mb.rl_batch(rows, prompt, response, vocab, device)
    out: dict = {"params": params, "rows": rows, "tokens_per_row": prompt + response}
    for backend in ("fsdp2", "megatron"):
        engine = (mb.fsdp_engine(path, layout, device, "bfloat16") if backend == "fsdp2"
                  else mb.megatron_engine(path, layout, device, torch.bfloat16))
        for micro in (2, rows):
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            seconds = mb.step_seconds(engine, batch.split(micro), steps=1 if smoke else 3)
            flops = mb.model_flops(shape, params, rows, prompt + response) / seconds
            row = {"step_s": round(seconds, 3), "model_tflops": round(flops / 1e12, 2)}
            if matmul_tflops:
                row["mfu"] = round(flops / 1e12 / matmul_tflops, 3)
            if device.startswith("cuda"):
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            out[f"{backend}_micro{micro}"] = row
        del engine
        free(device)
    return out


def weight_sync(device: str, smoke: bool) -> dict:
    """A full state loaded into the rollout engine against one fused device copy of its bytes."""
    args = Namespace(shape=None if smoke else "1.5B", hidden=64, layers=2, vocab=512)
    model = rb.build_model(args).to(device=device, dtype=torch.bfloat16)
    engine = RolloutEngine(model, eos_token_id=[], pad_token_id=rb.PAD, device=device)
    new = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    targets = [p.data for _, p in model.named_parameters()]
    sources = [t for _, t in new]

    load_s = rb.best_seconds(lambda: engine.load_weights(new), device, repeats=4)
    copy_s = rb.best_seconds(lambda: torch._foreach_copy_(targets, sources), device, repeats=4)
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    return {"bytes": nbytes, "load_weights_s": round(load_s, 4), "device_copy_s": round(copy_s, 4),
            "load_vs_copy": round(load_s / copy_s, 2)}


def grpo_step(device: str, smoke: bool, timeout: float) -> dict:
    """benchmarks.speed on this machine's device, in a subprocess (it starts its own daemons)."""
    cmd = [sys.executable, "-m", "benchmarks.speed", "--runs", "1", "--steps", "10" if smoke else "30"]
    if device.startswith("cuda"):
        cmd.append("trainer.n_workers=1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    last = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not last:
        raise RuntimeError(f"benchmarks.speed exited {res.returncode}: {res.stderr[-1500:]}")
    return json.loads(last[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: check the code paths")
    p.add_argument("--budget-s", type=float, default=420.0, help="sections after this many seconds are skipped")
    p.add_argument("--skip", nargs="*", default=[], help="sections to leave out")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    started = time.perf_counter()
    out: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}

    def section(name: str, fn) -> None:
        if name in args.skip:
            return
        if time.perf_counter() - started > args.budget_s:
            out[name] = {"skipped": f"over --budget-s {args.budget_s}"}
            return
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - one section's failure is its result; the rest still run
            out[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        free(device)  # what the section held
        if isinstance(out[name], dict):
            out[name]["section_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({name: out[name]}), flush=True)

    section("limits", lambda: limits(device, args.smoke))
    read_bw = out.get("limits", {}).get("read_gb_per_s", 1.0) * 1e9
    decode: dict = {}
    for shape in ("0.5B", "1.5B"):
        for rows in ((4,) if args.smoke else (64, 256)):
            section(f"decode_{shape}_x{rows}", lambda s=shape, r=rows: decode_case(
                s, r, device, "float32" if args.smoke else "bfloat16", args.smoke, read_bw))
            decode[f"{shape}_x{rows}"] = out.pop(f"decode_{shape}_x{rows}", None)
    out["decode"] = decode
    with tempfile.TemporaryDirectory(prefix="asyncrl-device-") as tmp:
        section("train", lambda: train(Path(tmp), device, args.smoke, out.get("limits", {}).get("bf16_matmul_tflops")))
    section("weight_sync", lambda: weight_sync(device, args.smoke))
    section("grpo_step", lambda: grpo_step(device, args.smoke, timeout=max(60.0, args.budget_s + 60 - (time.perf_counter() - started))))
    out["total_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
