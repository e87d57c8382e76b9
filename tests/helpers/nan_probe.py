"""A trainer job for tests: the real trainer whose second actor update reports a NaN loss (as a
diverged update would)."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.trainer import main as trainer_main


class NaNOnSecondUpdate:
    def __init__(self, group: Any) -> None:
        self.group, self.updates = group, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)

    def update_actor(self, batch: Any) -> asyncio.Future:
        return asyncio.ensure_future(self._update(batch))

    async def _update(self, batch: Any) -> Any:
        metrics = await self.group.update_actor(batch)
        self.updates += 1
        if self.updates == 2:
            nan = {"actor/pg_loss": float("nan")}
            metrics = [{**m, **nan} for m in metrics] if isinstance(metrics, list) else {**metrics, **nan}
        return metrics


async def main(ctx: Any) -> dict[str, Any]:
    def instrument(trainer: Any) -> None:
        trainer.roles.actor = NaNOnSecondUpdate(trainer.roles.actor)

    return await trainer_main(ctx, on_setup=instrument)
