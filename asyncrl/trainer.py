"""The RL trainer job: `asyncrl-launch --config-name grpo` runs `main(ctx)`.

It builds (or finds) the model, loads prompts, places the workers, and runs the configured
algorithm's step (`asyncrl.algorithms.loops`) with evaluation, progress, metrics (JSONL,
TensorBoard, a reward-curve PNG), checkpoints and resume around it. The final line printed by
`asyncrl-launch` is the JSON summary this returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from asyncrl.algorithms import core
from asyncrl.algorithms.loops import NEEDS_CRITIC, STEPS
from asyncrl.batch import Batch
from asyncrl.distbatch import DistBatch
from asyncrl.rollout.engine import positions_from_mask
from asyncrl.workers.actor import ActorRolloutRefWorker
from asyncrl.workers.critic import CriticWorker
from asyncrl.workers.reward import RewardModelWorker, RuleRewardWorker
from daemons.errors import ConfigError

log = logging.getLogger("asyncrl.trainer")

DONE_MARKER = "COMPLETE"


class Trainer:
    """State the algorithm steps use: groups, config, controllers, data."""

    def __init__(self, ctx: Any, cfg: dict[str, Any]) -> None:
        self.ctx, self.cfg = ctx, cfg
        algo = cfg["algorithm"]
        if algo["name"] not in STEPS:
            raise ConfigError(f"algorithm.name={algo['name']!r} is not one of {sorted(STEPS)}")
        self.step_fn = STEPS[algo["name"]]
        self.out_dir = Path(cfg["trainer"]["output_dir"])
        self.ckpt_dir = self.out_dir / "checkpoints"
        kl = algo.get("kl_ctrl", {})
        coef = float(kl.get("kl_coef", 0.0)) if algo.get("use_kl_in_reward", False) else 0.0
        self.kl_ctrl = (core.AdaptiveKLController(coef, float(kl.get("target_kl", 0.1)), int(kl.get("horizon", 10000)))
                        if kl.get("type", "fixed") == "adaptive" else core.FixedKLController(coef))
        safe = algo.get("safe", {})
        self.lagrange = core.LagrangeMultiplier(float(safe.get("lagrange_init", 1.0)), float(safe.get("lagrange_lr", 0.1)),
                                                float(safe.get("cost_limit", 0.0)), safe.get("lagrange_max"))
        self.pretrain_coef = float(cfg["actor"].get("pretrain_coef", 0.0))
        self.use_ref = bool(cfg["actor"].get("use_kl_loss", False)) or coef > 0
        # old log-probs need a forward pass of their own only when the update is off-policy
        ac = cfg["actor"]
        recompute = ac.get("recompute_log_prob", "auto")
        on_policy = int(ac.get("ppo_epochs", 1)) == 1 and int(ac.get("ppo_mini_batches", 1)) == 1
        self.recompute_old = (not on_policy) if recompute == "auto" else bool(recompute)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.critic = self.cost = None

    def adv_cfg(self, estimator: str) -> dict[str, Any]:
        algo = self.cfg["algorithm"]
        return {"estimator": estimator, "gamma": float(algo.get("gamma", 1.0)), "lam": float(algo.get("lam", 1.0)),
                "kl_coef": float(self.kl_ctrl.value), "kl_penalty": algo.get("kl_penalty", "kl"),
                "norm_adv_by_std": bool(algo.get("norm_adv_by_std", True)), "lagrange": float(self.lagrange.value)}

    # setup ----------------------------------------------------------------------------------------
    async def setup(self) -> None:
        cfg = self.cfg
        mc = cfg["model"]
        if mc.get("build_tiny"):
            from asyncrl.models.tiny import ensure_tiny_model

            await asyncio.to_thread(ensure_tiny_model, mc["path"], **dict(mc["build_tiny"]))
        # imports, tokenizer and tokenization block: keep them off the event loop (heartbeats)
        await asyncio.to_thread(self._load_tokenizer_and_data)
        tc = cfg["trainer"]
        pool = self.ctx.create_pool("actor_rollout_ref", world_size=int(tc["n_workers"]))
        roles: dict[str, Any] = {"actor": (ActorRolloutRefWorker, cfg), "reward": (RuleRewardWorker, cfg)}
        if cfg["algorithm"]["name"] in NEEDS_CRITIC:
            roles["critic"] = (CriticWorker, cfg)
        if cfg.get("cost_model", {}).get("enable"):
            roles["cost"] = (RewardModelWorker, (cfg, "costs"), {})
        groups = await self.ctx.spawn(pool, **roles)
        self.actor, self.reward = groups.actor, groups.reward
        self.critic, self.cost = groups.get("critic"), groups.get("cost")
        self.n_workers = pool.world_size

    def _load_tokenizer_and_data(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg["model"]["path"])
        self._load_data()

    def _load_data(self) -> None:
        from asyncrl.data.dataset import PromptDataset, PromptLoader, load_rows
        from asyncrl.data.synthetic import disjoint_splits

        dc = self.cfg["data"]
        if dc.get("train_files"):
            train, val = load_rows(dc["train_files"]), load_rows(dc["val_files"]) if dc.get("val_files") else []
        else:
            syn = dc["synthetic"]
            train, val = disjoint_splits(syn["task"], int(syn["n_train"]), int(syn["n_val"]), int(syn.get("seed", 0)))
        tpl = bool(dc.get("apply_chat_template", True))
        self.train_set = PromptDataset(train, self.tokenizer, int(dc["max_prompt_len"]), tpl)
        val_set = PromptDataset(val, self.tokenizer, int(dc["max_prompt_len"]), tpl) if val else None
        self.val_prompts = val_set.collate(val_set.items) if val_set else None  # one batch, reused
        self.loader = PromptLoader(self.train_set, int(dc["batch_size"]), shuffle=bool(dc.get("shuffle", True)),
                                   seed=int(self.cfg.get("seed", 0)))

    def _put(self, d: dict[str, Any], meta: dict[str, Any]) -> DistBatch:
        tensors = {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}
        rest = {k: v for k, v in d.items() if not isinstance(v, torch.Tensor)}
        return self.ctx.put(Batch(tensors, rest, meta))

    def pretrain_batch(self) -> DistBatch:
        """Prompt + ground-truth answer sequences for the Safe-RLHF pretrain (SFT) loss term."""
        bs = int(self.cfg["data"]["batch_size"])
        start = (self.step * bs) % max(1, len(self.train_set))
        items = [self.train_set[(start + i) % len(self.train_set)] for i in range(bs)]
        answers = [self.tokenizer.encode(str(it.ground_truth), add_special_tokens=False) + [self.tokenizer.eos_token_id]
                   for it in items]
        p, r = max(len(it.input_ids) for it in items), max(len(a) for a in answers)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((bs, p + r), pad, dtype=torch.long)
        mask = torch.zeros((bs, p + r), dtype=torch.long)
        for i, (it, a) in enumerate(zip(items, answers, strict=True)):
            ids[i, p - len(it.input_ids):p] = torch.tensor(it.input_ids)
            ids[i, p:p + len(a)] = torch.tensor(a)
            mask[i, p - len(it.input_ids):p + len(a)] = 1
        return self._put({"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask),
                          "responses": ids[:, p:], "response_mask": mask[:, p:]}, {})

    # evaluation -----------------------------------------------------------------------------------
    async def evaluate(self) -> float:
        """Mean reward of greedy responses on the held-out prompts."""
        if self.val_prompts is None:
            return float("nan")
        prompts = self._put(self.val_prompts, {"greedy": True, "n": 1})
        scored = await self.reward.compute_reward(self.actor.generate_sequences(prompts))
        scores = (await scored.select("scores").fetch())["scores"]  # one float per prompt
        return float(scores.float().mean())

    # checkpoints ----------------------------------------------------------------------------------
    def _latest_checkpoint(self) -> Path | None:
        done = [p for p in self.ckpt_dir.glob("step_*") if (p / DONE_MARKER).exists()]
        return max(done, key=lambda p: int(p.name.split("_")[1])) if done else None

    async def save(self) -> Path:
        path = self.ckpt_dir / f"step_{self.step}"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        hf = (await self.actor.save_checkpoint(str(path)))[0]
        if self.critic is not None:
            await self.critic.save_checkpoint(str(path))
        state = {"step": self.step, "loader": self.loader.state_dict(), "history": self.history,
                 "kl_coef": float(self.kl_ctrl.value), "lagrange": self.lagrange.state_dict(),
                 "val": self.val_log, "hf": hf}
        (path / "trainer_state.json").write_text(json.dumps(state))
        (path / DONE_MARKER).write_text("")  # last: a checkpoint without it is incomplete
        keep = int(self.cfg["trainer"].get("keep_checkpoints", 2))
        old = sorted((p for p in self.ckpt_dir.glob("step_*") if p != path), key=lambda p: int(p.name.split("_")[1]))
        for p in old[:max(0, len(old) - keep + 1)]:
            shutil.rmtree(p, ignore_errors=True)
        return Path(hf)

    async def resume(self) -> bool:
        mode = str(self.cfg["trainer"].get("resume", "auto"))
        if mode in ("none", "false", "False"):
            return False
        path = Path(mode) if mode not in ("auto",) else self._latest_checkpoint()
        if path is None:
            return False
        if not (path / DONE_MARKER).exists():
            raise ConfigError(f"trainer.resume={mode}: {path} is not a complete checkpoint")
        await self.actor.load_checkpoint(str(path))
        if self.critic is not None:
            await self.critic.load_checkpoint(str(path))
        state = json.loads((path / "trainer_state.json").read_text())
        self.step, self.history, self.val_log = state["step"], state["history"], state["val"]
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.value = state["kl_coef"]
        self.lagrange.load_state_dict(state["lagrange"])
        log.info("resumed from %s at step %d", path, self.step)
        return True

    # the loop -------------------------------------------------------------------------------------
    async def fit(self) -> dict[str, Any]:
        from asyncrl.metrics import MetricsWriter, progress

        tc = self.cfg["trainer"]
        total = int(tc["total_steps"])
        eval_every, save_every = int(tc.get("eval_every", 5)), int(tc.get("save_every", 10))
        self.val_log: list[list[float]] = []
        t_start = time.monotonic()
        resumed = await self.resume()
        writer = await asyncio.to_thread(MetricsWriter, self.out_dir, bool(tc.get("tensorboard", True)))
        if resumed:  # rewrite the metrics file up to the checkpoint: steps after it are redone
            writer.write(int(self.val_log[0][0]), {"val/reward": self.val_log[0][1]})
            for row in self.history:
                writer.write(int(row["step"]), {k: v for k, v in row.items() if k != "step"})
        if not self.val_log:
            self.val_log.append([self.step, await self.evaluate()])
            writer.write(self.step, {"val/reward": self.val_log[-1][1]})
            log.info("step %d: held-out reward %.3f", self.step, self.val_log[-1][1])
        tokens, step_time = 0.0, 0.0
        bar = progress(total, self.step, desc=f"{self.cfg['algorithm']['name']}")
        while self.step < total:
            t0 = time.monotonic()
            prompts = self._put(self.loader.next_batch(), {"seed": int(self.cfg.get("seed", 0)) * 100003 + self.step})
            metrics = await self.step_fn(self, prompts)
            self.step += 1
            dt = time.monotonic() - t0
            tokens += metrics.get("response/tokens", 0.0)
            step_time += dt
            self.kl_ctrl.update(metrics.get("critic/kl", 0.0), int(self.cfg["data"]["batch_size"]))
            metrics.update({"timing/step_s": dt, "actor/kl_coef": float(self.kl_ctrl.value),
                            "perf/tokens_per_s": metrics.get("response/tokens", 0.0) / dt})
            if self.step % eval_every == 0 or self.step == total:
                self.val_log.append([self.step, await self.evaluate()])
                metrics["val/reward"] = self.val_log[-1][1]
            bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v) and k != "val/reward"]
            if bad:
                log.warning("step %d: non-finite metrics %s", self.step, bad)
            self.history.append({"step": self.step, **metrics})
            writer.write(self.step, metrics)
            bar.update(metrics)
            if self.step % save_every == 0 and self.step < total:
                await self.save()
        bar.close()
        hf = await self.save()  # the final checkpoint (also when resumed at the end)
        await asyncio.to_thread(writer.plot, self.history, self.val_log, self.out_dir / "reward_curve.png")
        writer.close()
        return {"algorithm": self.cfg["algorithm"]["name"], "steps": self.step,
                "val_reward_start": round(self.val_log[0][1], 4), "val_reward_end": round(self.val_log[-1][1], 4),
                "wall_s": round(time.monotonic() - t_start, 1),
                "tokens_per_s": round(tokens / step_time, 1) if step_time else 0.0,
                "checkpoint": str(hf), "metrics": str(self.out_dir / "metrics.jsonl")}


async def main(ctx: Any) -> dict[str, Any]:
    cfg = OmegaConf.to_container(ctx.cfg, resolve=True)
    trainer = Trainer(ctx, cfg)
    await trainer.setup()
    return await trainer.fit()
