"""The RL trainer job: `asyncrl-launch --config-name grpo` runs `main(ctx)`.

It checks the model and the run directory, loads prompts, places the workers, and runs the
configured algorithm's step (`asyncrl.algorithms.registry`) with evaluation, progress, metrics
(`trainer.loggers`: JSONL, console, TensorBoard, wandb; a reward-curve PNG), per-phase timings,
checkpoints and resume around it.
The final line printed by `asyncrl-launch` is the JSON summary this returns.

A run directory (`trainer.output_dir`) holds what this program wrote and nothing else is touched:
`config.yaml` (the composed config), `metrics.jsonl`, `samples.jsonl`, `tensorboard/`, `wandb/`,
`reward_curve.png`, `checkpoints/step_N/` and `logs/`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncrl.algorithms.controllers import Controllers
from asyncrl.algorithms.registry import ALGORITHMS
from asyncrl.algorithms.roles import Roles
from asyncrl.config import RLConfig, rl_config, to_dict
from asyncrl.evaluation import format_samples, pass_at_ks, sample_rows, source_means
from asyncrl.models.resolve import resolve_model
from asyncrl.preflight import check_inputs, check_round_trip
from asyncrl.rewards import NonFiniteRewardError
from asyncrl.roles.actor import ActorRolloutRefWorker
from asyncrl.roles.critic import CriticWorker
from asyncrl.roles.reward import RewardModelWorker, RuleRewardWorker
from asyncrl.rollout.ahead import Generations
from asyncrl.rollout.engine import positions_from_mask
from asyncrl.rundir import DONE_MARKER, RunDir, complete_checkpoints
from asyncrl.single_controller.batch import Batch
from asyncrl.single_controller.distbatch import DistBatch
from asyncrl.single_controller.group import WorkerCallError
from daemons.errors import ConfigError, DaemonError, PlacementError

log = logging.getLogger("asyncrl.trainer")


class NonFiniteLossError(DaemonError, ValueError):
    """A training loss or gradient norm became NaN or infinite: the run stops instead of
    training (and checkpointing) non-finite weights."""

# the worker-side phases of a step; on one colocated pool they run one after another
PHASES = ("gen", "sync", "weight_sync", "reward", "reward_model", "old_log_prob", "ref_log_prob", "values",
          "update_actor", "update_critic", "update_pretrain")

class Trainer:
    """Drives one RL run: worker groups, controllers, data, the loop and its bookkeeping."""

    def __init__(self, ctx: Any, cfg: RLConfig) -> None:
        self.ctx, self.cfg = ctx, cfg
        self.algorithm = ALGORITHMS[cfg.algorithm.name]
        self.out_dir = Path(cfg.trainer.output_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.ctl = Controllers.from_config(cfg.algorithm)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.val_log: list[list[float]] = []
        self.val_details: dict[str, float] = {}  # the last evaluation's per-data_source means
        self.val_samples: list[dict[str, Any]] = []  # and a few of its completions

    # setup ----------------------------------------------------------------------------------------
    async def setup(self) -> None:
        cfg = self.cfg
        # tokenizer and tokenization block: keep them off the event loop (heartbeats)
        await asyncio.to_thread(self._load_tokenizer_and_data)
        split = cfg.trainer.placement == "split"
        pool = self._pool("actor_ref" if split else "actor_rollout_ref", "trainer.n_workers", cfg.trainer.n_workers)
        wire = to_dict(cfg)  # workers rebuild the typed config from this plain dict
        actor = (ActorRolloutRefWorker, (wire, ("actor", "ref")), {}) if split else (ActorRolloutRefWorker, wire)
        reward = ((RewardModelWorker, (wire, "scores", cfg.reward.model_path), {}) if cfg.reward.model_path
                  else (RuleRewardWorker, wire))
        roles: dict[str, Any] = {"actor": actor, "reward": reward}
        if self.algorithm.needs_critic:
            roles["critic"] = (CriticWorker, wire)
        if cfg.cost_model.enable:
            roles["cost"] = (RewardModelWorker, (wire, "costs", cfg.cost_model.path), {})
        groups = await self.ctx.spawn(pool, **roles)
        self.rollout = groups.actor  # the group that generates
        if split:
            rollout_pool = self._pool("rollout", "rollout.n_workers", cfg.rollout.n_workers)
            self.rollout = await self.ctx.spawn_group(rollout_pool, ActorRolloutRefWorker, wire, ("rollout",),
                                                      role="rollout")
            await self._open_bridge(groups.actor)
        self.generations = None  # generation launched ahead by the loop, for a rollout pool or staleness > 0
        if split or cfg.rollout.max_staleness > 0:
            self.generations = Generations(self.rollout, getattr(self, "loader", None),
                                           stream=split and cfg.rollout.engine == "native")
        self.roles = Roles(actor=groups.actor, rollout=self.generations or self.rollout, reward=groups.reward,
                           critic=groups.get("critic"), cost=groups.get("cost"))

    @property
    def samples_per_step(self) -> int:
        """Responses generated (and scored, and KL-measured) per step: prompts x rollout.n."""
        return self.cfg.data.batch_size * self.cfg.rollout.n

    def _pool(self, name: str, key: str, size: int) -> Any:
        try:
            return self.ctx.create_pool(name, world_size=size)
        except PlacementError as e:
            raise ConfigError(f"{key}={size} does not fit this cluster: {e}. Lower {key} or add devices "
                              "(cluster.cpu_devices on CPU nodes, or nodes)") from None

    async def _open_bridge(self, actor: Any) -> None:
        """The process group the training pool broadcasts weights to the rollout pool over."""
        train, rollout = await asyncio.gather(actor.weight_sync_digest(), self.rollout.weight_sync_digest())
        if len(set(train) | set(rollout)) != 1:
            raise ConfigError(f"the training and rollout pools hold different models ({set(train)} vs "
                              f"{set(rollout)}); both load model.path={self.cfg.model.path}")
        size = 1 + self.cfg.rollout.n_workers
        host, port = (await actor.bridge_listen(size))[0]
        await asyncio.gather(actor.bridge_join(host, port, size), self.rollout.bridge_join(host, port, size))

    async def sync_weights(self) -> float:
        """Split placement: broadcast the actor's weights (version = its update count) to the
        rollout pool, which stages them beside a running generate; returns the seconds taken."""
        if self.rollout is self.roles.actor:
            return 0.0
        mb = self.cfg.rollout.sync_bucket_mb
        push = self.roles.actor.push_weights(mb)
        receive = self.rollout.receive_weights(self.step, mb)
        pushed, _ = await asyncio.gather(push, receive)
        return max(r["timing/weight_sync_s"] for r in pushed)

    def _load_tokenizer_and_data(self) -> None:
        from transformers import AutoTokenizer

        from asyncrl.data.dataset import (
            EXPECTED_COLUMNS,
            DatasetError,
            PromptDataset,
            PromptLoader,
            load_rows,
        )
        from asyncrl.data.synthetic import disjoint_splits

        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
        dc = self.cfg.data

        def tokenised(where: str, load: Callable[[], list[dict]]) -> PromptDataset | None:
            """The prompts of `load()`'s rows (None for no rows); a bad file or row is a ConfigError."""
            try:
                rows = load()
                return (PromptDataset(rows, self.tokenizer, dc.max_prompt_len, dc.apply_chat_template,
                                      prompt_key=dc.prompt_key, answer_key=dc.answer_key) if rows else None)
            except DatasetError as e:
                raise ConfigError(f"{where}: {e}") from None

        if self.cfg.trainer.mode == "eval" and dc.val_files:  # evaluation: the held-out file only
            self.train_set = None
            val_set = tokenised(f"data.val_files={dc.val_files}", lambda: load_rows(dc.val_files))
            self.val_prompts = val_set.collate(val_set.items) if val_set else None
            return
        if dc.train_files:
            self.train_set = tokenised(f"data.train_files={dc.train_files}", lambda: load_rows(dc.train_files))
            val_set = (tokenised(f"data.val_files={dc.val_files}", lambda: load_rows(dc.val_files))
                       if dc.val_files else None)
        else:
            syn = dc.synthetic
            train, val = disjoint_splits(syn.task, syn.n_train, syn.n_val, syn.seed)
            self.train_set, val_set = tokenised("data.synthetic", lambda: train), tokenised("data.synthetic", lambda: val)
        if self.train_set is None:
            raise ConfigError(f"data.train_files={dc.train_files} holds no rows; a prompt dataset needs "
                              f"rows with {EXPECTED_COLUMNS}")
        check_round_trip(self.tokenizer, self.train_set.items[:8])
        self.val_prompts = val_set.collate(val_set.items) if val_set else None  # one batch, reused
        try:
            self.loader = PromptLoader(self.train_set, dc.batch_size, shuffle=dc.shuffle, seed=self.cfg.seed)
        except DatasetError as e:
            raise ConfigError(f"data.batch_size={dc.batch_size}: {e}") from None

    def _put(self, d: dict[str, Any], meta: dict[str, Any]) -> DistBatch:
        tensors = {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}
        rest = {k: v for k, v in d.items() if not isinstance(v, torch.Tensor)}
        return self.ctx.put(Batch(tensors, rest, meta))

    def _next_prompts(self, step: int, refill: int = 0) -> DistBatch:
        """The step's prompts; `refill` k > 0 is dynamic sampling's k-th extra batch of the step
        (its own seed and group ids). With dynamic sampling every batch is padded to
        data.max_prompt_len, so batches of one step concatenate."""
        seed = self.cfg.seed * 100003 + step
        from asyncrl.data.dataset import pad_prompts

        d = self.loader.next_batch()
        if self.cfg.algorithm.filter_groups.enable:
            d = pad_prompts(d, self.cfg.data.max_prompt_len, self.tokenizer.pad_token_id)
        if refill:  # a seed of its own, apart from every step's first batch
            digest = hashlib.blake2b(f"{self.cfg.seed}:{step}:{refill}".encode(), digest_size=4).digest()
            seed = int.from_bytes(digest, "little") >> 1
            d["uid"] = [f"{u}@{refill}" for u in d["uid"]]  # the same prompt again is another group
        return self._put(d, {"seed": seed})

    def pretrain_batch(self) -> DistBatch:
        """Prompt + ground-truth answer sequences for the Safe-RLHF pretrain (SFT) loss term."""
        bs = self.cfg.data.batch_size
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
        """Mean reward of greedy responses on the held-out prompts; per-data_source means and a
        few completions are kept for the step's log (`self.val_details`, `self.val_samples`)."""
        if self.val_prompts is None:
            return float("nan")
        rows = await self.generate_scored(n=1, greedy=True)
        self.val_details = source_means(rows)
        self.val_samples = self._decoded(sample_rows(rows, self.cfg.trainer.log_samples))
        if self.val_samples:
            log.info("%s", format_samples(self.step, self.val_samples))
        return sum(r["score"] for r in rows) / len(rows)

    async def generate_scored(self, n: int, greedy: bool) -> list[dict[str, Any]]:
        """`n` responses to each held-out prompt, scored by the reward: one dict per response
        (prompt_index, sample, data_source, ground_truth, score, and the response's token ids
        under "response_ids"; `_decoded` turns the rows that are shown or saved into text)."""
        prompts = self._put(self.val_prompts, {"greedy": greedy, "n": n})
        gen = self.roles.rollout.generate_sequences(prompts)
        scored = self.roles.reward.compute_reward(gen)
        out = await (await gen).select("responses", "response_mask", meta=False).fetch()
        scores = (await (await scored).select("scores", meta=False).fetch())["scores"].float().tolist()
        rows = []
        for i, (resp, m, score) in enumerate(zip(out["responses"], out["response_mask"].bool(), scores, strict=True)):
            p = i // n  # a prompt's n samples are consecutive rows
            rows.append({"prompt_index": p, "sample": i % n, "data_source": self.val_prompts["data_source"][p],
                         "ground_truth": self.val_prompts["ground_truth"][p], "response_ids": resp[m].tolist(),
                         "score": score})
        return rows

    def _decoded(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`rows` with the templated prompt and the response as text (token ids dropped)."""
        ids, mask = self.val_prompts["input_ids"], self.val_prompts["attention_mask"].bool()
        out = []
        for r in rows:
            p = r["prompt_index"]
            text = {"prompt": self.tokenizer.decode(ids[p][mask[p]].tolist()),
                    "response": self.tokenizer.decode(r["response_ids"], skip_special_tokens=True)}
            out.append({**{k: v for k, v in r.items() if k != "response_ids"}, **text})
        return out

    async def evaluate_only(self) -> dict[str, Any]:
        """trainer.mode=eval: rollout.n samples per held-out prompt, pass@k and mean@n per
        data_source, every sample written to `eval-<time>.jsonl`."""
        if self.val_prompts is None:
            raise ConfigError("trainer.mode=eval needs held-out prompts: set data.val_files (or use the "
                              "synthetic data with data.synthetic.n_val > 0)")
        cfg, t0 = self.cfg, time.monotonic()
        greedy = cfg.rollout.temperature == 0
        rows = await self.generate_scored(n=cfg.rollout.n, greedy=greedy)
        result = pass_at_ks(rows, cfg.evaluation.ks, cfg.evaluation.correct_at)
        log.info("%s", format_samples(0, self._decoded(sample_rows(rows, cfg.trainer.log_samples))))
        summary: dict[str, Any] = {"mode": "eval", "model": cfg.model.path, "samples_per_prompt": cfg.rollout.n,
                                   "temperature": cfg.rollout.temperature, "correct_at": cfg.evaluation.correct_at}
        if cfg.evaluation.write_generations:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / f"eval-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
            with path.open("x") as f:  # a new file of our own, never over another
                for r in self._decoded(rows):
                    f.write(json.dumps(r, default=str) + "\n")
            summary["generations"] = str(path)
        for key, value in result.items():
            log.info("%s = %.4f", key, value)
        return {**summary, **{k: round(v, 4) for k, v in result.items()}, "wall_s": round(time.monotonic() - t0, 1)}

    # checkpoints ----------------------------------------------------------------------------------
    async def save(self) -> Path:
        path = self.ckpt_dir / f"step_{self.step}"
        if path.exists():  # an incomplete save of this run's own step (we only name step_N dirs)
            shutil.rmtree(path)
        path.mkdir(parents=True)
        hf = (await self.roles.actor.save_checkpoint(str(path)))[0]
        if self.roles.critic is not None:
            await self.roles.critic.save_checkpoint(str(path))
        loader = self.generations.loader_state(self.step) if self.generations else self.loader.state_dict()
        state = {"step": self.step, "loader": loader, "history": self.history,
                 "controllers": self.ctl.state_dict(), "val": self.val_log, "hf": hf}
        (path / "trainer_state.json").write_text(json.dumps(state))
        (path / DONE_MARKER).write_text("")  # last: a checkpoint without it is incomplete
        older = [p for p in complete_checkpoints(self.out_dir) if p != path]
        for old in older[:max(0, len(older) - (self.cfg.trainer.keep_checkpoints - 1))]:
            shutil.rmtree(old, ignore_errors=True)
        return Path(hf)

    async def load(self, path: Path) -> None:
        """Restore from `path`, a complete checkpoint (`RunDir.claim` checked it)."""
        await self.roles.actor.load_checkpoint(str(path))
        if self.roles.critic is not None:
            await self.roles.critic.load_checkpoint(str(path))
        state = json.loads((path / "trainer_state.json").read_text())
        self.step, self.history, self.val_log = state["step"], state["history"], state["val"]
        self.loader.load_state_dict(state["loader"])
        self.ctl.load_state_dict(state["controllers"])
        log.info("resumed from %s at step %d", path, self.step)

    # the loop -------------------------------------------------------------------------------------
    async def fit(self, start: Path | None) -> dict[str, Any]:
        """Train from `start` (a checkpoint, or None for step 0) to trainer.total_steps."""
        from asyncrl.metrics import MetricsWriter

        tc = self.cfg.trainer
        t_start = time.monotonic()
        if start is not None:
            await self.load(start)
        await self.sync_weights()  # a separate rollout pool starts from the actor's weights
        resumed = self.step > 0
        run = {"project": tc.project, "name": self.cfg.job.name, "config": to_dict(self.cfg)}
        writer = await asyncio.to_thread(MetricsWriter, self.out_dir, tc.loggers,
                                         self.step if resumed else None, run)
        try:
            return await self._fit(writer, resumed, t_start)
        finally:
            await asyncio.to_thread(writer.close)  # wandb's finish waits for its files

    async def _fit(self, writer: Any, resumed: bool, t_start: float) -> dict[str, Any]:
        from asyncrl.metrics import progress

        tc = self.cfg.trainer
        if resumed:  # metrics.jsonl up to the checkpoint; TensorBoard and wandb already have these steps
            writer.write(int(self.val_log[0][0]), {"val/reward": self.val_log[0][1]}, mirror=False)
            for row in self.history:
                writer.write(int(row["step"]), {k: v for k, v in row.items() if k != "step"}, mirror=False)
        else:
            self.val_log.append([self.step, await self.evaluate()])
            writer.write(self.step, {"val/reward": self.val_log[-1][1], **self.val_details})
            writer.write_samples(self.step, self.val_samples)
            log.info("step %d: held-out reward %.3f", self.step, self.val_log[-1][1])
        tokens, step_time = 0.0, 0.0
        bar = progress(tc.total_steps, self.step, desc=self.cfg.algorithm.name, console="console" in tc.loggers)
        try:  # the bar (and its logging redirect) ends however the loop does
            k = self.cfg.rollout.max_staleness
            t0 = time.monotonic()
            while self.step < tc.total_steps:
                if self.generations:
                    # batches step .. step + k may be generated by the current version (this one's)
                    for i in range(self.step, min(tc.total_steps, self.step + k + 1)):
                        self.generations.launch(i, self._next_prompts, self.step)
                    prompts = self.generations.prompts(self.step)
                else:
                    prompts = self._next_prompts(self.step)
                data = {}
                if self.algorithm.needs_pretrain and self.cfg.actor.pretrain_coef > 0:
                    data["pretrain"] = self.pretrain_batch()
                if self.cfg.algorithm.filter_groups.enable:
                    data["refill"] = functools.partial(self._next_prompts, self.step)
                metrics = await self.algorithm.step(self.roles, self.cfg, self.ctl, prompts, **data)
                if self.generations:
                    metrics.update(self.generations.done(self.step))
                self.step += 1
                metrics["timing/weight_sync_s"] = await self.sync_weights()
                t1 = time.monotonic()
                dt, t0 = t1 - t0, t1
                metrics.update(self.ctl.update(metrics, self.samples_per_step))
                tokens += metrics.get("response/tokens", 0.0)
                step_time += dt
                busy = sum(metrics.get(f"timing/{p}_s", 0.0) for p in PHASES)
                metrics.update({"timing/step_s": dt, "timing/overhead_s": max(0.0, dt - busy),
                                "perf/tokens_per_s": metrics.get("response/tokens", 0.0) / dt})
                if self.step % tc.eval_every == 0 or self.step == tc.total_steps:
                    self.val_log.append([self.step, await self.evaluate()])
                    metrics["val/reward"] = self.val_log[-1][1]
                    metrics.update(self.val_details)
                    writer.write_samples(self.step, self.val_samples)
                bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v) and k != "val/reward"]
                if bad:
                    log.warning("step %d: non-finite metrics %s", self.step, bad)
                self.history.append({"step": self.step, **metrics})
                writer.write(self.step, metrics)
                diverged = [k for k in bad if "loss" in k or "grad_norm" in k]
                if diverged:  # the weights are no longer finite: stop before a checkpoint keeps them
                    raise NonFiniteLossError(
                        f"training diverged at step {self.step}: {', '.join(sorted(diverged))} not finite, so the "
                        f"weights are no longer usable and nothing was saved after step "
                        f"{self.step - self.step % tc.save_every}. Try a lower actor.optim.lr (now "
                        f"{self.cfg.actor.optim.lr:g}), actor.optim.grad_clip > 0 (now {self.cfg.actor.optim.grad_clip:g}), "
                        f"and check the rewards' scale in {self.out_dir / 'metrics.jsonl'}; the run resumes from its "
                        "last checkpoint")
                bar.update(metrics)
                if self.step % tc.save_every == 0 and self.step < tc.total_steps:
                    await self.save()
                t0 = time.monotonic()  # evaluation and checkpoints are not part of a step
        finally:
            bar.close()
        hf = await self.save()
        await asyncio.to_thread(writer.plot, self.history, self.val_log, self.out_dir / "reward_curve.png",
                                f"{self.cfg.job.name} ({self.cfg.algorithm.name}): {self.out_dir}")
        return {"algorithm": self.cfg.algorithm.name, "steps": self.step,
                "val_reward_start": round(self.val_log[0][1], 4), "val_reward_end": round(self.val_log[-1][1], 4),
                "wall_s": round(time.monotonic() - t_start, 1),
                "tokens_per_s": round(tokens / step_time, 1) if step_time else 0.0,
                "checkpoint": str(hf), "metrics": str(self.out_dir / "metrics.jsonl")}


async def main(ctx: Any, on_setup: Callable[[Trainer], None] | None = None) -> dict[str, Any]:
    """The job: check the inputs, claim the run directory, set up the workers (then `on_setup`,
    e.g. a test's instrumentation), train."""
    cfg = rl_config(ctx.cfg)
    # model building and file checks block: keep them off the event loop (heartbeats)
    cfg.model.path = await asyncio.to_thread(resolve_model, cfg.model)
    await asyncio.to_thread(check_inputs, cfg)
    if cfg.trainer.mode == "eval":  # no run directory to claim: nothing trains, nothing resumes
        trainer = Trainer(ctx, cfg)
        await trainer.setup()
        try:
            return await trainer.evaluate_only()
        except WorkerCallError as e:
            raise reward_fault(e, 0) or e from None
    run = RunDir(cfg)
    try:
        start = await asyncio.to_thread(run.claim)
        if start is not None:
            done_at = json.loads((start / "trainer_state.json").read_text())["step"]
            if done_at >= cfg.trainer.total_steps:
                msg = f"run already complete at step {done_at} (use a new trainer.output_dir or trainer.resume=none)"
                log.warning("%s: %s", cfg.trainer.output_dir, msg)
                return {"status": "already_complete", "steps": done_at, "message": msg,
                        "checkpoint": str(start / "actor" / "hf")}
        run.record_config()
        trainer = Trainer(ctx, cfg)
        await trainer.setup()
        if on_setup is not None:
            on_setup(trainer)
        try:
            return await trainer.fit(start)
        except WorkerCallError as e:
            fault = reward_fault(e, trainer.step)
            if fault is None:
                raise
            raise fault from None
    finally:
        run.release()


def reward_fault(e: WorkerCallError, step: int) -> NonFiniteRewardError | None:
    """A worker's NaN-reward error as the driver's own, without the worker's traceback (the
    reward function is at fault, not the framework); None for any other error."""
    if e.remote_type.rpartition(".")[2] != NonFiniteRewardError.__name__:
        return None
    return NonFiniteRewardError(f"{e.remote_message} (after {step} training steps; {e.group}.{e.method} "
                                f"on rank {e.rank})")
