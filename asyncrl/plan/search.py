"""Execution-plan search: HybridFlow's Algorithm 1, a REAL-style MCMC search, and an exhaustive
search to check both on small clusters.

A plan places the models (and, with asyncrl's split placement, the rollout engine) in colocated
sets, gives each set devices, and gives each model a parallel strategy on its set's devices.
`SearchSpace.cost` prices a plan with HybridFlow's `d_cost`: the three stages of an RL step run one
after another; in a stage, the calls of different sets run at once and those of one set one after
another; weights move after the update. With `max_staleness >= 1` and a rollout set of its own,
generation overlaps the other stages (asyncrl's asynchronous RL).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache

from asyncrl.plan.cost import (
    INFEASIBLE,
    CallCost,
    Mesh,
    Strategy,
    forward_backward,
    generate,
    offloaded_bytes,
    reshard,
    resident_bytes,
    sequence_transfer,
    weight_broadcast,
    weights_moved,
)
from asyncrl.plan.hardware import DeviceProfile
from asyncrl.plan.memory import RUNTIME_BYTES, Knobs, checkpoint_phases, training_state
from asyncrl.plan.workload import ModelSpec, Stage, Workload

SP_FROM_TOKENS = 8192  # sequences at least this long: the search also tries Ulysses sequence parallelism
OFFLOAD_FROM = 0.25  # the actor's training state above this share of a device: the search also tries offloading it
HOST_USABLE = 0.8  # of a node's host memory for offloaded state (the rest: the OS, the workers' processes, data)
ROLLOUT = "rollout"  # the generation engine as a unit of its own (asyncrl's trainer.placement=split)


@dataclass(frozen=True)
class Plan:
    sets: tuple[tuple[str, ...], ...]  # units placed together, in device order
    devices: tuple[int, ...]  # per set
    strategies: tuple[tuple[str, Strategy], ...]  # per model (and the rollout unit when split)

    def strategy(self, unit: str) -> Strategy:
        return dict(self.strategies)[unit]

    def set_of(self, unit: str) -> int:
        return next(i for i, s in enumerate(self.sets) if unit in s)

    @property
    def split(self) -> bool:
        return any(s == (ROLLOUT,) for s in self.sets)

    def placement(self) -> str:
        if len(self.sets) == 1:
            return "colocate"
        return " | ".join("+".join(s) for s in self.sets)


@dataclass
class PlanCost:
    step_s: float
    stages: dict[str, float] = field(default_factory=dict)
    calls: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)  # bytes per device, per set
    why: str = ""  # why a plan is infeasible
    decode_rows: int = 0  # the native engine's rows at once the plan needs (rollout.decode_slots), 0: all

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.step_s)


def set_partitions(items: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every way to split `items` into non-empty sets (Bell number many), order kept."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + ((first, *part[i]),) + part[i + 1:]
        yield ((first,), *part)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


class SearchSpace:
    """Plans for one workload on `nnodes` x `per_node` devices of one profile.

    `deployable=True` keeps to what `asyncrl-launch` runs: every model colocated, or the
    rollout on a pool of its own (split, whole-model replicas, no pipeline-parallel training);
    the reference model shares the actor's layout; generation TP divides the actor's TP; value
    models train without pipeline stages. `deployable=False` is HybridFlow's and REAL's space:
    any placement, a free strategy per model. `knobs`: the config's memory knobs (dtype,
    checkpointing, the rollout engine); by default the profile's width and a paged engine."""

    def __init__(self, workload: Workload, profile: DeviceProfile, nnodes: int, per_node: int,
                 deployable: bool = True, allow_split: bool = True, knobs: Knobs | None = None) -> None:
        self.w, self.profile = workload, profile
        self.knobs = knobs or Knobs(compute_bytes=profile.bytes_per_param)
        self.nnodes, self.per_node = nnodes, per_node
        self.total = nnodes * per_node
        self.deployable = deployable
        self.units = workload.model_names + ((ROLLOUT,) if allow_split else ())
        self.trained = {c.model for c in workload.calls if c.kind == "train"}
        self.usable = profile.mem_bytes * profile.usable_memory_fraction
        self._strategies = lru_cache(maxsize=None)(self._enumerate_strategies)
        self._call = lru_cache(maxsize=None)(self._call_cost)
        self.evaluated = 0

    # the space --------------------------------------------------------------------------------
    def placements(self) -> Iterator[tuple[tuple[str, ...], ...]]:
        for part in set_partitions(self.units):
            if ROLLOUT in self.units:
                rollout_set = next(s for s in part if ROLLOUT in s)
                if rollout_set != (ROLLOUT,) and "actor" not in rollout_set:
                    continue  # the engine runs the actor's weights: with the actor or alone
            if self.deployable and len(part) > 1 and not (len(part) == 2 and (ROLLOUT,) in part):
                continue
            yield part

    def set_sizes(self) -> list[int]:
        """Device counts a set may have: powers of two up to a node, then whole nodes."""
        small = _powers_of_two(min(self.per_node, self.total))
        return sorted(set(small) | {self.per_node * k for k in range(1, self.nnodes + 1)})

    def allocations(self, part: tuple[tuple[str, ...], ...]) -> list[tuple[int, ...]]:
        """Device counts per set using every device (no idle devices)."""
        sizes = self.set_sizes()
        return [a for a in itertools.product(sizes, repeat=len(part)) if sum(a) == self.total]

    def strategies(self, unit: str, devices: int) -> tuple[Strategy, ...]:
        found = self._strategies(unit, devices)
        lora = self.knobs.lora_params and unit in ("actor", "ref") or self.knobs.critic_lora_params and unit == "critic"
        if lora:  # LoRA trains over FSDP alone for now
            found = tuple(s for s in found if s.tp == 1 and s.pp == 1)
        return found

    def _enumerate_strategies(self, unit: str, devices: int) -> tuple[Strategy, ...]:
        model = self.w.models["actor" if unit == ROLLOUT else unit]
        tps = [t for t in _powers_of_two(min(self.per_node, devices)) if model.heads % t == 0 and devices % t == 0]
        if model.experts and self.deployable and (unit == ROLLOUT or not self.knobs.megatron):
            tps = [1]  # a mixture of experts generates, and trains on FSDP2, without TP for now
        if unit == ROLLOUT:
            tps = [1] if self.deployable else tps
            return tuple(Strategy(dp=devices // t, tp=1, gen_tp=t) for t in tps)
        out = []
        no_pp = model.value_head and self.deployable
        if self.deployable and unit == "reward":
            tps = [1]  # asyncrl's reward-model worker is data-parallel only
        for tp in tps:
            for pp in _powers_of_two(devices // tp):
                if (pp > 1 and (no_pp or model.layers % pp)) or devices % (tp * pp):
                    continue
                dp = devices // (tp * pp)
                rows = math.ceil(self.w.sequences / dp)
                mbs = [m for m in self.w.micro_batch_sizes if m <= rows] or [rows]
                gens = [1]
                if unit == "actor":
                    limit = tp if self.deployable else tp * pp
                    gens = [g for g in _powers_of_two(min(limit, self.per_node)) if limit % g == 0 and model.heads % g == 0]
                    gens = [1] if model.experts and self.deployable else gens
                sps = [1]
                if (self.w.seq_len >= SP_FROM_TOKENS and pp == 1 and unit in ("actor", "ref", "critic")
                        and not (model.experts and self.deployable)):  # asyncrl's Ulysses splits no routed tokens yet
                    sps = [k for k in _powers_of_two(min(dp, self.per_node)) if (model.heads // tp) % k == 0]
                offloads = self._offloads(model, dp, tp, pp) if unit == "actor" else [(False, False)]
                eps = self._expert_parallel(model, dp) if unit in ("actor", "ref") else [1]
                recomputes = self._recomputes(unit)
                for mb in mbs:
                    out.extend(Strategy(dp, tp, pp, mb, g, sp, off, all_, ep, gen_ep, rc) for g in gens for sp in sps
                               for off, all_ in offloads for ep in eps
                               for gen_ep in self._expert_generation(model, unit, dp, tp * pp, ep, g)
                               for rc in recomputes)
        return tuple(out)

    def _expert_parallel(self, model: ModelSpec, dp: int) -> list[int]:
        """megatron's expert-parallel sizes for a mixture of experts: as configured (actor.moe.ep > 1,
        where it divides the data-parallel ranks), else the powers of two that divide its data-parallel
        ranks and its experts (1 elsewhere)."""
        if not (model.experts and self.knobs.megatron):
            return [1]
        if self.knobs.ep > 1:
            return [self.knobs.ep] if dp % self.knobs.ep == 0 else []
        return [e for e in _powers_of_two(dp) if model.experts % e == 0]

    def _expert_generation(self, model: ModelSpec, unit: str, dp: int, model_shards: int, ep: int, gen_tp: int
                           ) -> list[int]:
        """Expert-parallel generation sizes for the actor of a mixture of experts: as configured
        (rollout.parallel.ep > 1), else both 1 and the ranks training splits the experts over
        (megatron's ep; FSDP2's dp ranks at tp = pp = 1), where they divide the experts."""
        if not (model.experts and unit == "actor" and self.deployable) or gen_tp > 1:
            return [1]
        split = ep if self.knobs.megatron else (dp if model_shards == 1 else 1)
        if self.knobs.gen_ep > 1:
            return [self.knobs.gen_ep] if self.knobs.gen_ep == split else []
        return [1, split] if split > 1 and model.experts % split == 0 else [1]

    def _recomputes(self, unit: str) -> list[bool]:
        """Whether the actor recomputes its layers' activations in the backward: as configured, else
        both tried for sequences of at least SP_FROM_TOKENS tokens on a GPU (where activations can
        outgrow the device)."""
        if unit != "actor" or self.knobs.gradient_checkpointing:
            return [False]
        tried = self.profile.kind == "gpu" and self.deployable and self.w.seq_len >= SP_FROM_TOKENS
        return [False, True] if tried else [False]

    def _offloads(self, model: ModelSpec, dp: int, tp: int, pp: int) -> list[tuple[bool, bool]]:
        """What of the actor's state lives in host memory (the optimizer's between its steps; with it
        the weights while the rollout runs): as configured (actor.offload), else on a GPU, where the
        training state takes more than OFFLOAD_FROM of a device, the optimizer's tried and the
        weights too; elsewhere it cannot matter."""
        if self.knobs.offload:
            return [(True, self.knobs.offload_weights)]
        tried = self.profile.kind == "gpu" and self.deployable and not self.knobs.lora_params
        state = resident_bytes(model, Strategy(dp, tp, pp), True, self.knobs, "actor")
        if not (tried and state > OFFLOAD_FROM * self.usable):
            return [(False, False)]
        return [(False, False), (True, False), (True, True)]

    # pricing ----------------------------------------------------------------------------------
    def _call_cost(self, index: int, s: Strategy, devices: int) -> CallCost:
        call = self.w.calls[index]
        model = self.w.models[call.model]
        return forward_backward(model, s, self.w, call, Mesh(devices, self.per_node), self.profile, self.knobs)

    def cost(self, plan: Plan) -> PlanCost:
        """HybridFlow's d_cost of one RL step under `plan` (inf when a set does not fit)."""
        self.evaluated += 1
        w, profile = self.w, self.profile
        strat = dict(plan.strategies)
        if self.deployable and "ref" in w.models and "actor" in strat:
            strat["ref"] = strat["actor"]
        if self.deployable and plan.split and strat["actor"].pp > 1:
            return PlanCost(INFEASIBLE, why="split placement trains without pipeline stages (actor pp must be 1)")
        busy: dict[tuple[str, int], float] = {}
        calls, memory, decode_rows = {}, {}, 0
        gen_set = plan.set_of(ROLLOUT) if ROLLOUT in self.units else plan.set_of("actor")
        for i, (units, devices) in enumerate(zip(plan.sets, plan.devices, strict=True)):
            models = [u for u in units if u != ROLLOUT]
            resident = RUNTIME_BYTES + sum(resident_bytes(w.models[m], strat[m], m in self.trained, self.knobs, m)
                                           for m in models)
            if "actor" in models and (why := self._host_memory(strat["actor"], resident, devices)):
                return PlanCost(INFEASIBLE, calls=calls, memory=memory, why=why)
            transient = 0.0
            for index, call in enumerate(w.calls):
                if call.model not in models or call.kind == "generate":
                    continue
                c = self._call(index, strat[call.model], devices)
                extra = sequence_transfer(w, profile) if i != gen_set else 0.0
                calls[call.name] = c.time_s + extra
                busy[(call.stage, i)] = busy.get((call.stage, i), 0.0) + c.time_s + extra
                transient = max(transient, c.memory_bytes)
            peak = resident + transient
            if i == gen_set:
                unit = ROLLOUT if units == (ROLLOUT,) else "actor"
                # actor.offload=all: the set's weights wait in host memory while the rollout runs
                beside = RUNTIME_BYTES if strat[unit].offload_weights else resident
                g = generate(w.models["actor"], strat[unit], w, Mesh(devices, self.per_node), profile,
                             self.usable - beside, self.knobs)
                calls["actor.generate"] = g.time_s + weights_moved(strat[unit], resident - RUNTIME_BYTES, profile)
                decode_rows = g.decode_rows
                busy[(Stage.GENERATE, i)] = calls["actor.generate"]
                peak = max(peak, beside + g.memory_bytes)
            if profile.kind == "cpu" and "actor" in models:  # a CPU's memory holds the checkpoint's bytes too
                shards = strat["actor"].devices
                peak = max(peak, *checkpoint_phases(w.models["actor"], shards, self.knobs, resident).values())
            memory["+".join(units)] = peak
            if peak > self.usable:
                return PlanCost(INFEASIBLE, calls=calls, memory=memory,
                                why=f"{'+'.join(units)} needs {peak / 2**30:.1f} GiB per device of "
                                    f"{self.usable / 2**30:.1f}")
        stages = {st: max((t for (s, _), t in busy.items() if s == st), default=0.0) for st in Stage.ORDER}
        actor = w.models["actor"]
        if gen_set == plan.set_of("actor"):
            sync = reshard(actor, strat["actor"], Mesh(plan.devices[gen_set], self.per_node), profile)
        else:
            sync = weight_broadcast(actor, profile, across_nodes=sum(plan.devices) > self.per_node)
        stages["sync"] = sync
        rest = stages[Stage.PREPARE] + stages[Stage.TRAIN] + sync
        if gen_set != plan.set_of("actor") and w.max_staleness >= 1:
            step = max(stages[Stage.GENERATE], rest)
        else:
            step = stages[Stage.GENERATE] + rest
        return PlanCost(step, stages, calls, memory, decode_rows=decode_rows)

    def _host_memory(self, s: Strategy, resident: float, devices: int) -> str:
        """Why a node's host memory cannot hold what the plan keeps there ('' when it can, or the
        profile does not say): each of the set's devices on the node its offloaded optimizer state
        (and with actor.offload=all its weights while the rollout runs), and rank 0 a checkpoint's
        tensors as it loads or saves one (`checkpoint_phases`)."""
        limit = self.profile.host_mem_bytes * HOST_USABLE
        if not limit or self.profile.kind != "gpu":  # a CPU's device memory is its host memory: priced as such
            return ""
        actor, ranks = self.w.models["actor"], min(devices, self.per_node)
        optimizer = offloaded_bytes(actor, s, self.knobs)
        weights = resident - RUNTIME_BYTES if s.offload_weights else 0.0
        staged = checkpoint_phases(actor, s.devices, self.knobs, 0.0)
        copies = sum(training_state(actor, s.devices).values()) if self.knobs.async_save else 0.0  # every rank's
        need = {"the offloaded state": ranks * (optimizer + weights),
                "a save": ranks * optimizer + staged["save (rank 0)"] + (ranks - 1) * copies,
                "a load on rank 0": staged["load (rank 0)"]}
        what, most = max(need.items(), key=lambda kv: kv[1])
        if most <= limit:
            return ""
        return (f"{what} needs {most / 2**30:.0f} GiB of host memory a node, of the {limit / 2**30:.0f} GiB "
                f"usable ({HOST_USABLE:.0%} of plan.host_memory_gib or the profile's)")

    def unit_time(self, unit: str, s: Strategy, devices: int) -> float:
        """One unit's own calls summed (HybridFlow's per-model simulation), generation at full memory."""
        if unit == ROLLOUT:
            return generate(self.w.models["actor"], s, self.w, Mesh(devices, self.per_node), self.profile,
                            self.usable - RUNTIME_BYTES, self.knobs).time_s
        total = 0.0
        for index, call in enumerate(self.w.calls):
            if call.model == unit and call.kind != "generate":
                total += self._call(index, s, devices).time_s
        if unit == "actor" and ROLLOUT not in self.units:
            total += generate(self.w.models["actor"], s, self.w, Mesh(devices, self.per_node), self.profile,
                              self.usable - RUNTIME_BYTES - self.unit_memory("actor", s), self.knobs).time_s
        return total

    def unit_memory(self, unit: str, s: Strategy) -> float:
        """What a unit keeps on each device between calls (the process itself not counted)."""
        if unit == ROLLOUT:
            return 0.0
        return resident_bytes(self.w.models[unit], s, unit in self.trained, self.knobs, unit)

    def unit_transient(self, unit: str, s: Strategy, devices: int) -> float:
        """The most a unit's training and forward calls hold beyond its resident state."""
        return max((self._call(i, s, devices).memory_bytes for i, c in enumerate(self.w.calls)
                    if c.model == unit and c.kind != "generate"), default=0.0)

    def free_units(self, units: tuple[str, ...]) -> list[str]:
        """The units whose strategy a search chooses (the reference follows the actor when deployable)."""
        return [u for u in units if not (self.deployable and u == "ref" and "actor" in self.units)
                and not (u == ROLLOUT and "actor" in units)]

    def plan(self, sets: tuple[tuple[str, ...], ...], devices: tuple[int, ...], chosen: dict[str, Strategy]) -> Plan:
        return Plan(sets, devices, tuple(sorted(chosen.items())))


@dataclass
class SearchResult:
    best: Plan | None
    cost: PlanCost | None
    runners_up: list[tuple[Plan, PlanCost]]
    seconds: float
    evaluated: int
    method: str


def _keep(top: list[tuple[Plan, PlanCost]], plan: Plan, cost: PlanCost, k: int) -> None:
    if not cost.feasible or any(p == plan for p, _ in top):
        return
    top.append((plan, cost))
    top.sort(key=lambda pc: pc[1].step_s)
    del top[k:]


def _result(space: SearchSpace, top: list[tuple[Plan, PlanCost]], t0: float, before: int, method: str) -> SearchResult:
    best = top[0] if top else (None, None)
    return SearchResult(best[0], best[1], top[1:], time.monotonic() - t0, space.evaluated - before, method)


# HybridFlow Algorithm 1 ---------------------------------------------------------------------------
def hybridflow(space: SearchSpace, top_k: int = 4, keep: int = 4) -> SearchResult:
    """Algorithm 1: for each placement (set partition) and allocation, `auto_parallel` picks each
    set's strategies from its models' simulated times (cached per set and size, top_k candidates
    per model plus its smallest-memory one, the best combination that fits), then `d_cost`
    prices the whole step."""
    t0, before = time.monotonic(), space.evaluated
    cache: dict[tuple[tuple[str, ...], int], dict[str, Strategy] | None] = {}

    def auto_parallel(units: tuple[str, ...], devices: int) -> dict[str, Strategy] | None:
        key = (units, devices)
        if key in cache:
            return cache[key]
        options = []
        for u in space.free_units(units):
            fits = [s for s in space.strategies(u, devices)
                    if RUNTIME_BYTES + space.unit_memory(u, s) + space.unit_transient(u, s, devices) <= space.usable]
            ranked = sorted(fits, key=lambda s, u=u: space.unit_time(u, s, devices))
            if not ranked:
                cache[key] = None
                return None
            smallest = min(ranked, key=lambda s, u=u: space.unit_memory(u, s) + space.unit_transient(u, s, devices))
            options.append([(u, s) for s in dict.fromkeys([*ranked[:top_k], smallest])])
        best, best_t = None, math.inf
        for combo in itertools.product(*options):
            chosen = dict(combo)
            if "ref" in units and "ref" not in chosen:
                chosen["ref"] = chosen["actor"]
            mem = RUNTIME_BYTES + sum(space.unit_memory(u, s) for u, s in chosen.items())
            mem += max(space.unit_transient(u, s, devices) for u, s in chosen.items())
            if mem > space.usable:
                continue
            t = sum(space.unit_time(u, s, devices) for u, s in chosen.items())
            if t < best_t:
                best, best_t = chosen, t
        cache[key] = best
        return best

    top: list[tuple[Plan, PlanCost]] = []
    for part in space.placements():
        for alloc in space.allocations(part):
            chosen: dict[str, Strategy] = {}
            for units, devices in zip(part, alloc, strict=True):
                picked = auto_parallel(units, devices)
                if picked is None:
                    break
                chosen.update(picked)
            else:
                plan = space.plan(part, alloc, chosen)
                _keep(top, plan, space.cost(plan), keep)
    return _result(space, top, t0, before, "hybridflow")


# exhaustive -----------------------------------------------------------------------------------------
def exhaustive(space: SearchSpace, keep: int = 4, limit: int = 5_000_000) -> SearchResult:
    """Every placement, allocation and strategy combination priced with `d_cost` (small
    clusters: the verification of the other searches). Raises when the space exceeds `limit`."""
    t0, before = time.monotonic(), space.evaluated
    jobs = []
    for part in space.placements():
        for alloc in space.allocations(part):
            axes = [[(u, s) for s in space.strategies(u, d)] for units, d in zip(part, alloc, strict=True)
                    for u in space.free_units(units)]
            jobs.append((part, alloc, axes))
    size = sum(math.prod(len(a) for a in axes) for _, _, axes in jobs)
    if size > limit:
        raise ValueError(f"exhaustive search over {size} plans exceeds its limit of {limit}; use mcmc or hybridflow")
    top: list[tuple[Plan, PlanCost]] = []
    for part, alloc, axes in jobs:
        for combo in itertools.product(*axes):
            plan = space.plan(part, alloc, dict(combo))
            _keep(top, plan, space.cost(plan), keep)
    return _result(space, top, t0, before, "exhaustive")


# REAL-style MCMC ------------------------------------------------------------------------------------
def mcmc(space: SearchSpace, seconds: float = 5.0, beta: float = 30.0, seed: int = 0, keep: int = 4,
         max_steps: int = 1_000_000, start: Plan | None = None, patience: int = 20_000) -> SearchResult:
    """Metropolis–Hastings over plans with energy exp(-beta · cost / best cost): each step
    redraws one unit's strategy, moves devices between two sets, or moves a unit to another set;
    plans that do not fit in memory are priced with a penalty. Stops after `seconds`, or after
    `patience` steps without a better plan."""
    t0, before = time.monotonic(), space.evaluated
    rng = random.Random(seed)
    parts = list(space.placements())
    allocs = {p: space.allocations(p) for p in parts}
    parts = [p for p in parts if allocs[p]]

    def fill(part: tuple[tuple[str, ...], ...], alloc: tuple[int, ...], old: dict[str, Strategy]) -> dict[str, Strategy] | None:
        chosen = {}
        for units, d in zip(part, alloc, strict=True):
            for u in space.free_units(units):
                options = space.strategies(u, d)
                if not options:
                    return None
                chosen[u] = old[u] if old.get(u) in options else rng.choice(options)
        return chosen

    def energy(plan: Plan) -> tuple[float, PlanCost]:
        c = space.cost(plan)
        if c.feasible:
            return c.step_s, c
        over = max(c.memory.values(), default=space.usable) / space.usable
        return 1e6 * over, c

    part = next((p for p in parts if len(p) == 1), parts[0]) if start is None else start.sets
    alloc = allocs[part][0] if start is None else start.devices
    chosen = fill(part, alloc, {} if start is None else dict(start.strategies)) or {}
    current = space.plan(part, alloc, chosen)
    e, c = energy(current)
    top: list[tuple[Plan, PlanCost]] = []
    _keep(top, current, c, keep)
    best_e, since_best = e, 0
    steps = 0
    while steps < max_steps and since_best < patience and (steps % 64 or time.monotonic() - t0 < seconds):
        steps += 1
        since_best += 1
        move = rng.random()
        new_part, new_alloc, new_chosen = part, alloc, dict(chosen)
        if move < 0.6 and new_chosen:
            u = rng.choice(sorted(new_chosen))
            d = alloc[current.set_of(u)]
            new_chosen[u] = rng.choice(space.strategies(u, d))
        elif move < 0.85 and len(allocs[part]) > 1:
            new_alloc = rng.choice(allocs[part])
        else:
            new_part = rng.choice(parts)
            new_alloc = rng.choice(allocs[new_part])
        filled = fill(new_part, new_alloc, new_chosen)
        if filled is None:
            continue
        candidate = space.plan(new_part, new_alloc, filled)
        e2, c2 = energy(candidate)
        _keep(top, candidate, c2, keep)
        scale = min(best_e, e)
        if e2 <= e or rng.random() < math.exp(-beta * (e2 - e) / scale):
            part, alloc, chosen, current, e = new_part, new_alloc, filled, candidate, e2
            if e < best_e:
                best_e, since_best = e, 0
    return _result(space, top, t0, before, "mcmc")
