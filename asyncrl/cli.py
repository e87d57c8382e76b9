"""`asyncrl` command line: key management (and, with the daemons, status/stop)."""

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
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
