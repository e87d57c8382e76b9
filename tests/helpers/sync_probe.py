"""A trainer job for tests: the real trainer, then the training pool's weights compared with
what every rollout worker generates with (trainer.placement=split)."""

from __future__ import annotations

from typing import Any

from asyncrl.single_controller.protocols import ONE_TO_ALL
from asyncrl.trainer import main as trainer_main
from tests.helpers.worker_probes import weights_checksum


async def main(ctx: Any) -> dict[str, Any]:
    trainers: list[Any] = []
    summary = await trainer_main(ctx, on_setup=trainers.append)
    t = trainers[0]
    train = (await t.roles.actor.apply(weights_checksum, protocol=ONE_TO_ALL))[0]
    rollout = await t.rollout.apply(weights_checksum, protocol=ONE_TO_ALL)
    return {**summary, "train_checksum": train, "rollout_checksums": rollout}
