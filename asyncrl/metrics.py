"""Watching a run: a progress bar with per-step metrics, a JSONL file, TensorBoard, a PNG curve."""

from __future__ import annotations

import functools
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from asyncrl.single_controller.memory import phase as memory_phase
from transport.checks import ConfigError

log = logging.getLogger("asyncrl.metrics")


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float in it (nested in dicts, lists, tuples) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def json_line(value: Any) -> str:
    """`value` as one line of strict JSON (non-finite numbers become null, never `NaN`)."""
    return json.dumps(finite(value), allow_nan=False, default=str)


def timed(phase: str) -> Callable:
    """Time a worker method: `timing/<phase>_s` goes into its returned Batch's meta or metric dict
    (the trainer logs the per-phase breakdown of every step from these); its peak memory is
    recorded as the phase's (`Worker.memory_stats()["phases"]`)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            with memory_phase(phase, getattr(args[0], "device", "cpu") if args else "cpu"):
                out = fn(*args, **kwargs)
            key, dt = f"timing/{phase}_s", time.perf_counter() - t0
            if isinstance(out, dict):
                out[key] = out.get(key, 0.0) + dt
            elif hasattr(out, "meta"):
                out.meta[key] = out.meta.get(key, 0.0) + dt
            return out
        return wrapper
    return decorate


def mean_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Average per-rank (or per-update) metric dicts, key by key; a key ending in `_max` takes the
    largest, and so does a `timing/` key (a phase lasts as long as its slowest rank)."""
    keys = {k for m in per_rank for k in m}
    return {k: max(m[k] for m in per_rank if k in m) if k.endswith("_max") or k.startswith("timing/") else
            sum(m[k] for m in per_rank if k in m) / sum(1 for m in per_rank if k in m) for k in sorted(keys)}

# TensorBoard's events reach disk this often (and at the end): a step writes one event (all its
# numbers), where a scalar each and a flush cost ~2 ms a step on the driver (0.16 ms now)
TB_FLUSH_S = 5

SHOWN = ("critic/score_mean", "val/reward", "actor/pg_loss", "actor/kl_loss", "critic/kl",
         "critic/vf_loss", "response/length_mean", "timing/step_s")


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 1 << 62  # a line we cannot read is not kept


class WandbLogger:
    """Each step's metrics and each evaluation's completions to a Weights & Biases run.

    Its files go under `out_dir/wandb` (with WANDB_MODE=offline nothing leaves the machine;
    `wandb sync` uploads them later). The run's id is kept there too, so a resumed run continues
    the same wandb run: wandb keeps the steps it already has, so the steps redone after the
    checkpoint keep their first values there (metrics.jsonl and TensorBoard have the new ones).
    Jobs running side by side in one daemon process each get a run of their own; wandb's service
    process ends when the last run of the process is closed."""

    _open = 0  # runs of this process not yet closed

    def __init__(self, out_dir: Path, project: str, name: str, config: dict[str, Any], resumed: bool) -> None:
        import wandb

        folder = out_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run-id"
        run_id = id_file.read_text().strip() if resumed and id_file.exists() else None
        try:
            # create_new: another job's run in this process (a daemon) is neither reused nor ended
            self.run = wandb.init(project=project, name=name, dir=str(out_dir), config=config, id=run_id,
                                  resume="allow" if run_id else None, reinit="create_new",
                                  settings=wandb.Settings(console="off"))  # our log lines stay ours
        except Exception as e:  # noqa: BLE001 - e.g. online mode without an API key
            raise ConfigError(f"trainer.loggers names wandb but wandb could not start a run: {type(e).__name__}: "
                              f"{e}. Log in (`wandb login`, or WANDB_API_KEY), set WANDB_MODE=offline to keep "
                              "the run local, or drop wandb from trainer.loggers") from None
        WandbLogger._open += 1
        id_file.write_text(self.run.id + "\n")
        self._wandb = wandb

    def log(self, step: int, numbers: dict[str, float]) -> None:
        self.run.log(numbers, step=step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        columns = ["data_source", "score", "prompt", "response"]
        table = self._wandb.Table(columns=columns, data=[[s[c] for c in columns] for s in samples])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()
        WandbLogger._open -= 1
        if WandbLogger._open == 0:  # the last run here: end wandb's service process
            self._wandb.teardown()


class MetricsWriter:
    """Appends one JSON object per step to `out_dir/metrics.jsonl` and mirrors it to the other
    loggers named in `loggers` (TensorBoard, wandb)."""

    def __init__(self, out_dir: Path, loggers: Iterable[str] = ("jsonl", "tensorboard"),
                 resume_step: int | None = None, run: dict[str, Any] | None = None) -> None:
        """A fresh writer; with `resume_step`, TensorBoard events after that step (written by the
        interrupted run, about to be redone) are purged so no step appears twice. `run` names the
        wandb run: project, name and config."""
        loggers = set(loggers)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self.file = self.path.open("w")
        # held-out completions: a resumed run keeps those up to its checkpoint
        samples = out_dir / "samples.jsonl"
        kept = []
        if resume_step is not None and samples.exists():
            kept = [ln for ln in samples.read_text().splitlines() if ln.strip() and _step_of(ln) <= resume_step]
        self.samples = samples.open("w")
        self.samples.writelines(ln + "\n" for ln in kept)
        self.tb = None
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = None if resume_step is None else resume_step + 1
                # written to disk by its own thread every TB_FLUSH_S (and at close), not every step
                self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=purge, flush_secs=TB_FLUSH_S)
            except ImportError as e:  # tensorboard is a dependency; a broken install only loses TB
                log.warning("TensorBoard logging off: %s", e)
        self.wandb = None
        if "wandb" in loggers:
            run = run or {}
            try:
                self.wandb = WandbLogger(out_dir, run.get("project", "asyncrl"), run.get("name", out_dir.name),
                                         run.get("config", {}), resumed=resume_step is not None)
            except BaseException:
                self.close()
                raise

    def write(self, step: int, metrics: dict[str, Any], mirror: bool = True) -> None:
        """One step's numbers to metrics.jsonl and, with `mirror`, to TensorBoard and wandb."""
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        # strict JSON: a non-finite value is written as null (json.dumps would write NaN)
        row = {k: v if math.isfinite(v) else None for k, v in numbers.items()}
        self.file.write(json.dumps({"step": step, **row}, allow_nan=False) + "\n")
        self.file.flush()
        if not mirror:
            return
        if self.tb is not None:  # one event with every number of the step
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = [Summary.Value(tag=k, simple_value=v) for k, v in numbers.items()]
            self.tb.file_writer.add_summary(Summary(value=values), step)
        if self.wandb is not None:
            self.wandb.log(step, numbers)

    def write_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """An evaluation's completions, to samples.jsonl, TensorBoard's text tab and a wandb table."""
        for s in samples:
            self.samples.write(json.dumps({"step": step, **s}, default=str) + "\n")
        self.samples.flush()
        if self.tb is not None and samples:
            text = "\n\n".join(f"**{s['data_source']}** score {s['score']:.3f}  \nprompt: `{s['prompt']}`  \n"
                                 f"response: `{s['response']}`" for s in samples)
            self.tb.add_text("samples", text, step)
        if self.wandb is not None and samples:
            self.wandb.log_samples(step, samples)

    def plot(self, history: list[dict[str, float]], val: list[list[float]], path: Path, title: str = "") -> None:
        """Training and held-out reward, and response length, per step: one PNG, axes scaled to
        the data (rewards in [-1, 1] or any other range show), titled with the run."""
        from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry

        fig = Figure(figsize=(7, 6))
        ax, lx = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
        steps = [h["step"] for h in history if "critic/score_mean" in h]
        ax.plot(steps, [h["critic/score_mean"] for h in history if "critic/score_mean" in h],
                label="train reward (mean over samples)", alpha=0.7)
        finite_val = [v for v in val if v[1] is not None and math.isfinite(v[1])]
        if finite_val:
            ax.plot([v[0] for v in finite_val], [v[1] for v in finite_val], "o-", label="held-out reward (greedy)")
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
        ax.legend()
        lengths = [(h["step"], h["response/length_mean"]) for h in history if "response/length_mean" in h]
        if lengths:
            lx.plot([s for s, _ in lengths], [n for _, n in lengths], color="tab:gray", label="response length (mean)")
            lx.legend()
        lx.set_xlabel("step")
        lx.set_ylabel("tokens")
        lx.grid(alpha=0.3)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)

    def close(self) -> None:
        """Idempotent: the files, TensorBoard and the wandb run are closed once."""
        self.file.close()
        self.samples.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb, run = None, self.wandb
            run.close()


class _Progress:
    """A progress bar that stays on the last line of a terminal (log lines print above it), and
    on every step one log line with the total and the time left (what a non-terminal sees)."""

    def __init__(self, total: int, initial: int, desc: str, console: bool = True) -> None:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.step, self.total, self.initial, self.console = initial, total, initial, console
        self.started = time.monotonic()
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", file=sys.stderr,
                        dynamic_ncols=True, disable=None)  # no bar when stderr is not a terminal
        self._redirect = None
        if not self.bar.disable:  # log records go through tqdm.write, above the bar
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()

    def update(self, metrics: dict[str, Any]) -> None:
        shown = {k.split("/")[-1]: f"{metrics[k]:.3g}" for k in SHOWN if k in metrics}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)
        self.step += 1
        per_step = (time.monotonic() - self.started) / max(1, self.step - self.initial)
        left = per_step * (self.total - self.step)
        if self.console:
            log.info("step %d/%d | %s | eta %s", self.step, self.total,
                     " ".join(f"{k}={metrics[k]:.4g}" for k in SHOWN if k in metrics), _clock(left))

    def close(self) -> None:
        self.bar.close()
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None


def _clock(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def progress(total: int, initial: int, desc: str, console: bool = True) -> _Progress:
    """The run's progress bar; with `console`, also one log line per step (trainer.loggers)."""
    return _Progress(total, initial, desc, console)


def phase_summary(path: Path, skip: int = 2) -> dict[str, float]:
    """Median seconds per step of each logged phase (`timing/*_s`), after `skip` warm-up steps,
    and each phase's share of the median step."""
    import statistics

    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) > skip and "timing/step_s" in r]
    if not rows:
        raise ValueError(f"{path} has no steps with timings after step {skip}")
    keys = sorted({k for r in rows for k in r if k.startswith("timing/")})
    out = {k.removeprefix("timing/"): statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    step = out["step_s"]
    out.update({f"share/{k.removesuffix('_s')}": round(v / step, 3) for k, v in list(out.items()) if k != "step_s"})
    out["steps"] = len(rows)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    """`python -m asyncrl.metrics RUN_DIR/metrics.jsonl`: the per-phase step breakdown, as JSON."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps to leave out")
    args = ap.parse_args(argv)
    print(json.dumps(phase_summary(args.metrics, args.skip)))


if __name__ == "__main__":
    main()
