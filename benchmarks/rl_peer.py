"""GRPO step time: asyncrl against TRL's GRPOTrainer, same model, data and batch, same run.

    python -m benchmarks.rl_peer [--steps 20]

Both train the quickstart's tiny model on the synthetic sort task with GRPO: 32 prompts × 8
samples per step, at most 6 new tokens, temperature 1, lr 1e-3, no KL term, one optimizer step
per batch, no gradient accumulation (TRL: one pass over its 256 rows; asyncrl: one pass over each
rank's 128, `actor.micro_batch_size=128` — the quickstart's default of 64 would add a second pass
per rank that TRL does not make). asyncrl runs its trainer on two worker processes (FSDP2 over
gloo, one thread each); TRL runs in one process with two threads (the same two cores). Reported: median seconds per
step after a warm-up, tokens/s, and `step_time_ratio` = asyncrl / TRL (below 1: asyncrl is
faster). TRL is optional (`pip install trl`); without it only asyncrl is measured.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from asyncrl.launch import load_config
from asyncrl.single_controller.context import local_cluster
from transport.loop import run

MODEL = {"task": "sort", "hidden": 64, "layers": 2, "heads": 4, "sft_steps": 0}


def _rows(n: int):
    from asyncrl.data.synthetic import make_rows

    return make_rows("sort", n, seed=0)


async def asyncrl_steps(model_dir: Path, out: Path, steps: int) -> dict:
    from asyncrl.trainer import Trainer
    from asyncrl.trainer import main as trainer_main

    cfg = load_config("quickstart", [f"model.path={model_dir}", "model.build_tiny=null",
                                     f"trainer.output_dir={out}", f"trainer.total_steps={steps}",
                                     f"trainer.eval_every={10 * steps}", f"trainer.save_every={10 * steps}",
                                     "trainer.loggers=[console,jsonl]", "data.synthetic.n_val=8",
                                     "actor.micro_batch_size=128"])
    async with local_cluster(cpu_devices=2, log_dir=out / "logs", cfg=cfg) as ctx:
        trainers: list[Trainer] = []
        await trainer_main(ctx, on_setup=trainers.append)
        trainer = trainers[0]
    times = [h["timing/step_s"] for h in trainer.history][2:]
    tokens = [h["response/tokens"] for h in trainer.history][2:]
    return {"step_s": statistics.median(times), "tokens_per_s": sum(tokens) / sum(times),
            "train_reward_last": trainer.history[-1]["critic/score_mean"]}


def trl_steps(model_dir: Path, out: Path, steps: int) -> dict | None:
    try:
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        print(f"TRL not measured: {e} (pip install trl)")
        return None
    import torch

    from asyncrl.data.synthetic import score_answer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    rows = [{"prompt": tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
             "ground_truth": r["reward_model"]["ground_truth"]} for r in _rows(4096)]

    def reward(prompts, completions, ground_truth, **kwargs):
        return [score_answer(c.replace(tok.eos_token, " "), g) for c, g in zip(completions, ground_truth, strict=True)]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.t0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    clock = Clock()
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=256, num_generations=8,
                      max_completion_length=6, temperature=1.0, learning_rate=1e-3, beta=0.0,
                      num_iterations=1, gradient_accumulation_steps=1, max_steps=steps, use_cpu=True,
                      report_to="none", logging_steps=1, save_strategy="no", lr_scheduler_type="constant",
                      weight_decay=0.0, max_grad_norm=1.0, bf16=False, seed=0, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[reward], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[clock])
    trainer.train()
    times = clock.times[2:]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    lengths = [h.get("completions/mean_length", 6.0) for h in trainer.state.log_history if "reward" in h][2:]
    tokens = sum(256 * n for n in lengths)
    return {"step_s": statistics.median(times), "tokens_per_s": tokens / sum(times),
            "train_reward_last": rewards[-1] if rewards else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    from asyncrl.models.tiny import ensure_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ensure_tiny_model(Path(tmp) / "model", **MODEL)
        ours = run(asyncrl_steps(model_dir, Path(tmp) / "asyncrl", args.steps))
        asyncio.set_event_loop(asyncio.new_event_loop())
        peer = trl_steps(model_dir, Path(tmp) / "trl", args.steps)
    result = {"asyncrl_step_s": round(ours["step_s"], 4), "asyncrl_tokens_per_s": round(ours["tokens_per_s"], 1),
              "asyncrl_train_reward_last": round(ours["train_reward_last"], 4), "steps": args.steps}
    if peer is not None:
        result.update(trl_step_s=round(peer["step_s"], 4), trl_tokens_per_s=round(peer["tokens_per_s"], 1),
                      trl_train_reward_last=round(peer["train_reward_last"], 4),
                      step_time_ratio=round(ours["step_s"] / peer["step_s"], 3))
    for k, v in result.items():
        print(f"{k:>28}: {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
