"""ActorRolloutRef: the policy (FSDP2-trained), its rollout engine and the frozen reference
policy, colocated in one process per device (HybridFlow's hybrid engine).

The rollout engine holds a full, unsharded copy of the policy; after every actor update the
trained weights are all-gathered from the FSDP shards and loaded into it in place (the hybrid
engine's trivial resharding: training DP shards -> a full replica per generation rank).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch

from asyncrl.algorithms import core
from asyncrl.batch import Batch
from asyncrl.engine import TrainEngine, apply_fsdp, mixed_precision_policy, rng_state, set_rng_state
from asyncrl.parallel import ParallelConfig, ParallelLayout
from asyncrl.protocols import DP_PROTO, ONE_TO_ALL
from asyncrl.rollout import RolloutEngine, SamplingParams
from asyncrl.worker import Worker, register
from asyncrl.workers.common import (
    load_causal_lm,
    mean_metrics,
    micro_batches,
    mini_batches,
    optim_config,
    response_forward,
    setup_process,
)

log = logging.getLogger(__name__)


class ActorRolloutRefWorker(Worker):
    """`roles` picks what this process hosts: any of "actor", "rollout", "ref"."""

    def __init__(self, config: dict[str, Any], roles: tuple[str, ...] = ("actor", "rollout", "ref")) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        self.cfg = config
        self.roles = set(roles)
        setup_process(config, self.rank)
        path = config["model"]["path"]
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        actor_cfg = config.get("actor", {})
        self.actor: TrainEngine | None = None
        self.ref: TrainEngine | None = None
        self.rollout: RolloutEngine | None = None
        base = load_causal_lm(path)
        if "rollout" in self.roles:
            self.rollout = RolloutEngine(copy.deepcopy(base), eos_token_id=self.tokenizer.eos_token_id,
                                         pad_token_id=self.tokenizer.pad_token_id, device=self.device)
        layout = self.register_mesh(ParallelLayout.from_config(ParallelConfig(), self.world_size))
        mp = mixed_precision_policy(self.device)
        if "ref" in self.roles:
            self.ref = TrainEngine(apply_fsdp(copy.deepcopy(base), layout.submesh("dp"), mp), layout,
                                   optim=None, device=self.device)
        if "actor" in self.roles:
            self.actor = TrainEngine(apply_fsdp(base, layout.submesh("dp"), mp), layout,
                                     optim=optim_config(actor_cfg.get("optim", {})), device=self.device)
        self.rollout_stale = False
        self.update_steps = 0
        self.shuffle_gen = torch.Generator().manual_seed(int(config.get("seed", 0)) + self.rank)

    # rollout -----------------------------------------------------------------------------------
    def _sync_rollout_weights(self) -> None:
        if self.rollout is not None and self.actor is not None and self.rollout_stale:
            self.rollout.load_weights(self.actor.full_state_dict(rank0_only=False))
            self.rollout_stale = False

    @register(DP_PROTO)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """Sample responses for this rank's prompts; returns B*n rows with per-token log-probs.

        prompts.meta may override sampling: n, temperature, top_p, top_k, max_tokens, greedy.
        """
        self._sync_rollout_weights()
        rc = dict(self.cfg.get("rollout", {}))
        rc.update({k: v for k, v in prompts.meta.items()
                   if k in ("n", "temperature", "top_p", "top_k", "max_tokens", "greedy")})
        params = SamplingParams(temperature=float(rc.get("temperature", 1.0)), top_p=float(rc.get("top_p", 1.0)),
                                top_k=int(rc.get("top_k", 0)), max_tokens=int(rc.get("max_tokens", 16)),
                                n=int(rc.get("n", 1)), greedy=bool(rc.get("greedy", False)))
        seed = prompts.meta.get("seed")
        gen = (torch.Generator(device=self.rollout.device).manual_seed(int(seed) * 1000 + self.rank)
               if seed is not None else None)
        out = _pad_responses(self.rollout.generate(prompts["input_ids"], prompts["attention_mask"], params,
                                                   generator=gen), params.max_tokens, self.tokenizer.pad_token_id)
        rest = prompts.select(*prompts.non_tensors, meta=True)
        rest = rest.repeat(params.n, interleave=True) if params.n > 1 else rest
        return Batch(out, rest.non_tensors, {**prompts.meta, "n": params.n})

    # log-probs -------------------------------------------------------------------------------------
    def _temperature(self, batch: Batch) -> float:
        """The sampling temperature of these responses (log-probs must use the same one)."""
        if batch.meta.get("greedy"):
            return 1.0
        return float(batch.meta.get("temperature", self.cfg.get("rollout", {}).get("temperature", 1.0))) or 1.0

    def _log_probs(self, engine: TrainEngine, batch: Batch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        temp = self._temperature(batch)
        size = int(self.cfg.get("actor", {}).get("log_prob_micro_batch_size", 16))
        engine.model.eval()
        logps, ents = [], []
        with torch.no_grad():
            for mb in micro_batches(batch, size):
                lp, ent = response_forward(engine.model, mb, temp, with_entropy)
                logps.append(lp)
                ents.append(ent)
        logp = torch.cat(logps) if logps else torch.zeros(0)
        return logp, (torch.cat(ents) if with_entropy and ents else None)

    @register(DP_PROTO)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """Current policy log-probs of the responses (`old_log_probs`) and their entropy."""
        logp, ent = self._log_probs(self.actor, batch, with_entropy=True)
        return Batch({"old_log_probs": logp, "entropy": ent})

    @register(DP_PROTO)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        logp, _ = self._log_probs(self.ref, batch, with_entropy=False)
        return Batch({"ref_log_prob": logp})

    # training ------------------------------------------------------------------------------------
    @register(DP_PROTO)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO-clip update over `ppo_epochs` × mini-batches; returns metrics averaged over updates."""
        ac = self.cfg.get("actor", {})
        temp = self._temperature(batch)
        mode = ac.get("loss_agg_mode", "token-mean")
        # Dr.GRPO's length normaliser must be a constant: the generation budget
        norm_len = int(self.cfg.get("rollout", {}).get("max_tokens", 0)) or None
        entropy_coeff = float(ac.get("entropy_coeff", 0.0))
        use_kl_loss = bool(ac.get("use_kl_loss", False)) and "ref_log_prob" in batch
        pretrain_coef = float(ac.get("pretrain_coef", 0.0))
        kl_coef, kl_type = float(ac.get("kl_loss_coef", 0.0)), ac.get("kl_loss_type", "low_var_kl")
        n_mini = int(ac.get("ppo_mini_batches", 1))
        micro = int(ac.get("micro_batch_size", 8))
        history: list[dict[str, float]] = []
        for _ in range(int(ac.get("ppo_epochs", 1))):
            for mini in mini_batches(batch, n_mini, bool(ac.get("shuffle", True)), self.shuffle_gen):
                rows = len(mini)

                def loss_fn(model: torch.nn.Module, mb: Batch, rows: int = rows) -> tuple[torch.Tensor, dict]:
                    logp, ent = response_forward(model, mb, temp, with_entropy=entropy_coeff != 0)
                    mask = mb["response_mask"].float()
                    # without recomputed old log-probs the update is on-policy (one epoch, one
                    # mini-batch): the ratio is 1 and the gradient that of the clipped objective
                    old = mb["old_log_probs"] if "old_log_probs" in mb else logp.detach()
                    loss, m = core.ppo_policy_loss(
                        old, logp, mb["advantages"], mask,
                        clip_ratio_low=float(ac.get("clip_ratio_low", ac.get("clip_ratio", 0.2))),
                        clip_ratio_high=float(ac.get("clip_ratio_high", ac.get("clip_ratio", 0.2))),
                        clip_ratio_c=float(ac.get("clip_ratio_c", 3.0)), loss_agg_mode=mode,
                        norm_len=norm_len)
                    metrics = {"actor/pg_loss": loss.detach(), **{f"actor/{k}": v for k, v in m.items()}}
                    if ent is not None:
                        e = core.agg_loss(ent, mask, mode)
                        loss = loss - entropy_coeff * e
                        metrics["actor/entropy"] = e.detach()
                    if use_kl_loss:
                        kl = core.kl_loss(logp, mb["ref_log_prob"], mask, kl_type, mode)
                        loss = loss + kl_coef * kl
                        metrics["actor/kl_loss"] = kl.detach()
                    if pretrain_coef and "pretrain_loss_mask" in mb:
                        ptx = -core.masked_mean(logp, mb["pretrain_loss_mask"].float())
                        loss = loss + pretrain_coef * ptx
                        metrics["actor/pretrain_loss"] = ptx.detach()
                    return loss * (len(mb) / rows), metrics

                history.append(self.actor.train_step(micro_batches(mini, micro), loss_fn))
        self.update_steps += 1
        self.rollout_stale = True
        out = mean_metrics(history)
        out["actor/lr"] = out.pop("lr", 0.0)
        out["actor/grad_norm"] = out.pop("grad_norm", 0.0)
        out.pop("loss", None)
        return out

    @register(DP_PROTO)
    def update_pretrain(self, batch: Batch) -> dict[str, float]:
        """One SFT step (pretrain loss, scaled by actor.pretrain_coef) on response tokens."""
        ac = self.cfg.get("actor", {})
        coef = float(ac.get("pretrain_coef", 1.0))
        rows = len(batch)

        def loss_fn(model: torch.nn.Module, mb: Batch) -> tuple[torch.Tensor, dict]:
            logp, _ = response_forward(model, mb)
            nll = -core.masked_mean(logp, mb["response_mask"].float())
            return coef * nll * (len(mb) / rows), {"actor/pretrain_loss": nll.detach()}

        out = self.actor.train_step(micro_batches(batch, int(ac.get("micro_batch_size", 8))), loss_fn)
        self.rollout_stale = True
        return {"actor/pretrain_loss": out["actor/pretrain_loss"]}

    @register(DP_PROTO)
    def compute_loss(self, batch: Batch) -> dict[str, float]:
        """Pretrain/SFT loss (mean negative log-likelihood of response tokens), no update."""
        logp, _ = self._log_probs(self.actor, batch, with_entropy=False)
        mask = batch["response_mask"].float()
        return {"sft_loss": float(-core.masked_mean(logp, mask)), "tokens": float(mask.sum())}

    # checkpoints -----------------------------------------------------------------------------------
    @register(ONE_TO_ALL)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        extra = {**(extra or {}), "rng": rng_state(), "update_steps": self.update_steps,
                 "shuffle_gen": self.shuffle_gen.get_state()}
        self.actor.save_checkpoint(Path(path) / "actor", extra, tokenizer=self.tokenizer)
        return str(Path(path) / "actor" / "hf")

    @register(ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        extra = self.actor.load_checkpoint(Path(path) / "actor") or {}
        if "rng" in extra:
            set_rng_state(extra["rng"])
        if "shuffle_gen" in extra:
            self.shuffle_gen.set_state(extra["shuffle_gen"])
        self.update_steps = int(extra.get("update_steps", 0))
        self.rollout_stale = True
        return {k: v for k, v in extra.items() if k not in ("rng", "shuffle_gen")}


def _pad_responses(out: dict[str, torch.Tensor], width: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad the response columns to the generation budget, so every rank's output has the
    same width and rows from different ranks concatenate (masked, so nothing else changes)."""
    extra = width - out["responses"].shape[1]
    if extra <= 0:
        return out
    rows = out["responses"].shape[0]

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.cat([t, t.new_full((rows, extra), value)], dim=1)

    out = dict(out)
    out["responses"] = pad(out["responses"], pad_id)
    out["response_mask"] = pad(out["response_mask"], 0)
    out["rollout_log_probs"] = pad(out["rollout_log_probs"], 0.0)
    out["input_ids"] = pad(out["input_ids"], pad_id)
    out["attention_mask"] = pad(out["attention_mask"], 0)
    out["position_ids"] = pad(out["position_ids"], 0) + 0
    last = out["position_ids"][:, -extra - 1:-extra]
    out["position_ids"][:, -extra:] = last + torch.arange(1, extra + 1)  # keep positions increasing
    return out
