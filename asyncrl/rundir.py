"""A run's directory (`trainer.output_dir`): what it may hold, who may use it, where a run starts.

It holds only what asyncrl wrote: `config.yaml` (the composed config), `metrics.jsonl`, `samples.jsonl`,
`tensorboard/`, `wandb/`, `reward_curve.png`, `checkpoints/step_N/`, `logs/`, `trace/`, Hydra's `.hydra/`, the run's
`.lock`, `previous-<time>/` for outputs a fresh start moved aside, and evaluations'
`eval-<time>[-N].jsonl`. Nothing else in it is ever touched.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import yaml

from asyncrl.config import RLConfig, to_dict
from transport.checks import ConfigError

log = logging.getLogger("asyncrl.rundir")

DONE_MARKER = "COMPLETE"
CONFIG_FILE = "config.yaml"
LOCK_FILE = ".lock"
OURS = (CONFIG_FILE, "metrics.jsonl", "samples.jsonl", "tensorboard", "wandb", "reward_curve.png", "checkpoints", "logs",
        "trace", ".hydra", LOCK_FILE, "replay", "rollouts", "ledger.jsonl")
EVAL_FILE = re.compile(r"eval-\d{8}-\d{6}(-\d+)?\.jsonl")  # trainer.mode=eval's samples, one file per evaluation
KEPT_IN_PLACE = ("logs", ".hydra", LOCK_FILE)  # this run's own, written before the trainer starts
# keys whose change between a run and its resume does not change what is being trained (the
# parallel layouts included: checkpoints reshard into another layout)
RESUMABLE_CHANGES = ("trainer.total_steps", "trainer.eval_every", "trainer.save_every", "trainer.resume",
                     "trainer.keep_checkpoints", "trainer.loggers", "trainer.project", "trainer.output_dir", "cluster.",
                     "actor.parallel.", "critic.parallel.", "rollout.parallel.", "trainer.torch_threads",
                     "trainer.trace", "trainer.stats_every", "trainer.replay.", "trainer.keep_rollouts",
                     "trainer.failover.")
UNREMARKABLE_CHANGES = ("trainer.resume", "trainer.output_dir", "cluster.log_dir")


def complete_checkpoints(out: Path) -> list[Path]:
    """The run's complete checkpoints (`checkpoints/step_N` with its COMPLETE marker), oldest first."""
    done = [p for p in (out / "checkpoints").glob("step_*") if p.name[5:].isdigit() and (p / DONE_MARKER).exists()]
    return sorted(done, key=lambda p: int(p.name[5:]))


def check_output_dir(out: Path) -> None:
    """Refuse an output directory that is a file or holds anything this program did not write."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"trainer.output_dir={out} is a file; choose a directory")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir()
                         if p.name not in OURS and not p.name.startswith("previous-") and not EVAL_FILE.fullmatch(p.name))
        if foreign:
            raise ConfigError(f"trainer.output_dir={out} holds files asyncrl did not write ({', '.join(foreign[:5])}); "
                              "choose a new trainer.output_dir (nothing was changed)")


class RunDir:
    """One run's claim on `trainer.output_dir`: an exclusive lock for the run's lifetime, the
    checkpoint it starts from, and its recorded config.

    - A directory holding anything this program did not write is refused (never overwritten).
    - `resume=auto` continues from the last complete checkpoint, after comparing the saved config
      with this one (changes are named; a change to what is trained is refused). Earlier outputs
      without a complete checkpoint (a run killed before its first save) are moved aside.
    - `resume=none` starts clean: an earlier run's outputs are moved to `previous-<time>/`, so they
      are never picked up later by mistake.
    - `resume=PATH` starts from that complete checkpoint.
    """

    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.trainer.output_dir)
        self._lock: Any = None

    def claim(self) -> Path | None:
        """Lock the directory and decide where the run starts; returns the checkpoint or None."""
        out, mode = self.out, self.cfg.trainer.resume
        check_output_dir(out)
        out.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        ckpts = complete_checkpoints(out)
        if mode == "none":
            self._move_aside("trainer.resume=none")
            return None
        if mode == "auto":
            if not ckpts:
                self._move_aside("no complete checkpoint to resume from")
                return None
            start = ckpts[-1]
        else:
            start = Path(mode)
            if not (start / DONE_MARKER).is_file() or not (start / "trainer_state.json").is_file():
                raise ConfigError(f"trainer.resume={mode}: not a complete checkpoint (a checkpoints/step_N "
                                  f"directory with {DONE_MARKER}); use auto, none or such a path")
        saved = out / CONFIG_FILE
        if saved.exists() and start.resolve().parent.parent == out.resolve():
            self._compare(yaml.safe_load(saved.read_text()))
        return start

    def record_config(self) -> None:
        (self.out / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(self.cfg), sort_keys=False))

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file drops the lock
            self._lock = None

    def _take_lock(self) -> None:
        import fcntl

        lock = (self.out / LOCK_FILE).open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise ConfigError(f"trainer.output_dir={self.out} is in use by a running job ({holder}); wait for it "
                              "or choose another trainer.output_dir") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        self._lock = lock

    def _move_aside(self, why: str) -> None:
        produced = [p for p in self.out.iterdir() if p.name in OURS and p.name not in KEPT_IN_PLACE]
        if not produced:
            return
        aside = self.out / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir(exist_ok=True)
        for p in produced:
            p.rename(aside / p.name)
        log.warning("%s: starting at step 0; the earlier outputs were moved to %s", why, aside)

    def _compare(self, saved: dict) -> None:
        current = to_dict(self.cfg)
        # a run directory from an older asyncrl: keys added to the schema since then are read at
        # their defaults, and keys the schema no longer has (e.g. trainer.tensorboard) are noted
        saved = with_defaults(saved, to_dict(type(self.cfg)()))
        changed = config_changes(saved, current)
        blocking = [k for k in changed if not k.startswith(RESUMABLE_CHANGES) and has_key(current, k)]
        if blocking:
            raise ConfigError(f"cannot resume {self.out} with a different {', '.join(blocking)} (was → now: "
                              + "; ".join(f"{k}: {changed[k]}" for k in blocking)
                              + "); use a new trainer.output_dir, or trainer.resume=none to start over")
        noted = {k: v for k, v in changed.items() if not k.startswith(UNREMARKABLE_CHANGES)}
        if noted:
            log.warning("resuming with changed %s", "; ".join(f"{k}: {v}" for k, v in noted.items()))


def with_defaults(saved: dict, defaults: dict) -> dict:
    """`saved` with the keys it lacks taken from `defaults` (recursively)."""
    out = dict(saved)
    for k, v in defaults.items():
        if k not in out:
            out[k] = v
        elif isinstance(out[k], dict) and isinstance(v, dict):
            out[k] = with_defaults(out[k], v)
    return out


def has_key(cfg: dict, dotted: str) -> bool:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def config_changes(old: dict, new: dict, prefix: str = "") -> dict[str, str]:
    """Dotted keys whose values differ between two config dicts, as 'old → new'."""
    out: dict[str, str] = {}
    for k in sorted(set(old) | set(new)):
        a, b, key = old.get(k), new.get(k), f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(config_changes(a, b, key + "."))
        elif a != b:
            out[key] = f"{a!r} → {b!r}"
    return out


def new_eval_file(out: Path) -> Path:
    """A new `eval-<time>.jsonl` in `out`, created empty (`-2`, `-3`, ... within one second)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 1000):
        path = out / (f"{stem}.jsonl" if n == 1 else f"{stem}-{n}.jsonl")
        try:
            path.open("x").close()  # ours alone: never over another file
            return path
        except FileExistsError:
            continue
    raise ConfigError(f"trainer.output_dir={out}: too many evaluations in one second")
