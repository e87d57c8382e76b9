"""Weight sync against its floor, measured in the same run on gloo CPU ranks.

    python -m benchmarks.weight_sync                       # the 0.5B shape: bf16/fp32 x 2/4 training x 1/2 rollout ranks
    python -m benchmarks.weight_sync --configs bf16:4:2    # one configuration (dtype:training ranks:rollout ranks)
    python -m benchmarks.weight_sync --delta               # delta updates' bytes after real AdamW steps
    python -m benchmarks.weight_sync --delta --link 1gbit  # ... synced over a shaped link to a node of 2 workers

Every configuration spawns N training ranks (one torch.distributed world, Qwen2.5-0.5B's shape
built on the meta device and sharded by FSDP2 with `asyncrl.train.parallelize`, random fp32
master weights) and R rollout ranks (a staging copy of the model in the sync dtype each), and
times, interleaved over `--reps` after a warm-up (max over ranks of each rank's wall time):

- `split`: the split-placement sync as the trainer runs it (`asyncrl.train.weight_sync`): every
  training rank sends its own shards (`WeightBridge.send_pieces`), the rollout ranks receive them
  into their staging copies (`receive_pieces`);
- `single_source`: the path before (and for TP/PP layouts): every training rank gathers each
  weight (`full_tensors`), rank 0 broadcasts it bucketed (`WeightBridge.send`/`receive`);
- `split_floor`: one raw broadcast of a flat buffer of the model's bytes from training rank 0 to
  the rollout ranks over the same kind of gloo group: one link's limit;
- `reshard`: the colocated reshard (`Resharder.reshard()` into full generation weights, tg = 1,
  in the sync dtype, then `release()`), and `reshard_floor`: one raw all-gather of a flat buffer
  of the model's bytes over the N training ranks (each contributing 1/N).

Every rollout rank's staging copy is checked equal to the training weights (checksums) after
each method. The last line printed is one JSON object: per configuration seconds, GB/s and the
ratios floor / method (`split_vs_floor`, `reshard_vs_floor`; >= 1 beats the floor), and
`max_rank_send_fraction` (the most one training rank sends / the model's bytes); the headline
keys are the bf16 configuration with 4 training ranks and 2 rollout ranks (or the largest run).
Ranks use one torch thread each; with more ranks than cores they share them.

`--delta` (one process, no ranks): `--steps` real AdamW steps on the 0.5B shape at each of `--lrs`;
after each, every weight in bf16 is encoded as a delta from the version before
(`asyncrl.train.delta`: XOR or changed elements, zstd, a checksum) and applied to a receiver's
copy; it reports `delta_bytes_ratio` (bytes sent / the bf16 model, median over the steps), the
encode and apply seconds, and `bit_identical` (every rebuilt weight equal to the sender's).

`--delta --link 1gbit` (root): the sender and a node of `--node-workers` (2) rollout workers in two
network namespaces over a veth shaped to the rate: each version in full and as deltas, timed until
every worker of the node holds it (encode, wire, relay, apply); `per_node_copies` (the bytes the
node's link received / the update's) with the node's first worker relaying to the others as the
trainer does it, against `per_node_copies_without_relay` and `full_sync_s_without_relay` (every
worker in the sender's group, one full sync before the steps).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

QWEN05 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
          "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
          "vocab_size": 151936, "max_position_embeddings": 512, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _barrier(group: Any) -> None:
    group.barrier().wait()


def _max(group: Any, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    opts = torch.distributed.AllreduceOptions()
    opts.reduceOp = torch.distributed.ReduceOp.MAX
    group.allreduce([t], opts).wait()
    return float(t)


def _timed(group: Any, fn: Any) -> float:
    _barrier(group)
    t0 = time.perf_counter()
    fn()
    return _max(group, time.perf_counter() - t0)


def _training_model(model_dir: Path, world: int, dtype: torch.dtype) -> Any:
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import mixed_precision_policy, parallelize
    from asyncrl.train.load import materialize, skeleton

    layout = ParallelLayout.from_config(ParallelConfig(), world)
    model = parallelize(skeleton(str(model_dir), torch.float32), layout, mixed_precision_policy("cpu", dtype=str(dtype)[6:]))
    materialize(model, "cpu")
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02, generator=gen)
    return model, layout


def _rank(rank: int, n: int, r: int, dtype_name: str, model_dir: str, ports: tuple[int, int], reps: int,
          out_dir: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo CPU ranks, also on a GPU host (whose meshes default to cuda)
    import torch.distributed as dist

    from asyncrl.single_controller.parallel import GenerationParallelConfig, generation_layout
    from asyncrl.train.reshard import Resharder, all_gather_single
    from asyncrl.train.weight_sync import (
        TensorSpec,
        WeightBridge,
        full_tensors,
        local_pieces,
        source_rows,
        specs_of,
    )

    torch.set_num_threads(1)
    dtype = DTYPES[dtype_name]
    training = rank < n
    timeout = datetime.timedelta(seconds=600)
    store = dist.TCPStore("127.0.0.1", ports[1], n + r, is_master=rank == 0, timeout=timeout)
    everyone = dist.ProcessGroupGloo(dist.PrefixStore("all/", store), rank, n + r, timeout)
    results: dict[str, Any] = {}
    if training:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
        dist.init_process_group("gloo", rank=rank, world_size=n, timeout=timeout)
        model, layout = _training_model(Path(model_dir), n, dtype)
        tensors = [p.data for _, p in model.named_parameters()]
        rows = source_rows(tensors)
        assert rows is not None
        specs = [TensorSpec(s.name, s.shape, dtype) for s in specs_of(model)]
        store.set(f"rows{rank}", json.dumps(rows))
        bridge = WeightBridge(store, 0, r + 1, "cpu", 600, n, source=rank)
        checks = [float(t.to(dtype).double().sum()) for t in full_tensors(model)]  # collective
        if rank == 0:
            store.set("checks", json.dumps(checks))
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        specs = [TensorSpec(s.name, s.shape, dtype) for s in specs_of(meta)]
        bridge = WeightBridge(store, rank - n + 1, r + 1, "cpu", 600, n)
        rows = [json.loads(store.get(f"rows{i}")) for i in range(n)]
        staged = [torch.empty(s.shape, dtype=dtype) for s in specs]
        checks = json.loads(store.get("checks"))
    model_bytes = sum(s.nbytes for s in specs)
    flat = torch.empty(model_bytes // dtype.itemsize, dtype=dtype) if rank == 0 or not training else None

    def split() -> None:
        if training:
            results["sent"] = bridge.send_pieces(local_pieces(tensors, dtype))
        else:
            bridge.receive_pieces(specs, rows, staged)

    def single() -> None:
        if training:
            it = (t.to(dtype) for t in full_tensors(model))
            if rank == 0:
                bridge.send(specs, it, 64 << 20)
            else:
                for _ in it:
                    pass
        else:
            bridge.receive(specs, staged, 64 << 20)

    def split_floor() -> None:
        if rank == 0 or not training:
            bridge._broadcast_async(bridge.groups[0], flat).wait()

    def check(method: str) -> None:
        if not training:
            got = [float(t.double().sum()) for t in staged]
            bad = [s.name for s, a, b in zip(specs, got, checks, strict=True) if a != b]
            assert not bad, f"{method}: rollout rank {rank - n} differs in {bad[:3]}"
            for t in staged:
                t.zero_()

    times: dict[str, list[float]] = {"split": [], "single_source": [], "split_floor": []}
    for rep in range(reps + 1):
        for name, fn in (("split", split), ("single_source", single), ("split_floor", split_floor)):
            dt = _timed(everyone, fn)
            if name != "split_floor":
                check(name)
            if rep:
                times[name].append(dt)
    flat = None  # noqa: F841 - freed
    if not training:
        del staged  # idle from here: room for the reshard's full copies
    if training:  # the colocated reshard, the rollout ranks idle
        gen = generation_layout(layout, GenerationParallelConfig())
        resharder = Resharder(model, layout, gen, dtype=dtype)
        piece = torch.ones(-(-model_bytes // dtype.itemsize // n), dtype=dtype)

        def reshard() -> None:  # fresh full weights each time, as the trainer's generate phase gets them
            resharder.reshard()
            resharder.release()

        def reshard_floor() -> None:  # the same bytes into a fresh buffer
            gathered = torch.empty(piece.numel() * n, dtype=dtype)
            all_gather_single(gathered, piece)

        times.update(reshard=[], reshard_floor=[])
        for rep in range(reps + 1):
            for name, fn in (("reshard", reshard), ("reshard_floor", reshard_floor)):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                t = torch.tensor([dt], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if rep:
                    times[name].append(float(t))
    _barrier(everyone)
    if rank == 0:
        sent = [sum(rr[i] * torch.Size(s.shape[1:]).numel() * dtype.itemsize for i, s in enumerate(specs))
                for rr in [json.loads(store.get(f"rows{i}")) for i in range(n)]]
        out = {k: statistics.median(v) for k, v in times.items()}
        out.update(model_bytes=model_bytes, max_rank_send_fraction=max(sent) / model_bytes, sent_rank0=results["sent"])
        Path(out_dir, "result.json").write_text(json.dumps(out))
    _barrier(everyone)
    bridge.close()
    if training:
        dist.destroy_process_group()


def run_config(dtype: str, n: int, r: int, model_dir: Path, reps: int, timeout_s: float) -> dict[str, Any]:
    from daemons.proc import free_port, run_spawned

    with tempfile.TemporaryDirectory(prefix="asyncrl-wsync-") as out:
        master = free_port()
        ports = (master, free_port(avoid=[master]))
        codes = run_spawned(_rank, [(k, n, r, dtype, str(model_dir), ports, reps, out) for k in range(n + r)], timeout_s)
        if any(codes):
            raise RuntimeError(f"{dtype}:{n}:{r}: ranks exited with {codes}")
        raw = json.loads(Path(out, "result.json").read_text())
    gb = raw["model_bytes"] / 1e9
    row = {"config": f"{dtype}:{n}:{r}", "model_gb": round(gb, 3),
           "max_rank_send_fraction": round(raw["max_rank_send_fraction"], 4)}
    for k in ("split", "single_source", "split_floor", "reshard", "reshard_floor"):
        row[f"{k}_s"] = round(raw[k], 4)
        row[f"{k}_gbps"] = round(gb / raw[k], 3)
    row["split_vs_floor"] = round(raw["split_floor"] / raw["split"], 3)
    row["split_vs_single_source"] = round(raw["single_source"] / raw["split"], 3)
    row["reshard_vs_floor"] = round(raw["reshard_floor"] / raw["reshard"], 3)
    return row


def delta_run(lrs: list[float], steps: int, tokens: int, seed: int = 0) -> dict[str, Any]:
    """Real AdamW steps on the 0.5B shape (fp32 master weights, a language-model loss on random
    tokens); after each, every weight in bf16 encoded as a delta from the step before
    (`asyncrl.train.delta`) and applied to a receiver's copy, checked bit for bit."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.train.delta import apply, checksum, encode

    out: dict[str, Any] = {}
    for lr in lrs:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in QWEN05.items() if k != "architectures"}))
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        held = {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}
        full = sum(t.numel() * t.element_size() for t in held.values())
        g = torch.Generator().manual_seed(seed + 1)
        rows = []
        for step in range(1, steps + 1):
            ids = torch.randint(0, QWEN05["vocab_size"], (2, tokens // 2), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sent, kinds, t_enc, t_apply, identical = 0, {"xor": 0, "sparse": 0}, 0.0, 0.0, True
            for n, p in model.named_parameters():
                new = p.detach().to(torch.bfloat16)
                t0 = time.perf_counter()
                delta = encode(n, new, held[n], version=step, base_version=step - 1)
                t1 = time.perf_counter()
                apply(delta, held[n], held_version=step - 1)  # the receiver's copy moves to this version
                t_enc, t_apply = t_enc + t1 - t0, t_apply + time.perf_counter() - t1
                sent += delta.nbytes
                kinds[delta.kind] += 1
                identical &= checksum(held[n]) == checksum(new)
            rows.append({"step": step, "delta_bytes_ratio": round(sent / full, 4), "encode_s": round(t_enc, 2),
                         "apply_s": round(t_apply, 2), "kinds": kinds, "bit_identical": identical})
            print(json.dumps({"lr": lr, **rows[-1]}), flush=True)
        out[f"{lr:g}"] = {"full_mb": round(full / 2**20, 1), "steps": rows,
                          "delta_bytes_ratio": statistics.median(r["delta_bytes_ratio"] for r in rows),
                          "bit_identical": all(r["bit_identical"] for r in rows)}
        del model, opt, held
    return out


def _link_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in QWEN05.items() if k != "architectures"}))


def _link_bridges(role: str, index: int, workers: int, host: str, port: int) -> tuple[Any, Any]:
    """The sender's or rollout worker `index`'s two bridges: as the trainer plans it (the
    receiving node's first worker takes each update and relays it to the others there,
    `bridge_plan`), and without the relay (every worker in the sender's group)."""
    from asyncrl.train.weight_sync import WeightBridge, bridge_plan

    store = torch.distributed.TCPStore(host if role == "receiver" else "0.0.0.0", port, 1 + workers,
                                       is_master=role == "sender", timeout=datetime.timedelta(seconds=600))
    receivers, relays = bridge_plan(["receiving node"] * workers, {"sending node"})
    rank = 0 if role == "sender" else 1 + receivers.index(index) if index in receivers else None
    relayed = WeightBridge(store, rank, 1 + len(receivers), "cpu", 600,
                           relay=None if role == "sender" else relays.get(index))
    direct = WeightBridge(torch.distributed.PrefixStore("direct/", store), 0 if role == "sender" else 1 + index,
                          1 + workers, "cpu", 600)
    return relayed, direct


def _rx_bytes() -> int:
    """Bytes this network namespace's link to the sender has received (its sysfs counter)."""
    return int(Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/rx_bytes").read_text())


def link_role(role: str, host: str, port: int, lrs: list[float], steps: int, tokens: int, index: int = 0,
              workers: int = 1, seed: int = 0) -> None:
    """One side of `delta_link_run`, inside its network namespace. The sender trains (real AdamW
    steps on the 0.5B shape) and sends each version twice, in full and as deltas; every receiver
    times both from a barrier to the version applied (encode, wire, relay and apply), checks the
    rebuilt copy against the full one bit for bit, and prints one JSON line per step; the first
    also counts the bytes that crossed into its namespace. Before the steps, one full sync over a
    bridge without the relay counts what every worker receiving its own copy costs."""
    from asyncrl.single_controller.memory import release_host_memory
    from asyncrl.train.delta import apply, checksum, encode
    from asyncrl.train.weight_sync import TensorSpec

    torch.set_num_threads(1)
    bridge, direct = _link_bridges(role, index, workers, host, port)
    first = True
    for lr in lrs:
        model = _link_model(seed)
        specs = [TensorSpec(n, tuple(p.shape), torch.bfloat16) for n, p in model.named_parameters()]
        rows = [[s.shape[0] for s in specs]]
        if role == "sender":
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
            base = [p.detach().to(torch.bfloat16).clone() for p in model.parameters()]
            g = torch.Generator().manual_seed(seed + 1)
            if first:
                direct._broadcast(torch.zeros(1))
                direct.send_pieces(base)
        else:
            held = [p.detach().to(torch.bfloat16).clone() for p in model.parameters()]  # version 0, as the sender's base
            full = [torch.empty_like(t) for t in held]
            del model
            release_host_memory()  # the fp32 model's pages back: three of these processes share the machine
            if first:
                direct._broadcast(torch.zeros(1))
                rx, t0 = _rx_bytes(), time.perf_counter()
                full_bytes = direct.receive_pieces(specs, rows, full)
                print(json.dumps({"direct_copies": round((_rx_bytes() - rx) / full_bytes, 3),
                                  "direct_full_s": round(time.perf_counter() - t0, 3)}), flush=True)
        first = False
        for step in range(1, steps + 1):
            if role == "sender":
                ids = torch.randint(0, QWEN05["vocab_size"], (2, tokens // 2), generator=g)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                new = [p.detach().to(torch.bfloat16) for p in model.parameters()]
                bridge._broadcast(torch.zeros(1))
                bridge.send_pieces(new)
                bridge._broadcast(torch.zeros(1))
                deltas = [encode(s.name, t, b, step, step - 1) for s, t, b in zip(specs, new, base, strict=True)]
                bridge.send_deltas(deltas)
                for b, t in zip(base, new, strict=True):
                    b.copy_(t)
                continue
            bridge._broadcast(torch.zeros(1))
            rx, t0 = _rx_bytes(), time.perf_counter()
            full_bytes = bridge.receive_pieces(specs, rows, full)
            t1, full_rx = time.perf_counter(), _rx_bytes() - rx
            bridge._broadcast(torch.zeros(1))
            rx, t2 = _rx_bytes(), time.perf_counter()
            (deltas,), received = bridge.receive_deltas(specs, rows, step)
            t3, delta_rx = time.perf_counter(), _rx_bytes() - rx
            for d, t in zip(deltas, held, strict=True):
                apply(d, t, held_version=step - 1)
            t4 = time.perf_counter()
            identical = all(checksum(a) == checksum(b) for a, b in zip(held, full, strict=True))
            print(json.dumps({"lr": lr, "step": step, "worker": index, "full_s": round(t1 - t0, 3),
                              "delta_s": round(t4 - t2, 3), "delta_wire_and_encode_s": round(t3 - t2, 3),
                              "apply_s": round(t4 - t3, 3), "full_bytes": full_bytes, "delta_bytes": received,
                              "node_rx_full": full_rx, "node_rx_delta": delta_rx, "bit_identical": identical}),
                  flush=True)
        if role == "sender":
            del model, opt, base
            release_host_memory()
    bridge.close()
    direct.close()


def delta_link_run(rate: str, lrs: list[float], steps: int, tokens: int, workers: int = 2) -> dict[str, Any]:
    """The sender and a node of `workers` rollout workers in two network namespaces joined by a
    veth link whose sending side is shaped to `rate` (`tc ... tbf`): full syncs against delta
    syncs as bytes cost time between machines, encode, relay and apply included; and the copies
    of each update that cross into the receiving node (its link's received bytes / the update's)."""
    import subprocess
    import sys

    from benchmarks.elastic import hosts

    with hosts(2) as [(ns0, ip0), (ns1, _)]:
        def ifname(ns: str) -> str:  # the namespace's end of its veth pair
            return next(line.split(":")[1].strip().split("@")[0] for line in subprocess.run(
                ["ip", "-n", ns, "-o", "link", "show"], capture_output=True, text=True, check=True).stdout.splitlines()
                if ": lo:" not in line)

        dev = ifname(ns0)
        subprocess.run(["ip", "netns", "exec", ns0, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                        "burst", "1mb", "latency", "100ms"], check=True)
        port = 29500 + os.getpid() % 1000
        common = ["--lrs", *map(str, lrs), "--steps", str(steps), "--tokens", str(tokens), "--link-host", ip0,
                  "--link-port", str(port), "--node-workers", str(workers)]

        def side(ns: str, role: str, index: int = 0) -> subprocess.Popen:
            return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "benchmarks.weight_sync",
                                     "--link-role", role, "--link-index", str(index), *common],
                                    env={**os.environ, "GLOO_SOCKET_IFNAME": ifname(ns)},
                                    stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
        procs = [side(ns0, "sender"), *(side(ns1, "receiver", k) for k in range(workers))]
        try:
            outs = [p.communicate(timeout=3600)[0] for p in procs[1:]]
            procs[0].wait(60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"the link run failed (exit codes: sender, receivers {[p.returncode for p in procs]})")
    lines = [json.loads(line) for out in outs for line in out.splitlines() if line.startswith("{")]
    rows = [r for r in lines if "lr" in r]
    direct = [r for r in lines if "direct_copies" in r]
    per_lr: dict[str, Any] = {"direct_copies": direct[0]["direct_copies"],
                              "direct_full_s": max(r["direct_full_s"] for r in direct)}
    for lr in lrs:
        steps_ = sorted({r["step"] for r in rows if r["lr"] == lr})
        # a step's sync is done when every worker of the node holds the version
        mine = [[r for r in rows if r["lr"] == lr and r["step"] == k] for k in steps_]
        full_s = [max(r["full_s"] for r in m) for m in mine]
        delta_s = [max(r["delta_s"] for r in m) for m in mine]
        lead = [next(r for r in m if r["worker"] == 0) for m in mine]
        per_lr[f"{lr:g}"] = {"steps": [x for m in mine for x in m], "full_sync_s": statistics.median(full_s),
                             "delta_sync_s": statistics.median(delta_s),
                             "delta_time_ratio": round(statistics.median(d / f for d, f in zip(delta_s, full_s, strict=True)), 3),
                             "delta_bytes_ratio": round(statistics.median(r["delta_bytes"] / r["full_bytes"] for r in lead), 4),
                             "per_node_copies": round(statistics.median(r["node_rx_full"] / r["full_bytes"] for r in lead), 3),
                             "link_gbit_s": round(8 * lead[0]["full_bytes"] / statistics.median(full_s) / 1e9, 3),
                             "bit_identical": all(r["bit_identical"] for m in mine for r in m)}
    return per_lr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.weight_sync", description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=["bf16:2:1", "bf16:4:1", "bf16:2:2", "bf16:4:2",
                                                     "fp32:2:1", "fp32:4:1", "fp32:2:2", "fp32:4:2"],
                   help="dtype:training ranks:rollout ranks")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=1200)
    p.add_argument("--delta", action="store_true", help="the bytes of delta updates after real AdamW steps")
    p.add_argument("--lrs", type=float, nargs="*", default=[1e-6, 1e-5])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=256, help="tokens per optimizer step (2 rows)")
    p.add_argument("--link", default=None, help="with --delta: over a real bridge between two network namespaces, "
                                                "the sending side shaped to this rate (tc; e.g. 1gbit); needs root")
    p.add_argument("--link-role", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    p.add_argument("--link-host", help=argparse.SUPPRESS)
    p.add_argument("--link-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--link-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--node-workers", type=int, default=2,
                   help="with --link: rollout workers on the receiving node (one copy of each update crosses to it)")
    args = p.parse_args(argv)
    if args.link_role:
        link_role(args.link_role, args.link_host, args.link_port, args.lrs, args.steps, args.tokens, args.link_index,
                  args.node_workers)
        return 0
    if args.delta and args.link:
        per_lr = delta_link_run(args.link, args.lrs, args.steps, args.tokens, args.node_workers)
        direct, direct_s = per_lr.pop("direct_copies"), per_lr.pop("direct_full_s")
        print(json.dumps({"benchmark": "weight_sync_delta_link", "model": "Qwen2.5-0.5B shape", "sync_dtype": "bf16",
                          "link": args.link, "steps": args.steps, "node_workers": args.node_workers,
                          "lrs": {k: {x: y for x, y in v.items() if x != "steps"} for k, v in per_lr.items()},
                          "delta_time_ratio": {k: v["delta_time_ratio"] for k, v in per_lr.items()},
                          "delta_bytes_ratio": {k: v["delta_bytes_ratio"] for k, v in per_lr.items()},
                          "per_node_copies": max(v["per_node_copies"] for v in per_lr.values()),
                          "per_node_copies_without_relay": direct,
                          "full_sync_s_without_relay": direct_s,
                          "bit_identical": all(v["bit_identical"] for v in per_lr.values())}))
        return 0
    if args.delta:
        torch.set_num_threads(os.cpu_count() or 1)
        per_lr = delta_run(args.lrs, args.steps, args.tokens)
        print(json.dumps({"benchmark": "weight_sync_delta", "model": "Qwen2.5-0.5B shape", "sync_dtype": "bf16",
                          "steps": args.steps, "lrs": per_lr,
                          "delta_bytes_ratio": {lr: v["delta_bytes_ratio"] for lr, v in per_lr.items()},
                          "bit_identical": all(v["bit_identical"] for v in per_lr.values())}))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-qwen05-") as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(QWEN05))
        for spec in args.configs:
            dtype, n, r = spec.split(":")
            row = run_config(dtype, int(n), int(r), Path(model_dir), args.reps, args.timeout_s)
            print(json.dumps(row), flush=True)
            rows.append(row)
    head = next((x for x in rows if x["config"] == "bf16:4:2"), rows[-1])
    print(json.dumps({"benchmark": "weight_sync", "model": "Qwen2.5-0.5B shape", "headline": head["config"],
                      "split_vs_floor": head["split_vs_floor"], "reshard_vs_floor": head["reshard_vs_floor"],
                      "max_rank_send_fraction": head["max_rank_send_fraction"],
                      "split_vs_single_source": head["split_vs_single_source"], "configs": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
