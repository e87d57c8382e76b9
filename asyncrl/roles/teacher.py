"""On-policy distillation's teacher: a frozen policy of its own (`teacher.path`) that scores the
student's sampled tokens, sharded over its workers by its backend (`teacher.backend`: FSDP2 x TP
like the reference policy, or megatron-core's TP x PP)."""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.config import RLConfig, rl_config
from asyncrl.engines import backend
from asyncrl.metrics import timed
from asyncrl.roles.forward import forward_only, packed_view, response_forward, sampling_temperature
from asyncrl.roles.process import setup_process
from asyncrl.roles.update import row_micro_batches
from asyncrl.single_controller.batch import Batch
from asyncrl.single_controller.parallel import ParallelLayout
from asyncrl.single_controller.protocols import THREE_D_PROTO
from asyncrl.single_controller.worker import Worker, register
from asyncrl.train import parallelize
from asyncrl.train.fsdp import FSDPEngine, compute_dtype, mixed_precision_policy
from asyncrl.train.load import load_sharded, materialize, skeleton
from asyncrl.train.packing import is_packing, resolve_packing

TEACHER_LOG_PROBS = "teacher_log_probs"


class TeacherWorker(Worker):
    """The teacher's log-probs of each response token, at the temperature it was sampled with."""

    def __init__(self, config: RLConfig | dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg = rl_config(config)
        setup_process(cfg, self.rank)
        layout = self.register_mesh(ParallelLayout.from_config(cfg.teacher.parallel, self.world_size))
        self.engine = backend(cfg.teacher.backend).build_teacher(self, cfg.teacher.path, layout)

    @register(THREE_D_PROTO)
    @timed("teacher_log_prob")
    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        model = self.engine.model
        model.eval()
        temp = sampling_temperature(batch, self.cfg.rollout.temperature)
        mbs, join = row_micro_batches(batch, self.cfg.teacher.micro_batch_size, packed=is_packing(model))

        def forward(m: torch.nn.Module, mb: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
            return response_forward(m, mb, temp, packed=packed_view(m, mb)[0])

        staged = forward_only(self.engine, mbs, forward)
        if staged is None:  # not the last pipeline stage: the last one answers
            return None
        outs = [lp for lp, _ in staged]
        width = batch["responses"].shape[1]
        return Batch({TEACHER_LOG_PROBS: join(outs) if outs else torch.zeros(0, width, device=self.device)})


def fsdp_teacher(worker: TeacherWorker, path: str, layout: ParallelLayout) -> FSDPEngine:
    """teacher.backend=fsdp2: the model at `path` in the compute dtype (forward only: no master
    copy), FSDP2 x TP over `layout`, filled from rank 0's read of the checkpoint."""
    cfg, device = worker.cfg, worker.device
    dtype = compute_dtype(device, cfg.model.dtype)
    model = parallelize(skeleton(path, dtype), layout, mixed_precision_policy(device, dtype=cfg.model.dtype))
    materialize(model, device)
    engine = FSDPEngine(model, layout, optim=None, device=device)
    load_sharded(engine, path)  # rank 0 reads, the shards are broadcast
    resolve_packing(engine.model, None, "teacher.")  # rows packed where the model can (exact)
    return engine


def megatron_teacher(worker: TeacherWorker, path: str, layout: ParallelLayout) -> Any:
    """teacher.backend=megatron: the model at `path` as a forward-only megatron-core GPTModel, TP x PP
    over `layout`, each rank reading its own shards of the checkpoint."""
    from asyncrl.train.megatron import require_megatron

    require_megatron()
    from asyncrl.train.megatron.engine import MegatronEngine

    cfg, device = worker.cfg, worker.device
    return MegatronEngine(path, layout, optim=None, device=device, dtype=compute_dtype(device, cfg.model.dtype),
                          seed=cfg.seed)
