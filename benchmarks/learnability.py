"""Does asyncrl learn as well as a plain GRPO loop? The quickstart against a reference, same run.

For each seed, two runs of the same recipe, one after the other on the same cores:

1. **asyncrl**, exactly as a user runs it: `python -m asyncrl.launch --config-name quickstart
   seed=S trainer.output_dir=TMP/asyncrl model.path=TMP/model` in a subprocess with its own
   process group (coordinator, node daemon, two FSDP2 worker processes, object store, checkpoints,
   TensorBoard). The held-out reward curve is read from the `val/reward` rows of its
   `metrics.jsonl`, the summary from the last line of its stdout.
2. **the reference**: a single-process GRPO loop with no asyncrl runtime — sample n responses per
   prompt, group-normalised advantages, clipped (dual-clip) surrogate, AdamW — configured from the
   same composed config (`load_config("quickstart", same overrides)` → `rl_config`), so it shares
   every setting the loop knows: the tiny model build (`model.build_tiny`: same size, same init,
   no SFT warm start unless it says so), the `disjoint_splits` data and its 128 held-out prompts,
   the prompt order (`PromptLoader`, seed S), the reward function, batch size × n, max_tokens,
   temperature, AdamW (lr, betas, eps, weight decay, grad clip, schedule), clip ratios,
   loss_agg_mode, epochs × mini-batches × micro-batches, total_steps and eval_every. Settings
   it does not implement (KL loss or KL in the reward, entropy bonus, top-p/top-k, other
   algorithms) are refused, not ignored.

Both evaluate greedy decoding on the same held-out prompts at step 0, every eval_every steps and
at the end. Reported per seed and overall: held-out reward start/end, `gain_asyncrl`,
`gain_reference`, `gain_ratio` = asyncrl gain / reference gain, wall seconds (whole run: asyncrl
from launch to exit, the reference from model build to its last evaluation; `train_s_*`: the
training loop with its evaluations), `wall_ratio` = asyncrl / reference, and the first evaluated
step at which each gained GAIN_TARGET. The last line printed is one JSON object.

Differences that remain:
- layout: asyncrl trains on `trainer.n_workers` (2) worker processes, FSDP2 over gloo, each rank
  sampling and scoring half the rows with `torch_threads` threads; the reference is one process
  with as many threads as asyncrl's workers have together (`--threads`).
- randomness: the same init and prompt order, but different sampling streams (asyncrl seeds a
  generator per step and rank), so sampled responses — and the curves — differ within noise.
- the rollout: asyncrl samples with its own engine (`asyncrl.rollout`), the reference with a
  Hugging Face forward and a KV cache; same model, temperature and budget.
- work asyncrl does that the reference does not: start-up and teardown of its processes, the
  weight sync from the trainer to the rollout engine, checkpoints every `save_every` steps,
  TensorBoard and the reward-curve PNG. These count in asyncrl's wall seconds (users pay them).

    python -m benchmarks.learnability                   # seed 0, the quickstart's total_steps
    python -m benchmarks.learnability --seeds 0,1 --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.config import ActorConfig, ModelConfig, RLConfig, rl_config
from asyncrl.launch import load_config
from asyncrl.train import lr_multiplier
from daemons.proc import kill_group
from objectstore import remove_stale_segments

CONFIG = "quickstart"
GAIN_TARGET = 0.2  # the held-out reward rise the quickstart is expected to show (README)
REPO = Path(__file__).resolve().parent.parent


def recipe(seed: int, workdir: Path, steps: int | None) -> tuple[list[str], RLConfig]:
    """The command-line overrides both sides run with, and the typed config they compose to."""
    overrides = [f"seed={seed}", f"trainer.output_dir={workdir / 'asyncrl'}",
                 f"model.path={workdir / 'model'}"]
    if steps is not None:
        overrides.append(f"trainer.total_steps={steps}")
    return overrides, rl_config(load_config(CONFIG, overrides))


def first_gain_step(evals: list[tuple[int, float]], target: float = GAIN_TARGET) -> int | None:
    """The first evaluated step whose held-out reward is `target` above the step-0 one."""
    start = evals[0][1]
    return next((s for s, r in evals if r - start >= target - 1e-9), None)


# ---- asyncrl, as users run it --------------------------------------------------------------------


def run_asyncrl(overrides: list[str], cfg: RLConfig, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """The quickstart in a subprocess; its held-out curve, summary and wall seconds."""
    cmd = [sys.executable, "-m", "asyncrl.launch", "--config-name", CONFIG, *overrides]
    # the launcher's state file (coordinator endpoint and keys) stays in our temp dir
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(workdir / "state")}
    stdout, stderr = workdir / "launch.stdout", workdir / "launch.stderr"
    proc: subprocess.Popen | None = None
    t0 = time.monotonic()
    try:
        with stdout.open("w") as out, stderr.open("w") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err,
                                    start_new_session=True)
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the quickstart ran past --timeout-s={timeout_s:.0f}")
            time.sleep(0.5)
        wall = time.monotonic() - t0
    finally:
        if proc is not None:
            # SIGTERM: the launcher stops its workers (which also die with their node daemon)
            kill_group(proc, grace_s=15)
        remove_stale_segments()  # shared memory of stores that were killed before closing
    if proc.returncode != 0:
        tail = "\n".join(stderr.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")
    lines = [ln for ln in stdout.read_text().splitlines() if ln.strip()]
    summary = json.loads(lines[-1])
    metrics = Path(cfg.trainer.output_dir) / "metrics.jsonl"
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    evals = [(int(r["step"]), float(r["val/reward"])) for r in rows if "val/reward" in r]
    return {"evals": evals, "wall_s": wall, "train_s": float(summary["wall_s"]),
            "steps": int(summary["steps"])}


# ---- the reference: one process, no asyncrl runtime ----------------------------------------------


@torch.no_grad()
def generate(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
    temperature: float, eos_id: int, pad_id: int, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample (temperature 0: greedy) with a KV cache; responses [B, R] and their mask (1 up to
    and including <eos>)."""
    from transformers import DynamicCache

    bsz = input_ids.shape[0]
    mask = attention_mask.clone()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos,
                past_key_values=DynamicCache(), use_cache=True)
    next_pos = pos[:, -1:] + 1
    done = torch.zeros(bsz, dtype=torch.bool)
    tokens, alive = [], []
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1, :].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            tok = logits.argmax(-1)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        tokens.append(tok)
        alive.append(~done)
        done = done | (tok == eos_id)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones(bsz, 1, dtype=mask.dtype)], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                    past_key_values=out.past_key_values, use_cache=True)
        next_pos = next_pos + 1
    return torch.stack(tokens, 1), torch.stack(alive, 1).long()


def token_logprobs(model, prompt_ids, prompt_mask, resp_ids, resp_mask, temperature: float) -> torch.Tensor:
    """Log-probabilities [B, R] of the response tokens under `model` at `temperature`."""
    ids = torch.cat([prompt_ids, resp_ids], dim=1)
    mask = torch.cat([prompt_mask, resp_mask], dim=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    r = resp_ids.shape[1]
    logits = logits[:, -r - 1:-1, :] / max(temperature, 1e-6)
    return torch.gather(F.log_softmax(logits, -1), 2, resp_ids[..., None]).squeeze(-1)


def grpo_advantage(rewards: torch.Tensor, n: int, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps) for consecutive groups of `n` responses."""
    g = rewards.view(-1, n)
    adv = g - g.mean(1, keepdim=True)
    if norm_by_std and n > 1:
        adv = adv / (g.std(1, keepdim=True) + eps)
    return adv.view(-1) if n > 1 else torch.zeros_like(rewards)


def aggregate(losses: torch.Tensor, mask: torch.Tensor, mode: str, norm_len: int) -> torch.Tensor:
    """A [B, R] loss matrix to a scalar, as `actor.loss_agg_mode` says."""
    token_sum = (losses * mask).sum(-1)
    if mode == "token-mean":
        return token_sum.sum() / mask.sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return token_sum.mean()
    if mode == "seq-mean-token-mean":
        return (token_sum / mask.sum(-1).clamp(min=1)).mean()
    if mode == "seq-mean-token-sum-norm":
        return (token_sum / norm_len).mean()
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def clipped_loss(logp, old_logp, adv, mask, ac: ActorConfig, norm_len: int) -> torch.Tensor:
    """PPO's clipped surrogate, the loss bounded at -A*clip_ratio_c for negative advantages."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    a = adv[:, None]
    loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - ac.clip_low, 1 + ac.clip_high))
    loss = torch.where(a < 0, torch.minimum(loss, -a * ac.clip_ratio_c), loss)
    return aggregate(loss, mask, ac.loss_agg_mode, norm_len)


def check_reference_supports(cfg: RLConfig) -> None:
    """Refuse settings the reference loop would otherwise silently ignore."""
    unsupported = {
        "algorithm.name": cfg.algorithm.name != "grpo",
        "actor.use_kl_loss": cfg.actor.use_kl_loss,
        "algorithm.use_kl_in_reward": cfg.algorithm.use_kl_in_reward,
        "actor.entropy_coeff": cfg.actor.entropy_coeff != 0,
        "actor.pretrain_coef": cfg.actor.pretrain_coef != 0,
        "rollout.top_p": cfg.rollout.top_p < 1,
        "rollout.top_k": cfg.rollout.top_k > 0,
        "cost_model.enable": cfg.cost_model.enable,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"the reference loop does not implement {', '.join(bad)} as configured")


def run_reference(cfg: RLConfig, workdir: Path, threads: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """GRPO in this process, configured by `cfg`; its held-out curve and wall seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from asyncrl.data.dataset import PromptDataset, PromptLoader, load_rows
    from asyncrl.data.synthetic import disjoint_splits
    from asyncrl.models.resolve import resolve_model
    from asyncrl.rewards.rules import load_reward_fn

    check_reference_supports(cfg)
    hf_logging.disable_progress_bar()
    t0 = time.monotonic()
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    dc, rc, ac, tc = cfg.data, cfg.rollout, cfg.actor, cfg.trainer
    model_dir = resolve_model(ModelConfig(path=str(workdir / "reference-model"),
                                          build_tiny=cfg.model.build_tiny)
                              if cfg.model.build_tiny else cfg.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    if dc.train_files:
        train_rows, val_rows = load_rows(dc.train_files), load_rows(dc.val_files) if dc.val_files else []
    else:
        syn = dc.synthetic
        train_rows, val_rows = disjoint_splits(syn.task, syn.n_train, syn.n_val, syn.seed)
    train = PromptDataset(train_rows, tok, dc.max_prompt_len, dc.apply_chat_template)
    val = PromptDataset(val_rows, tok, dc.max_prompt_len, dc.apply_chat_template)
    val_batch = val.collate(val.items)
    loader = PromptLoader(train, dc.batch_size, shuffle=dc.shuffle, seed=cfg.seed)
    reward_fn = load_reward_fn(cfg.reward.fn)
    oc = ac.optim
    opt = torch.optim.AdamW(model.parameters(), lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps,
                            weight_decay=oc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, oc))
    gen = torch.Generator().manual_seed(cfg.seed)
    eos, pad = tok.eos_token_id, tok.pad_token_id

    def rewards_of(batch: dict, resp: torch.Tensor, rmask: torch.Tensor, repeat: int) -> torch.Tensor:
        texts = [tok.decode(r[m.bool()].tolist(), skip_special_tokens=True)
                 for r, m in zip(resp, rmask, strict=True)]
        rows = [(s, g, e) for s, g, e in zip(batch["data_source"], batch["ground_truth"],
                                             batch["extra_info"], strict=True) for _ in range(repeat)]
        return torch.tensor([float(reward_fn(s, t, g, e)) for (s, g, e), t in zip(rows, texts, strict=True)])

    def evaluate() -> float:
        model.eval()
        resp, rmask = generate(model, val_batch["input_ids"], val_batch["attention_mask"],
                               max_new_tokens=rc.max_tokens, temperature=0.0, eos_id=eos, pad_id=pad)
        return float(rewards_of(val_batch, resp, rmask, 1).mean())

    t_train = time.monotonic()
    evals = [(0, evaluate())]
    log(f"[reference seed {cfg.seed}] step 0: held-out reward {evals[0][1]:.3f}")
    norm = cfg.algorithm.estimator == "grpo" and cfg.algorithm.norm_adv_by_std
    for step in range(1, tc.total_steps + 1):
        batch = loader.next_batch()
        p_ids = batch["input_ids"].repeat_interleave(rc.n, 0)
        p_mask = batch["attention_mask"].repeat_interleave(rc.n, 0)
        model.eval()
        resp, rmask = generate(model, p_ids, p_mask, max_new_tokens=rc.max_tokens,
                               temperature=rc.temperature, eos_id=eos, pad_id=pad, generator=gen)
        adv = grpo_advantage(rewards_of(batch, resp, rmask, rc.n), rc.n, norm_by_std=norm)
        temp = rc.temperature or 1.0
        old = None
        if ac.recompute_old_log_probs():
            with torch.no_grad():
                old = token_logprobs(model, p_ids, p_mask, resp, rmask, temp)
        model.train()
        rows = len(adv)
        for _ in range(ac.ppo_epochs):
            order = torch.randperm(rows, generator=gen) if ac.shuffle else torch.arange(rows)
            for mini in torch.tensor_split(order, min(ac.ppo_mini_batches, rows)):
                for micro in mini.split(ac.micro_batch_size):
                    logp = token_logprobs(model, p_ids[micro], p_mask[micro], resp[micro],
                                          rmask[micro], temp)
                    # on-policy (no recomputed old log-probs): ratio 1, the clipped objective's gradient
                    ref = old[micro] if old is not None else logp.detach()
                    loss = clipped_loss(logp, ref, adv[micro], rmask[micro].float(), ac, rc.max_tokens)
                    (loss * len(micro) / len(mini)).backward()
                if oc.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
        if step % tc.eval_every == 0 or step == tc.total_steps:
            evals.append((step, evaluate()))
            log(f"[reference seed {cfg.seed}] step {step}: held-out reward {evals[-1][1]:.3f} "
                f"({time.monotonic() - t_train:.1f}s)")
    end = time.monotonic()
    return {"evals": evals, "wall_s": end - t0, "train_s": end - t_train, "steps": tc.total_steps}


# ---- the report ----------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def compare(seed: int, ours: dict, ref: dict) -> dict[str, Any]:
    """One seed's numbers, both sides side by side."""
    out: dict[str, Any] = {"seed": seed}
    for side, r in (("asyncrl", ours), ("reference", ref)):
        start, end = r["evals"][0][1], r["evals"][-1][1]
        out.update({f"reward_start_{side}": round(start, 4), f"reward_end_{side}": round(end, 4),
                    f"gain_{side}": round(end - start, 4), f"wall_s_{side}": round(r["wall_s"], 1),
                    f"train_s_{side}": round(r["train_s"], 1),
                    f"step_gain_{GAIN_TARGET}_{side}": first_gain_step(r["evals"]),
                    f"steps_{side}": r["steps"]})
    out["gain_ratio"] = _ratio(out["gain_asyncrl"], out["gain_reference"])
    out["wall_ratio"] = _ratio(out["wall_s_asyncrl"], out["wall_s_reference"])
    out["evals_asyncrl"] = [[s, round(v, 4)] for s, v in ours["evals"]]
    out["evals_reference"] = [[s, round(v, 4)] for s, v in ref["evals"]]
    return out


def summarize(results: list[dict], cfg: RLConfig, threads: int) -> dict[str, Any]:
    """All seeds: per-seed lists, means, and the overall ratios (of the means)."""
    keys = [k for k in results[0] if k != "seed" and not k.startswith("evals_")]
    out: dict[str, Any] = {"benchmark": "learnability", "config": CONFIG,
                           "seeds": [r["seed"] for r in results]}
    out.update({k: [r[k] for r in results] for k in keys})
    mean = {side: sum(r[f"gain_{side}"] for r in results) / len(results) for side in ("asyncrl", "reference")}
    wall = {side: sum(r[f"wall_s_{side}"] for r in results) for side in ("asyncrl", "reference")}
    out.update({"gain_asyncrl_mean": round(mean["asyncrl"], 4),
                "gain_reference_mean": round(mean["reference"], 4),
                "gain_ratio": _ratio(mean["asyncrl"], mean["reference"]),
                "wall_ratio": _ratio(wall["asyncrl"], wall["reference"])})
    tiny = cfg.model.build_tiny
    out["recipe"] = {
        "model": None if tiny is None else {"task": tiny.task, "hidden": tiny.hidden, "layers": tiny.layers,
                                            "heads": tiny.heads, "sft_steps": tiny.sft_steps},
        "lr": cfg.actor.optim.lr, "batch_size": cfg.data.batch_size, "n": cfg.rollout.n,
        "max_tokens": cfg.rollout.max_tokens, "temperature": cfg.rollout.temperature,
        "total_steps": cfg.trainer.total_steps, "eval_every": cfg.trainer.eval_every,
        "n_val": cfg.data.synthetic.n_val, "loss_agg_mode": cfg.actor.loss_agg_mode,
        "clip_ratio": cfg.actor.clip_ratio, "use_kl_loss": cfg.actor.use_kl_loss,
        "n_workers_asyncrl": cfg.trainer.n_workers, "threads_reference": threads,
    }
    return out


def reference_threads(cfg: RLConfig) -> int:
    """As many threads as asyncrl's workers have together on this node (see setup_process)."""
    n = cfg.trainer.n_workers
    return n * (cfg.trainer.torch_threads or max(1, (os.cpu_count() or 1) // n))


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    p.add_argument("--steps", type=int, default=None,
                   help="train both sides this many steps (default: the quickstart's total_steps)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the reference (default: those of asyncrl's workers together)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="limit on one asyncrl run")
    a = p.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a terminated benchmark still cleans up
    results, cfg, threads = [], None, 0
    try:
        for seed in seeds:
            with tempfile.TemporaryDirectory(prefix="asyncrl-learnability-") as tmp:
                workdir = Path(tmp)
                overrides, cfg = recipe(seed, workdir, a.steps)
                threads = a.threads or reference_threads(cfg)
                print(f"[asyncrl seed {seed}] python -m asyncrl.launch --config-name {CONFIG} "
                      f"{' '.join(overrides)}", flush=True)
                ours = run_asyncrl(overrides, cfg, workdir, a.timeout_s)
                print(f"[asyncrl seed {seed}] held-out reward {ours['evals'][0][1]:.3f} -> "
                      f"{ours['evals'][-1][1]:.3f} in {ours['wall_s']:.1f}s", flush=True)
                ref = run_reference(cfg, workdir, threads, log=lambda m: print(m, flush=True))
            results.append(compare(seed, ours, ref))
            print(json.dumps(results[-1]), flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(summarize(results, cfg, threads)))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("learnability: interrupted (the quickstart's processes and temp files are removed)",
              file=sys.stderr)
        sys.exit(130)
