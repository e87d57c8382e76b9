"""Critic: a value model (a causal LM body with a one-output token head), trained with FSDP2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncrl.algorithms import core
from asyncrl.batch import Batch
from asyncrl.engine import TrainEngine, apply_fsdp, mixed_precision_policy
from asyncrl.parallel import ParallelConfig, ParallelLayout
from asyncrl.protocols import DP_PROTO, ONE_TO_ALL
from asyncrl.worker import Worker, register
from asyncrl.workers.common import (
    mean_metrics,
    micro_batches,
    mini_batches,
    optim_config,
    same_init_on_every_rank,
    setup_process,
    values_forward,
)


def load_value_model(path: str) -> torch.nn.Module:
    """The model at `path` with a fresh 1-output token-classification head (verl's critic layout);
    no dropout, so training-mode values match the eval-mode values they are clipped against."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32)


class CriticWorker(Worker):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = config
        setup_process(config, self.rank)
        cc = config.get("critic", {})
        same_init_on_every_rank(config)
        layout = self.register_mesh(ParallelLayout.from_config(ParallelConfig(), self.world_size))
        model = load_value_model(cc.get("model_path") or config["model"]["path"])
        self.critic = TrainEngine(apply_fsdp(model, layout.submesh("dp"), mixed_precision_policy(self.device)),
                                  layout, optim=optim_config(cc.get("optim", {"lr": 1e-4})), device=self.device)
        self.shuffle_gen = torch.Generator().manual_seed(int(config.get("seed", 0)) + 7 + self.rank)

    @register(DP_PROTO)
    def compute_values(self, batch: Batch) -> Batch:
        self.critic.model.eval()
        size = int(self.cfg.get("critic", {}).get("micro_batch_size", 16))
        with torch.no_grad():
            values = [values_forward(self.critic.model, mb) for mb in micro_batches(batch, size)]
        return Batch({"values": torch.cat(values) * batch["response_mask"].float()})

    @register(DP_PROTO)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        cc = self.cfg.get("critic", {})
        mode = cc.get("loss_agg_mode", "token-mean")
        clip = float(cc.get("cliprange_value", 0.5))
        history = []
        for _ in range(int(cc.get("ppo_epochs", 1))):
            for mini in mini_batches(batch, int(cc.get("ppo_mini_batches", 1)), True, self.shuffle_gen):
                rows = len(mini)

                def loss_fn(model: torch.nn.Module, mb: Batch, rows: int = rows) -> tuple[torch.Tensor, dict]:
                    v = values_forward(model, mb)
                    loss, clipfrac = core.value_loss(v, mb["values"], mb["returns"], mb["response_mask"].float(),
                                                     clip_range=clip, loss_agg_mode=mode)
                    return loss * (len(mb) / rows), {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": clipfrac}

                history.append(self.critic.train_step(micro_batches(mini, int(cc.get("micro_batch_size", 8))), loss_fn))
        out = mean_metrics(history)
        out["critic/grad_norm"] = out.pop("grad_norm", 0.0)
        out["critic/lr"] = out.pop("lr", 0.0)
        out.pop("loss", None)
        return out

    @register(ONE_TO_ALL)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        self.critic.save_checkpoint(Path(path) / "critic", {**(extra or {}), "gen": self.shuffle_gen.get_state()})
        return str(Path(path) / "critic")

    @register(ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        extra = self.critic.load_checkpoint(Path(path) / "critic") or {}
        if "gen" in extra:
            self.shuffle_gen.set_state(extra.pop("gen"))
        return extra
