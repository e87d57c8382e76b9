"""Where a step's rows move: bytes each rank pulled from other ranks' stores, per stage, for GRPO,
PPO and REINFORCE++ steps on 4 gloo CPU ranks with the quickstart's tiny model.

    python -m benchmarks.data_path            # about 3 minutes on 2 cores
    python -m benchmarks.data_path --steps 3 --algorithms grpo

Each algorithm runs twice, as `asyncrl-launch --config-name quickstart algorithm.name=<algo>
trainer.n_workers=4` runs it: with advantages estimated where the rows live (`LOCAL_ROWS`, the
default) and, as the peer, with every step's advantages on rank 0 (`RANK_ZERO`, how the steps
ran before). Per stage (a worker method, or `advantage` for the estimators) the workers count
every byte they pulled, from their own store and from others (`Worker.pulled_bytes`).
`advantage_cross_rank_fraction` = the most one rank pulled from other ranks for the advantage
stage / the bytes of the rows all ranks read for it (0: no row moved; rank 0 alone: about 3/4).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

ALGORITHMS = ("grpo", "ppo", "reinforce_pp")
MB = float(1 << 20)


async def run(algo: str, steps: int, out: Path, protocol: str | None) -> dict:
    """One run; per stage: the most a rank pulled from other ranks (MB), and the bytes all ranks read."""
    from asyncrl.launch import load_config
    from asyncrl.single_controller.context import local_cluster
    from asyncrl.single_controller.group import WorkerGroup
    from asyncrl.trainer import Trainer
    from asyncrl.trainer import main as trainer_main

    cfg = load_config("quickstart", [f"algorithm.name={algo}", "trainer.n_workers=4", "cluster.cpu_devices=4",
                                     f"trainer.total_steps={steps}", f"trainer.eval_every={steps}",
                                     f"trainer.save_every={steps}", f"trainer.output_dir={out}",
                                     "trainer.loggers=[jsonl]", "trainer.resume=none",
                                     f"model.path={out.parent.parent / 'tiny-model'}"])
    trainers: list[Trainer] = []
    apply = WorkerGroup.apply
    if protocol is not None:  # the peer: the same steps with the estimators on one rank
        WorkerGroup.apply = functools.partialmethod(apply, protocol=protocol)
    try:
        async with local_cluster(cpu_devices=4, log_dir=out / "logs", cfg=cfg) as ctx:
            await trainer_main(ctx, on_setup=trainers.append)
            pulled = await trainers[0].roles.actor.pulled_bytes()
    finally:
        WorkerGroup.apply = apply
    stages = sorted({k for p in pulled for k in p})
    return {s: {"cross_rank_mb": round(max(p.get(s, [0, 0])[1] for p in pulled) / MB, 4),
                "read_mb": round(sum(sum(p.get(s, [0, 0])) for p in pulled) / MB, 4)} for s in stages}


def fraction(stages: dict, stage: str = "advantage") -> float:
    s = stages.get(stage, {"cross_rank_mb": 0.0, "read_mb": 0.0})
    return round(s["cross_rank_mb"] / s["read_mb"], 4) if s["read_mb"] else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.data_path", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from asyncrl.single_controller.protocols import RANK_ZERO

    out: dict = {"ranks": 4, "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="asyncrl-data-path-") as tmp:
        for algo in args.algorithms:
            local = asyncio.run(run(algo, args.steps, Path(tmp) / algo / "local", None))
            peer = asyncio.run(run(algo, args.steps, Path(tmp) / algo / "rank0", RANK_ZERO))
            print(json.dumps({"algorithm": algo, "where_the_rows_live": local, "rank_zero": peer}), flush=True)
            out[f"advantage_cross_rank_fraction_{algo}"] = fraction(local)
            out[f"rank_zero_advantage_cross_rank_fraction_{algo}"] = fraction(peer)
            out[f"cross_rank_mb_{algo}"] = {s: v["cross_rank_mb"] for s, v in local.items()}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
