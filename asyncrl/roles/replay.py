"""Replay bundles on the training ranks: what one step's actor update read and what it gave.

With `trainer.replay.window` K > 0 each actor rank writes, per training step, a bundle to
`<run>/replay/step_N/rank<r>.pt`: its rows of the update's batch (prompts, sampled tokens, rollout
and old log-probs, advantages: every column the update reads), the random states the update
starts from and, after it, its metrics and a digest of this rank's weights. The last K steps are
kept within `max_mb` per rank. `asyncrl replay` (asyncrl.replay) loads a checkpoint before step N,
re-runs the updates up to N from the bundles and compares. Bundles are read with
`torch.load(weights_only=True)`: tensors and plain values, nothing that runs code.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asyncrl.single_controller.batch import Batch
from asyncrl.train.lora import plain_name
from transport.checks import ConfigError

REPLAY_DIR = "replay"


class ReplayError(ConfigError):
    """A step cannot be replayed from what the run kept (the command exits 2 saying why)."""


def bundle_path(run_dir: str | Path, step: int, rank: int) -> Path:
    return Path(run_dir) / REPLAY_DIR / f"step_{step}" / f"rank{rank}.pt"


def weights_digest(model: nn.Module) -> str:
    """sha256 over this rank's parameter shards, bytes in parameter order (bit-exact weights)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        h.update(plain_name(name).encode())
        h.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def capture(batch: Batch, step: int, rng: dict[str, Any], shuffle: torch.Tensor, update_steps: int) -> dict[str, Any]:
    """What the update is about to read: this rank's rows, the random states, the step."""
    return {"step": step, "tensors": {k: v.detach().cpu() for k, v in batch.tensors.items()},
            "non_tensors": dict(batch.non_tensors), "meta": dict(batch.meta), "rng": rng,
            "shuffle_gen": shuffle, "update_steps": update_steps}


def batch_of(bundle: dict[str, Any], device: torch.device | str) -> Batch:
    return Batch({k: v.to(device) for k, v in bundle["tensors"].items()}, bundle["non_tensors"], bundle["meta"])


def write(run_dir: str | Path, bundle: dict[str, Any], rank: int, window: int, max_mb: int) -> None:
    """Write `bundle` and drop this rank's bundles beyond the last `window` steps or `max_mb`."""
    path = bundle_path(run_dir, bundle["step"], rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(bundle, tmp)
    tmp.replace(path)  # a bundle is whole or absent
    _prune(Path(run_dir) / REPLAY_DIR, rank, window, max_mb * 2**20)


def _prune(root: Path, rank: int, window: int, budget: int) -> None:
    mine = sorted(((int(d.name.removeprefix("step_")), d / f"rank{rank}.pt") for d in root.glob("step_*")
                   if (d / f"rank{rank}.pt").is_file()), reverse=True)
    used = 0
    for i, (_, f) in enumerate(mine):
        used += f.stat().st_size
        if i >= window or (used > budget and i > 0):
            f.unlink(missing_ok=True)
            try:  # the step's folder goes with its last rank's file; the other ranks prune at once too
                f.parent.rmdir()
            except OSError:  # another rank's file is still there, or that rank removed the folder
                pass


def read(run_dir: str | Path, step: int, rank: int) -> dict[str, Any]:
    path = bundle_path(run_dir, step, rank)
    if not path.is_file():
        raise ReplayError(f"no replay bundle for step {step} on rank {rank} ({path}): the run kept the last "
                          "trainer.replay.window steps")
    return torch.load(path, weights_only=True)  # tensors, lists, dicts and numbers: nothing executes


def kept_steps(run_dir: str | Path, ranks: int) -> list[int]:
    """The steps whose bundles every one of `ranks` ranks wrote, ascending."""
    root = Path(run_dir) / REPLAY_DIR
    steps = [int(d.name.removeprefix("step_")) for d in root.glob("step_*") if d.name.removeprefix("step_").isdigit()]
    return sorted(s for s in steps if all(bundle_path(run_dir, s, r).is_file() for r in range(ranks)))


@dataclass
class NonFinite:
    """Where the first non-finite activation of a replayed update appeared."""

    module: str
    micro_batch: int
    value: str  # nan, inf or -inf


class NonFiniteWatch:
    """Forward hooks on every module of `model` that note the first output holding a NaN or an
    infinity (the innermost module, as hooks fire after each module's forward) and the micro-batch
    it was in; `plant` (MODULE@MICRO_BATCH) writes a NaN into that module's output to test it.
    The update runs to its end either way: every rank takes part in every collective."""

    def __init__(self, model: nn.Module, plant: str = "") -> None:
        self.micro_batch, self.first = -1, None
        target, _, at = plant.partition("@")
        names = {plain_name(n): m for n, m in model.named_modules()}
        if target and target not in names:
            raise ReplayError(f"--plant-nan {plant}: no module {target!r} in the model (e.g. {next(iter(names))})")
        self.handles = []
        if target:
            self.handles.append(names[target].register_forward_hook(self._planter(int(at or 0))))
        self.handles += [m.register_forward_hook(self._watcher(n)) for n, m in names.items() if n]

    def next_micro_batch(self) -> None:
        self.micro_batch += 1

    def _planter(self, micro_batch: int):
        def plant(module: nn.Module, args: Any, out: Any) -> Any:
            if self.micro_batch != micro_batch:
                return None
            if isinstance(out, torch.Tensor):
                return torch.full_like(out, math.nan)
            return (torch.full_like(out[0], math.nan), *out[1:])
        return plant

    def _watcher(self, name: str):
        def watch(module: nn.Module, args: Any, out: Any) -> None:
            if self.first is not None:
                return
            t = _first_tensor(out)
            if t is None or not t.is_floating_point():
                return
            bad = ~torch.isfinite(t.detach())
            if bool(bad.any()):
                v = float(t.detach()[bad][0])
                self.first = NonFinite(name, self.micro_batch, "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
        return watch

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _first_tensor(out: Any) -> torch.Tensor | None:
    """A module's output tensor: itself, the first of a tuple, or a model output's logits."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return getattr(out, "logits", None)
