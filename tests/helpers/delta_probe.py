"""A trainer job for the delta sync test: the real trainer (trainer.placement=split); after every
step (its sync done: the trainer's step ends with it) the bytes of the training pool's weights and
every rollout worker's; after step FORGET_AT every rollout worker is told it holds another version
(the next delta cannot rebuild there); at the end, the same bytes once more."""

from __future__ import annotations

from typing import Any

from asyncrl.single_controller.protocols import ONE_TO_ALL
from asyncrl.trainer import main as trainer_main
from tests.helpers.worker_probes import forget_held_version, weights_digest

FORGET_AT = 4


async def main(ctx: Any) -> dict[str, Any]:
    trainers: list[Any] = []
    held: list[int] = []
    differ: list[int] = []  # the steps after which a rollout worker's weights were not the training pool's

    def instrument(trainer: Any) -> None:
        trainers.append(trainer)
        step = trainer.train_step

        async def then_forget() -> dict[str, float]:
            metrics = await step()
            train = (await trainer.roles.actor.apply(weights_digest, protocol=ONE_TO_ALL))[0]
            if any(r != train for r in await trainer.rollout.apply(weights_digest, protocol=ONE_TO_ALL)):
                differ.append(trainer.step)
            if trainer.step == FORGET_AT:
                held.extend(await trainer.rollout.apply(forget_held_version, protocol=ONE_TO_ALL))
            return metrics

        trainer.train_step = then_forget

    summary = await trainer_main(ctx, on_setup=instrument)
    t = trainers[0]
    train = (await t.roles.actor.apply(weights_digest, protocol=ONE_TO_ALL))[0]
    rollout = await t.rollout.apply(weights_digest, protocol=ONE_TO_ALL)
    return {**summary, "train_digest": train, "rollout_digests": rollout, "held_before_forgetting": held,
            "steps_differing": differ}
