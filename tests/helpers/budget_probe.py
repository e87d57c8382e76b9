"""A trainer job for the budget tests: the real trainer, each step counted.

Per step it records, from the driver: the requests it sent to workers and to other stores (RPC
round trips) and their bytes both ways; from every worker process (read between steps, outside
the counted window): the torch.distributed calls made (collectives, by name), threads alive;
and the processes under the launcher. The counts land in the job's summary as `budget`.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import traceback
from pathlib import Path
from typing import Any

from asyncrl.trainer import main as trainer_main

# the torch.distributed entry points a step may call; counted where the caller reaches them
# (FSDP2, our own code), one count per top-level call
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "all_gather_object", "reduce_scatter_tensor",
               "reduce_scatter", "broadcast", "broadcast_object_list", "all_to_all_single", "all_to_all", "barrier",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter", "reduce")
_counts: collections.Counter = collections.Counter()
_callers: collections.Counter = collections.Counter()


def install_counters() -> int:
    """Count this worker process's torch.distributed calls (run once, inside the worker)."""
    import torch.distributed as dist

    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "__counted__", False):
            continue

        def counted(*args: Any, __fn=fn, __name=name, **kwargs: Any) -> Any:
            _counts[__name] += 1
            _callers[f"{__name} from {_caller()}"] += 1
            return __fn(*args, **kwargs)
        counted.__counted__ = True
        functools.update_wrapper(counted, fn)
        setattr(dist, name, counted)
    return os.getpid()


def _caller() -> str:
    """The first frame outside torch that led to a collective (where a new one came from)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"


def read_counters() -> dict[str, Any]:
    """This worker's collective calls so far (by caller too), and its threads and child processes now."""
    return {"collectives": dict(_counts), "callers": dict(_callers), "threads": len(os.listdir("/proc/self/task")),
            "py_threads": threading.active_count(), "children": _children(os.getpid())}


def _children(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return len(f.read().split())
    except OSError:
        return -1


def _driver_clients(trainer: Any) -> list[Any]:
    """The RPC clients the driver calls workers and other stores through."""
    clients = {id(h.client): h.client for ps in trainer.ctx.process_sets.values() for h in ps.handles}
    store = trainer.ctx.store if hasattr(trainer.ctx, "store") else None
    for c in (getattr(store, "_clients", {}) or {}).values():
        clients[id(c)] = c
    return list(clients.values())


def _snapshot(clients: list[Any]) -> tuple[collections.Counter, int, int]:
    return (sum((c.requests for c in clients), collections.Counter()), sum(c.request_bytes for c in clients),
            sum(c.reply_bytes for c in clients))


async def main(ctx: Any) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []

    def instrument(trainer: Any) -> None:
        step = trainer.train_step
        handles = [h for ps in trainer.ctx.process_sets.values() for h in ps.handles]

        last: list[list[dict[str, Any]]] = []  # the workers' counters when the last step ended

        async def counted_step() -> dict[str, float]:
            if not steps:
                for h in handles:
                    await h.run(f"{__name__}:install_counters")
            # windows that meet: a generation sent in the last step may run between the two
            before_workers = last.pop() if last else [await h.run(f"{__name__}:read_counters") for h in handles]
            clients = _driver_clients(trainer)
            before = _snapshot(clients)
            metrics = await step()
            after = _snapshot(clients)
            after_workers = [await h.run(f"{__name__}:read_counters") for h in handles]
            last.append(after_workers)
            collectives = []
            for b, a in zip(before_workers, after_workers, strict=True):
                names = set(a["collectives"]) | set(b["collectives"])
                collectives.append({n: a["collectives"].get(n, 0) - b["collectives"].get(n, 0) for n in names
                                    if a["collectives"].get(n, 0) != b["collectives"].get(n, 0)})
            callers = [{k: a["callers"][k] - b["callers"].get(k, 0) for k in a["callers"]
                        if a["callers"][k] != b["callers"].get(k, 0)} for b, a in zip(before_workers, after_workers, strict=True)]
            steps.append({"step": trainer.step, "collective_callers": callers, "requests": dict(after[0] - before[0]), "request_bytes": after[1] - before[1],
                          "reply_bytes": after[2] - before[2], "collectives": collectives,
                          "worker_threads": [w["threads"] for w in after_workers],
                          "worker_children": [w["children"] for w in after_workers],
                          "driver_threads": len(os.listdir("/proc/self/task")),
                          "driver_children": _children(os.getpid())})
            return metrics

        trainer.train_step = counted_step

    summary = await trainer_main(ctx, on_setup=instrument)
    return {**summary, "budget": steps}
