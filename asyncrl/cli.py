"""`asyncrl` command line: keys, status, stop, submit."""

from __future__ import annotations

import argparse
import sys


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


def _connect(args: argparse.Namespace):
    """A client for the coordinator named on the command line, or the one this machine runs."""
    from daemons.cluster import STATE_FILE, read_state, state_dir
    from transport import CurveConfig, RpcClient

    if args.coordinator:
        endpoint = args.coordinator if "://" in args.coordinator else f"tcp://{args.coordinator}"
        if args.insecure:
            return RpcClient(endpoint, insecure=True, name="cli")
        if not args.key_dir:
            raise SystemExit("asyncrl: give --key-dir DIR (the cluster's keys) or --insecure")
        return RpcClient(endpoint, curve=CurveConfig.load(args.key_dir), name="cli")
    state = read_state()
    if state is None:
        raise SystemExit(f"asyncrl: no coordinator runs on this machine ({state_dir() / STATE_FILE} "
                         "is absent); pass --coordinator HOST:PORT --key-dir DIR")
    if state.insecure:
        return RpcClient(state.endpoint, insecure=True, name="cli")
    return RpcClient(state.endpoint, curve=state.client_curve(), name="cli")


def _rpc(args: argparse.Namespace, method: str, *call_args, timeout: float = 10.0):
    from transport import TransportError
    from transport.loop import run

    async def go():
        client = _connect(args)
        try:
            return await client.call(method, *call_args, timeout=timeout)
        finally:
            await client.close()

    try:
        return run(go())
    except TransportError as e:
        raise SystemExit(f"asyncrl: {method} failed: {e}") from None


def _status(args: argparse.Namespace) -> int:
    import json

    st = _rpc(args, "status").to_dict()  # a daemons.messages.ClusterStatus
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"coordinator {st['coordinator']}  up {st['uptime_s']}s  "
          f"objects {st['objects']['count']} ({st['objects']['bytes'] / 2**20:.1f} MiB)")
    for n in st["nodes"]:
        print(f"  node {n['rank']} {n['node_id']} {n['host']} {'alive' if n['alive'] else 'DEAD'} "
              f"devices={len(n['devices'])} heartbeat {n['last_heartbeat_s']}s ago")
    for w in st["workers"]:
        mem = st["memory"].get(w["worker_id"], {})
        used = mem.get("bytes_used", mem.get("bytes", 0)) or 0
        print(f"  worker {w['worker_id']} rank {w['rank']} {w['device']} pid {w['pid']} {w['state']}"
              f"{' (' + w['exit'] + ')' if w['exit'] else ''} store {used / 2**20:.1f} MiB")
    return 0


def _stop(args: argparse.Namespace) -> int:
    _rpc(args, "stop", args.reason)
    print("stop requested")
    return 0


def _submit(args: argparse.Namespace) -> int:
    import json

    from asyncrl.metrics import json_line

    result = _rpc(args, "submit", args.entry, json.loads(args.overrides), timeout=args.timeout)
    print(json_line(result))
    return 0


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", help="HOST:PORT (default: the coordinator on this machine)")
    p.add_argument("--key-dir", help="cluster key directory for --coordinator")
    p.add_argument("--insecure", action="store_true", help="the cluster runs without keys")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="asyncrl", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    keys = sub.add_parser("keys", help="CurveZMQ key management")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    gen = keys_sub.add_parser("generate", help="write a key pair into DIR and authorize it")
    gen.add_argument("dir", help="key directory, e.g. ~/.asyncrl/keys")
    gen.add_argument("--name", default="cluster",
                     help="identity name; 'cluster' (default) is the key every daemon presents")
    gen.set_defaults(func=_keys_generate)
    st = sub.add_parser("status", help="nodes, devices, workers, objects, memory")
    st.add_argument("--json", action="store_true")
    _add_target(st)
    st.set_defaults(func=_status)
    stop = sub.add_parser("stop", help="stop the running job")
    stop.add_argument("--reason", default="asyncrl stop")
    _add_target(stop)
    stop.set_defaults(func=_stop)
    submit = sub.add_parser("submit", help="run a job on a daemon cluster (asyncrl-launch ... daemon)")
    submit.add_argument("entry", help="the driver, package.module:main")
    submit.add_argument("--overrides", default="{}", help='config overrides as JSON, e.g. \'{"smoke": {"rows": 64}}\'')
    submit.add_argument("--timeout", type=float, default=24 * 3600)
    _add_target(submit)
    submit.set_defaults(func=_submit)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
