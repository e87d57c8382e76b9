"""`asyncrl-plan profile`: measure this machine as a CPU device profile, layer by layer.

As REAL's profiler does, it times the real building blocks rather than trusting a datasheet: a
decoder layer of the config's model forward and forward+backward over a range of token counts
(fitted as fixed overhead + seconds per token, which gives the efficiency against the measured
matmul rate), one decode step of the whole model with a KV cache (the engine's per-step
overhead), a memory copy, and gloo all-reduces between two processes. Each "device" gets the
threads a worker would (the node's cores divided by cluster.cpu_devices).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from asyncrl.plan.hardware import CPU_PROFILE, DeviceProfile
from asyncrl.plan.workload import ModelSpec

ASSUMED_CALL_OVERHEAD_S = 0.005  # per model function call through the runtime (not measured here)


def _timed(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = a + b·x with the slope b from the two largest x (where the per-token cost dominates)
    and the fixed cost a from the smallest (where it does). Where a busy machine timed the largest
    x no slower than the next, b is the largest x's time per unit instead (an upper bound: it
    holds the fixed cost too), never a zero or negative cost."""
    b = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    if b <= 0:
        b = ys[-1] / xs[-1]
    return max(0.0, ys[0] - b * xs[0]), b


def _efficiency(flops: float, peak: float, seconds: float) -> float:
    """`flops` in `seconds` as a fraction of the peak matmul rate, at most 1: a noisy slope must not
    price a layer faster than the peak measured in the same run."""
    return min(1.0, flops / (peak * seconds))


def _train_step(model: Any, ids: Any) -> None:
    import torch

    logits = model(input_ids=ids).logits
    torch.log_softmax(logits.float(), -1).mean().backward()


def _micro_batch_fit(model: Any, vocab: int, rows: list[int], seq: int, repeat: int) -> tuple[float, float]:
    """(seconds per micro-batch, seconds per token) of a whole-model forward + backward."""
    import torch

    gen = torch.Generator().manual_seed(0)
    times = [_timed(lambda r=r: _train_step(model, torch.randint(0, vocab, (r, seq), generator=gen)), repeat)
             for r in rows]
    return _fit([r * seq for r in rows], times)


def _two_rank_worker(rank: int, init: str, sizes: list[int], repeat: int, out: str, threads: int,
                     spec: dict, rows: list[int], seq: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from asyncrl.train.fsdp import apply_fsdp

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    results = []
    for n in sizes:
        t = torch.ones(n // 4)
        results.append(_timed(lambda t=t: dist.all_reduce(t), repeat))
    from asyncrl.train.tp import apply_tp

    torch.manual_seed(0)
    model = apply_fsdp(_model(ModelSpec(**spec)), init_device_mesh("cpu", (2,)))
    results.extend(_micro_batch_fit(model, spec["vocab"], rows, seq, max(3, repeat // 4)))
    torch.manual_seed(0)
    model = apply_tp(_model(ModelSpec(**spec)), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    results.extend(_micro_batch_fit(model, spec["vocab"], rows, seq, max(3, repeat // 4)))
    if rank == 0:
        Path(out).write_text(",".join(map(str, results)))
    dist.barrier()  # both ranks are done with every collective before either tears down
    dist.destroy_process_group()


def measure_two_ranks(spec: ModelSpec, threads: int, rows: list[int], seq: int,
                      repeat: int = 20) -> tuple[float, float, float, float]:
    """Two gloo processes: (latency s, bandwidth bytes/s) of an all-reduce, from a small and a
    large one, and the per-micro-batch seconds of FSDP and of tensor-parallel training over
    both (their collectives and, for TP, DTensor's dispatch)."""
    import torch.multiprocessing as mp

    sizes = [4096, 16 * 2**20]
    with tempfile.TemporaryDirectory(prefix="asyncrl-profile-") as tmp:
        out = os.path.join(tmp, "result")
        init = "file://" + os.path.join(tmp, "store")
        try:
            # forked from multiprocessing's fork server: one this process already runs (its imports
            # done) or a fresh one, whose two children import what they need as spawned ones would
            mp.start_processes(_two_rank_worker, args=(init, sizes, repeat, out, threads, asdict(spec), rows, seq),
                               nprocs=2, start_method="forkserver", join=True)
        except mp.ProcessExitedException:
            # gloo can abort a rank while tearing down after the results are written ("terminate
            # called without an active exception"): the measurements stand; anything else does not
            if not Path(out).is_file():
                raise
        small, large, fsdp_per_micro, _, tp_per_micro, _ = map(float, Path(out).read_text().split(","))
    # two ranks: t = latency + bytes / bw
    bw = (sizes[1] - sizes[0]) / max(1e-9, large - small)
    return max(1e-6, small - sizes[0] / bw), bw, fsdp_per_micro, tp_per_micro


def dense_proxy(spec: ModelSpec) -> ModelSpec:
    """A dense Llama of the model's width (a mixture of experts' `ffn` is its dense MLP size)."""
    return replace(spec, head_dim=0, experts=0, experts_per_token=0, expert_ffn=0, shared_ffn=0)


def _model(spec: ModelSpec) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
                         num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                         num_key_value_heads=spec.kv_heads, max_position_embeddings=4096,
                         tie_word_embeddings=spec.tied)
    return LlamaForCausalLM(config).float()


def measure(spec: ModelSpec, devices: int, quick: bool = False) -> DeviceProfile:
    import torch
    from transformers.cache_utils import DynamicCache

    cores = os.cpu_count() or 1
    threads = max(1, cores // devices)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    repeat = 3 if quick else 7

    peak = 0.0
    for n in (256, 512, 1024):
        a, b = torch.randn(n, n), torch.randn(n, n)
        peak = max(peak, 2 * n**3 / _timed(lambda a=a, b=b: a @ b, repeat))

    big = torch.empty(64 * 2**20 // 4)
    dst = torch.empty_like(big)
    mem_bw = 2 * big.numel() * 4 / _timed(lambda: dst.copy_(big), repeat)

    model = _model(spec)
    layer = model.model.layers[0]
    rotary = model.model.rotary_emb
    token_counts = [8, 256, 1024] if quick else [8, 64, 256, 1024, 2048]
    fwd, train = [], []
    for x in token_counts:
        seq = min(x, 128)
        rows = x // seq
        hidden = torch.randn(rows, seq, spec.hidden, requires_grad=True)
        pos = torch.arange(seq).unsqueeze(0).expand(rows, -1)
        emb = rotary(hidden, pos)

        def forward(hidden: Any = hidden, emb: Any = emb) -> Any:
            out = layer(hidden, position_embeddings=emb)
            return out[0] if isinstance(out, tuple) else out

        with torch.no_grad():
            fwd.append(_timed(forward, repeat))
        train.append(_timed(lambda forward=forward: forward().sum().backward(), repeat))
    per_token = 2 * spec.layer_params + 2 * spec.hidden * 64  # matmuls and attention over ~128 / 2 tokens
    a_f, b_f = _fit(token_counts, fwd)
    a_t, b_t = _fit(token_counts, train)
    layer_overhead = min(a_f, a_t / 3)

    model.eval()
    with torch.no_grad():
        prompt = torch.randint(0, spec.vocab, (1, 16))
        cache = DynamicCache()
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        last = prompt[:, -1:]
        step = _timed(lambda: model(input_ids=last, past_key_values=cache, use_cache=True), repeat * 3)
    compute = 2 * spec.params * b_f / per_token  # the whole model's matmuls at the layers' measured rate
    decode_overhead = max(0.0, step - spec.layers * layer_overhead - compute)

    # a whole micro-batch (what the runtime adds per micro-batch: the head, the loss, Python), alone
    # and under FSDP over two ranks (each micro-batch gathers and reduce-scatters every block)
    rows, seq = [1, 8, 16], 32
    plain_per_micro, _ = _micro_batch_fit(model.train(), spec.vocab, rows, seq, repeat)
    latency, bw, fsdp_per_micro, tp_per_micro = measure_two_ranks(spec, threads, rows, seq,
                                                                  repeat=5 if quick else 20)
    latency = max(latency, (fsdp_per_micro - plain_per_micro) / (3 * (spec.layers + 1)))  # as inside training
    # TP: two all-reduces per layer forward, two backward
    tp_latency = max(latency, (tp_per_micro - plain_per_micro) / (4 * spec.layers))
    mem_total = _host_memory()
    return DeviceProfile(
        name="cpu", kind="cpu", devices_per_node=devices, peak_flops=peak, mem_bw=mem_bw,
        description=(f"this machine measured by `asyncrl-plan profile` on {time.strftime('%Y-%m-%d')}: {cores} cores, "
                     f"{devices} devices of {threads} thread(s), layers of {spec.name} (hidden {spec.hidden}); "
                     f"call_overhead_s assumed"),
        mem_bytes=mem_total / devices, intra_bw=bw, inter_bw=bw, intra_latency_s=latency, inter_latency_s=latency,
        train_efficiency=_efficiency(3 * per_token, peak, b_t), infer_efficiency=_efficiency(per_token, peak, b_f),
        mem_bw_efficiency=1.0, half_efficiency_tokens=0.0, layer_overhead_s=layer_overhead,
        decode_step_overhead_s=decode_overhead, call_overhead_s=ASSUMED_CALL_OVERHEAD_S,
        micro_batch_overhead_s=max(0.0, plain_per_micro - 3 * spec.layers * layer_overhead), tp_latency_s=tp_latency,
        usable_memory_fraction=0.8, bytes_per_param=4)


def _host_memory() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return float(line.split()[1]) * 1024
    return 8 * 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl-plan profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(CPU_PROFILE), help="where to write the profile (default %(default)s)")
    parser.add_argument("--config-name", "-cn", default="quickstart", help="the config whose model's layers are timed")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and sizes (tests)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    from asyncrl.config import ConfigError, rl_config
    from asyncrl.launch import load_config
    from asyncrl.plan.workload import config_model_spec

    try:
        cfg = rl_config(load_config(args.config_name, args.overrides))
        spec = config_model_spec(cfg)
    except ConfigError as e:
        print(f"asyncrl-plan profile: {e}", file=sys.stderr)
        return 2
    profile = measure(dense_proxy(spec), cfg.cluster.cpu_devices, quick=args.quick)  # rates of a dense layer as wide
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(profile.to_json())
    tmp.replace(out)
    print(profile.to_json(), end="")
    print(f"wrote {out}")
    return 0
