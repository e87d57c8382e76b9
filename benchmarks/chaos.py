"""The stranger's attacks of issue 13, in one bounded run on localhost:

    python -m benchmarks.chaos [--only net,store,live,jobs]

- net (`benchmarks.chaos_net`): a keyless flood of large frames and connections against a live
  server: `preauth_peak_mib` (RSS growth of the server), `frames_sent`, `daemon_crashes`;
- store (`benchmarks.chaos_store`): `store_full_error`, `small_shm_ok`, `leftover_shm_segments`;
- live (`benchmarks.chaos_live`): `stall_8s_ok`, `blamed_rank_correct`, `head_loss_exit_s`;
- jobs (`benchmarks.chaos_jobs`): `two_jobs_ok`.

Each part starts and ends its own processes. The last line printed is one JSON object: every
part's keys, plus `seconds` per part and `errors` (a part that raised, with its message).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

PARTS = ("net", "store", "live", "jobs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts to run")
    args = parser.parse_args()
    parts = [p for p in args.only.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    result: dict = {"seconds": {}, "errors": {}}
    for part in parts:
        t0 = time.perf_counter()
        try:
            part_result = importlib.import_module(f"benchmarks.chaos_{part}").run()
            for key in ("seconds", "errors"):  # this report's own keys
                if key in part_result:
                    part_result[f"{part}_{key}"] = part_result.pop(key)
            result.update(part_result)
        except Exception as e:  # a failed part is reported, the others still run
            result["errors"][part] = f"{type(e).__name__}: {e}"
        result["seconds"][part] = round(time.perf_counter() - t0, 1)
        print(f"chaos {part}: done in {result['seconds'][part]} s", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
