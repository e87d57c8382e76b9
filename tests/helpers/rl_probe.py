"""A trainer job for tests: the real trainer and algorithm steps, with the actor group wrapped so
every actor update also measures which way it moved the policy.

For each update, `policy_gain` = mean over responses of the response's centred outcome (its
score minus its prompt group's mean; minus the cost for Safe-RLHF) × the change of the
response's log-probability under the update. It measures the update against the reward itself,
not against the advantages the update was given: an update that makes better-scored responses
likelier is positive; a flipped sign anywhere (advantage estimator, loss, aggregation) makes the
policy move away from reward and the gain negative. On-policy distillation's gain is per token:
(log pi_teacher - log pi_student) × the token's change of log-probability, averaged; and
`teacher_gap`, the largest difference of the teacher's log-probs from the Hugging Face teacher's
own (loaded in this process) on the update's tokens, whichever backend runs the teacher.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from asyncrl.trainer import main as trainer_main


class UpdateProbe:
    def __init__(self, group: Any, cfg: Any) -> None:
        self.group, self.cfg, self.gains, self.teacher_gaps = group, cfg, [], []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)

    def update_actor(self, batch: Any) -> asyncio.Future:
        return asyncio.ensure_future(self._measured_update(batch))

    async def _measured_update(self, batch: Any) -> Any:
        before = await self.group.compute_log_prob(batch)
        metrics = await self.group.update_actor(batch)
        after = await self.group.compute_log_prob(batch)
        cols = [c for c in ("scores", "costs", "response_mask", "uid", "teacher_log_probs") if c in batch.columns]
        if "teacher_log_probs" in cols:  # and what the Hugging Face teacher reads
            cols += ["input_ids", "attention_mask", "position_ids", "responses"]
        b = await batch.select(*cols).fetch()
        lp0 = (await before.select("old_log_probs").fetch())["old_log_probs"]
        lp1 = (await after.select("old_log_probs").fetch())["old_log_probs"]
        if "teacher_log_probs" in b:  # distillation: tokens the teacher likes more should get likelier
            mask = b["response_mask"].float()
            self.gains.append(float(((b["teacher_log_probs"] - lp0) * (lp1 - lp0) * mask).sum() / mask.sum()))
            self.teacher_gaps.append(self._teacher_gap(b))
            return metrics
        moved = ((lp1 - lp0) * b["response_mask"].float()).sum(-1)  # Δ log p(response)
        outcome = b["scores"].float() - (b["costs"].float() if "costs" in b else 0.0)
        groups = b["uid"] if "uid" in b else [0] * len(outcome)
        centred = outcome.clone()
        for g in set(groups):
            rows = torch.tensor([i for i, x in enumerate(groups) if x == g])
            centred[rows] -= outcome[rows].mean()
        self.gains.append(float((centred * moved).mean()))
        return metrics

    def _teacher_gap(self, b: Any) -> float:
        from transformers import AutoModelForCausalLM

        from asyncrl.roles.forward import response_forward
        from asyncrl.single_controller.batch import Batch

        model = AutoModelForCausalLM.from_pretrained(self.cfg.teacher.path, dtype=torch.float32).eval()
        cols = ("input_ids", "attention_mask", "position_ids", "responses")
        with torch.no_grad():
            hf, _ = response_forward(model, Batch({k: b[k] for k in cols}), self.cfg.rollout.temperature)
        mask = b["response_mask"].bool()
        return float((b["teacher_log_probs"] - hf)[mask].abs().max())


async def main(ctx: Any) -> dict[str, Any]:
    probes: list[UpdateProbe] = []

    def instrument(trainer: Any) -> None:
        probes.append(UpdateProbe(trainer.roles.actor, trainer.cfg))
        trainer.roles.actor = probes[0]

    summary = await trainer_main(ctx, on_setup=instrument)
    gaps = {"teacher_gap": probes[0].teacher_gaps} if probes[0].teacher_gaps else {}
    return {**summary, "policy_gain": probes[0].gains, **gaps}
