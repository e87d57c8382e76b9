"""The RL trainer job: `asyncrl-launch --config-name grpo` runs `main(ctx)`.

It checks the model and the run directory, loads prompts, places the workers, and runs the
configured algorithm's step (`asyncrl.algorithms.registry`) with evaluation, progress, metrics
(`trainer.loggers`: JSONL, console, TensorBoard, wandb; a reward-curve PNG), per-phase timings,
checkpoints and resume around it.
The final line printed by `asyncrl-launch` is the JSON summary this returns.

A run directory (`trainer.output_dir`) holds what this program wrote and nothing else is touched:
`config.yaml` (the composed config), `metrics.jsonl`, `samples.jsonl`, `tensorboard/`, `wandb/`,
`reward_curve.png`, `checkpoints/step_N/`, `logs/`, `trace/` (trainer.trace), Hydra's `.hydra/`, the run's `.lock`, and
`eval-<time>.jsonl` from evaluations (`asyncrl.rundir` lists them).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.algorithms.controllers import Controllers
from asyncrl.algorithms.registry import algorithms
from asyncrl.algorithms.roles import Roles
from asyncrl.config import RLConfig, rl_config, to_dict
from asyncrl.engines import rollout_engine
from asyncrl.errors import TrainingError
from asyncrl.evaluation import Evaluator
from asyncrl.failover import StepGuard
from asyncrl.models.resolve import resolve_model
from asyncrl.preflight import check_inputs
from asyncrl.rewards import NonFiniteRewardError
from asyncrl.roles.actor import ActorRolloutRefWorker
from asyncrl.roles.critic import CriticWorker
from asyncrl.roles.reward import RewardModelWorker, RuleRewardWorker
from asyncrl.roles.teacher import TeacherWorker
from asyncrl.rollout.ahead import Generations
from asyncrl.rollout.elastic import ElasticRollout, Ledger, UpdateRecorder
from asyncrl.run_data import RunData
from asyncrl.rundir import DONE_MARKER, RunDir, complete_checkpoints
from asyncrl.single_controller.group import WorkerCallError
from asyncrl.single_controller.trace import Recording
from asyncrl.train.weight_sync import bridge_plan
from daemons.errors import PlacementError, WorkerDiedError
from daemons.heap import settle
from transport import trace
from transport.checks import ConfigError
from transport.dtypes import torch_dtype

log = logging.getLogger("asyncrl.trainer")
GIB = float(1 << 30)


class NonFiniteLossError(TrainingError, ValueError):
    """A training loss or gradient norm became NaN or infinite: the run stops instead of
    training (and checkpointing) non-finite weights."""


# the worker-side phases of a step; on one colocated pool they run one after another
PHASES = ("gen", "sync", "weight_sync", "reward", "reward_model", "old_log_prob", "ref_log_prob", "values", "advantage",
          "update_actor", "update_critic", "update_pretrain")


def _batch_bytes(batch: Any) -> int:
    """The bytes of a stored batch's columns, from its refs (nothing pulled)."""
    return sum(math.prod(shape) * torch_dtype(dtype).itemsize
               for ref in batch.refs().values() for dtype, shape in ref.column_specs.values())


@dataclass
class SyncRecord:
    """Split placement: the last weight sync between the pools, and the loop's waits for syncs."""

    bytes: int = 0  # what one sync carries (LoRA: the adapters only)
    wire_bytes: int = 0  # what its training ranks sent (rollout.weight_sync=delta: the deltas)
    max_rank_share: float = 0.0  # the most one training rank sent of it (1/N + rounding when source-parallel)
    seconds: float = 0.0  # its own seconds, from its start to the rollout pool holding it
    waited_s: float = 0.0  # the seconds the loop has waited for syncs
    delta_ready: bool = False  # the rollout pool holds the version sent last: the next may go as a delta
    delta_fallbacks: int = 0  # deltas that did not rebuild on a rollout rank, synced again in full


class Trainer:
    """Drives one RL run: worker groups, controllers, data, the loop and its bookkeeping."""

    def __init__(self, ctx: Any, cfg: RLConfig, restarts: int = 0) -> None:
        self.ctx, self.cfg = ctx, cfg
        self.restarts = restarts  # failovers before this trainer (trainer.max_restarts)
        self.algorithm = algorithms()[cfg.algorithm.name]
        self.out_dir = Path(cfg.trainer.output_dir)
        self.ctl = Controllers.from_config(cfg.algorithm)
        self.data = RunData(ctx, cfg)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.val_log: list[list[float]] = []
        self.tokens, self.step_time = 0.0, 0.0  # generated tokens and seconds of the steps run here
        # the step it was read after, and per rank the bytes pulled by stage so far
        self.pulled: tuple[int, list[dict[str, list[int]]] | None] = (0, None)
        self._saving: tuple[Path, dict[str, Any]] | None = None  # a save whose marker waits (async_save)
        self.synced = SyncRecord()
        self._ended: float | None = None  # when the last step ended, if the next one's generation was sent in it

    @property
    def ckpt_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    # the loop -------------------------------------------------------------------------------------
    async def fit(self, start: Path | None) -> dict[str, Any]:
        """Train from `start` (a checkpoint, or None for step 0) to trainer.total_steps."""
        from asyncrl.metrics import MetricsWriter, progress

        tc, t_start = self.cfg.trainer, time.monotonic()
        if start is not None:
            await self.load(start)
        await self.sync_weights()  # a separate rollout pool starts from the actor's weights
        await self._synced()
        resumed, self.pulled = self.step > 0, (self.step, None)
        if isinstance(self.rollout, ElasticRollout):  # its ledger of what each step trained
            self.rollout.ledger.resume(self.step)
        run = {"project": tc.project, "name": self.cfg.job.name, "config": await asyncio.to_thread(to_dict, self.cfg)}
        writer = await asyncio.to_thread(MetricsWriter, self.out_dir, tc.loggers, self.step if resumed else None, run)
        bar = None
        try:  # the loggers and the bar (with its logging redirect) end however the loop does
            if resumed:
                self._replay(writer)
            else:
                writer.write(0, await self._evaluate(writer))
                log.info("step 0: held-out reward %.3f", self.val_log[-1][1])
            bar = progress(tc.total_steps, self.step, desc=self.cfg.algorithm.name, console="console" in tc.loggers)
            # what setup built lives as long as the run: kept out of the collector's full passes
            # (each took ~200 ms on the quickstart's driver, about one per 55 steps); the young
            # garbage collected first, not the whole heap (a daemon's, after a few jobs, blocked
            # its loop for a second), and all of it unfrozen when the run ends (below)
            settle(generation=1)
            guard = StepGuard(self) if tc.failover.enable else None  # a step a rank died in runs again
            while self.step < tc.total_steps:
                metrics = await (guard.run_step() if guard else self.train_step())
                if self.step % tc.eval_every == 0 or self.step == tc.total_steps:
                    metrics.update(await self._evaluate(writer))
                self._record(writer, metrics)
                bar.update(metrics)
                await self.complete_save(only_if_written=True)
                if self.step % tc.save_every == 0 and self.step < tc.total_steps:
                    await self.save(wait=False)
            return {**await self._finish(writer, t_start), **({"failovers": guard.events} if guard else {})}
        finally:
            gc.unfreeze()  # a daemon runs job after job: this run's objects collectable again
            if bar is not None:
                bar.close()
            if isinstance(self.rollout, ElasticRollout):
                self.rollout.close()
            await asyncio.to_thread(writer.close)  # wandb's finish waits for its files

    async def train_step(self) -> dict[str, float]:
        """One step of the algorithm on the next prompts, the weights synced after it; its metrics
        (a step listed in trainer.trace also writes its trace)."""
        step = self.step + 1
        if step not in self.cfg.trainer.trace:
            with trace.span(f"step {step}", "step"):
                return await self._train_step(step)
        recording = Recording(self.ctx.process_sets.values())
        await recording.start()
        try:
            with trace.span(f"step {step}", "step"):
                metrics = await self._train_step(step)
        except BaseException:
            trace.collect()  # the driver stops recording; the step's error is what the run reports
            raise
        path = self.out_dir / "trace" / f"step_{step}.json"
        written = await recording.write(path, {"step": step, "step_s": metrics["timing/step_s"]})
        log.info("step %d: trace written to %s (%s events; open it in ui.perfetto.dev)", step, path,
                 sum(written["events"].values()))
        return metrics

    async def _train_step(self, step: int) -> dict[str, float]:
        # launched in the last step, this step's generation may have run since that step ended:
        # the step is the loop's period (every step's bookkeeping in it)
        t0, waited, launching = self._ended or time.monotonic(), self.synced.waited_s, None
        self._ended = None
        if self.generations:
            launching = await self._launch_ahead()
            prompts = self.generations.prompts(self.step)
        else:
            prompts = self.data.next_prompts(self.step)
        data = {}
        if self.algorithm.needs_pretrain and self.cfg.actor.pretrain_coef > 0:
            data["pretrain"] = self.data.pretrain_batch(self.step)
        if self.cfg.algorithm.filter_groups.enable:
            data["refill"] = functools.partial(self.data.next_prompts, self.step)
        early = self._launch_next_early(step)
        try:
            metrics = await self.algorithm.step(self.roles, self.cfg, self.ctl, prompts, **data)
        except BaseException:
            if launching is not None:
                launching.cancel()
            if self.generations is not None and self.generations.behind:
                self.generations.drop()
            raise
        finally:
            if early:
                self.roles.actor.after_issue.pop(self.algorithm.last_update, None)
        if isinstance(self.roles.actor, UpdateRecorder):  # the rows the step's updates consumed
            await self.rollout.ledger.record(self.step + 1, prompts, self.roles.actor.take())
            metrics.update(self.rollout.metrics())
        if launching is not None:
            await launching
        metrics.update(self.generations.done(self.step) if self.generations else {"async/staleness": 0.0})
        self.step += 1
        # split: the broadcast between pools (its wait: what this step paid of it); colocated: the
        # reshard into generation weights
        await self.sync_weights()
        if self.cfg.trainer.placement == "split":
            metrics["timing/weight_sync_s"] = self.synced.waited_s - waited
            metrics["perf/weight_sync_s"] = self.synced.seconds  # the last sync's own time, overlapped or not
            metrics["perf/weight_sync_mb"] = self.synced.wire_bytes / 2**20  # on the wire, from every training rank
            metrics["perf/weight_sync_max_rank_share"] = self.synced.max_rank_share
            if self.cfg.rollout.weight_sync == "delta":
                metrics["perf/weight_sync_delta_ratio"] = self.synced.wire_bytes / max(1, self.synced.bytes)
                metrics["perf/weight_sync_fallbacks"] = float(self.synced.delta_fallbacks)
        else:
            metrics["timing/weight_sync_s"] = metrics.get("timing/sync_s", 0.0)
        if step % self.cfg.trainer.stats_every == 0 or step == 1:
            with trace.span("memory and bytes pulled", "bookkeeping"):
                metrics.update(await self._memory())
        ended = time.monotonic()
        self._ended = ended if early and self.step in self.generations.ahead else None
        return self._timed(metrics, ended - t0)

    def _launch_next_early(self, step: int) -> bool:
        """Arm sending the next step's generation right behind this step's last update
        (rollout.launch_next_early): not before a step that evaluates, saves, reads memory or
        is traced, so those see their own step."""
        tc, last = self.cfg.trainer, self.algorithm.last_update
        if (not self.generations or not self.generations.behind or last is None or step >= tc.total_steps
                or step % tc.eval_every == 0 or step % tc.save_every == 0 or step in tc.trace or step + 1 in tc.trace
                or step % tc.stats_every == 0 or step == 1):
            return False
        nxt = self.step + 1
        self.roles.actor.after_issue[last] = functools.partial(self.generations.launch, nxt, self.data.next_prompts, nxt)
        return True

    async def _launch_ahead(self) -> asyncio.Future | None:
        """Launch batches step .. step + k (each may be generated by a version >= its step - k);
        the last needs the version whose sync may still be in flight: with k > 0 it is launched
        once that arrived, by the future returned, while this step trains."""
        k = self.cfg.rollout.max_staleness
        for i in range(self.step, min(self.cfg.trainer.total_steps, self.step + k + 1)):
            if i == self.step + k and self._sync is not None:
                if k:
                    return asyncio.ensure_future(self._launch_synced(i, self.step))
                await self._synced()
            self.generations.launch(i, self.data.next_prompts, self.step)
        return None

    async def _memory(self) -> dict[str, float]:
        """The actor's largest rank so far: peak resident memory, and on a GPU torch's peak
        allocation (GiB); and per stage, the most any of its processes pulled from other ranks'
        stores per step since the last time this was asked (`perf/<stage>_cross_rank_mb`: rows
        that had to move). Asked every trainer.stats_every steps."""
        stats, pulled = await asyncio.gather(self.roles.actor.memory_stats(), self.roles.actor.pulled_bytes())
        out = {"perf/peak_rss_gib": max(s["peak_rss"] for s in stats) / GIB}
        (at, before), self.pulled = self.pulled, (self.step, pulled)
        steps = max(1, self.step - at)
        for stage in sorted({k for p in pulled for k in p}):
            moved = [p.get(stage, [0, 0])[1] - (b.get(stage, [0, 0])[1] if b else 0)
                     for p, b in zip(pulled, before or [None] * len(pulled), strict=True)]
            out[f"perf/{stage}_cross_rank_mb"] = max(moved) / steps / 2**20
        cuda = [s["cuda_peak_allocated"] for s in stats if "cuda_peak_allocated" in s]
        if cuda:
            out["perf/max_memory_allocated_gib"] = max(cuda) / GIB
        return out

    def _timed(self, metrics: dict[str, float], dt: float) -> dict[str, float]:
        """The controllers' update and the step's time: total, outside worker phases, tokens/s."""
        metrics.update(self.ctl.update(metrics, self.samples_per_step))
        self.tokens += metrics.get("response/tokens", 0.0)
        self.step_time += dt
        # colocated, weight_sync_s repeats sync_s (the reshard inside generate): counted once
        phases = PHASES if self.cfg.trainer.placement == "split" else [p for p in PHASES if p != "weight_sync"]
        busy = sum(metrics.get(f"timing/{p}_s", 0.0) for p in phases)
        metrics.update({"timing/step_s": dt, "timing/overhead_s": max(0.0, dt - busy),
                        "perf/tokens_per_s": metrics.get("response/tokens", 0.0) / dt,
                        "trainer/restarts": float(self.restarts)})
        return metrics

    async def _evaluate(self, writer: Any) -> dict[str, float]:
        """Evaluate at this step: logged, its completions written; the metrics to add."""
        await self._synced()  # a rollout pool of its own evaluates this step's weights
        self.val_log.append([self.step, await self.evaluator.evaluate(self.step)])
        metrics = {"val/reward": self.val_log[-1][1], **self.evaluator.details}
        writer.write_samples(self.step, self.evaluator.samples)
        return metrics

    def _replay(self, writer: Any) -> None:
        """Resumed: metrics.jsonl up to the checkpoint (TensorBoard and wandb have these steps)."""
        writer.write(int(self.val_log[0][0]), {"val/reward": self.val_log[0][1]}, mirror=False)
        for row in self.history:
            writer.write(int(row["step"]), {k: v for k, v in row.items() if k != "step"}, mirror=False)

    def _record(self, writer: Any, metrics: dict[str, float]) -> None:
        """Keep and write the step's metrics; stop (NonFiniteLossError) once a loss is not finite."""
        bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v) and k != "val/reward"]
        if bad:
            log.warning("step %d: non-finite metrics %s", self.step, bad)
        self.history.append({"step": self.step, **metrics})
        writer.write(self.step, metrics)
        diverged = [k for k in bad if "loss" in k or "grad_norm" in k]
        if diverged:  # the weights are no longer finite: stop before a checkpoint keeps them
            raise NonFiniteLossError(self._divergence(diverged))

    def _divergence(self, keys: list[str]) -> str:
        cfg, saved = self.cfg, self.step - self.step % self.cfg.trainer.save_every
        return (f"training diverged at step {self.step}: {', '.join(sorted(keys))} not finite, so the weights are "
                f"no longer usable and nothing was saved after step {saved}. Try a lower actor.optim.lr (now "
                f"{cfg.actor.optim.lr:g}), actor.optim.grad_clip > 0 (now {cfg.actor.optim.grad_clip:g}), and check "
                f"the rewards' scale in {self.out_dir / 'metrics.jsonl'}; the run resumes from its last checkpoint")

    async def _finish(self, writer: Any, t_start: float) -> dict[str, Any]:
        """The last checkpoint, the reward curve, and the run's summary."""
        await self._synced()
        hf = await self.save()
        await asyncio.to_thread(writer.plot, self.history, self.val_log, self.out_dir / "reward_curve.png",
                                f"{self.cfg.job.name} ({self.cfg.algorithm.name}): {self.out_dir}")
        return {"algorithm": self.cfg.algorithm.name, "steps": self.step, "restarts": self.restarts,
                "val_reward_start": round(self.val_log[0][1], 4), "val_reward_end": round(self.val_log[-1][1], 4),
                "wall_s": round(time.monotonic() - t_start, 1),
                "tokens_per_s": round(self.tokens / self.step_time, 1) if self.step_time else 0.0,
                "checkpoint": str(hf), "metrics": str(self.out_dir / "metrics.jsonl")}

    # setup ----------------------------------------------------------------------------------------
    async def setup(self) -> None:
        cfg = self.cfg
        await asyncio.to_thread(self.data.load)  # tokenization blocks: off the event loop (heartbeats)
        split = cfg.trainer.placement == "split"
        pool = self._pool("actor_ref" if split else "actor_rollout_ref", "trainer.n_workers", cfg.trainer.n_workers)
        wire = await asyncio.to_thread(to_dict, cfg)  # workers rebuild the typed config from this plain dict
        actor = (ActorRolloutRefWorker, (wire, ("actor", "ref")), {}) if split else (ActorRolloutRefWorker, wire)
        reward = ((RewardModelWorker, (wire, "scores", cfg.reward.model_path), {}) if cfg.reward.model_path
                  else (RuleRewardWorker, wire))
        roles: dict[str, Any] = {"actor": actor, "reward": reward}
        if self.algorithm.needs_critic:
            roles["critic"] = (CriticWorker, wire)
        if cfg.cost_model.enable:
            roles["cost"] = (RewardModelWorker, (wire, "costs", cfg.cost_model.path), {})
        if self.algorithm.needs_teacher and not cfg.teacher.n_workers:  # colocated with the actor
            roles["teacher"] = (TeacherWorker, wire)
        groups = await self.ctx.spawn(pool, **roles)
        teacher = groups.get("teacher")
        if self.algorithm.needs_teacher and cfg.teacher.n_workers:  # a pool of its own
            teacher = await self.ctx.spawn_group(self._pool("teacher", "teacher.n_workers", cfg.teacher.n_workers),
                                                 TeacherWorker, wire, role="teacher")
        self.rollout = groups.actor  # the group that generates
        if split and cfg.rollout.elastic:  # one group per rollout worker, weights pulled by version
            self.rollout = ElasticRollout(self.ctx, functools.partial(self._rollout_worker, wire), groups.actor.hold_rows,
                                          cfg.rollout.min_workers, cfg.rollout.min_workers_wait_s)
            self.rollout.rows = (rows := await groups.actor.source_rows()) and (rows if all(r is not None for r in rows)
                                                                                 else None)
            await self.rollout.start(cfg.rollout.n_workers)
            self.rollout.ledger = Ledger(self.out_dir / "ledger.jsonl")
        elif split:
            rollout_pool = self._pool("rollout", "rollout.n_workers", cfg.rollout.n_workers)
            self.rollout = await self.ctx.spawn_group(rollout_pool, ActorRolloutRefWorker, wire, ("rollout",),
                                                      role="rollout")
            await self._open_bridge(groups.actor)
        self.generations = None  # generation launched ahead by the loop: a rollout pool, or staleness > 0
        if split or cfg.rollout.max_staleness > 0:
            stream = split and rollout_engine(cfg.rollout.engine).continuous_batching
            self.generations = Generations(self.rollout, self.data.loader, stream=stream)
        elif cfg.rollout.launch_next_early and self.algorithm.last_update and not cfg.algorithm.filter_groups.enable:
            self.generations = Generations(self.rollout, self.data.loader, stream=False, behind=True)
        actor = UpdateRecorder(groups.actor) if isinstance(self.rollout, ElasticRollout) else groups.actor
        self.roles = Roles(actor=actor, rollout=self.generations or self.rollout, reward=groups.reward,
                           critic=groups.get("critic"), cost=groups.get("cost"), teacher=teacher)
        self.evaluator = Evaluator(cfg, self.data, self.roles)

    async def _rollout_worker(self, wire: dict, name: str, per_node: list[int] | None) -> tuple[Any, str]:
        """An elastic pool's rollout worker: a group of one on a device of its own."""
        pool = (self.ctx.create_pool(name, per_node=per_node) if per_node is not None
                else self._pool(name, "rollout.n_workers", 1))
        group = await self.ctx.spawn_group(pool, ActorRolloutRefWorker, wire, ("rollout",), role=name)
        return group, pool.placements[0][0]

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
        nodes, train_nodes = ([h.info.node_id for h in group.handles] for group in (self.rollout, actor))
        size = 1 + len(bridge_plan(nodes, set(train_nodes))[0])  # one receiver per node it relays to
        rows = await actor.source_rows()  # each training rank's shard rows: source-parallel sync
        rows = rows if all(r is not None for r in rows) else None
        host, port = (await actor.bridge_listen(size))[0]
        await asyncio.gather(*(g.bridge_join(host, port, rows, nodes, train_nodes) for g in (actor, self.rollout)))

    _sync: asyncio.Future | None = None  # a sync in flight (overlap_weight_sync)

    async def sync_weights(self) -> None:
        """Split placement: broadcast the actor's weights (version = its update count) to the
        rollout pool, which stages them beside a running generate. Overlapped (trainer.
        overlap_weight_sync with rollout.max_staleness >= 1): the training ranks return once their
        sends are queued and the sync finishes beside the next step, which launches the batch
        that needs this version once it arrived (`_synced`)."""
        if self.cfg.trainer.placement != "split":  # colocated: generation uses the actor's own weights
            return
        await self._synced()  # versions arrive in order
        overlap = self.cfg.trainer.overlap_weight_sync and self.cfg.rollout.max_staleness > 0
        self._sync = asyncio.ensure_future(self._sync_run(self.step, overlap))
        if not overlap:
            await self._synced()

    async def _sync_run(self, version: int, overlap: bool) -> None:
        t0, mb = time.monotonic(), self.cfg.rollout.sync_bucket_mb
        if isinstance(self.rollout, ElasticRollout):  # published in the training stores, pulled from there
            pieces = await self.roles.actor.publish_weights()
            deltas = await self.roles.actor.publish_deltas(version) if self.cfg.rollout.weight_sync == "delta" else None
            await self.rollout.sync(version, pieces, deltas)
            self.synced.seconds = time.monotonic() - t0
            self.synced.wire_bytes = self.rollout.pulled_bytes  # every live worker's pull
            self.synced.bytes = sum(_batch_bytes(p) for p in pieces) * len(self.rollout.members)
            self.synced.delta_fallbacks = self.rollout.delta_fallbacks
            return
        delta = self.cfg.rollout.weight_sync == "delta" and self.synced.delta_ready
        self.synced.delta_ready = False
        pushed, received = await asyncio.gather(self.roles.actor.push_weights(mb, overlap, delta, version),
                                                self.rollout.receive_weights(version, mb, delta),
                                                return_exceptions=True)
        if delta and isinstance(received, WorkerCallError) and received.remote_type.endswith("DeltaMismatchError"):
            self.synced.delta_fallbacks += 1
            log.warning("weight sync of version %d: %s; sending it in full", version, received.remote_message)
            pushed, received = await asyncio.gather(self.roles.actor.push_weights(mb, overlap, False, version),
                                                    self.rollout.receive_weights(version, mb, False),
                                                    return_exceptions=True)
        for outcome in (pushed, received):
            if isinstance(outcome, BaseException):
                raise outcome
        self.synced.delta_ready = True
        self.synced.seconds = time.monotonic() - t0
        self.synced.bytes = int(pushed[0]["bytes"])
        self.synced.wire_bytes = int(sum(r["sent_bytes"] for r in pushed))
        self.synced.max_rank_share = max(r["sent_bytes"] for r in pushed) / max(1, self.synced.wire_bytes)

    async def _synced(self, counted: bool = True) -> None:
        """Wait for the sync in flight, if any (the loop's own waits counted in `synced.waited_s`)."""
        if self._sync is None:
            return
        t0 = time.monotonic()
        try:
            await asyncio.shield(self._sync)  # a cancelled waiter leaves the sync to finish
        finally:
            self._sync = None
            self.synced.waited_s += time.monotonic() - t0 if counted else 0.0

    async def _launch_synced(self, step: int, version: int) -> None:
        """Launch batch `step`'s generation once the version in flight is on the rollout pool
        (beside the step that trains meanwhile: not a wait of the loop's)."""
        await self._synced(counted=False)
        self.generations.launch(step, self.data.next_prompts, version)

    # checkpoints ----------------------------------------------------------------------------------
    async def save(self, wait: bool = True) -> Path:
        """Checkpoint this step; with trainer.async_save and not `wait`, the sharded state is
        still being written when this returns and the checkpoint is marked complete later."""
        await self.complete_save()
        path = self.ckpt_dir / f"step_{self.step}"
        if path.exists():  # an incomplete save of this run's own step (we only name step_N dirs)
            shutil.rmtree(path)
        path.mkdir(parents=True)
        hf = (await self.roles.actor.save_checkpoint(str(path)))[0]
        if self.roles.critic is not None:
            await self.roles.critic.save_checkpoint(str(path))
        loader = self.generations.loader_state(self.step) if self.generations else self.data.loader.state_dict()
        state = {"step": self.step, "loader": loader, "history": self.history,
                 "controllers": self.ctl.state_dict(), "val": self.val_log, "hf": hf}
        self._saving = (path, state)
        if wait or not self.cfg.trainer.async_save:
            await self.complete_save()
        return Path(hf)

    async def complete_save(self, only_if_written: bool = False) -> None:
        """Wait for the last save's background writes (`only_if_written`: not at all, unless they
        are done), then mark it complete (the marker last: a checkpoint without it is
        incomplete) and drop the oldest beyond trainer.keep_checkpoints."""
        if self._saving is None:
            return
        if only_if_written and await self._still_writing():
            return
        (path, state), self._saving = self._saving, None
        waited = max(await self.roles.actor.finish_checkpoint())
        if self.roles.critic is not None:
            waited = max(waited, *await self.roles.critic.finish_checkpoint())
        if waited:
            log.info("checkpoint %s: waited %.1f s for its background write", path, waited)
        (path / "trainer_state.json").write_text(json.dumps(state))
        (path / DONE_MARKER).write_text("")
        older = [p for p in complete_checkpoints(self.out_dir) if p != path]
        for old in older[:max(0, len(older) - (self.cfg.trainer.keep_checkpoints - 1))]:
            shutil.rmtree(old, ignore_errors=True)

    async def _still_writing(self) -> bool:
        pending = await self.roles.actor.checkpoint_pending()
        if self.roles.critic is not None:
            pending += await self.roles.critic.checkpoint_pending()
        return any(pending)

    async def load(self, path: Path) -> None:
        """Restore from `path`, a complete checkpoint (`RunDir.claim` checked it)."""
        await self.roles.actor.load_checkpoint(str(path))
        if self.roles.critic is not None:
            await self.roles.critic.load_checkpoint(str(path))
        state = json.loads((path / "trainer_state.json").read_text())
        self.step, self.history, self.val_log = state["step"], state["history"], state["val"]
        self.data.loader.load_state_dict(state["loader"])
        self.ctl.load_state_dict(state["controllers"])
        log.info("resumed from %s at step %d", path, self.step)


async def main(ctx: Any, on_setup: Callable[[Trainer], None] | None = None) -> dict[str, Any]:
    """The job: check the inputs, claim the run directory, set up the workers (then `on_setup`,
    e.g. a test's instrumentation), train."""
    # the schema's merge and checks, model building and file checks block: off the event loop (heartbeats)
    cfg = await asyncio.to_thread(rl_config, ctx.cfg)
    cfg.model.path = await asyncio.to_thread(resolve_model, cfg.model, data=cfg.data)
    await asyncio.to_thread(check_inputs, cfg)
    if cfg.trainer.mode == "replay":  # the run's directory is read, not claimed: it may still be training
        from asyncrl.replay import replay_run, replay_start

        # before any worker starts: what the run kept must reach the step (the actor's ranks: n_workers)
        replay_start(Path(cfg.trainer.output_dir), cfg.trainer.replay.step, cfg.trainer.n_workers)
        trainer = Trainer(ctx, cfg)
        await trainer.setup()
        return await replay_run(trainer)
    if cfg.trainer.mode == "eval":  # no run directory to claim: nothing trains, nothing resumes
        trainer = Trainer(ctx, cfg)
        await trainer.setup()
        try:
            return await trainer.evaluator.evaluate_only()
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
        await asyncio.to_thread(run.record_config)
        restarts = 0
        while True:
            trainer = Trainer(ctx, cfg, restarts)
            try:
                await trainer.setup()
                if on_setup is not None:
                    on_setup(trainer)
                return await trainer.fit(start)
            except WorkerDiedError as e:
                if restarts >= cfg.trainer.max_restarts:
                    raise
                restarts += 1
                start = (complete_checkpoints(trainer.out_dir) or [None])[-1]
                log.warning("failover %d of trainer.max_restarts=%d: %s; restarting every worker from %s",
                            restarts, cfg.trainer.max_restarts, str(e).splitlines()[0],
                            start or "step 0 (no complete checkpoint yet)")
                await ctx.restart_workers()
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
