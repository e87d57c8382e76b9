"""`asyncrl` command line: keys, status, stop, shutdown, submit, serve.

Every job and daemon on this machine has a state file (see `daemons.state`), so

    asyncrl status                 # the only job (or daemon) here in detail, or a list of them
    asyncrl status --job ID        # one of them
    asyncrl stop [--job ID]        # end a job (one run by asyncrl-launch, or one submitted to a daemon)
    asyncrl shutdown [--daemon ID] # end a daemon and every job it runs
    asyncrl submit ENTRY           # run a job on the daemon here
    asyncrl submit --config-name grpo key=value ...  # an RL job, composed as asyncrl-launch does
    asyncrl serve DIR              # a model or a run's checkpoint behind an OpenAI-compatible endpoint
    asyncrl inspect RUN_DIR...     # runs' metrics, kept rollouts and evaluations in the browser

`--coordinator HOST:PORT --key-dir DIR` talks to a coordinator elsewhere instead. Without an
id, a command picks the only candidate; with several it lists them and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from daemons.proc import exit_now
from daemons.state import ClusterState, StateKind, new_job_id, read_states, state_dir

USAGE_ERROR = 2
CONNECT_TIMEOUT_S = 3.0  # a live process that does not answer a ping within this is stuck


def _fail(message: str, code: int = 1) -> NoReturn:
    print(f"asyncrl: {message}", file=sys.stderr)
    raise SystemExit(code)


def _keys_generate(args: argparse.Namespace) -> int:
    from transport.auth import generate_keys

    try:
        secret = generate_keys(args.dir, name=args.name)
    except FileExistsError as e:
        print(f"asyncrl keys: {e}", file=sys.stderr)
        return 2
    print(f"wrote {secret} and its public key; authorized keys are in {secret.parent / 'authorized'}")
    print("copy this directory (mode 0700) to every node of the cluster")
    return 0


# finding a target ------------------------------------------------------------------------------
def _listing(states: list[ClusterState]) -> str:
    now = time.time()
    rows = [("ID", "KIND", "NAME", "PID", "UP", "ENDPOINT")]
    rows += [(s.job_id, s.kind.value, s.name, str(s.pid), f"{now - s.started_at:.0f}s", s.endpoint)
             for s in states]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _find(states: list[ClusterState], wanted: str) -> ClusterState:
    for s in states:
        if s.job_id == wanted:
            return s
    known = ", ".join(s.job_id for s in states) or "none"
    _fail(f"no job or daemon {wanted!r} runs on this machine (state files in {state_dir()}); "
          f"running: {known}", USAGE_ERROR)


def _only(states: list[ClusterState], what: str, option: str) -> ClusterState:
    """The only state in `states`, or an error that lists them and asks for `option`."""
    if len(states) == 1:
        return states[0]
    if not states:
        _fail(f"no {what} runs on this machine (no state file in {state_dir()}); pass "
              "--coordinator HOST:PORT --key-dir DIR to reach one elsewhere")
    print(_listing(states), file=sys.stderr)
    _fail(f"{len(states)} {what}s run on this machine: choose one with {option} ID", USAGE_ERROR)


# RPC ------------------------------------------------------------------------------------------
def _client(args: argparse.Namespace, target: ClusterState | None) -> Any:
    import daemons.messages  # noqa: F401  (registers the reply types)
    from transport import CurveConfig, RpcClient

    if target is not None:
        if target.insecure:
            return RpcClient(target.endpoint, insecure=True, name="cli")
        return RpcClient(target.endpoint, curve=target.client_curve(), name="cli")
    endpoint = args.coordinator if "://" in args.coordinator else f"tcp://{args.coordinator}"
    if args.insecure:
        return RpcClient(endpoint, insecure=True, name="cli")
    if not args.key_dir:
        _fail("give --key-dir DIR (the cluster's keys) or --insecure", USAGE_ERROR)
    return RpcClient(endpoint, curve=CurveConfig.load(args.key_dir), name="cli")


def _rpc(args: argparse.Namespace, target: ClusterState | None, method: str, *call_args: Any,
         timeout: float = 10.0, full_errors: bool = False, progress: Path | None = None) -> Any:
    """Call `method` on `target`'s coordinator (or --coordinator's) and return the result;
    meanwhile a `progress` metrics.jsonl, when this machine sees it, is echoed to stderr."""
    import asyncio

    from transport import RemoteError, TransportError
    from transport.loop import run

    async def go() -> Any:
        client = _client(args, target)
        echo = _StepEcho(progress) if progress is not None else None
        tail = asyncio.ensure_future(echo.follow()) if echo is not None else None
        try:
            await client.connect(timeout=min(CONNECT_TIMEOUT_S, timeout))
            result = await client.call(method, *call_args, timeout=timeout)
            if echo is not None:
                echo.print_new()  # the steps written since the last look
            return result
        finally:
            if tail is not None:
                tail.cancel()
            await client.close()

    try:
        return run(go())
    except RemoteError as e:
        _fail(f"{method} failed: {e if full_errors else f'{e.remote_type}: {e.remote_message}'}")
    except TransportError as e:
        _fail(f"{method} failed: {e}")


PROGRESS_KEYS = ("critic/score_mean", "val/reward", "response/length_mean", "timing/step_s")


class _StepEcho:
    """Each new step of a job's metrics.jsonl (a job submitted from this machine writes it under
    its trainer.output_dir) as one line on stderr; each look reads only what was appended."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.started = path, 0, time.time()

    async def follow(self, every_s: float = 2.0) -> None:
        import asyncio

        while True:
            await asyncio.sleep(every_s)
            self.print_new()

    def print_new(self) -> None:
        try:
            if self.path.stat().st_mtime < self.started - 1:
                return  # an earlier run's file, not yet replaced by this job's
            with self.path.open("rb") as f:
                f.seek(self.offset)
                appended = f.read()
        except OSError:
            return
        for line in appended.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                return  # a line being written: read it next time
            self.offset += len(line)
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            shown = "  ".join(f"{k}={row[k]:.4g}" for k in PROGRESS_KEYS if isinstance(row.get(k), (int, float)))
            print(f"asyncrl: step {row.get('step')}  {shown}", file=sys.stderr, flush=True)


def _job_from_config(args: argparse.Namespace) -> tuple[str, dict[str, Any], Path | None]:
    """`asyncrl submit --config-name NAME key=value ...`: the config composed and checked as
    `asyncrl-launch` does, as the job's overrides (the daemon's own `cluster` section stays);
    relative paths are made absolute here, where they were meant. Returns (entry, overrides,
    the job's metrics.jsonl)."""
    from omegaconf import OmegaConf

    from asyncrl.jobs.nodes import check_config
    from asyncrl.launch import load_config
    from asyncrl.single_controller.schema import job_schema
    from transport.checks import ConfigError

    try:
        cfg = load_config(args.config_name, args.hydra_overrides, args.config_dir)
        schema = job_schema(OmegaConf.get_type(cfg))
        if schema and schema.preflight and not args.coordinator:  # a daemon on this machine: its files are here
            schema.preflight(check_config(cfg), None, True)  # what asyncrl-launch checks before it starts
    except ConfigError as e:
        _fail(str(e), USAGE_ERROR)
    job = OmegaConf.to_container(cfg, resolve=True)
    for section in ("cluster", "hydra"):
        job.pop(section, None)
    for section, key in (("trainer", "output_dir"), ("model", "path"), ("data", "train_files"), ("data", "val_files")):
        value = (job.get(section) or {}).get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            local = Path(value).expanduser()
            if key == "output_dir" or local.exists():
                job[section][key] = str(local.resolve())
    entry = args.entry or (job.get("job") or {}).get("entry")
    if not entry:
        _fail(f"config {args.config_name!r} names no job.entry; pass the entry (package.module:main)", USAGE_ERROR)
    out = (job.get("trainer") or {}).get("output_dir")
    return entry, job, Path(out) / "metrics.jsonl" if out else None


# commands -------------------------------------------------------------------------------------
def _print_status(st: dict[str, Any]) -> None:
    print(f"coordinator {st['coordinator']}  up {st['uptime_s']}s  "
          f"objects {st['objects']['count']} ({st['objects']['bytes'] / 2**20:.1f} MiB)")
    for j in st.get("jobs", []):
        stopping = f"  stopping: {j['stopping']}" if j["stopping"] else ""
        print(f"  job {j['job_id']} ({j['name']}) up {time.time() - j['started_at']:.0f}s "
              f"workers={j['workers']}{stopping}")
    for n in st["nodes"]:
        print(f"  node {n['rank']} {n['node_id']} {n['host']} {'alive' if n['alive'] else 'DEAD'} "
              f"devices={len(n['devices'])} heartbeat {n['last_heartbeat_s']}s ago")
    for w in st["workers"]:
        mem = st["memory"].get(w["worker_id"], {})
        used = mem.get("bytes_used", mem.get("bytes", 0)) or 0
        print(f"  worker {w['worker_id']} rank {w['rank']} {w['device']} pid {w['pid']} {w['state']}"
              f"{' (' + w['exit'] + ')' if w['exit'] else ''} store {used / 2**20:.1f} MiB")


def _status(args: argparse.Namespace) -> int:
    if args.coordinator:
        target, job = None, args.job
    else:
        states = read_states()
        if args.job:
            target = _find(states, args.job)
        elif len(states) > 1:  # several: the list is the status
            if args.json:
                print(json.dumps({"jobs": [_state_dict(s) for s in states]}, indent=2))
            else:
                print(_listing(states))
                print("(asyncrl status --job ID shows one of them)", file=sys.stderr)
            return 0
        else:
            target = _only(states, "job or daemon", "--job")
        job = target.job_id if target.kind is StateKind.DAEMON_JOB else None
    st = _rpc(args, target, "status", job).to_dict()  # a daemons.messages.ClusterStatus
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        _print_status(st)
    return 0


def _state_dict(s: ClusterState) -> dict[str, Any]:
    return {"job_id": s.job_id, "kind": s.kind.value, "name": s.name, "pid": s.pid,
            "endpoint": s.endpoint, "started_at": s.started_at}


def _stop(args: argparse.Namespace) -> int:
    if args.coordinator:
        target, job = None, args.job
    else:
        states = read_states()
        if args.job:
            target = _find(states, args.job)
            if target.kind is StateKind.DAEMON:
                _fail(f"{args.job} is a daemon: `asyncrl shutdown --daemon {args.job}` stops it, "
                      "`asyncrl stop --job ID` one of its jobs", USAGE_ERROR)
        else:
            jobs = [s for s in states if s.kind is not StateKind.DAEMON]
            if not jobs and states:
                _fail(f"no job runs on this machine; daemon(s) {', '.join(s.job_id for s in states)} "
                      "idle (`asyncrl shutdown` stops a daemon)")
            target = _only(jobs, "job", "--job")
        job = target.job_id if target.kind is StateKind.DAEMON_JOB else None
    stopped = _rpc(args, target, "stop", args.reason, job)
    print(f"stop requested for job {stopped}")
    return 0


def _shutdown(args: argparse.Namespace) -> int:
    if args.coordinator:
        target = None
    else:
        states = read_states()
        if args.daemon:
            target = _find(states, args.daemon)
            if target.kind is not StateKind.DAEMON:
                _fail(f"{args.daemon} is a job, not a daemon: `asyncrl stop --job {args.daemon}` "
                      "stops it", USAGE_ERROR)
        else:
            target = _only([s for s in states if s.kind is StateKind.DAEMON], "daemon", "--daemon")
    _rpc(args, target, "shutdown", args.reason)
    print("shutdown requested: the daemon stops its jobs and exits with status 75, which systemd's "
          "Restart=on-failure restarts (`systemctl stop` keeps it down)")
    return 0


def _submit(args: argparse.Namespace) -> int:
    try:
        overrides = json.loads(args.overrides)
    except json.JSONDecodeError as e:
        _fail(f"--overrides is not JSON: {e}", USAGE_ERROR)
    if not isinstance(overrides, dict):
        _fail("--overrides must be a JSON object, e.g. '{\"smoke\": {\"rows\": 64}}'", USAGE_ERROR)
    progress = None
    if args.entry and "=" in args.entry:  # `submit -cn grpo a=1`: argparse took the first override for ENTRY
        args.hydra_overrides.insert(0, args.entry)
        args.entry = None
    if args.config_name:
        from omegaconf import OmegaConf

        args.entry, composed, progress = _job_from_config(args)
        overrides = OmegaConf.to_container(OmegaConf.merge(composed, overrides))
    elif args.hydra_overrides:
        _fail(f"key=value overrides ({' '.join(args.hydra_overrides)}) need --config-name; without one use "
              "--overrides JSON", USAGE_ERROR)
    elif not args.entry:
        _fail("name the job: asyncrl submit ENTRY (package.module:main) or --config-name NAME", USAGE_ERROR)
    name = (overrides.get("job") or {}).get("name") or args.entry.rpartition(":")[0].rpartition(".")[2]
    job_id = args.job or new_job_id(name or "job")
    if args.coordinator:
        target = None
    else:
        states = read_states()
        target = (_find(states, args.daemon) if args.daemon else
                  _only([s for s in states if s.kind is StateKind.DAEMON], "daemon", "--daemon"))
    print(f"asyncrl: job {job_id} submitted (`asyncrl stop --job {job_id}` ends it)", file=sys.stderr)
    result = _rpc(args, target, "submit", args.entry, overrides, job_id, timeout=args.timeout,
                  full_errors=True, progress=progress)
    from asyncrl.metrics import json_line

    print(json_line(result))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from asyncrl.model_server import serve
    from transport.checks import ConfigError

    try:
        return serve(args.model, host=args.host, port=args.port, api_key=args.api_key, name=args.served_model_name,
                     max_tokens=args.max_tokens_limit, slots=args.slots, device=args.device, dtype=args.dtype,
                     decode=args.decode)
    except ConfigError as e:
        _fail(str(e), USAGE_ERROR)


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser("serve", help="a model or a run's checkpoint behind an OpenAI-compatible endpoint "
                           "(docs/serve.md)")
    serve.add_argument("model", help="a Hugging Face model directory (an export's .../actor/hf), a checkpoint "
                       "step, or a run directory (its last complete checkpoint)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="0: any free port (the URL is printed)")
    serve.add_argument("--api-key", help="the key clients must send (default: $ASYNCRL_API_KEY, else a generated "
                       "one, printed; the environment keeps it out of `ps`)")
    serve.add_argument("--served-model-name", help="default: the directory's name (run/step_N for a checkpoint)")
    serve.add_argument("--max-tokens-limit", type=int, default=4096, help="the most tokens one choice may ask for")
    serve.add_argument("--slots", type=int, default=16, help="rows the continuous batcher decodes together (on a CPU)")
    serve.add_argument("--device", help="default: cuda when there is a GPU, else cpu")
    serve.add_argument("--decode", default="eager", choices=["eager", "compiled"],
                       help="each decode step eager, or compiled over a preallocated KV cache (as rollout.decode)")
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="auto: bfloat16 on a GPU, float32 on a CPU")
    serve.set_defaults(func=_serve)


def _add_replay(sub: Any) -> None:
    p = sub.add_parser("replay", help="re-run a training step from the run's replay bundles and compare, bit for "
                       "bit (docs/replay.md)")
    p.add_argument("run_dir", help="a run directory whose run kept replay bundles (trainer.replay.window > 0)")
    p.add_argument("--step", type=int, required=True, help="the training step to re-run (1-based)")
    p.add_argument("--log-probs", action="store_true", help="also recompute the step's old log-probs and compare")
    p.add_argument("--nonfinite", action="store_true",
                   help="name the first non-finite activation of the step's update (its module and micro-batch)")
    p.add_argument("--plant-nan", default="", metavar="MODULE@MICRO_BATCH",
                   help="write a NaN into that module's output on the replay (implies --nonfinite; tests the finder)")
    p.add_argument("--cluster", nargs="+", default=[], metavar="KEY=VALUE",
                   help="where to replay, over the run's recorded cluster section (a multi-node run's ranks on one "
                        "machine: --cluster host=127.0.0.1 nnodes=1 cpu_devices=4)")
    p.set_defaults(func=_replay)


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="runs' metrics, kept rollouts and evaluations in the browser, live while "
                       "they train (docs/inspect.md)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (trainer.output_dir), overlaid")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only; "
                   "any other gets a token)")
    p.add_argument("--port", type=int, default=8765, help="0: any free port (the URL is printed)")
    p.add_argument("--token", help="the token a browser must bring (default: $ASYNCRL_INSPECT_TOKEN; generated and "
                   "printed when --host is not this machine's loopback)")
    p.set_defaults(func=_inspect)


def _inspect(args: argparse.Namespace) -> int:
    import os

    try:
        from asyncrl.inspector.app import serve
    except ImportError as e:
        _fail(f"inspect needs its web stack ({e.name} is missing): pip install 'asyncrl[inspect]'", USAGE_ERROR)
    try:
        return serve(args.run_dirs, host=args.host, port=args.port,
                     token=args.token or os.environ.get("ASYNCRL_INSPECT_TOKEN") or None)
    except OSError as e:
        _fail(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); pass --port 0 for any free port",
              USAGE_ERROR)
    except KeyboardInterrupt:
        return 0


def _replay(args: argparse.Namespace) -> int:
    from asyncrl.replay import command

    return command(args)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", help="HOST:PORT (default: the coordinator on this machine)")
    p.add_argument("--key-dir", help="cluster key directory for --coordinator")
    p.add_argument("--insecure", action="store_true", help="the cluster runs without keys")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="asyncrl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    keys = sub.add_parser("keys", help="CurveZMQ key management")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    gen = keys_sub.add_parser("generate", help="write a key pair into DIR and authorize it")
    gen.add_argument("dir", help="key directory, e.g. ~/.asyncrl/keys")
    gen.add_argument("--name", default="cluster",
                     help="identity name; 'cluster' (default) is the key every daemon presents")
    gen.set_defaults(func=_keys_generate)
    st = sub.add_parser("status", help="the jobs and daemons here; nodes, workers, objects, memory of one")
    st.add_argument("--job", help="a job's (or daemon's) id, as `asyncrl status` lists them")
    st.add_argument("--json", action="store_true")
    _add_target(st)
    st.set_defaults(func=_status)
    stop = sub.add_parser("stop", help="stop a job (not the daemon that runs it: see shutdown)")
    stop.add_argument("--job", help="the job's id (default: the only job running)")
    stop.add_argument("--reason", default="asyncrl stop")
    _add_target(stop)
    stop.set_defaults(func=_stop)
    down = sub.add_parser("shutdown", help="stop a daemon and every job it runs (exit status 75)")
    down.add_argument("--daemon", help="the daemon's id (default: the only daemon running)")
    down.add_argument("--reason", default="asyncrl shutdown")
    _add_target(down)
    down.set_defaults(func=_shutdown)
    submit = sub.add_parser("submit", help="run a job on a daemon cluster (asyncrl-launch ... daemon)")
    submit.add_argument("entry", nargs="?", help="the driver, package.module:main (default with --config-name: "
                        "its job.entry)")
    submit.add_argument("--config-name", "-cn", help="compose this config as asyncrl-launch does (e.g. grpo)")
    submit.add_argument("--config-dir", "-cd", help="a directory of your own configs (with --config-name)")
    submit.add_argument("hydra_overrides", nargs="*", metavar="key=value",
                        help="Hydra overrides of --config-name, as for asyncrl-launch")
    submit.add_argument("--overrides", default="{}", help='config overrides as JSON, e.g. \'{"smoke": {"rows": 64}}\'')
    submit.add_argument("--timeout", type=float, default=24 * 3600)
    submit.add_argument("--job", help="the job's id (default: its job.name and a random suffix)")
    submit.add_argument("--daemon", help="the daemon's id (default: the only daemon running)")
    _add_target(submit)
    submit.set_defaults(func=_submit)
    _add_serve(sub)
    _add_replay(sub)
    _add_inspect(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def cli() -> None:
    """The `asyncrl` command: `main`, then the process ends without the interpreter's teardown."""
    exit_now(main())


def launch() -> None:
    """The `asyncrl-launch` command (`asyncrl.launch.cli`), with the workers' allocator settings
    set before it loads torch: its CPU node's fork server is this process, forked."""
    import os

    from daemons.proc import with_allocator_settings

    with_allocator_settings(os.environ)  # type: ignore[arg-type]
    from asyncrl.launch import cli as launch_cli

    launch_cli()


if __name__ == "__main__":
    cli()
