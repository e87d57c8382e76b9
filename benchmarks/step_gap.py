"""A job entry for `benchmarks.speed`: the trainer's own loop, with every worker's spans
recorded over steps FIRST..LAST (not the trainer's trace, which runs each traced step on its own),
written to $ASYNCRL_GAP_TRACE; `gaps` reads, per rank, how long it sat between an update's end
and the next generation's start: what a device idles between two steps."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

FIRST, LAST = 20, 50


async def main(ctx: Any) -> dict[str, Any]:
    from asyncrl.single_controller.trace import Recording
    from asyncrl.trainer import main as trainer_main

    def instrument(trainer: Any) -> None:
        step, held = trainer.train_step, []

        async def recorded() -> dict[str, float]:
            if trainer.step == FIRST:
                held.append(Recording(trainer.ctx.process_sets.values()))
                await held[0].start()
            metrics = await step()
            if trainer.step == LAST and held:
                await held[0].write(Path(os.environ["ASYNCRL_GAP_TRACE"]))
            return metrics

        trainer.train_step = recorded

    return await trainer_main(ctx, on_setup=instrument)


def gaps(path: Path) -> list[float]:
    """Per rank, the median milliseconds from an update's end to the next generation's start."""
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X" and e["pid"]]
    out = []
    for pid in sorted({e["pid"] for e in spans}):
        work = sorted((e for e in spans if e["pid"] == pid and e["name"] in ("update_actor", "generate_sequences")),
                      key=lambda e: e["ts"])
        pairs = zip(work, work[1:], strict=False)
        out.append(round(statistics.median((b["ts"] - a["ts"] - a["dur"]) / 1000 for a, b in pairs
                                           if a["name"] == "update_actor" and b["name"] == "generate_sequences"), 3))
    return out
