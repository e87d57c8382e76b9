"""Long, long-tailed responses on CPU ranks: packed against padded training steps, token-balanced
data parallelism, and Ulysses sequence parallelism's memory.

    python -m benchmarks.long_context            # ~6 minutes on 2 cores
    python -m benchmarks.long_context --quick    # smaller batch and a 4 K-token row (~2 minutes)
    python -m benchmarks.long_context --skip-throughput --skip-sp2 --sp4   # sp = 1 and 4 on a 16 K row

- Throughput (2 gloo ranks, FSDP2, the actor's update as `update_actor` runs it: `ppo_update`
  with the PPO-clip loss, fp32): a batch of `--rows` rows, prompts of 64-128 tokens, responses
  log-normal (median 256, sigma 1, clipped to 64 … 4 096 tokens; `response_p99_over_p50` is the
  batch's own), split over the ranks as `balance_tokens` splits it. `packed_speedup` = training
  tokens / s with `actor.pack_sequences` (default) over `pack_sequences=false`, micro-batches of
  `micro_batch_size` rows each; `packed_speedup_token_budget` the same with
  `max_tokens_per_micro_batch` (the padded path then sorts rows by length: its best case).
  The model: Qwen2 with hidden 512, 8 heads / 2 KV heads, intermediate 1 536, 2 layers,
  vocabulary 8 192 (random weights).
- `packed_max_abs_diff`: the largest |Δ log-prob| and |Δ grad| between the packed and the padded
  forward of that model over 8 of the batch's rows (fp32).
- `dp_token_imbalance`: the largest rank's tokens over the mean after `balance_tokens`'
  Karmarkar–Karp split of that batch over the 2 ranks, beside `dp_token_imbalance_unbalanced`
  (the arrival order's equal chunks); `*_256x8` the same for 256 rows over 8 ranks.
- Ulysses (gloo ranks; rank 0 owns one row of `--sp-tokens` tokens, 3/4 prompt and 1/4 response;
  the Qwen2.5-0.5B shape with `--sp-layers` (4) of its 24 layers and its 151 936 vocabulary,
  activation checkpointing on, fp32, the model replicated with its gradients allocated, glibc's
  mmap threshold fixed at 1 MiB so freed blocks leave the resident set): the update pass's peak
  resident memory above the memory before it, per rank: its activations, logits and their
  transients (`sp{k}_activation_gib`), beside the estimate's activation terms
  (`asyncrl.plan.memory.update_pass`, `sp{k}_estimate_gib`); `sp2_memory_ratio` = sp 2 over sp 1.
  `--sp4`: the same at sp = 1 and 4 (4 ranks) on the Qwen2.5-1.5B shape (12 heads) with 2 layers,
  a 32 768 vocabulary (four replicas fit this machine's 24 GiB) and a `--sp4-tokens` row
  (`sp4_memory_ratio`).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

SMALL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=8192, max_position_embeddings=16384)
QWEN05_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
QWEN15_SHAPE = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
SHAPES = {"0.5b": QWEN05_SHAPE, "1.5b": QWEN15_SHAPE}


def model_of(shape: dict, seed: int = 0, checkpointing: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(pad_token_id=0, **shape))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def rollout_batch(rows: int, vocab: int, seed: int = 0, max_response: int = 4096):
    """Rows shaped as generate_sequences returns them, with the step's advantages and old log-probs."""
    from asyncrl.single_controller.batch import Batch

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(64, 129, (rows,), generator=g)
    responses = torch.exp(math.log(256) + torch.randn(rows, generator=g)).round().clamp(64, max_response).long()
    p, r = int(prompts.max()), int(responses.max())
    mask = torch.zeros(rows, p + r, dtype=torch.long)
    for i in range(rows):
        mask[i, p - prompts[i]:p] = 1
        mask[i, p:p + responses[i]] = 1
    ids = torch.randint(1, vocab, (rows, p + r), generator=g) * mask
    batch = Batch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                   "responses": ids[:, p:], "response_mask": mask[:, p:],
                   "advantages": torch.randn(rows, r, generator=g) * mask[:, p:],
                   "old_log_probs": torch.zeros(rows, r)})
    return batch, (prompts + responses).tolist(), responses


def _loss(model, mb):
    from asyncrl.algorithms import core
    from asyncrl.roles.forward import response_forward

    logp, _ = response_forward(model, mb)
    mask = mb["response_mask"].float()
    loss, _ = core.ppo_policy_loss(logp.detach(), logp, mb["advantages"], mask, clip_ratio_low=0.2,
                                   clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean")
    return loss, {}


def _engine(shape: dict, packed: bool):
    from asyncrl.config import OptimConfig
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import FSDPEngine, init_distributed, parallelize
    from asyncrl.train.packing import enable_packing

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(), int(os.environ["WORLD_SIZE"]))
    model = parallelize(model_of(shape), layout)
    engine = FSDPEngine(model, layout, optim=OptimConfig(lr=1e-6), device="cpu")
    if packed:
        enable_packing(model)
    return engine


def _update_cfg(micro_rows: int, max_tokens: int):
    from asyncrl.config import PPOUpdateConfig

    return PPOUpdateConfig(micro_batch_size=micro_rows, max_tokens_per_micro_batch=max_tokens, shuffle=False)


def _throughput_rank(rank: int, args: dict) -> dict:
    """Training tokens / s of one update over this rank's balanced share, packed and padded."""
    from asyncrl.roles.update import ppo_update
    from asyncrl.single_controller.balance import balanced_shards

    batch, tokens, _ = rollout_batch(args["rows"], SMALL["vocab_size"])
    order = balanced_shards(tokens, 2)
    half = len(order) // 2
    mine = batch.take(torch.tensor(order[rank * half:(rank + 1) * half]))
    warm = mine.take(torch.tensor([half - 1]))  # a short row: lazy initialisation outside the timing
    out = {}
    for packed in (True, False):
        for label, cfg in (("rows", _update_cfg(args["micro_rows"], 0)),
                           ("budget", _update_cfg(args["micro_rows"], args["budget"]))):
            engine = _engine(SMALL, packed)
            gen = torch.Generator().manual_seed(0)
            ppo_update(engine, warm, cfg, _loss, gen)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            ppo_update(engine, mine, cfg, _loss, gen)
            torch.distributed.barrier()
            out[packed, label] = time.perf_counter() - t0
    return out


def _sp_rank(rank: int, args: dict) -> dict:
    """Peak activation memory of one update pass (forward and backward, the actor's loss) per rank:
    rank 0 owns one row of `tokens` tokens (3/4 prompt, 1/4 response), the others a 256-token row.
    The model is replicated (no FSDP) with its gradients allocated by a first pass, so what the
    pass adds on top of the memory before it is activations, logits and their transients."""
    from asyncrl.single_controller.memory import _reset, _status
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed
    from asyncrl.train.packing import enable_packing
    from asyncrl.train.ulysses import sequence_parallel, turn_loss

    init_distributed()
    shape = {**SHAPES[args["shape"]], "num_hidden_layers": args["layers"], **args.get("override", {})}
    model = model_of(shape, checkpointing=True)
    model.train()
    enable_packing(model)
    if args["sp"] > 1:
        layout = ParallelLayout.from_config(ParallelConfig(), int(os.environ["WORLD_SIZE"]))
        sequence_parallel(layout, args["sp"], [model], "actor.")

    def update(mb) -> None:
        steps, loss_fn = turn_loss(model, [mb], _loss)
        for step in steps:
            loss_fn(model, step)[0].backward()

    update(_row(256, shape["vocab_size"], rank))  # gradients exist from here on
    model.zero_grad(set_to_none=False)
    mb = _row(args["tokens"] if rank == 0 else 256, shape["vocab_size"], rank)
    torch.distributed.barrier()
    _reset("cpu")
    before = _status()[0]
    t0 = time.perf_counter()
    update(mb)
    return {"peak_above_gib": (_status()[1] - before) / 2**30, "seconds": time.perf_counter() - t0}


def _row(n: int, vocab: int, seed: int):
    from asyncrl.single_controller.batch import Batch

    p, r = n * 3 // 4, n - n * 3 // 4
    ids = torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(seed))
    return Batch({"input_ids": ids, "attention_mask": torch.ones(1, n, dtype=torch.long),
                  "position_ids": torch.arange(n)[None], "responses": ids[:, p:], "response_mask": torch.ones(1, r),
                  "advantages": torch.randn(1, r, generator=torch.Generator().manual_seed(seed)),
                  "old_log_probs": torch.zeros(1, r)})


def _rank_main(fn_name: str, rank: int, world: int, port: int, out_dir: str, args: dict) -> None:
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        torch.set_num_threads(1)
        result = globals()[fn_name](rank, args)
        torch.save(result, Path(out_dir) / f"result{rank}.pt")
        torch.distributed.barrier()
    except BaseException:
        (Path(out_dir) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_ranks(fn_name: str, world: int, args: dict, timeout_s: float = 1800) -> list:
    from daemons.proc import free_port, run_spawned

    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        codes = run_spawned(_rank_main, [(fn_name, r, world, port, out, args) for r in range(world)], timeout_s)
        errors = [f.read_text() for f in sorted(Path(out).glob("error*.txt"))]
        if errors or any(codes):
            raise RuntimeError(f"{fn_name}: exit codes {codes}\n" + "\n".join(errors))
        return [torch.load(Path(out) / f"result{r}.pt", weights_only=False) for r in range(world)]


def exactness(rows: int = 8, limit: int = 512) -> dict[str, float]:
    """The largest |Δ log-prob| and |Δ grad| (of the token-mean log-likelihood) between the packed
    and the padded forward (fp32)."""
    from asyncrl.roles.forward import response_forward
    from asyncrl.train.packing import enable_packing

    batch, _, _ = rollout_batch(rows, SMALL["vocab_size"], max_response=limit)
    model = model_of(SMALL)
    mask = batch["response_mask"].float()
    logps, grads = [], []
    for packed in (False, True):
        if packed:
            enable_packing(model)
        lp, _ = response_forward(model, batch)
        ((lp * mask).sum() / mask.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
        logps.append(lp.detach() * mask)
    return {"logprob": float((logps[0] - logps[1]).abs().max()),
            "grad": max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0])}


def imbalances(rows: int, shards: int, seed: int = 0) -> tuple[float, float]:
    from asyncrl.algorithms.roles import _shard_loads
    from asyncrl.single_controller.balance import balanced_shards, imbalance

    _, tokens, _ = rollout_batch(rows, 16, seed=seed)
    order = balanced_shards(tokens, shards)
    return (imbalance(_shard_loads([tokens[i] for i in order], shards)), imbalance(_shard_loads(tokens, shards)))


def sp_estimate(shape: dict, tokens: int, sp: int) -> float:
    """The memory estimate's activation terms for that pass (`update_pass` with checkpointing:
    the kept layer inputs and one layer's recompute, the logits and their gradient with the fp32
    chunks, the all-to-all buffers), fp32, GiB."""
    from asyncrl.plan.memory import Knobs, update_pass
    from asyncrl.plan.workload import ModelSpec

    spec = ModelSpec("bench", shape["num_hidden_layers"], shape["hidden_size"], shape["num_attention_heads"],
                     shape["num_key_value_heads"], shape["intermediate_size"], shape["vocab_size"], tied=True)
    parts = update_pass(spec, 1, tokens, tokens - tokens * 3 // 4 + 1, 1, Knobs(4.0, True, sp=sp))
    return sum(v for k, v in parts.items() if "gathered" not in k and "embedding" not in k) / 2**30


def sp_memory(shape: str, layers: int, tokens: int, sps: tuple[int, ...], result: dict, tag: str,
              **override: int) -> dict[int, float]:
    # glibc otherwise raises its mmap threshold as large blocks are freed and then keeps tens-of-MB
    # blocks in its heap: at sp = 4 that retention was ~1 GiB of the resident peak, more than the
    # activations themselves; a fixed 1 MiB threshold returns them, so the peak is what the pass holds
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    peaks = {}
    for sp in sps:
        per_rank = run_ranks("_sp_rank", max(2, sp), {"shape": shape, "layers": layers, "tokens": tokens, "sp": sp,
                                                      "override": override})
        peaks[sp] = max(r["peak_above_gib"] for r in per_rank)
        estimate = sp_estimate({**SHAPES[shape], "num_hidden_layers": layers, **override}, tokens, sp)
        result.update({f"{tag}sp{sp}_activation_gib": round(peaks[sp], 3),
                       f"{tag}sp{sp}_estimate_gib": round(estimate, 3),
                       f"{tag}sp{sp}_s": round(max(r["seconds"] for r in per_rank), 1)})
        print(f"{shape} x {layers} layers, {tokens} tokens, sp={sp}: {peaks[sp]:.3f} GiB of activations per rank "
              f"(estimate {estimate:.3f})", file=sys.stderr)
    return peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-sp2", action="store_true")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--micro-rows", type=int, default=4)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--sp-tokens", type=int, default=8192)
    ap.add_argument("--sp-layers", type=int, default=4)
    ap.add_argument("--sp4", action="store_true", help="also sp=4 over 4 ranks on the Qwen2.5-1.5B shape")
    ap.add_argument("--sp4-tokens", type=int, default=16384)
    args = ap.parse_args()
    if args.quick:
        args.rows, args.sp_tokens = 16, 4096
    t0 = time.perf_counter()
    _, tokens, responses = rollout_batch(args.rows, 16)
    q = torch.quantile(responses.float(), torch.tensor([0.5, 0.99]))
    result: dict = {"rows": args.rows, "tokens": sum(tokens), "response_p99_over_p50": round(float(q[1] / q[0]), 2)}
    diff = exactness()
    result.update(packed_max_abs_diff=max(diff.values()), packed_logprob_max_abs_diff=diff["logprob"],
                  packed_grad_max_abs_diff=diff["grad"])
    print(f"packed vs padded: max |diff| {diff}", file=sys.stderr)
    after, before = imbalances(args.rows, 2)
    result.update(dp_token_imbalance=round(after, 4), dp_token_imbalance_unbalanced=round(before, 4))
    after, before = imbalances(256, 8, seed=1)
    result.update(dp_token_imbalance_256x8=round(after, 4), dp_token_imbalance_unbalanced_256x8=round(before, 4))
    if not args.skip_throughput:
        times = run_ranks("_throughput_rank", 2, {"rows": args.rows, "micro_rows": args.micro_rows,
                                                  "budget": args.budget})
        slowest = {k: max(t[k] for t in times) for k in times[0]}
        result["update_s"] = {f"{'packed' if k[0] else 'padded'}_{k[1]}": round(v, 2) for k, v in slowest.items()}
        result["packed_speedup"] = round(slowest[False, "rows"] / slowest[True, "rows"], 3)
        result["packed_speedup_token_budget"] = round(slowest[False, "budget"] / slowest[True, "budget"], 3)
        print(f"update seconds {result['update_s']}", file=sys.stderr)
    if not args.skip_sp2:
        result["sp_tokens"] = args.sp_tokens
        peaks = sp_memory("0.5b", args.sp_layers, args.sp_tokens, (1, 2), result, "")
        result["sp2_memory_ratio"] = round(peaks[2] / peaks[1], 3)
    if args.sp4:  # 12 heads: sp = 4 divides them (the 0.5B shape's 14 do not); four replicas fit 24 GiB
        result["sp4_tokens"] = args.sp4_tokens  # with a 32 K vocabulary
        peaks = sp_memory("1.5b", 2, args.sp4_tokens, (1, 4), result, "qwen1.5b_", vocab_size=32768)
        result["sp4_memory_ratio"] = round(peaks[4] / peaks[1], 3)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
