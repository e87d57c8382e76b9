"""Critic: a value model (a causal LM body with a one-output token head), trained with FSDP2
(and tensor parallel when critic.parallel.tp > 1: the body is split as the actor's is, the
one-output head stays replicated)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncrl.algorithms import core
from asyncrl.config import RLConfig, rl_config
from asyncrl.engines import backend
from asyncrl.metrics import timed
from asyncrl.roles.forward import values_forward
from asyncrl.roles.process import same_init_on_every_rank, setup_process
from asyncrl.roles.update import ppo_update, row_micro_batches
from asyncrl.single_controller.batch import Batch
from asyncrl.single_controller.parallel import ParallelLayout
from asyncrl.single_controller.protocols import ONE_TO_ALL, THREE_D_PROTO
from asyncrl.single_controller.worker import Worker, register
from asyncrl.train import (
    FSDPEngine,
    TrainEngine,
    compute_dtype,
    mixed_precision_policy,
    parallelize,
)
from asyncrl.train.load import either, load_sharded, materialize, new_head, skeleton
from asyncrl.train.lora import apply_lora, fresh_adapter
from asyncrl.train.packing import AUTO_ATTR, is_packing, resolve_packing
from asyncrl.train.ulysses import run_turns, sequence_parallel

VALUE_HEAD = ("score.", "classifier.")  # the token head transformers adds: not in a causal LM checkpoint


class CriticWorker(Worker):
    def __init__(self, config: RLConfig | dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg = rl_config(config)
        setup_process(cfg, self.rank)
        same_init_on_every_rank(cfg)
        layout = self.register_mesh(ParallelLayout.from_config(cfg.critic.parallel, self.world_size))
        path = cfg.critic.model_path or cfg.model.path
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 7 + layout.dp_rank(self.rank))
        self.critic = backend(cfg.critic.backend).build_critic(self, path, layout)

    @register(THREE_D_PROTO)
    @timed("values")
    def compute_values(self, batch: Batch) -> Batch:
        cc = self.cfg.critic
        self.critic.model.eval()
        mbs, join = row_micro_batches(batch, cc.micro_batch_size, cc.max_tokens_per_micro_batch,
                                      is_packing(self.critic.model))
        with torch.no_grad():
            values = join(run_turns(self.critic.model, mbs, lambda mb: values_forward(self.critic.model, mb)))
            self.critic.release_unsharded()  # no backward follows a forward-only pass to reshard it
        return Batch({"values": values * batch["response_mask"].float()})

    @register(THREE_D_PROTO)
    @timed("update_critic")
    def update_critic(self, batch: Batch) -> dict[str, float]:
        cc = self.cfg.critic

        def loss_fn(model: torch.nn.Module, mb: Batch) -> tuple[torch.Tensor, dict]:
            v = values_forward(model, mb)
            loss, clipfrac = core.value_loss(v, mb["values"], mb["returns"], mb["response_mask"].float(),
                                             clip_range=cc.cliprange_value, loss_agg_mode=cc.loss_agg_mode)
            return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": clipfrac}

        out = ppo_update(self.critic, batch, cc, loss_fn, self.shuffle_gen)
        out["critic/grad_norm"] = out.pop("grad_norm", 0.0)
        out["critic/lr"] = out.pop("lr", 0.0)
        return out

    @register(ONE_TO_ALL)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        self.critic.save_checkpoint(Path(path) / "critic", {**(extra or {}), "gen": self.shuffle_gen.get_state()},
                                    asynchronous=self.cfg.trainer.async_save)
        return str(Path(path) / "critic")

    @register(ONE_TO_ALL)
    def checkpoint_pending(self) -> bool:
        """Whether an asynchronous save is still writing its sharded state (no wait)."""
        return self.critic.checkpoint_pending()

    @register(ONE_TO_ALL)
    def finish_checkpoint(self) -> float:
        """Wait for an asynchronous save's write (trainer.async_save); the seconds waited."""
        return self.critic.finish_checkpoint()

    @register(ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        extra = self.critic.load_checkpoint(Path(path) / "critic") or {}
        if "gen" in extra:
            self.shuffle_gen.set_state(extra.pop("gen"))
        return extra


def fsdp_critic(worker: CriticWorker, path: str, layout: ParallelLayout) -> TrainEngine:
    """critic.backend=fsdp2: the model's body with a fresh one-output token head (verl's critic
    layout), built on the meta device and filled from rank 0's read of the checkpoint: one copy per node."""
    cfg, device = worker.cfg, worker.device
    model = skeleton(path, torch.float32, value_head=True)
    lora = cfg.critic.lora
    if lora.enabled:  # adapters on the body before FSDP wraps the layers; the new head trains in full
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules, train=VALUE_HEAD,
                   freeze_a=lora.freeze_a)
    if cfg.critic.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = parallelize(model, layout, mixed_precision_policy(device, dtype=cfg.model.dtype))
    materialize(model, device)
    critic = FSDPEngine(model, layout, optim=cfg.critic.optim, device=device)
    resolve_packing(model, cfg.critic.pack_sequences, "critic.")
    if cfg.critic.parallel.sp > 1:
        setattr(model, AUTO_ATTR, False)  # Ulysses splits packed rows: every micro-batch packs
        sequence_parallel(layout, cfg.critic.parallel.sp, [model], "critic.")
    head = new_head(VALUE_HEAD, model.config.get_text_config().initializer_range)
    if lora.enabled:  # checkpoints hold the adapters and the head (the body is the model's files)
        # no PEFT export: the critic's export is the merged value model (the head is no adapter)
        critic.lora = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                       "targets": lora.target_modules, "base_model": None}
    load_sharded(critic, path, fresh=either(fresh_adapter, head) if lora.enabled else head)
    return critic


def megatron_critic(worker: CriticWorker, path: str, layout: ParallelLayout) -> TrainEngine:
    """critic.backend=megatron: the body as a megatron-core GPTModel and a replicated one-output
    head (fresh, the same on every rank, when the checkpoint is a causal LM's)."""
    cfg, device = worker.cfg, worker.device
    from asyncrl.train.megatron import require_megatron

    require_megatron()
    from asyncrl.train.megatron.engine import MegatronEngine

    return MegatronEngine(path, layout, optim=cfg.critic.optim, device=device, dtype=compute_dtype(device, cfg.model.dtype),
                          seed=cfg.seed, recompute=cfg.critic.gradient_checkpointing, value_head=True,
                          ep=cfg.actor.moe.ep)  # megatron's parallel state is the process's: the actor's
