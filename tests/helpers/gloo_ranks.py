"""Run a function on N spawned gloo CPU ranks and collect what each returns (tests only).

`run_ranks(fn, world_size, out_dir)` starts `fn(rank, world_size, out_dir)` in `world_size`
spawned processes with the rendezvous env set, waits (stopping every rank as soon as one
fails: the others would wait in a collective forever), reaps every process, and returns the
per-rank results, or fails the test with each rank's traceback.

The ranks fork from the session's fork server (tests/helpers/forked.py), which imported torch,
transformers and the engines once: a rank group starts in a fraction of a second instead of
each rank importing for seconds (a test module's imports were ~4 s a rank on the 2-core
machine). The server keeps the environment of its start: a test that needs other environment
variables sets them in `fn`.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from daemons.proc import free_port, run_spawned
from tests.helpers.forked import context


def _rank_main(fn: Callable[[int, int, Path], Any], rank: int, world_size: int, port: int, out_dir: str) -> None:
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        if world_size > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        else:  # a lone process needs no rendezvous
            os.environ.pop("MASTER_ADDR", None)
            os.environ.pop("MASTER_PORT", None)
        torch.set_num_threads(1)
        torch.save(fn(rank, world_size, Path(out_dir)), Path(out_dir) / f"result{rank}.pt")
        import torch.distributed as dist

        if dist.is_initialized():  # no rank tears its groups down while a peer still talks on them
            dist.barrier()
    except BaseException:
        (Path(out_dir) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        import atexit

        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        # what multiprocessing's exit skips: libraries' exit handlers (wandb, which megatron
        # imports, removes its temporary directories there; without this each rank left two in /tmp)
        atexit._run_exitfuncs()


def run_ranks(fn: Callable[[int, int, Path], Any], world_size: int, out_dir: Path,
              timeout_s: float = 100) -> list[Any]:
    """`fn`'s result on every rank, in rank order; every process is reaped on return."""
    context()  # the fork server's preload list, before it starts
    port = free_port()
    codes = run_spawned(_rank_main, [(fn, r, world_size, port, str(out_dir)) for r in range(world_size)],
                        timeout_s, start_method="forkserver")
    errors = [f.read_text() for f in sorted(out_dir.glob("error*.txt"))]
    if errors or any(codes):
        pytest.fail(f"rank exit codes {codes} (-9: killed because a peer failed or the job ran past "
                    f"{timeout_s}s)\n" + "\n".join(errors))
    return [torch.load(out_dir / f"result{r}.pt", weights_only=False) for r in range(world_size)]
