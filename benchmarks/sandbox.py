"""The cost of one sandboxed tool call against its floor: a bare isolated interpreter started the
same way (`python -I -c ...`, a pipe each for stdout and stderr), which every call pays anyway.

    python -m benchmarks.sandbox                 # 30 calls of print(1) each, interleaved
    python -m benchmarks.sandbox --calls 100

Prints the median milliseconds of each and the ratio (`sandbox_vs_bare`), and whether the runs got a
filesystem and a network of their own (as root, or with user namespaces). The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from asyncrl.agents.sandbox import run_python


async def bare(code: str) -> float:
    """Seconds for a bare `python -I -c code`, its output read."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-I", "-c", code, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, start_new_session=True)
    await proc.communicate()
    return time.monotonic() - t0


async def measure(calls: int, code: str) -> dict:
    sandboxed, floor, own_fs, own_net = [], [], True, True
    for _ in range(calls):
        result = await run_python(code)
        if result.error is not None:
            raise RuntimeError(f"the sandboxed call failed: {result.error}")
        sandboxed.append(result.seconds)
        own_fs, own_net = own_fs and result.own_filesystem, own_net and result.isolated_network
        floor.append(await bare(code))
    s_ms, b_ms = statistics.median(sandboxed) * 1e3, statistics.median(floor) * 1e3
    return {"benchmark": "sandbox", "calls": calls, "code": code, "sandbox_ms": round(s_ms, 1),
            "bare_ms": round(b_ms, 1), "sandbox_vs_bare": round(s_ms / b_ms, 2),
            "own_filesystem": own_fs, "isolated_network": own_net}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sandbox", description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--code", default="print(1)")
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(measure(args.calls, args.code))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
