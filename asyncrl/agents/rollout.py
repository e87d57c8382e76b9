"""Multi-turn rollouts, token in and token out: one asyncio task per trajectory.

A trajectory's ids are the prompt's, then turn by turn exactly the ids the engine generated
(never decoded and re-encoded) and the ids of the environment's observation, rendered by the
chat template as the delta that follows the model's stop token (the observation message and the
next generation prompt). Model tokens have `response_mask` 1 and their sampling log-probs;
observation tokens have mask 0 (no loss, KL, entropy or advantage) and attention 1.

Each turn is a request for tokens: `WaveGenerator` serves an engine that decodes batches (the
colocated `RolloutEngine`): the requests waiting when a decode starts go in together, and a
trajectory that is waiting on its environment does not hold one back; `BatcherGenerator` hands
each turn to the continuous batcher of a rollout pool of its own, where a finished row's slot is
taken at once. Environment steps run concurrently (sync environments on a bounded thread pool).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from asyncrl.agents.config import MultiTurnConfig
from asyncrl.agents.env import Action, Environment, StepResult, call
from asyncrl.agents.tools import load_environment
from asyncrl.data.dataset import positions_from_mask
from asyncrl.data.images import (
    ImageInputError,
    ImageReader,
    expand_image_tokens,
    image_columns,
    image_token_counts,
    load_image,
    no_images,
    process_images,
)
from asyncrl.rollout.params import SamplingParams
from asyncrl.serve.backend import Sampling

TRAJECTORY_METRICS = ("num_turns", "tool_calls", "tool_errors", "env_errors", "env_s", "env_reward")
API_METRICS = ("api_calls", "api_splits", "api_dropped_tokens", "api_truncated_tokens")  # ApiRollout's counts
AGENT_INFO = "agent/"  # an environment's own StepResult.info numbers: columns agent/<key>, logged as agent/<key>_mean
log = logging.getLogger(__name__)


class EnvironmentStepError(RuntimeError):
    """Every trajectory's environment step raised: the environment is broken, not the model."""
GATHER_S = 0.005  # the longest a decode waits for turns still arriving


@dataclass
class Trajectory:
    """One rollout: the ids after the prompt (model and observation tokens) and what they were."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: the model's, 0: an observation's
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    env_reward: float = math.nan  # nan: the environment gave none (the reward function scores)
    error: str | None = None  # what the environment raised, if it did
    counts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TRAJECTORY_METRICS[:-1], 0.0))
    images: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (patches, grids), in order

    def image_inputs(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every image so far (the prompt's, then the observations'): patches [P, D] and grids
        [K, 3]; None without images."""
        kept = [(p, g) for p, g in self.images if len(g)]
        if not kept:
            return None
        return torch.cat([p for p, _ in kept]), torch.cat([g for _, g in kept])

    def add(self, ids: list[int], model: bool, logprobs: list[float] | None = None,
            versions: list[int] | None = None) -> None:
        self.tokens += ids
        self.mask += [int(model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        # an observation's tokens carry the version of the turn before them (they are never trained)
        self.versions += versions if versions is not None else [self.versions[-1] if self.versions else 0] * len(ids)

    def reward(self, value: float | None) -> None:
        if value is not None:
            self.env_reward = (0.0 if math.isnan(self.env_reward) else self.env_reward) + float(value)


class TurnGenerator(Protocol):
    """Tokens for one turn: (token ids, their log-probs, the policy version of each); told how
    many trajectories are live (`begin` as each starts, `retire` as it ends). `sampling` (the
    OpenAI endpoint's per-request settings, `asyncrl.serve`) overrides the generator's own."""

    async def __call__(self, ids: list[int], max_tokens: int, sampling: Sampling | None = None,
                       images: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[list[int], list[float], list[int]]: ...

    def begin(self, trajectories: int) -> None: ...

    def retire(self) -> None: ...


class WaveGenerator:
    """Turns served by `RolloutEngine.generate` in waves: every request waiting when a decode
    starts goes into it (at most `max_rows`: the rollout's decode budget); requests arriving
    meanwhile wait for the next one.

    `lockstep=True` is the baseline other trainers run (TRL's GRPOTrainer): a decode waits until
    every live trajectory has asked, so turn t of all rows ends before any row's turn t + 1.

    A wave decodes requests of one `Sampling` but for the seed (the engine samples a call with
    one setting): the others wait for a later wave. A request with a seed samples from a
    generator of its own, so it gets the same tokens whichever requests share its wave (up to
    the forward's numerics): `MultiTurnRollout` seeds every turn, so which turns the timing of
    the environments puts together does not change what is sampled."""

    def __init__(self, engine: Any, params: SamplingParams, generator: torch.Generator | None,
                 version: Any = lambda: 0, lockstep: bool = False, max_rows: int = 0) -> None:
        self.engine, self.params, self.generator, self.version = engine, params, generator, version
        # max_rows > 0: the most rows one decode takes (lock-step decodes a whole turn at once)
        self.lockstep, self.max_rows = lockstep, 0 if lockstep else max_rows
        self.waiting: list[tuple[list[int], int, Sampling | None, Any, asyncio.Future]] = []
        self.runner: asyncio.Task | None = None
        self.waves = self.live = 0

    def begin(self, trajectories: int) -> None:
        self.live += trajectories

    def retire(self) -> None:
        self.live -= 1
        self._kick()

    async def __call__(self, ids: list[int], max_tokens: int, sampling: Sampling | None = None,
                       images: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[list[int], list[float], list[int]]:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((ids, max_tokens, sampling, images, future))
        self._kick()
        return await future

    def _ready(self) -> bool:
        return bool(self.waiting) and (not self.lockstep or len(self.waiting) >= self.live)

    def _kick(self) -> None:
        if self._ready() and (self.runner is None or self.runner.done()):
            self.runner = asyncio.create_task(self._run())

    async def _gather(self) -> None:
        """Before a decode, let turns that are arriving now join it: wait while each pass of the
        event loop brings new requests (environments that answer at once), at most `GATHER_S`."""
        loop = asyncio.get_running_loop()
        deadline, seen = loop.time() + GATHER_S, -1
        while len(self.waiting) != seen and len(self.waiting) < self.live and loop.time() < deadline:
            seen = len(self.waiting)
            for _ in range(3):
                await asyncio.sleep(0)

    async def _run(self) -> None:
        while self._ready():
            await self._gather()
            shared = _shared(self.waiting[0][2])
            wave = [w for w in self.waiting if _shared(w[2]) == shared][:self.max_rows or None]
            taken = {id(w) for w in wave}
            self.waiting = [w for w in self.waiting if id(w) not in taken]
            try:
                outs = await asyncio.to_thread(self._decode, [(ids, m, s, im) for ids, m, s, im, _ in wave], shared)
            except BaseException as e:  # every waiting trajectory gets the engine's error
                for *_, f in wave:
                    if not f.done():
                        f.set_exception(e)
                raise
            for (*_, f), out in zip(wave, outs, strict=True):
                if not f.done():
                    f.set_result(out)

    def _decode(self, requests: list[tuple[list[int], int, Sampling | None, Any]],
                shared: Sampling | None = None) -> list[tuple[list[int], list[float], list[int]]]:
        self.waves += 1
        width = max(len(ids) for ids, *_ in requests)
        pad = self.engine.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, *_ in requests])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, *_ in requests])
        version = self.version()
        params = replace(self.params if shared is None else shared.apply(self.params),
                         n=1, max_tokens=max(m for _, m, *_ in requests))
        seen = [im for *_, im in requests]
        images = ({} if all(im is None for im in seen) else
                  {"images": image_columns([no_images() if im is None else im for im in seen])})
        out = self.engine.generate(input_ids, mask, params, generator=self._generators([s for _, _, s, _ in requests]),
                                   **images)
        results = []
        for row, (_, budget, *_) in enumerate(requests):
            k = min(budget, int(out["response_mask"][row].sum()))
            results.append((out["responses"][row, :k].tolist(), out["rollout_log_probs"][row, :k].tolist(),
                            [version] * k))
        return results

    def _generators(self, samplings: list[Sampling | None]) -> torch.Generator | list[torch.Generator] | None:
        """The shared generator when no request has a seed; else one per row, the seeded rows'
        from their seeds and the others' seeded from the shared one (drawn on the CPU)."""
        if all(s is None or s.seed is None for s in samplings):
            return self.generator
        shared = self.generator
        gens = []
        for s in samplings:
            if s is None or s.seed is None:
                device = shared.device if shared is not None else "cpu"
                seed = int(torch.randint(2**62, (1,), generator=shared, device=device))
            gens.append(torch.Generator().manual_seed(seed if s is None or s.seed is None else s.seed))
        return gens


def _shared(sampling: Sampling | None) -> Sampling | None:
    return None if sampling is None else sampling.shared()


class BatcherGenerator:
    """Turns served by a `ContinuousBatcher` (a rollout pool of its own): one request per turn;
    requests of different `Sampling` share its forwards (it samples each request on its own)."""

    def __init__(self, batcher: Any, params: SamplingParams, generator: torch.Generator | None) -> None:
        self.batcher, self.params, self.generator = batcher, params, generator

    def begin(self, trajectories: int) -> None:
        pass

    def retire(self) -> None:
        pass

    async def __call__(self, ids: list[int], max_tokens: int, sampling: Sampling | None = None,
                       images: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[list[int], list[float], list[int]]:
        if images is not None:  # asyncrl.preflight refuses image runs on a split pool before they start
            raise ValueError("a split rollout pool's continuous batcher takes no images")
        params, generator = self.params, self.generator
        if sampling is not None:
            params = sampling.apply(params)
            generator = sampling.generator(self.batcher.engine.device) or generator
        request = self.batcher.submit(ids, replace(params, n=1, max_tokens=max_tokens), generator)
        # shielded: a cancelled caller must not cancel the batcher's future (its decode loop would
        # then fail to set the result and stop for every caller); the row decodes to its end
        await asyncio.shield(asyncio.wrap_future(request.future))
        return request.tokens[0], request.logprobs[0], request.versions[0]


class ObservationRenderer:
    """The ids of an observation message plus the next generation prompt, as the chat template
    renders them after an assistant turn that ended with the tokenizer's end-of-turn token."""

    def __init__(self, tokenizer: Any, max_tokens: int, reader: ImageReader | None = None) -> None:
        self.tokenizer, self.max_tokens, self.reader = tokenizer, max_tokens, reader
        self.base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        before = tokenizer.apply_chat_template(self.base, tokenize=False)
        end = before.rfind(tokenizer.eos_token) if tokenizer.eos_token else -1
        self.cut = end + len(tokenizer.eos_token) if end >= 0 else len(before)
        self.prefix = before[:self.cut]

    def __call__(self, text: str, role: str = "tool") -> list[int]:
        return self.tokenizer.encode(self._delta(self._cut(text), role), add_special_tokens=False)

    def with_images(self, text: str, role: str, images: Sequence[Any]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """An observation with images: its ids (each image part's placeholder widened to the
        image's tokens), the images' patches [P, D] and grids [K, 3]. ImageInputError for a text
        model or an image that cannot be read."""
        if self.reader is None:
            raise ImageInputError(f"the environment returned {len(images)} image(s) with an observation, and the "
                                  "policy reads no images (no vision_config): return text, or train a "
                                  "vision-language model")
        parts = [*({"type": "image"} for _ in images), {"type": "text", "text": self._cut(text)}]
        ids = self.tokenizer.encode(self._delta(parts, role), add_special_tokens=False)
        pixels, grid = process_images(self.reader.processor, [load_image(v, f"observation image {i}")
                                                              for i, v in enumerate(images)])
        counts = image_token_counts(grid, self.reader.processor.merge_size)
        return expand_image_tokens(ids, self.reader.image_token_id, counts), pixels, grid

    def _cut(self, text: str) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > self.max_tokens:  # the observation's own ids, cut; never the model's
            return self.tokenizer.decode(ids[:self.max_tokens]) + " ...[truncated]"
        return text

    def _delta(self, content: Any, role: str) -> str:
        full = self.tokenizer.apply_chat_template([*self.base, {"role": role, "content": content}],
                                                  tokenize=False, add_generation_prompt=True)
        if not full.startswith(self.prefix):
            raise ValueError("the chat template renders the conversation differently once an observation "
                             "follows; multi-turn rollouts need a template that appends messages")
        return full[self.cut:]


def substream(seed: int, index: int) -> int:
    """The seed of stream `index` under `seed` (a trajectory's, a turn's): independent of the others'."""
    return random.Random(f"{seed}:{index}").getrandbits(63)


async def run_trajectory(env: Environment, row: dict[str, Any], prompt: list[int], generate: TurnGenerator,
                         render: ObservationRenderer, cfg: MultiTurnConfig, budget: int, pool: Any,
                         seed: int | None = None, images: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> Trajectory:
    """Model turns and environment steps until done, `max_turns`, or the token budget; with a
    `seed`, turn t samples from its own generator (`substream(seed, t)`), whatever shares its decode.
    `images`: the prompt's (patches, grids); observations may add more."""
    traj = Trajectory(list(prompt), images=[images] if images is not None else [])
    await call(pool, env.reset, row)
    for turn in range(cfg.max_turns):
        room = budget - len(traj.tokens)
        if room <= 0:
            break
        sampling = None if seed is None else Sampling(seed=substream(seed, turn))
        tokens, logprobs, versions = await generate(traj.prompt + traj.tokens, min(room, cfg.max_turn_tokens or room),
                                                    sampling, traj.image_inputs())
        traj.add(tokens, True, logprobs, versions)
        traj.counts["num_turns"] += 1
        text = render.tokenizer.decode(tokens, skip_special_tokens=True)
        result = await _step(env, Action(tuple(tokens), text), cfg, pool, traj)
        traj.reward(result.reward)
        if result.done or turn == cfg.max_turns - 1 or not result.observation:
            break
        seen = _observe(render, result, traj)
        if seen is None:
            break
        obs, images = seen
        if len(traj.tokens) + len(obs) >= budget:  # no room to answer after it: stop here
            break
        traj.add(obs, False)
        if images is not None:
            traj.images.append(images)
    return traj


def _observe(render: ObservationRenderer, result: StepResult, traj: Trajectory
             ) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor] | None] | None:
    """The observation's ids (and its images' patches and grids); None, the trajectory ending
    as an environment error, when its images cannot be read."""
    if not result.images:
        return render(result.observation, result.role), None
    try:
        ids, pixels, grid = render.with_images(result.observation, result.role, result.images)
    except ImageInputError as e:
        log.warning("an observation's images: %s (the trajectory ends there; counted in agent/env_errors_mean)", e)
        traj.error = f"ImageInputError: {e}"
        traj.counts["env_errors"] += 1.0
        return None
    return ids, (pixels, grid)


async def _step(env: Environment, action: Action, cfg: MultiTurnConfig, pool: Any, traj: Trajectory) -> StepResult:
    t0 = time.monotonic()
    try:
        result = await asyncio.wait_for(call(pool, env.step, action), cfg.step_timeout_s)
    except TimeoutError:
        result = StepResult(f"error: the environment step took more than {cfg.step_timeout_s} s", done=True,
                            info={"tool_errors": 1.0})
    except Exception as e:  # what the model wrote broke the environment: this trajectory ends, the rest go on
        log.warning("%s.step raised %s: %s (the trajectory ends there; counted in agent/env_errors_mean)",
                    type(env).__name__, type(e).__name__, e)
        traj.error = f"{type(e).__name__}: {e}"
        result = StepResult(done=True, info={"env_errors": 1.0})
    traj.counts["env_s"] += time.monotonic() - t0
    if not isinstance(result, StepResult):
        raise TypeError(f"{type(env).__name__}.step returned {type(result).__name__}; return a StepResult")
    for k, v in result.info.items():
        traj.counts[k] = traj.counts.get(k, 0.0) + float(v)
    return result


class MultiTurnRollout:
    """Rolls out `n` trajectories per prompt row of a batch, each with a new environment."""

    def __init__(self, cfg: MultiTurnConfig, tokenizer: Any, reader: ImageReader | None = None) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.factory = load_environment(cfg.env)
        self.render = ObservationRenderer(tokenizer, cfg.max_observation_tokens, reader)
        self.pool = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="env")

    def rollout(self, prompts: list[list[int]], rows: list[dict[str, Any]], n: int,
                generate: TurnGenerator, budget: int, seed: int | None = None,
                images: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> list[Trajectory]:
        """Every trajectory (B*n, interleaved like single-turn samples) within `budget` tokens
        after its prompt, run on an event loop of its own (the worker method runs on a thread).
        With a `seed`, trajectory i samples from `substream(seed, i)`: the same tokens however
        the environments' timing groups the turns into decodes. `images`: each prompt's
        (patches, grids), or None."""
        return asyncio.run(self._all(prompts, rows, n, generate, budget, seed, images or [None] * len(prompts)))

    async def _all(self, prompts: list[list[int]], rows: list[dict[str, Any]], n: int,
                   generate: TurnGenerator, budget: int, seed: int | None,
                   images: list[tuple[torch.Tensor, torch.Tensor] | None]) -> list[Trajectory]:
        gate = asyncio.Semaphore(self.cfg.concurrency)

        async def one(i: int, prompt: list[int], row: dict[str, Any], seen: Any) -> Trajectory:
            async with gate:
                generate.begin(1)
                try:
                    env = self.factory(**self.cfg.env_kwargs)
                    return await run_trajectory(env, row, prompt, generate, self.render, self.cfg, budget, self.pool,
                                                None if seed is None else substream(seed, i), seen)
                finally:
                    generate.retire()

        triples = [t for t in zip(prompts, rows, images, strict=True) for _ in range(n)]
        trajs = await asyncio.gather(*(one(i, *t) for i, t in enumerate(triples)))
        if trajs and all(t.error for t in trajs):  # not the model's doing: the environment itself is broken
            raise EnvironmentStepError(f"{self.cfg.env}: every trajectory's step raised (first: {trajs[0].error}); "
                                       "fix the environment (a model's odd output may end one trajectory, not all)")
        return trajs

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def trajectories_to_tensors(trajs: list[Trajectory], prompts: torch.Tensor | None, prompt_mask: torch.Tensor | None,
                            width: int, pad_id: int, prompt_width: int = 0) -> dict[str, torch.Tensor]:
    """The rollout batch of single-turn generation, with holes in `response_mask` where
    observations are, plus the per-trajectory metrics as [rows] tensors. `prompts` None: each
    row's prompt is its trajectory's own (an API agent's first call), left-padded to
    `prompt_width` (every data-parallel rank's batch the same width) or the longest."""
    if prompts is None:
        prompts, prompt_mask = _own_prompts(trajs, pad_id, prompt_width)
    rows = len(trajs)
    responses = torch.full((rows, width), pad_id, dtype=torch.long)
    resp_mask = torch.zeros((rows, width), dtype=torch.long)
    attn = torch.zeros((rows, width), dtype=torch.long)
    logps = torch.zeros((rows, width), dtype=torch.float32)
    versions = torch.zeros((rows, width), dtype=torch.long)
    for i, t in enumerate(trajs):
        k = len(t.tokens)
        responses[i, :k], resp_mask[i, :k], attn[i, :k] = torch.tensor(t.tokens), torch.tensor(t.mask), 1
        logps[i, :k], versions[i, :k] = torch.tensor(t.logprobs), torch.tensor(t.versions)
    n = rows // max(1, prompts.shape[0])
    prompts, prompt_mask = prompts.repeat_interleave(n, 0), prompt_mask.long().repeat_interleave(n, 0)
    mask = torch.cat([prompt_mask, attn], dim=1)
    out = {"prompts": prompts, "responses": responses, "response_mask": resp_mask,
           "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": mask,
           "position_ids": positions_from_mask(mask), "rollout_log_probs": logps, "behav_versions": versions}
    if any(t.images for t in trajs):  # each row's images, the prompt's and the observations'
        out.update(image_columns([t.image_inputs() or no_images() for t in trajs]))
    own = sorted({k for t in trajs for k in t.counts} - set(TRAJECTORY_METRICS))  # an environment's info keys
    for name in [*TRAJECTORY_METRICS, *own]:
        column = name if name in TRAJECTORY_METRICS or name in API_METRICS else AGENT_INFO + name
        out[column] = torch.tensor([t.env_reward if name == "env_reward" else t.counts.get(name, 0.0) for t in trajs],
                                   dtype=torch.float32)
    return out


def _own_prompts(trajs: list[Trajectory], pad_id: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each trajectory's prompt, left-padded to `width` (at least the longest): [rows, P] ids and mask."""
    width = max(width, *(len(t.prompt) for t in trajs))
    ids = torch.full((len(trajs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(trajs), width), dtype=torch.long)
    for i, t in enumerate(trajs):
        ids[i, width - len(t.prompt):], mask[i, width - len(t.prompt):] = torch.tensor(t.prompt, dtype=torch.long), 1
    return ids, mask
