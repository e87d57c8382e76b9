"""`asyncrl-plan`: the best execution plan for an RL config, as a table and as the overrides
`asyncrl-launch` runs.

    asyncrl-plan --config-name ppo cluster.nnodes=16 cluster.gpus_per_node=8 model.path=meta-llama/Llama-2-7b-hf
    asyncrl-plan --config-name quickstart --explain      # on this machine (its measured CPU profile)
    asyncrl-plan profile                                  # measure this machine's CPU profile
    asyncrl-plan --config-name grpo cluster.nnodes=2 cluster.gpus_per_node=8 --sbatch > run.sbatch

Overrides are Hydra's, checked like `asyncrl-launch`'s (a typo is an error); `plan.*` keys pick
the device profile and the search (see asyncrl/config.py, PlanConfig).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError
from asyncrl.engines import backend
from asyncrl.plan.hardware import DeviceProfile, load_profile
from asyncrl.plan.memory import ADAM, Knobs, actor_trained, generation_params, training_state
from asyncrl.plan.search import (
    HOST_USABLE,
    ROLLOUT,
    Plan,
    PlanCost,
    SearchResult,
    SearchSpace,
    exhaustive,
    hybridflow,
    mcmc,
)
from asyncrl.plan.workload import Workload, config_model_spec, workload_from_config

USAGE_ERROR = 2
EXHAUSTIVE_LIMIT = 200_000  # plans; above this `plan.search=auto` uses hybridflow + mcmc


def _local_gpus() -> tuple[int, str]:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count(), torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return 0, ""


def device_setup(cfg: Any) -> tuple[DeviceProfile, int, int]:
    """(profile, nodes, devices per node) the plan is for."""
    gpus, gpu_name = _local_gpus()
    name = cfg.plan.device
    if name == "auto":
        known = next((k for k in ("h200", "h100", "a100") if k in gpu_name.lower()), None)
        if gpus:
            if known is None:
                raise ConfigError(f"this machine's GPU ({gpu_name}) has no shipped profile; pass plan.device=h100|h200|"
                                  "a100 or a profile JSON file")
            name = known
        else:
            name = "h100" if cfg.cluster.gpus_per_node > 0 else "cpu"
    profile = load_profile(name)
    if cfg.plan.host_memory_gib:
        profile = replace(profile, host_mem_bytes=cfg.plan.host_memory_gib * 2**30)
    if profile.kind == "cpu":
        per_node = cfg.cluster.cpu_devices
    else:
        per_node = cfg.cluster.gpus_per_node or gpus or profile.devices_per_node
    return profile, cfg.cluster.nnodes, per_node


def search(space: SearchSpace, how: str, seconds: float, seed: int, keep: int) -> SearchResult:
    size = sum(len(space.allocations(p)) for p in space.placements())
    if how == "exhaustive" or (how == "auto" and size * 400 < EXHAUSTIVE_LIMIT):
        try:
            return exhaustive(space, keep=keep, limit=EXHAUSTIVE_LIMIT if how == "auto" else 50_000_000)
        except ValueError:
            if how == "exhaustive":
                raise
    if how == "mcmc":
        return mcmc(space, seconds=seconds, seed=seed, keep=keep)
    first = hybridflow(space, keep=keep)
    if how == "hybridflow" or first.best is None:
        return first
    refined = mcmc(space, seconds=max(0.0, seconds - first.seconds), seed=seed, keep=keep, start=first.best)
    pool = {p: c for p, c in [(first.best, first.cost), *first.runners_up, (refined.best, refined.cost),
                              *refined.runners_up] if p is not None}
    ranked = sorted(pool.items(), key=lambda pc: pc[1].step_s)[:keep]
    return SearchResult(ranked[0][0], ranked[0][1], ranked[1:], first.seconds + refined.seconds,
                        first.evaluated + refined.evaluated, "hybridflow+mcmc")


def overrides(plan: Plan, space: SearchSpace, profile: DeviceProfile, decode_rows: int = 0) -> list[str]:
    """The `asyncrl-launch` overrides that run `plan` (`decode_rows`: the generation waves it priced)."""
    s = dict(plan.strategies)
    out = [f"cluster.nnodes={space.nnodes}"]
    out += [f"rollout.decode_slots={decode_rows}"] if decode_rows else []
    if profile.kind == "gpu":
        out.append(f"cluster.gpus_per_node={space.per_node}")
    train_devices = plan.devices[plan.set_of("actor")]
    out.append(f"trainer.n_workers={train_devices}")
    if plan.split:
        out += ["trainer.placement=split", f"rollout.n_workers={plan.devices[plan.set_of(ROLLOUT)]}"]
    else:
        out.append("trainer.placement=colocated")
    a = s["actor"]
    out += [f"actor.parallel.dp={a.dp}", f"actor.parallel.tp={a.tp}", f"actor.parallel.pp={a.pp}"]
    out += [f"actor.parallel.sp={a.sp}"] if a.sp > 1 else []
    out += [f"actor.offload={'all' if a.offload_weights else 'optimizer'}"] if a.offload else []
    out += ["actor.gradient_checkpointing=true"] if a.recompute else []
    out += [f"actor.moe.ep={a.ep}"] if a.ep > 1 else []
    out += [f"rollout.parallel.ep={a.gen_ep}"] if a.gen_ep > 1 else []
    out += [f"actor.micro_batch_size={a.micro_batch}", f"actor.log_prob_micro_batch_size={a.micro_batch}",
            f"rollout.parallel.tp={s[ROLLOUT].gen_tp if plan.split else a.gen_tp}"]
    if "critic" in s:
        c = s["critic"]
        out += [f"critic.parallel.dp={c.dp}", f"critic.parallel.tp={c.tp}", f"critic.micro_batch_size={c.micro_batch}"]
        out += [f"critic.parallel.sp={c.sp}"] if c.sp > 1 else []
    if "reward" in s:
        out.append(f"cost_model.micro_batch_size={s['reward'].micro_batch}")
    return out


def launch_command(user: list[str], plan: list[str]) -> list[str]:
    """The user's overrides (less the planner's own `plan.*` and what the plan sets) and the plan's."""
    planned = {o.split("=", 1)[0] for o in plan}
    keep = [o for o in user if not o.lstrip("+~").startswith("plan.") and o.split("=", 1)[0].lstrip("+~") not in planned]
    return [*keep, *plan]


def _roles(plan: Plan, space: SearchSpace) -> str:
    s = dict(plan.strategies)
    parts = []
    for unit in space.units:
        if unit in s:
            st = s[unit]
            label = f"gen dp{st.dp}·tp{st.gen_tp}" if unit == ROLLOUT else st.label()
            parts.append(f"{unit} {label}")
        elif unit == "ref" and "actor" in s:
            parts.append("ref = actor's")
    return "; ".join(parts)


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def table(result: SearchResult, space: SearchSpace, w: Workload) -> str:
    rows = [("#", "placement", "devices", "strategies", "step s", "GiB/dev", "tokens/s")]
    for i, (plan, cost) in enumerate([(result.best, result.cost), *result.runners_up]):
        rows.append((str(i + 1), plan.placement(), "/".join(map(str, plan.devices)), _roles(plan, space),
                     f"{cost.step_s:.3g}", _gib(max(cost.memory.values())),
                     f"{w.sequences * w.seq_len / cost.step_s:.4g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(wd) for c, wd in zip(r, widths, strict=True)).rstrip() for r in rows)


def explain(cost: PlanCost) -> str:
    lines = ["where the step's time goes (estimated):"]
    for stage, t in cost.stages.items():
        lines.append(f"  {stage:<9} {t:9.3g} s")
    lines.append("  calls (a stage runs the calls of different sets at once, of one set one after another):")
    for name, t in sorted(cost.calls.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {name:<16} {t:9.3g} s")
    lines.append("  memory per device: " + ", ".join(f"{k} {_gib(v)} GiB" for k, v in cost.memory.items()))
    return "\n".join(lines)


def no_plan_message(spec: Any, knobs: Knobs, profile: DeviceProfile, nnodes: int, per_node: int) -> str:
    """Why nothing fits: the training state alone when sharded over every device, and what to change."""
    floor = sum(training_state(spec, nnodes * per_node, actor_trained(spec, knobs)).values()) / 2**30
    return (f"asyncrl-plan: no plan fits {nnodes}x{per_node} {profile.name} devices for {spec.name} "
            f"({spec.params / 1e9:.2f}B parameters): its training state alone is {floor:.1f} GiB per device "
            f"when sharded over all {nnodes * per_node} (fp32 weights, and gradients and Adam moments of what "
            f"trains), of a {profile.name}'s {profile.mem_bytes / 2**30:.0f} GiB, before weights for generation, "
            "activations and the KV cache; add devices (cluster.nnodes), train LoRA adapters (actor.lora.rank) "
            "or lower data.batch_size, rollout.n or the sequence lengths" + moe_generation_note(spec, profile, nnodes * per_node)
            + host_memory_note(spec, knobs, profile, nnodes, per_node))


def host_memory_note(spec: Any, knobs: Knobs, profile: DeviceProfile, nnodes: int, per_node: int) -> str:
    """On GPUs whose nodes' host memory cannot hold the optimizer's state that offloading it
    (actor.offload) would move there: the figure."""
    limit = profile.host_mem_bytes * HOST_USABLE
    if profile.kind != "gpu" or not limit:
        return ""
    node = per_node * training_state(spec, nnodes * per_node, actor_trained(spec, knobs))[ADAM]
    if node <= limit:
        return ""
    return (f"; offloading its optimizer state (actor.offload=optimizer) would need {node / 2**30:.0f} GiB of host "
            f"memory a node, more than the {limit / 2**30:.0f} GiB usable (plan.host_memory_gib)")


def moe_generation_note(spec: Any, profile: DeviceProfile, devices: int) -> str:
    """For a mixture of experts: what generation holds on each device, whole and with its experts
    split over every device (rollout.parallel.ep)."""
    if not spec.experts:
        return ""
    whole = profile.bytes_per_param * spec.params / 2**30
    split = profile.bytes_per_param * generation_params(spec, devices) / 2**30
    return (f"; generation holds this mixture of experts whole on each device ({whole:.1f} GiB), "
            f"{split:.1f} GiB with its experts split over all {devices} (rollout.parallel.ep={devices})")


def plan_main(args: argparse.Namespace) -> int:
    from asyncrl.config import rl_config
    from asyncrl.launch import load_config

    cfg = rl_config(load_config(args.config_name, args.overrides, args.config_dir))
    profile, nnodes, per_node = device_setup(cfg)
    spec = config_model_spec(cfg)
    w = workload_from_config(cfg, spec)
    w = replace(w, micro_batch_sizes=tuple(sorted({1, 2, 4, 8, 16, 32, cfg.actor.micro_batch_size})))
    knobs = Knobs.from_config(cfg, on_gpu=profile.kind == "gpu", device_bytes=profile.mem_bytes, spec=spec)
    # a rollout pool of its own is fed by the training shards' weight sync, which some backends lack
    space = SearchSpace(w, profile, nnodes, per_node, deployable=True, knobs=knobs,
                        allow_split=backend(cfg.actor.backend).feeds_split_pool)
    result = search(space, cfg.plan.search, cfg.plan.time_limit_s, cfg.plan.seed, keep=1 + cfg.plan.runners_up)
    if result.best is None:
        print(no_plan_message(spec, knobs, profile, nnodes, per_node), file=sys.stderr)
        return 1
    launch = overrides(result.best, space, profile, result.cost.decode_rows)
    memory = worker_breakdown(args, launch, spec, profile)
    if memory is not None and memory.total > profile.mem_bytes:
        print(f"asyncrl-plan: the best plan needs about {memory.total / 2**30:.1f} GiB per device "
              f"({memory.peak_phase}), more than a {profile.name}'s {profile.mem_bytes / 2**30:.0f} GiB:\n"
              + "\n".join(memory.lines()) + "\nadd devices, lower actor.micro_batch_size or set "
              "actor.max_tokens_per_micro_batch, actor.gradient_checkpointing=true, or a larger "
              "actor.parallel.tp", file=sys.stderr)
        return 1
    if args.sbatch:  # the script alone on stdout (`> run.sbatch`)
        print(sbatch_script(args, launch_command(args.overrides, launch), nnodes, per_node, profile.kind == "gpu"))
        return 0
    if args.json:
        print(json.dumps({"model": spec.name, "params": spec.params, "device": profile.name, "nnodes": nnodes,
                          "devices_per_node": per_node, "search": result.method, "search_s": round(result.seconds, 3),
                          "plans_priced": result.evaluated, "step_s": result.cost.step_s,
                          "stages": result.cost.stages, "calls": result.cost.calls, "memory": result.cost.memory,
                          "strategies": {u: asdict(s) for u, s in result.best.strategies},
                          "placement": result.best.placement(), "overrides": launch,
                          **(memory.to_json() if memory is not None else {})}))
        return 0
    print(f"model {spec.name}: {spec.params / 1e9:.3g}B parameters; {w.sequences} sequences of "
          f"{w.prompt_len}+{w.response_len} tokens per step; calls {', '.join(c.name for c in w.calls)}")
    print(f"devices: {nnodes} node(s) x {per_node} {profile.name} ({profile.description})")
    print(f"search: {result.method}, {result.evaluated} plans priced in {result.seconds:.2f} s\n")
    print(table(result, space, w))
    if args.explain:
        print()
        print(explain(result.cost))
    if memory is not None:
        print("\nmemory per actor device (asyncrl.plan.memory):")
        print("\n".join(memory.lines()))
    print("\nrun the best plan with:")
    print("  " + shlex.join(_launch_argv(args, launch_command(args.overrides, launch))))
    return 0


SLURM_GIVES = ("cluster.nnodes", "cluster.node_rank", "cluster.coordinator", "cluster.host",
               "cluster.port")  # what `srun asyncrl-launch` reads from SLURM (daemons/slurm.py)
SLURM_KEYS = "cluster.key_dir=SLURM_PER_JOB"  # while planning for sbatch: the per-job keys SLURM's task 0 makes


def sbatch_script(args: argparse.Namespace, overrides: list[str], nnodes: int, per_node: int, gpu: bool) -> str:
    """An sbatch script that runs the plan: one task per node, the cluster flags left to SLURM."""
    kept = [o for o in overrides if o.partition("=")[0].lstrip("+") not in SLURM_GIVES and o != SLURM_KEYS]
    lines = ["#!/bin/bash", f"# asyncrl-plan --config-name {args.config_name}: {nnodes} node(s) x {per_node} "
             f"{'GPU' if gpu else 'CPU device'}(s); submit from a directory every node shares",
             f"#SBATCH --job-name=asyncrl-{args.config_name}", f"#SBATCH --nodes={nnodes}",
             "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive", "#SBATCH --output=%x-%j.out"]
    if gpu:
        lines.insert(4, f"#SBATCH --gres=gpu:{per_node}")
    launch = shlex.join(_launch_argv(args, kept))
    return "\n".join([*lines, "", "set -euo pipefail", f"srun --kill-on-bad-exit=1 {launch} \"$@\"", ""])


def worker_breakdown(args: argparse.Namespace, launch: list[str], spec: Any, profile: DeviceProfile) -> Any:
    """The memory estimate of one actor device under the plan (colocated, no pipeline stages;
    None otherwise): the config as the printed command runs it."""
    from asyncrl.config import rl_config
    from asyncrl.launch import load_config
    from asyncrl.plan.memory import worker_memory

    cfg = rl_config(load_config(args.config_name, launch_command(args.overrides, launch), args.config_dir))
    if cfg.trainer.placement != "colocated" or cfg.actor.parallel.pp > 1:
        return None
    return worker_memory(cfg, spec, on_gpu=profile.kind == "gpu", device_bytes=profile.mem_bytes)


def _launch_argv(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The asyncrl-launch command line that runs the plan, as it can be pasted: the same config
    directory (absolute, so it runs from any directory) and config."""
    where = ["--config-dir", str(Path(args.config_dir).expanduser().resolve())] if args.config_dir else []
    return ["asyncrl-launch", *where, "--config-name", args.config_name, *overrides]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["profile"]:
        from asyncrl.plan.profile import main as profile_main

        return profile_main(argv[1:])
    parser = argparse.ArgumentParser(prog="asyncrl-plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", "-cn", default="ppo")
    parser.add_argument("--config-dir", "-cd", default=None)
    parser.add_argument("--explain", action="store_true", help="where the best plan's time goes")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--sbatch", action="store_true", help="print an sbatch script that runs the best plan")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for asyncrl-launch")
    args = parser.parse_intermixed_args(argv)
    if args.sbatch and not any(o.startswith(("cluster.key_dir=", "cluster.insecure=")) for o in args.overrides):
        args.overrides.append(SLURM_KEYS)
    try:
        return plan_main(args)
    except ConfigError as e:
        print(f"asyncrl-plan: {e}", file=sys.stderr)
        return USAGE_ERROR

