"""Is the synthetic task learnable by GRPO on a CPU in minutes? Single-process reference loop.

Builds the tiny model (random init + short SFT warm start on the output format), then runs plain
GRPO — sampled groups of n responses per prompt, group-normalised advantages, clipped policy loss,
AdamW — and evaluates the held-out reward (greedy) before, during and after. The peer it is
measured against is the warm-started model itself: the report is reward_end - reward_start and
the ratio of the two, and the step at which the gain first reached GAIN_TARGET. Last line of
output: one JSON object.

    python -m benchmarks.learnability --seed 0
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from asyncrl.data.dataset import PromptDataset, PromptLoader, load_rows
from asyncrl.data.synthetic import write_dataset
from asyncrl.models.tiny import build_tiny_model
from asyncrl.rewards.rules import default_reward

GAIN_TARGET = 0.3  # held-out reward rise the quickstart needs (0.2) plus margin


@dataclass
class Recipe:
    """Everything that decides the outcome of one run (defaults: the recipe the quickstart uses)."""

    task: str = "sort"
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    seed: int = 0
    sft_steps: int = 100  # format-only warm start: right shape, random symbols
    sft_lr: float = 1e-3
    sft_targets: str = "format"
    rl_lr: float = 3e-4
    prompts_per_step: int = 64
    n: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 5  # 4 answer symbols + <eos>
    steps: int = 150
    minibatches: int = 4  # optimizer steps per rollout batch (ppo_mini_batch = 64 * 8 / 4)
    clip: float = 0.2
    eval_every: int = 25
    n_train: int = 4096
    n_val: int = 256
    time_budget_s: float = 300.0


# ---- rollout ------------------------------------------------------------------------------------


@torch.no_grad()
def generate(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
    temperature: float, eos_id: int, pad_id: int, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample (temperature 0: greedy) with a KV cache; returns responses [B, R] and their mask."""
    from transformers import DynamicCache

    bsz = input_ids.shape[0]
    mask = attention_mask.clone()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos,
                past_key_values=cache, use_cache=True)
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


def token_logprobs(model, prompt_ids, prompt_mask, resp_ids, resp_mask, temperature: float):
    """Log-probabilities [B, R] of the response tokens under `model` at `temperature`."""
    ids = torch.cat([prompt_ids, resp_ids], dim=1)
    mask = torch.cat([prompt_mask, resp_mask], dim=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    r = resp_ids.shape[1]
    logits = logits[:, -r - 1:-1, :] / max(temperature, 1e-6)
    return torch.gather(F.log_softmax(logits, -1), 2, resp_ids[..., None]).squeeze(-1)


# ---- GRPO numerics ------------------------------------------------------------------------------


def grpo_advantage(rewards: torch.Tensor, n: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps) for consecutive groups of `n` responses."""
    g = rewards.view(-1, n)
    adv = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)
    return adv.view(-1)


def ppo_clip_loss(logp, old_logp, adv, mask, clip: float) -> torch.Tensor:
    """Token-mean clipped surrogate loss."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    loss = -torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    return (loss * mask).sum() / mask.sum().clamp(min=1)


# ---- loop ---------------------------------------------------------------------------------------


def decode(tokenizer, resp: torch.Tensor, mask: torch.Tensor) -> list[str]:
    return [tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
            for r, m in zip(resp, mask, strict=True)]


def score(batch: dict, texts: list[str], repeat: int = 1) -> torch.Tensor:
    rows = [(ds, gt, ei) for ds, gt, ei in zip(batch["data_source"], batch["ground_truth"],
                                                batch["extra_info"], strict=True)]
    rows = [r for r in rows for _ in range(repeat)]
    return torch.tensor([default_reward(ds, t, gt, ei) for (ds, gt, ei), t in zip(rows, texts,
                                                                                 strict=True)])


def evaluate(model, tokenizer, val: PromptDataset, max_new_tokens: int) -> float:
    """Mean greedy reward over the held-out prompts."""
    model.eval()
    batch = val.collate(val.items)
    resp, rmask = generate(model, batch["input_ids"], batch["attention_mask"],
                           max_new_tokens=max_new_tokens, temperature=0.0,
                           eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    return float(score(batch, decode(tokenizer, resp, rmask)).mean())


def run(rc: Recipe, workdir: Path, log=print) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.perf_counter()
    torch.manual_seed(rc.seed)
    max_new = rc.max_new_tokens
    model_dir = build_tiny_model(workdir / "model", task=rc.task, hidden=rc.hidden,
                                 layers=rc.layers, heads=rc.heads, seed=rc.seed,
                                 sft_steps=rc.sft_steps, sft_lr=rc.sft_lr,
                                 sft_targets=rc.sft_targets)
    t_sft = time.perf_counter() - t_start
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    files = write_dataset(workdir / "data", rc.task, n_train=rc.n_train, n_val=rc.n_val,
                          seed=rc.seed)
    train = PromptDataset(load_rows(files["train"]), tokenizer, max_prompt_len=32)
    val = PromptDataset(load_rows(files["test"]), tokenizer, max_prompt_len=32)
    loader = PromptLoader(train, rc.prompts_per_step, shuffle=True, seed=rc.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=rc.rl_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(rc.seed)

    t_rl, cpu_rl = time.perf_counter(), time.process_time()
    evals = [(0, evaluate(model, tokenizer, val, max_new), 0.0)]
    log(f"[seed {rc.seed}] sft {rc.sft_steps} steps in {t_sft:.1f}s; "
        f"eval@0 {evals[0][1]:.3f}")
    train_rewards, step = [], 0
    for step in range(1, rc.steps + 1):
        batch = loader.next_batch()
        p_ids = batch["input_ids"].repeat_interleave(rc.n, 0)
        p_mask = batch["attention_mask"].repeat_interleave(rc.n, 0)
        model.eval()
        resp, rmask = generate(model, p_ids, p_mask, max_new_tokens=max_new,
                               temperature=rc.temperature, eos_id=tokenizer.eos_token_id,
                               pad_id=tokenizer.pad_token_id, generator=gen)
        rewards = score(batch, decode(tokenizer, resp, rmask), repeat=rc.n)
        train_rewards.append(float(rewards.mean()))
        adv = grpo_advantage(rewards, rc.n)
        model.train()
        with torch.no_grad():
            old = token_logprobs(model, p_ids, p_mask, resp, rmask, rc.temperature)
        for mb in torch.randperm(len(adv), generator=gen).chunk(rc.minibatches):
            logp = token_logprobs(model, p_ids[mb], p_mask[mb], resp[mb], rmask[mb],
                                  rc.temperature)
            loss = ppo_clip_loss(logp, old[mb], adv[mb], rmask[mb].float(), rc.clip)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        elapsed = time.perf_counter() - t_rl
        last = step == rc.steps or elapsed > rc.time_budget_s
        if step % rc.eval_every == 0 or last:
            evals.append((step, evaluate(model, tokenizer, val, max_new), elapsed))
            log(f"[seed {rc.seed}] step {step:4d} {elapsed:6.1f}s "
                f"cpu {time.process_time() - cpu_rl:6.1f}s train_reward "
                f"{sum(train_rewards[-rc.eval_every:]) / len(train_rewards[-rc.eval_every:]):.3f}"
                f" eval {evals[-1][1]:.3f}")
        if last:
            break
    t_total = time.perf_counter() - t_start
    start, end = evals[0][1], evals[-1][1]
    reached = next(((s, t) for s, r, t in evals if r - start >= GAIN_TARGET), (None, None))
    window = max(1, rc.eval_every)
    return {
        "seed": rc.seed,
        "reward_start": round(start, 4),
        "reward_end": round(end, 4),
        "reward_gain": round(end - start, 4),
        "ratio_end_over_start": round(end / start, 3) if start > 0 else None,
        "sampled_reward_first_last": [round(sum(w) / len(w), 4) for w in
                                      (train_rewards[:window], train_rewards[-window:])],
        f"step_gain_{GAIN_TARGET}": reached[0],
        f"rl_s_gain_{GAIN_TARGET}": None if reached[1] is None else round(reached[1], 1),
        "steps": step,
        "sft_s": round(t_sft, 1),
        "rl_s": round(time.perf_counter() - t_rl, 1),
        "rl_cpu_s": round(time.process_time() - cpu_rl, 1),
        "total_s": round(t_total, 1),
        "evals": [(s, round(r, 4), round(t, 1)) for s, r, t in evals],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for field, default in asdict(Recipe()).items():
        p.add_argument("--" + field.replace("_", "-"), type=type(default), default=default)
    p.add_argument("--seeds", type=str, default=None, help="comma-separated; overrides --seed")
    p.add_argument("--threads", type=int, default=2)
    a = vars(p.parse_args(argv))
    torch.set_num_threads(a.pop("threads"))
    seeds_arg = a.pop("seeds")
    seeds = [int(x) for x in seeds_arg.split(",")] if seeds_arg else [a["seed"]]
    results = []
    for seed in seeds:
        rc = Recipe(**{**a, "seed": seed})
        with tempfile.TemporaryDirectory(prefix="asyncrl-learn-") as tmp:
            res = run(rc, Path(tmp))
        print(json.dumps(res))
        results.append(res)
    gains = [r["reward_gain"] for r in results]
    recipe = asdict(Recipe(**a))
    recipe.pop("seed")
    print(json.dumps({
        "benchmark": "learnability",
        "recipe": recipe,
        "seeds": seeds,
        "reward_start": [r["reward_start"] for r in results],
        "reward_end": [r["reward_end"] for r in results],
        "min_gain": min(gains),
        "passed": min(gains) >= GAIN_TARGET,
        f"step_gain_{GAIN_TARGET}": [r[f"step_gain_{GAIN_TARGET}"] for r in results],
        "rl_s": [r["rl_s"] for r in results],
        "total_s": [r["total_s"] for r in results],
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
