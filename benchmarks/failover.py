"""A training rank lost mid-update, the run going on without a restart (trainer.failover).

The job is GRPO on the quickstart's task and model as users run it (`--config-name quickstart`),
on 4 CPU training ranks, `trainer.failover.enable=true`, 10 steps, checkpoints at steps 4 and 8 (none beside the
kill: a death during a save or an evaluation is trainer.max_restarts' to handle) and
`trainer.replay.window=6`. It runs twice in one sitting: uninterrupted, then with rank 1 SIGKILLed
halfway through step 5's update (half the previous update's time after the driver sent it; with
`--node`, every process of rank 1's host: four network namespaces on a bridge play four hosts,
one device each, and a fifth, spare host takes the replacement). Then `asyncrl replay RUN --step 7`
on the interrupted run (from checkpoint 4: steps 5, the one redone, 6 and 7).

Reported: `restarted_workers` (worker processes started beyond the uninterrupted run's: the
replacement alone is 1) and their names, `steps_lost` (steps completed before the death that ran
again: 0 when the step in flight alone is redone), `resume_s` (from the kill to the redone step's
start), `final_weights_equal` (every weight's bytes against the uninterrupted run), the step's
prompts `prompts_trained_once` (each step's prompts in its completed update once, the same as
the uninterrupted run's, no data row twice in an epoch), `killed_mid_update`, the redundancy's
memory per rank (`held_gib`, its own and its neighbour's kept states) against the rank's model
and optimizer state (`state_gib`, `held_over_state`), what keeping a step cost (`mark_s_median`,
`mark_over_step`), and `replay_bit_exact`. The last line printed is one JSON object.

    python -m benchmarks.failover
    python -m benchmarks.failover --node      # the rank's whole host lost (needs root: ip netns)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from daemons.proc import kill_group
from objectstore import remove_stale_segments

REPO = Path(__file__).resolve().parent.parent
KILL_ENV = "ASYNCRL_BENCH_KILL"  # STEP:RANK[:NETNS][,...] for `job`: kill that rank (or every process of NETNS)
PORT = 29460


# the job -------------------------------------------------------------------------------------------
def _pids_in(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _arm(t: Any, plan: str, killed: dict[str, Any]) -> None:
    """Wrap the actor group's update_actor: at the plan's step, kill its rank (or host) midway
    (`killed` says what and when; a plan of several kills, comma-separated, fills `killed["more"]`)."""
    first, *rest = plan.split(",")
    if rest:
        killed["more"] = []
        for later in rest:
            _arm(t, later, box := {})
            killed["more"].append(box)
    step, rank, *netns = first.split(":")
    group, send = t.roles.actor, t.roles.actor.update_actor

    def update_actor(*args: Any, **kwargs: Any) -> Any:
        fut = send(*args, **kwargs)
        if t.step + 1 == int(step) and "worker" not in killed:
            last = t.history[-1].get("timing/update_actor_s", 0.2) if t.history else 0.2
            info = group.handles[int(rank)].info
            killed.update(worker=info.worker_id, node=info.node_id, delay_s=round(last / 2, 4))

            def kill() -> None:
                killed["at"], killed["in_update"] = time.time(), not fut.done()
                for pid in _pids_in(netns[0]) if netns else [info.pid]:
                    os.kill(pid, signal.SIGKILL)

            asyncio.get_running_loop().call_later(last / 2, kill)
        return fut

    group.update_actor = update_actor


async def job(ctx: Any) -> dict[str, Any]:
    """The trainer as `asyncrl-launch` runs it, with the kill armed (KILL_ENV), the prompts each
    draw took and the final weights' digest returned beside its summary."""
    from asyncrl.single_controller.protocols import ONE_TO_ALL
    from asyncrl.trainer import main as trainer_main
    from tests.helpers.worker_probes import weights_digest

    trainers: list[Any] = []
    killed: dict[str, Any] = {}
    draws: list[tuple[int, list[str]]] = []

    def setup(t: Any) -> None:
        trainers.append(t)
        loader, draw = t.data.loader, t.data.loader.next_batch

        def next_batch() -> dict[str, Any]:
            batch = draw()
            draws.append((t.step + 1, [str(u) for u in batch["uid"]]))
            return batch

        loader.next_batch = next_batch
        if os.environ.get(KILL_ENV):
            _arm(t, os.environ[KILL_ENV], killed)

    summary = await trainer_main(ctx, on_setup=setup)
    if not trainers:  # trainer.mode=replay (`asyncrl replay` runs the run's own job): its summary alone
        return summary
    digest = (await trainers[0].roles.actor.apply(weights_digest, protocol=ONE_TO_ALL))[0]
    return {**summary, "weights_digest": digest, "killed": killed, "draws": draws}


# the benchmark -------------------------------------------------------------------------------------
def _trained(draws: list) -> list:
    """Each step's prompts as its completed update trained them: a step's last draw."""
    return [uids for _, uids in sorted({step: uids for step, uids in draws}.items())]


def _once(draws: list, steps: int, epoch_rows: int) -> bool:
    trained = _trained(draws)
    flat = [u for uids in trained for u in uids]
    per_epoch = max(1, epoch_rows)
    return len(trained) == steps and all(len(set(flat[i:i + per_epoch])) == len(flat[i:i + per_epoch])
                                         for i in range(0, len(flat), per_epoch))


def _rows(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if '"actor/pg_loss"' in x] if path.exists() else []


def _overrides(tmp: Path, out: Path, steps: int, workers: int) -> list[str]:
    return [f"trainer.output_dir={out}", f"model.path={tmp / 'model'}", f"trainer.total_steps={steps}",
            f"trainer.n_workers={workers}", "trainer.failover.enable=true", "rollout.launch_next_early=false",
            "trainer.save_every=4", "trainer.keep_checkpoints=3", f"trainer.eval_every={steps}", "trainer.replay.window=6",
            "trainer.loggers=[jsonl]", "job.entry=benchmarks.failover:job", "cluster.allowed_packages=[benchmarks,tests]"]


def _launch(argv: list[str], env: dict[str, str], cwd: Path, log: Path, timeout_s: float) -> tuple[int, dict]:
    with log.open("w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=cwd, env=env,
                                start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stdout = ""
    finally:
        kill_group(proc, grace_s=5)
        remove_stale_segments()
    lines = stdout.strip().splitlines()
    return proc.returncode, json.loads(lines[-1]) if proc.returncode == 0 and lines else {}


def _spawned(log: Path) -> list[str]:
    """The workers the run's node daemons started: in its log, and in its other hosts' logs beside it."""
    logs = [log, *sorted(log.parent.glob(f"{log.stem}-node*.log"))]
    return [w for p in logs for w in re.findall(r"spawned worker (\S+) pid", p.read_text())]


def run_local(tmp: Path, steps: int, kill_step: int, timeout_s: float) -> dict[str, Any]:
    """Both runs on this machine: one node, 4 CPU devices."""
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(tmp / "state"), "PYTHONPATH": str(REPO)}
    launch = [sys.executable, "-m", "asyncrl.launch", "--config-name", "quickstart", "cluster.cpu_devices=4"]
    runs = {}
    for name, kill in (("plain", ""), ("killed", f"{kill_step}:1")):
        out = tmp / name
        code, summary = _launch([*launch, *_overrides(tmp, out, steps, 4)], {**env, KILL_ENV: kill}, tmp,
                                tmp / f"{name}.log", timeout_s)
        runs[name] = {"code": code, "summary": summary, "log": tmp / f"{name}.log", "out": out}
    return runs


def run_hosts(tmp: Path, steps: int, kill_step: int, timeout_s: float) -> dict[str, Any]:
    """Both runs across five network namespaces, one device each: the pool takes hosts 0-3 (node
    rank order), host 4 is the spare; the killed run loses rank 1's host, every process in it."""
    from benchmarks.elastic import hosts
    from transport.auth import generate_keys

    keys = tmp / "keys"
    generate_keys(keys)
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(tmp / "state"), "PYTHONPATH": str(REPO)}
    launch = [sys.executable, "-m", "asyncrl.launch", "--config-name", "quickstart"]
    runs = {}
    for name in ("plain", "killed"):
        with hosts(5) as nets:
            (head_ns, head_ip), others = nets[0], nets[1:]
            common = [f"cluster.key_dir={keys}", "cluster.cpu_devices=1", "cluster.nnodes=5", "trainer.torch_threads=1"]
            nodes = []
            for rank, (ns, ip) in enumerate(others, start=1):
                with (tmp / f"{name}-node{rank}.log").open("w") as err:
                    nodes.append(subprocess.Popen(
                        ["ip", "netns", "exec", ns, *launch, *common, f"cluster.coordinator={head_ip}:{PORT}",
                         f"cluster.node_rank={rank}", f"cluster.host={ip}", f"cluster.log_dir={tmp / f'{name}-logs-{rank}'}"],
                        stdout=subprocess.DEVNULL, stderr=err, cwd=tmp, env=env, start_new_session=True))
            kill = f"{kill_step}:1:{others[0][0]}" if name == "killed" else ""
            head = ["ip", "netns", "exec", head_ns, *launch, *common, f"cluster.host={head_ip}", f"cluster.port={PORT}",
                    *_overrides(tmp, tmp / name, steps, 4)]
            try:
                code, summary = _launch(head, {**env, KILL_ENV: kill}, tmp, tmp / f"{name}.log", timeout_s)
            finally:
                for p in nodes:
                    kill_group(p, grace_s=5)
            runs[name] = {"code": code, "summary": summary, "log": tmp / f"{name}.log", "out": tmp / name}
    return runs


def replay(tmp: Path, out: Path, step: int, timeout_s: float) -> dict[str, Any]:
    """`asyncrl replay` of the interrupted run, its 4 ranks on this machine (a --node run's too)."""
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(tmp / "state-replay"), "PYTHONPATH": str(REPO)}
    here = ["--cluster", "host=127.0.0.1", "port=0", "nnodes=1", "cpu_devices=4"]
    code, summary = _launch([sys.executable, "-m", "asyncrl.cli", "replay", str(out), "--step", str(step), *here], env,
                            tmp, tmp / "replay.log", timeout_s)
    return summary if code == 0 else {"bit_exact": None, "exit_code": code, "log": (tmp / "replay.log").read_text()[-1500:]}


def report(runs: dict[str, Any], steps: int, kill_step: int, epoch_rows: int, replayed: dict[str, Any]) -> dict[str, Any]:
    plain, killed = runs["plain"]["summary"], runs["killed"]["summary"]
    events = killed.get("failovers", [])
    extra = [w for w in _spawned(runs["killed"]["log"]) if w not in set(_spawned(runs["plain"]["log"]))]
    rows = _rows(runs["killed"]["out"])
    kill = killed.get("killed", {})
    step_s = statistics.median(r["timing/step_s"] for r in rows) if rows else None
    mark_s = statistics.median(r["perf/failover_mark_s"] for r in rows) if rows else None
    held, state = (max(r[k] for r in rows) if rows else None for k in ("perf/failover_held_gib", "perf/failover_state_gib"))
    return {
        "exit_codes": [runs["plain"]["code"], runs["killed"]["code"]], "steps": killed.get("steps"),
        "failovers": len(events), "killed_worker": kill.get("worker"), "killed_node": kill.get("node"),
        "killed_mid_update": kill.get("in_update"),
        "restarted_workers": len(extra), "restarted": extra,
        "replacement_node": events[0]["replacement_node"] if events else None,
        "steps_lost": kill_step - events[0]["step"] if events else None,
        "steps_run_once": [r["step"] for r in rows] == list(range(1, steps + 1)),
        "resume_s": round(events[0]["resumed_at"] - kill["at"], 2) if events and "at" in kill else None,
        "final_weights_equal": bool(plain.get("weights_digest")) and killed.get("weights_digest") == plain.get("weights_digest"),
        "prompts_trained_once": _once(killed.get("draws", []), steps, epoch_rows)
        and _trained(killed.get("draws", [])) == _trained(plain.get("draws", [])),
        "held_gib": round(held, 6) if held is not None else None, "state_gib": round(state, 6) if state is not None else None,
        "held_over_state": round(held / state, 3) if held and state else None,
        "mark_s_median": round(mark_s, 4) if mark_s is not None else None,
        "mark_over_step": round(mark_s / step_s, 4) if mark_s is not None and step_s else None,
        "replay_bit_exact": replayed.get("bit_exact"), "replay_error": replayed.get("log"),
        "log_tail": None if killed.get("steps") else runs["killed"]["log"].read_text()[-2000:],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kill-step", type=int, default=5)
    p.add_argument("--node", action="store_true", help="lose rank 1's whole host (network namespaces; root)")
    p.add_argument("--timeout-s", type=float, default=600)
    args = p.parse_args()
    if args.node and os.geteuid() != 0:
        sys.exit("benchmarks.failover --node needs root for `ip netns` (network namespaces as hosts)")
    from asyncrl.config import rl_config
    from asyncrl.launch import load_config

    epoch_rows = rl_config(load_config("quickstart", [])).data.synthetic.n_train
    with tempfile.TemporaryDirectory(prefix="asyncrl-failover-") as tmp_dir:
        tmp = Path(tmp_dir)
        runs = (run_hosts if args.node else run_local)(tmp, args.steps, args.kill_step, args.timeout_s)
        replayed = replay(tmp, runs["killed"]["out"], min(7, args.steps), args.timeout_s) if runs["killed"]["code"] == 0 else {}
        result = report(runs, args.steps, args.kill_step, epoch_rows, replayed)
    print(json.dumps({"mode": "node" if args.node else "rank", "kill_step": args.kill_step, **result}))


if __name__ == "__main__":
    main()
