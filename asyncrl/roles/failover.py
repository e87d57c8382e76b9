"""A colocated actor pool that loses a rank and goes on (trainer.failover): the worker's part.

At each step's end the driver calls `failover_mark`: every rank keeps its training state and
sends a copy to its ring neighbour (`asyncrl.train.failover.ShardMirror`, held in the process, so
it outlives the worker instance). When a rank dies, the driver starts a replacement and runs
`prepare` on every rank (the old process group and actor instance dropped, the new rendezvous
set), builds the actor on every rank again — on the new group, nothing read from disk — and
calls `failover_restore`: the pool is back at the last kept step's end and the driver runs the next step again.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

import torch.distributed as dist

from asyncrl.single_controller import peers
from asyncrl.single_controller.protocols import ONE_TO_ALL
from asyncrl.single_controller.worker import register
from asyncrl.train import rng_state, set_rng_state
from asyncrl.train.failover import ShardMirror, frozen_tensors, prime, state_tensors

log = logging.getLogger(__name__)

REBUILD = "failover_rebuild"  # runtime.state: the next actor built joins a re-formed group, reads no weights
MIRROR = "failover_mirror"  # runtime.state: this process's ShardMirror


def prepare(host: str, port: int, runtime: Any) -> None:
    """Before the pool's actor is built again: forget this process's actor instances and process
    group (a collective of the failed step may still wait in it: it ends once the others let go),
    and point the next rendezvous at (host, port)."""
    for name in [n for n, i in runtime.instances.items() if hasattr(i, "failover")]:
        del runtime.instances[name]
    if dist.is_initialized():
        dist.destroy_process_group()
    peers.reset_group()
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))
    runtime.state[REBUILD] = True
    gc.collect()  # the old group's connections close with its last reference


def rebuilding(worker: Any) -> bool:
    """Whether this worker is built for a re-formed pool (its weights come from the kept states)."""
    return worker.runtime is not None and bool(worker.runtime.state.get(REBUILD))


class Failover:
    """The actor worker's kept states: marked at each step's end, restored after a rank died."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.enabled = worker.cfg.trainer.failover.enable and worker.actor is not None
        if self.enabled:
            prime(worker.actor)  # optimizer state from the start: every kept state has one shape
        if worker.runtime is not None:
            worker.runtime.state.pop(REBUILD, None)

    def _mirror(self) -> ShardMirror:
        if not self.enabled or self.worker.runtime is None:
            raise RuntimeError("failover calls need trainer.failover.enable=true on a worker with an actor")
        state = self.worker.runtime.state
        if MIRROR not in state:
            state[MIRROR] = ShardMirror()
        return state[MIRROR]

    def _tensors(self) -> tuple[list, list]:
        w = self.worker
        state = state_tensors(w.actor)
        return state, frozen_tensors(w.actor, w.ref.model if w.ref is not None else None)

    def _extras(self) -> dict[str, Any]:
        w = self.worker
        return {"update_steps": w.update_steps, "rng": rng_state(), "sample_gen": w.sample_gen.get_state(),
                "shuffle_gen": w.shuffle_gen.get_state(),
                "scheduler": w.actor.scheduler.state_dict() if w.actor.scheduler is not None else None,
                "lr": [g["lr"] for g in w.actor.optimizer.param_groups]}  # the schedule's value, set by its last step

    def _apply(self, extras: dict[str, Any]) -> None:
        w = self.worker
        w.update_steps = extras["update_steps"]
        set_rng_state(extras["rng"])
        w.sample_gen.set_state(extras["sample_gen"])
        w.shuffle_gen.set_state(extras["shuffle_gen"])
        if extras["scheduler"] is not None:
            w.actor.scheduler.load_state_dict(extras["scheduler"])
        for group, lr in zip(w.actor.optimizer.param_groups, extras["lr"], strict=True):
            group["lr"] = lr

    @register(ONE_TO_ALL)
    def failover_mark(self, step: int) -> dict[str, float]:
        """Keep this rank's state after `step` steps, and a copy of the previous rank's."""
        t0, mirror = time.perf_counter(), self._mirror()
        state, frozen = self._tensors()
        mirror.update(step, state, frozen, self._extras())
        return {"sent_bytes": mirror.nbytes, "held_bytes": mirror.held_bytes, "seconds": time.perf_counter() - t0,
                "state_bytes": sum(t.numel() * t.element_size() for t in state + frozen)}

    @register(ONE_TO_ALL)
    def failover_restore(self, lost: int) -> int:
        """Back to the kept step on every rank of a rebuilt pool (rank `lost` from its
        neighbour's copy), the copies kept again; returns that step."""
        mirror = self._mirror()
        state, frozen = self._tensors()
        step, extras = mirror.restore(lost, state, frozen)
        self._apply(extras)
        mirror.copy_frozen = mirror.copy_frozen[:0]  # the replacement holds no copy yet: frozen ones go again
        mirror.update(step, state, frozen, extras)
        return step
