"""A tiny word-level Llama for the CPU quickstart, built locally (no model hub).

`build_tiny_model` writes a HF checkpoint directory — tokenizer (word-level, chat template) and a
random-init `LlamaForCausalLM` — optionally after a short supervised warm start on the synthetic
task, so `AutoModelForCausalLM.from_pretrained(dir)` / `AutoTokenizer.from_pretrained(dir)` load it.
For reasoning-gym tasks (task="reasoning_gym") the vocabulary is the words of the run's rows and
the warm start its training rows.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import torch

from asyncrl.data.dataset import positions_from_mask
from asyncrl.data.reasoning_gym import GYM_TASK
from asyncrl.data.synthetic import all_symbols, get_task, make_examples
from asyncrl.models.vision import (
    VL_CHAT_TEMPLATE,
    build_image_processor,
    build_vl_config,
    build_vl_tokenizer,
    vl_warm_start,
)
from asyncrl.models.words import (
    CHAT_TEMPLATE,
    build_tokenizer,
)
from transport.checks import ConfigError

log = logging.getLogger(__name__)

MARKER = "asyncrl_tiny.json"


def build_config(tokenizer, *, hidden: int, layers: int, heads: int, experts: int = 0, experts_per_token: int = 2,
                 qk_norm: bool | None = None):
    """A small `LlamaConfig` sized to the tokenizer; with `experts` a `Qwen3MoeConfig` whose
    experts are 4 * hidden / experts_per_token wide (the dense MLP's active parameters); with
    `qk_norm` and no experts a dense `Qwen3Config` (the Qwen3-MoE's twin: the same attention)."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    shape = {"intermediate_size": 4 * hidden}
    if experts:
        shape = {"intermediate_size": 4 * hidden, "num_experts": experts, "num_experts_per_tok": experts_per_token,
                 "moe_intermediate_size": 4 * hidden // experts_per_token, "norm_topk_prob": True,
                 "head_dim": hidden // heads, "router_aux_loss_coef": 0.0}
    elif qk_norm:
        shape = {"intermediate_size": 4 * hidden, "head_dim": hidden // heads}
    return (Qwen3MoeConfig if experts else Qwen3Config if qk_norm else LlamaConfig)(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        **shape,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def sft_batches(tokenizer, task: str, batch_size: int, seed: int, targets: str = "format", steps: int = 0):
    """Endless (input_ids, labels) batches of chat-formatted task examples; loss on the answer.

    targets="task" trains on the true answers; targets="format" on answers of the right shape
    (length, symbols, end of turn) whose symbols are drawn at random, which teaches the format and
    nothing of the task, leaving the task itself for RL.
    """
    if targets not in ("task", "format"):
        raise ValueError(f"SFT targets must be 'task' or 'format', not {targets!r}")
    spec = get_task(task)
    rng = random.Random(f"sft-format:{task}:{seed}")
    step = 0
    seen: dict[tuple, tuple[list[int], list[int]]] = {}  # a conversation's ids, templated once
    while True:
        pairs = make_examples(task, batch_size, seed=10_000 * (seed + 1) + step)
        rows = []
        for prompt, answer in pairs:
            if spec.name == "lookup":  # conversations with the tool (asyncrl.agents.tasks)
                rows.append(_lookup_demo(tokenizer, prompt, rng, _lookup_call_rate(targets, step, steps),
                                         copy=targets == "task", seen=seen))
                continue
            if targets == "format":
                answer = " ".join(rng.choice(spec.answer_symbols) for _ in answer.split())
            rows.append(_chat_example(tokenizer, [{"role": "user", "content": prompt}], answer))
        yield _padded(tokenizer.pad_token_id, rows)
        step += 1


def example_batches(tokenizer, examples: list[tuple[list[dict], str]], batch_size: int, seed: int,
                    targets: str = "format"):
    """Endless (input_ids, labels) batches of `examples` ((chat messages, answer) pairs, drawn
    at random); loss on the answer. targets="format" replaces each answer's words by words drawn
    at random from all the answers', as `sft_batches` does: the shape, not the task."""
    rng = random.Random(f"sft-examples:{seed}")
    answer_words = sorted({w for _, answer in examples for w in answer.split()})
    while True:
        pairs = rng.choices(examples, k=batch_size)
        if targets == "format":
            pairs = [(m, " ".join(rng.choice(answer_words) for _ in answer.split())) for m, answer in pairs]
        yield _padded(tokenizer.pad_token_id, [_chat_example(tokenizer, m, answer) for m, answer in pairs])


def _chat_example(tokenizer, messages: list[dict], answer: str) -> tuple[list[int], list[int]]:
    """The templated conversation and its answer turn as ids, and labels on the answer only."""
    head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    head = list(head["input_ids"] if hasattr(head, "keys") else head)
    tail = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return head + tail, [-100] * len(head) + tail


def _padded(pad: int, rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([[pad] * (width - len(s)) + s for s, _ in rows])
    labels = torch.tensor([[-100] * (width - len(s)) + s for _, s in rows])
    return ids, labels


def _lookup_call_rate(targets: str, step: int, steps: int) -> float:
    """The share of `lookup` demonstrations that call the tool. "task": a fifth for the first 70 %
    of the warm start (the model learns to call and to answer with the tool's digit), 3 % after
    (it learns to guess, and seldom calls on its own: RL has that to change); "format": half."""
    if targets == "format":
        return 0.5
    return 0.2 if step < 0.7 * steps else 0.03


def _lookup_demo(tokenizer, prompt: str, rng: random.Random, call_rate: float, copy: bool = True,
                 seen: dict[tuple, tuple[list[int], list[int]]] | None = None) -> tuple[list[int], list[int]]:
    """One `lookup` conversation as the multi-turn rollout's ids (the observation rendered as
    `ObservationRenderer` does), loss on the assistant's tokens: it calls the tool with
    probability `call_rate`; its answer is the tool's digit after a call with `copy`, else a
    random digit (a guess: the task cannot be solved without the tool). `seen` keeps the ids of
    conversations already templated (the same prompt, call and guess give the same ids)."""
    call = rng.random() < call_rate
    guess = str(rng.randrange(10))
    seen = {} if seen is None else seen
    key = (prompt, call, guess, copy)
    if key not in seen:
        seen[key] = _lookup_ids(tokenizer, prompt, call, guess, copy)
    ids, labels = seen[key]
    return list(ids), list(labels)


def _lookup_ids(tokenizer, prompt: str, call: bool, guess: str, copy: bool) -> tuple[list[int], list[int]]:
    from asyncrl.agents.rollout import ObservationRenderer
    from asyncrl.agents.tasks import lookup_demonstration

    messages = lookup_demonstration(prompt, [guess], call)
    if call and copy:
        messages[-1]["content"] = messages[-2]["content"]
    head = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(head, add_special_tokens=False)
    labels = [-100] * len(ids)
    render = ObservationRenderer(tokenizer, 256)
    for m in messages[1:]:
        if m["role"] == "assistant":
            part = tokenizer.encode(m["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
            labels += part
        else:
            part = render(m["content"], m["role"])
            labels += [-100] * len(part)
        ids += part
    return ids, labels


def sft_warm_start(
    model, tokenizer, task: str, *, steps: int, lr: float, batch_size: int = 64, seed: int = 0,
    targets: str = "format", examples: list[tuple[list[dict], str]] | None = None,
) -> float:
    """Supervised warm start on `task` (or on `examples`, a reasoning-gym build's training rows)
    for `steps` AdamW steps; returns the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss_val = float("nan")
    batches = (example_batches(tokenizer, examples, batch_size, seed, targets) if examples is not None
               else sft_batches(tokenizer, task, batch_size, seed, targets, steps))
    for _ in range(steps):
        ids, labels = next(batches)
        mask = (ids != tokenizer.pad_token_id).long()
        pos = positions_from_mask(mask)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        loss_val = float(out.loss.detach())
    model.eval()
    return loss_val


def build_tiny_model(
    out_dir: str | Path,
    *,
    task: str = "sort",
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    experts: int = 0,
    experts_per_token: int = 2,
    qk_norm: bool | None = None,
    seed: int = 0,
    sft_steps: int = 0,
    sft_lr: float = 1e-3,
    sft_batch_size: int = 64,
    sft_targets: str = "format",
    reasoning_gym: dict | None = None,
) -> Path:
    """Write tokenizer + (optionally SFT-warmed) random-init Llama (with `experts`: a Qwen3-MoE of
    `experts` experts, top-`experts_per_token`; with `qk_norm` alone a Qwen3; for a task with
    images, `squares`: a Qwen2.5-VL and its image processor) to `out_dir`; return the path.
    task="reasoning_gym" builds for `reasoning_gym` ({"source": data.source, **data.reasoning_gym}):
    the vocabulary is every word of its rows, the warm start its training rows."""
    if sft_targets not in ("task", "format"):
        raise ValueError(f"sft_targets must be 'task' or 'format', not {sft_targets!r}")
    examples, words = gym_examples(reasoning_gym) if task == GYM_TASK else (None, all_symbols(task))
    visual = task != GYM_TASK and get_task(task).images
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    t0 = time.perf_counter()
    tokenizer = (build_vl_tokenizer if visual else build_tokenizer)(words)
    loss = None
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = _fresh_model(tokenizer, visual, hidden=hidden, layers=layers, heads=heads, experts=experts,
                             experts_per_token=experts_per_token, qk_norm=qk_norm)
        if sft_steps > 0:
            warm = vl_warm_start if visual else functools.partial(sft_warm_start, examples=examples)
            loss = warm(model, tokenizer, task, steps=sft_steps, lr=sft_lr, batch_size=sft_batch_size, seed=seed,
                        targets=sft_targets)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _make_tokenizer_config_portable(out, VL_CHAT_TEMPLATE if visual else CHAT_TEMPLATE)
    if visual:
        build_image_processor().save_pretrained(out)
    info = {"task": task, "hidden": hidden, "layers": layers, "heads": heads, "experts": experts,
            "experts_per_token": experts_per_token, "qk_norm": qk_norm, "seed": seed, "sft_steps": sft_steps,
            "sft_lr": sft_lr, "sft_batch_size": sft_batch_size, "sft_targets": sft_targets, "reasoning_gym": reasoning_gym,
            "vocab_size": len(tokenizer), "sft_final_loss": loss, "params": sum(p.numel() for p in model.parameters())}
    # the marker goes last: a directory without it is a half-written build
    (out / MARKER).write_text(json.dumps(info, indent=1))
    log.info("built tiny model in %s (%.1fs): %s", out, time.perf_counter() - t0, info)
    return out


def gym_examples(spec: dict | None) -> tuple[list[tuple[list[dict], str]], list[str]]:
    """The training rows of `spec`'s reasoning-gym tasks as (messages, answer) pairs, and the
    words of all its rows (the held-out prompts' too: the vocabulary must cover what is asked)."""
    if not spec:
        raise ConfigError(f"a tiny model for task={GYM_TASK} is built from data.source's reasoning-gym rows; "
                          "set data.source=reasoning_gym:<task> (asyncrl-launch passes it with data.reasoning_gym)")
    from asyncrl.data.reasoning_gym import make_rows, row_words

    train, val = make_rows(**spec)
    return [(r["prompt"], r["reward_model"]["ground_truth"]) for r in train], row_words(train + val)


def _fresh_model(tokenizer, visual: bool, *, hidden: int, layers: int, heads: int, experts: int,
                 experts_per_token: int, qk_norm: bool | None):
    """A random-init Llama (Qwen3-MoE with `experts`, Qwen3 with `qk_norm`), or with `visual` a
    Qwen2.5-VL, for `tokenizer`."""
    from asyncrl.train.load import lm_class

    config = (build_vl_config(tokenizer, hidden=hidden, layers=layers, heads=heads) if visual else
              build_config(tokenizer, hidden=hidden, layers=layers, heads=heads, experts=experts,
                           experts_per_token=experts_per_token, qk_norm=qk_norm))
    model = lm_class(config).from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _make_tokenizer_config_portable(out: Path, template: str) -> None:
    # transformers 5 writes its own class name and a separate .jinja file; older loaders (e.g. the
    # transformers 4.x a vLLM install may pin) need the classic class name and an inline template.
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2))


def _settings(kw: dict) -> dict:
    params = inspect.signature(build_tiny_model).parameters
    unknown = set(kw) - set(params)
    if unknown:
        raise TypeError(f"unknown tiny-model settings {sorted(unknown)}")
    defaults = {k: p.default for k, p in params.items() if p.kind is p.KEYWORD_ONLY}
    return {**defaults, **kw}


def ensure_tiny_model(out_dir: str | Path, **kw) -> Path:
    """Build the tiny model into `out_dir` unless a complete build with these settings is there.

    Safe to call from several processes at once: each builds into its own temporary directory
    and the first to finish renames it into place.
    """
    out = Path(out_dir)
    settings = _settings(kw)
    marker = out / MARKER
    if marker.exists():
        info = json.loads(marker.read_text())
        # a setting newer than the build's marker has its default there
        defaults = _settings({})
        differ = {k: (info.get(k, defaults[k]), v) for k, v in settings.items() if info.get(k, defaults[k]) != v}
        if not differ:
            return out
        # never rebuilt in place: the directory may hold the user's own files or training since
        raise ConfigError(f"{out} holds a tiny model built with other settings ("
                          + ", ".join(f"{k}: {a!r} there, {b!r} asked" for k, (a, b) in differ.items())
                          + "); build into a new directory (model.path=NEW) or remove it yourself "
                          "(it was left as it is)")
    if out.exists():  # never replace what this builder did not write
        raise ConfigError(f"{out} exists and is not a tiny model built by asyncrl (no {MARKER}); "
                          "leave model.build_tiny unset to use it as a model, or build into a new directory "
                          "(it was left as it is)")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(tmp, **settings)
    try:
        os.rename(tmp, out)
    except OSError:
        # another process won the race with the same settings
        shutil.rmtree(tmp, ignore_errors=True)
        if not marker.exists():
            raise
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI: python -m asyncrl.models.tiny OUT_DIR [--task T] [--sft-steps N] ...

    Defaults are the quickstart's (`asyncrl.config.TinyModelConfig`); OUT_DIR must not exist
    yet, or hold a build with the same settings (then nothing is done)."""
    from asyncrl.config import TinyModelConfig

    d = TinyModelConfig()
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("out_dir")
    p.add_argument("--task", default=d.task)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--qk-norm", action="store_true", help="a dense Qwen3 (queries and keys normalised), not a Llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=d.sft_steps)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--sft-targets", choices=("format", "task"), default="format")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tiny %(levelname)s %(message)s")
    try:
        path = ensure_tiny_model(a.out_dir, task=a.task, hidden=a.hidden, layers=a.layers, heads=a.heads,
                                 qk_norm=a.qk_norm or None, seed=a.seed, sft_steps=a.sft_steps, sft_lr=a.sft_lr,
                                 sft_targets=a.sft_targets)
    except ConfigError as e:
        raise SystemExit(f"asyncrl.models.tiny: {e}") from None
    print(path)


if __name__ == "__main__":
    main()
