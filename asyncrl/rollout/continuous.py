"""Continuous batching for a rollout pool of its own (`trainer.placement=split`).

`RolloutEngine.generate` decodes one batch until its longest response ends: with long-tailed
response lengths most rows sit finished while a few run on. Here one decode loop (a thread) runs
a fixed number of slots; every `generate` call (several at once: batches launched ahead of
training) queues its prompts, a prompt's n samples take n free slots as soon as there are n,
and a finished row frees its slot for the next prompt at once. Rows of different prompts,
calls and sampling settings share each forward.

The slots share one KV cache: a row that joins at cache length L gets its prompt's keys and
values (one prefill of that prompt) written into columns L-P .. L-1 and everything before masked
out; columns masked for every live row are dropped now and then. Positions are per row. With
`rollout.decode=compiled` (`continuous_batcher`), `CompiledBatcher` does the same on one
preallocated cache stepped by the engine's compiled decode step.

Weights change only between decode steps (`Weights`): with interrupts allowed a new version is
loaded at the next step (rows keep their KV cache from the old one, as in AReaL's interruptible
rollouts); otherwise no new prompt is admitted until the live rows end, then it is loaded. Each
response token records the version that produced it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache, StaticCache

from asyncrl.data.dataset import positions_from_mask
from asyncrl.rollout.engine import (
    PACKED_PREFILL_TOKENS,
    STATIC_WIDTH_STEP,
    RolloutEngine,
    prefill_packed,
    sample_tokens,
    token_groups,
)
from asyncrl.rollout.params import SamplingParams, last_positions, rollout_outputs

COMPACT_EVERY = 16  # drop fully masked leading cache columns once this many have piled up


class Weights(Protocol):
    """What the decode loop asks of the worker's weights between steps."""

    version: int
    interrupt: bool

    def pending(self) -> bool: ...

    def apply(self) -> None: ...


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    future: Future
    slots: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    live: int = 0


class ContinuousBatcher:
    """`generate` with the same inputs and outputs as `RolloutEngine.generate` (plus
    `behav_versions`), served by one decode loop shared by every caller."""

    def __init__(self, engine: RolloutEngine, slots: int, weights: Weights) -> None:
        self.engine, self.model, self.slots, self.weights = engine, engine.model, slots, weights
        self.stop_ids = engine.eos_token_ids
        self._queue: deque[_Request] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._owner: list[_Request | None] = []
        self.steps = 0  # decode steps run (forwards over all slots)

    # the callers' side ----------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        if params.n > self.slots:
            raise ValueError(f"rollout.n={params.n} samples of a prompt need as many slots; the continuous "
                             f"batcher has {self.slots} (raise rollout.decode_slots)")
        requests = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            prompt = [t for t, m in zip(ids, mask, strict=True) if m]
            requests.append(self.submit(prompt, params, generator))
        for r in requests:
            r.future.result()
        return self._outputs(input_ids, attention_mask, requests)

    def submit(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None = None) -> _Request:
        """Queue one prompt (token ids, no padding); its `future` completes when its `params.n`
        samples are in `tokens`, `logprobs` and `versions` (one list per sample)."""
        request = _Request(list(prompt), params, generator, Future())
        with self._cv:
            self._queue.append(request)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="continuous-batcher", daemon=True)
                self._thread.start()
            self._cv.notify()
        return request

    def _outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 requests: list[_Request]) -> dict[str, torch.Tensor]:
        n = requests[0].params.n if requests else 1
        rows = [(r, i) for r in requests for i in range(n)]
        width = max((len(r.tokens[i]) for r, i in rows), default=1) or 1
        pad = self.engine.pad_token_id
        responses = torch.full((len(rows), width), pad, dtype=torch.long)
        log_probs = torch.zeros((len(rows), width), dtype=torch.float32)
        versions = torch.zeros((len(rows), width), dtype=torch.long)
        resp_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, (r, i) in enumerate(rows):
            k = len(r.tokens[i])
            responses[j, :k] = torch.tensor(r.tokens[i])
            log_probs[j, :k] = torch.tensor(r.logprobs[i])
            versions[j, :k] = torch.tensor(r.versions[i])
            resp_mask[j, :k] = 1
        # built on the host from Python lists; the batch lives on the prompts' device
        device = input_ids.device
        responses, log_probs, versions, resp_mask = (t.to(device) for t in (responses, log_probs, versions, resp_mask))
        prompts = input_ids.repeat_interleave(n, dim=0)
        mask = torch.cat([attention_mask.long().repeat_interleave(n, dim=0), resp_mask], dim=1)
        out = rollout_outputs(prompts, mask, responses, log_probs)
        out["behav_versions"] = versions
        return out

    # the decode loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            with torch.no_grad():
                self._run()
        except BaseException as e:  # noqa: BLE001 - every waiting caller gets the error
            with self._cv:
                waiting = [*self._queue, *(o for o in self._owner if o is not None)]
                self._queue.clear()
            for r in waiting:
                if not r.future.done():
                    r.future.set_exception(e)

    def _reset(self) -> None:
        """No live rows: drop the cache (the next prompt starts a new one)."""
        S = self.slots
        self._owner: list[_Request | None] = [None] * S
        self._row = [0] * S  # which of its request's n samples a slot holds
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((S, 0), dtype=torch.long)
        self.start = [0] * S  # first cache column of each slot's row
        self.pos = torch.zeros((S, 1), dtype=torch.long)
        self.logits = torch.zeros((S, 0))
        self.logit_version = [0] * S  # the weights version each slot's next-token logits came from

    def _run(self) -> None:
        self._reset()
        self.model.eval()
        w = self.weights
        while True:
            live = any(o is not None for o in self._owner)
            if w.pending() and (w.interrupt or not live):
                w.apply()
            if w.interrupt or not w.pending():  # otherwise the live rows end first
                self._admit()
            if any(o is not None for o in self._owner):
                self._step()
                continue
            with self._cv:
                if not self._queue:
                    self._reset()
                    self._cv.wait(timeout=1.0)

    def _admit(self) -> None:
        """Give queued prompts free slots (n each, in queue order) and prefill them together."""
        free = [s for s in range(self.slots) if self._owner[s] is None]
        joining: list[tuple[_Request, list[int]]] = []
        with self._cv:
            while self._queue and len(free) >= self._queue[0].params.n:
                req = self._queue.popleft()
                joining.append((req, free[:req.params.n]))
                free = free[req.params.n:]
        if joining:
            self._join(joining)

    def _join(self, joining: list[tuple[_Request, list[int]]]) -> None:
        """Prefill the joining prompts into their slots; each row starts at its prompt's columns."""
        L = self._prefill(joining)
        for req, ss in joining:
            req.slots = list(ss)
            req.tokens, req.logprobs, req.versions = [[] for _ in ss], [[] for _ in ss], [[] for _ in ss]
            req.live = len(ss)
            for i, s in enumerate(ss):
                self._owner[s], self._row[s] = req, i
                self.start[s] = L - len(req.prompt)
                self.logit_version[s] = self.weights.version

    def _prefill(self, joining: list[tuple[_Request, list[int]]]) -> int:
        """One left-padded prefill of the joining prompts; their keys and values go into their
        slots ending at the cache's right edge (returned), their last logits into `logits`."""
        P = max(len(req.prompt) for req, _ in joining)
        ids = torch.full((len(joining), P), self.engine.pad_token_id, dtype=torch.long)
        pmask = torch.zeros_like(ids)
        for j, (req, _) in enumerate(joining):
            ids[j, P - len(req.prompt):] = torch.tensor(req.prompt)
            pmask[j, P - len(req.prompt):] = 1
        small = DynamicCache(config=getattr(self.model, "config", None))
        out = self.model(input_ids=ids, attention_mask=pmask, position_ids=positions_from_mask(pmask),
                         past_key_values=small, use_cache=True, logits_to_keep=last_positions(P, 1, ids.device))
        slots, source = _slots_and_sources(joining)
        L = self._place(small, pmask, slots, source)
        self.pos[slots] = pmask[source].sum(-1, keepdim=True)
        self._set_logits(slots, out.logits[source, -1].float())
        return L

    def _set_logits(self, slots: torch.Tensor, logits: torch.Tensor) -> None:
        if self.logits.shape[-1] != logits.shape[-1]:
            self.logits = logits.new_zeros((self.slots, logits.shape[-1]))
        self.logits[slots] = logits

    def _place(self, small: DynamicCache, pmask: torch.Tensor, slots: torch.Tensor, source: torch.Tensor) -> int:
        """The joining rows' prompt keys and values (`small`, P left-padded columns) into `slots`
        at the cache's right edge L (returned), widening the cache on the left when L < P."""
        P, L = pmask.shape[1], self.mask.shape[1]
        if self.cache is None:
            self.cache = DynamicCache(config=getattr(self.model, "config", None))
            for i, layer in enumerate(small.layers):
                shape = (self.slots, layer.keys.shape[1], P, layer.keys.shape[-1])
                self.cache.update(layer.keys.new_zeros(shape), layer.values.new_zeros(shape), i)
            self.mask = torch.zeros((self.slots, P), dtype=torch.long)
            L = P
        elif P > L:  # widen on the left
            for layer in self.cache.layers:
                extra = (self.slots, layer.keys.shape[1], P - L, layer.keys.shape[-1])
                layer.keys = torch.cat([layer.keys.new_zeros(extra), layer.keys], dim=2)
                layer.values = torch.cat([layer.values.new_zeros(extra), layer.values], dim=2)
            self.mask = torch.cat([self.mask.new_zeros((self.slots, P - L)), self.mask], dim=1)
            self.start = [s + P - L for s in self.start]
            L = P
        _copy_rows(self.cache, small, slots, source, L - P)
        self.mask[slots] = 0
        self.mask[slots, L - P:L] = pmask[source]
        return L

    def _step(self) -> None:
        """Sample one token for every live row, retire finished rows, run one forward."""
        S = self.slots
        tokens = torch.full((S,), self.engine.pad_token_id, dtype=torch.long)
        for params, generator, rows in self._sampling_groups():
            toks, lps = sample_tokens(self.logits[rows], params, generator)
            for s, t, lp in zip(rows, toks.tolist(), lps.tolist(), strict=True):
                req = self._owner[s]
                i = self._row[s]
                req.tokens[i].append(t)
                req.logprobs[i].append(lp)
                req.versions[i].append(self.logit_version[s])
                tokens[s] = t
                if t in self.stop_ids or t in req.params.stop_token_ids or len(req.tokens[i]) >= req.params.max_tokens:
                    self._owner[s] = None
                    req.live -= 1
                    if req.live == 0:
                        req.future.set_result(None)
        live = [s for s in range(S) if self._owner[s] is not None]
        if not live:
            return
        self.logits = self._forward(tokens, live)
        self.logit_version = [self.weights.version] * S
        self.pos = self.pos + 1
        self.steps += 1

    def _sampling_groups(self) -> list[tuple[SamplingParams, torch.Generator | None, list[int]]]:
        """The live slots by sampling settings and generator (a call's requests share theirs: one
        draw for all its rows, in its rows' order, as the engine alone draws)."""
        groups: dict[tuple[int, int], tuple[SamplingParams, torch.Generator | None, list[int]]] = {}
        for req in {id(o): o for o in self._owner if o is not None}.values():
            rows = [s for s in req.slots if self._owner[s] is req]
            key = (id(req.params), id(req.generator))
            groups.setdefault(key, (req.params, req.generator, []))[2].extend(rows)
        return list(groups.values())

    def _forward(self, tokens: torch.Tensor, live: list[int]) -> torch.Tensor:
        """One decode step over every slot: each slot's next-token logits (fp32)."""
        # every slot attends to its newest column (idle ones too: never a fully masked row)
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.slots, 1))], dim=1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=self.pos,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self._compact(live)
        return out.logits[:, -1].float()

    def _compact(self, live: list[int]) -> None:
        drop = min(self.start[s] for s in live)
        if drop < COMPACT_EVERY:
            return
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, drop:].contiguous()
            layer.values = layer.values[:, :, drop:].contiguous()
        self.mask = self.mask[:, drop:].contiguous()
        self.start = [max(0, s - drop) for s in self.start]


class CompiledBatcher(ContinuousBatcher):
    """The same continuous batch over a preallocated KV cache (`width` columns a slot) stepped by
    the engine's compiled decode step (`rollout.decode=compiled`): every step has the same shapes,
    so one graph serves every step, call and weight version. The columns in use are moved left in
    place when the cache is full (those no live row reads dropped); the cache grows, and the step
    compiles once more, only where a live row needs more columns than it has."""

    def __init__(self, engine: RolloutEngine, slots: int, weights: Weights) -> None:
        super().__init__(engine, slots, weights)
        self._compiled = engine.compiled_step()
        self._busy = contextlib.ExitStack()  # packed linears and matmul attention while rows are live
        self.width = 0

    def _reset(self) -> None:
        super()._reset()
        self._busy.close()
        self.cursor = 0  # the column the next step writes (every slot's)

    def _loop(self) -> None:
        try:
            super()._loop()
        finally:  # a failed step: the model's attention and linears as they were
            self._busy.close()

    def _prefill(self, joining: list[tuple[_Request, list[int]]]) -> int:
        """The joining prompts without padding (`prefill_packed`, in groups of up to
        PACKED_PREFILL_TOKENS tokens), each row's keys and values ending at the cursor."""
        if self.cache is None:
            self._busy.enter_context(self.engine.compiled_decoding())
        lengths = [len(req.prompt) for req, _ in joining]
        for group in token_groups(lengths, PACKED_PREFILL_TOKENS):
            part = joining[group.start:group.stop]
            tokens = torch.tensor([t for req, _ in part for t in req.prompt])
            logits, packed = prefill_packed(self.model, tokens, torch.tensor(lengths[group.start:group.stop]))
            if group.start == 0:
                self._make_room(packed, max(lengths), max(len(req.prompt) + req.params.max_tokens
                                                          for req, _ in joining))
            self._write(part, packed, logits)
        return self.cursor

    def _make_room(self, like: DynamicCache, prompt: int, longest: int) -> None:
        """A cache for rows of up to `longest` columns, and the cursor past `prompt` columns."""
        if self.cache is None or longest > self.width:
            self._grow(like, longest)
        if self.cursor < prompt:  # every row's columns move right: the prompt ends at the cursor
            self._shift(prompt - self.cursor)

    def _write(self, part: list[tuple[_Request, list[int]]], packed: DynamicCache, logits: torch.Tensor) -> None:
        """`part`'s prompts' keys and values (laid end to end in `packed`) into their slots'
        columns ending at the cursor; their positions and last logits."""
        slot_of, column, token, offset = [], [], [], 0
        for req, ss in part:
            n = len(req.prompt)
            for s in ss:
                slot_of += [s] * n
                column += range(self.cursor - n, self.cursor)
                token += range(offset, offset + n)
            offset += n
        slot_of, column, token = (torch.tensor(x) for x in (slot_of, column, token))
        for big, layer in zip(self.cache.layers, packed.layers, strict=True):
            big.keys[slot_of, :, column] = layer.keys[0].transpose(0, 1)[token]  # [tokens, kv heads, dim]
            big.values[slot_of, :, column] = layer.values[0].transpose(0, 1)[token]
        slots, source = _slots_and_sources(part)
        self.mask[slots] = 0
        self.mask[slot_of, column] = 1
        self.pos[slots] = torch.tensor([len(req.prompt) for req, _ in part])[source, None]
        self._set_logits(slots, logits[source])

    def _grow(self, small: DynamicCache, longest: int) -> None:
        """A cache of twice `longest` columns (rounded up), the columns in use copied over."""
        width = -(-2 * longest // STATIC_WIDTH_STEP) * STATIC_WIDTH_STEP
        cache = self.engine.static_cache(width)
        if cache is None:
            raise RuntimeError("this model's KV cache cannot be static: build the batcher with continuous_batcher()")
        for layer, like in zip(cache.layers, small.layers, strict=True):
            layer.lazy_initialization(*(t[:1].expand(self.slots, -1, -1, -1) for t in (like.keys, like.values)))
        mask = torch.zeros((self.slots, width), dtype=torch.long)
        if self.cache is not None:
            _copy_columns(cache, self.cache, self.cursor)
            mask[:, :self.cursor] = self.mask[:, :self.cursor]
        self.cache, self.mask, self.width = cache, mask, width
        self._set_cursor(self.cursor)

    def _shift(self, by: int) -> None:
        """Move every slot's columns `by` places (right if positive), in place."""
        c = self.cursor
        src, dst = (slice(0, c), slice(by, c + by)) if by > 0 else (slice(-by, c), slice(0, c + by))
        for layer in self.cache.layers:
            layer.keys[:, :, dst] = layer.keys[:, :, src].clone()
            layer.values[:, :, dst] = layer.values[:, :, src].clone()
        self.mask[:, dst] = self.mask[:, src].clone()
        if by > 0:
            self.mask[:, :by] = 0
        else:
            self.mask[:, c + by:] = 0
        self.start = [s + by for s in self.start]
        self._set_cursor(c + by)

    def _set_cursor(self, column: int) -> None:
        self.cursor = column
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(column)

    def _forward(self, tokens: torch.Tensor, live: list[int]) -> torch.Tensor:
        if self.cursor == self.width:  # full: drop the columns no live row reads, or grow
            drop = min(self.start[s] for s in live)
            if drop >= self.width // 4:  # each move frees a quarter of the cache or more
                self._shift(-drop)
            else:
                self._grow(self.cache, self.width)
        self.mask[:, self.cursor] = 1  # every slot attends to its newest column (idle ones too)
        logits = self._compiled(self.model, tokens[:, None], self.mask, self.pos, self.cache)
        self.cursor += 1  # the step's write moved the cache's own count
        return logits


def continuous_batcher(engine: RolloutEngine, slots: int, weights: Weights) -> ContinuousBatcher:
    """The engine's continuous batch: compiled where its decode is and the model's KV cache can
    be static (sliding windows: eager, logged once)."""
    if engine.decode == "compiled" and engine.static_cache(STATIC_WIDTH_STEP) is not None:
        return CompiledBatcher(engine, slots, weights)
    return ContinuousBatcher(engine, slots, weights)

def _slots_and_sources(joining: list[tuple[_Request, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every joining row's slot, and the index of its prompt in `joining`."""
    slots = torch.tensor([s for _, ss in joining for s in ss])
    source = torch.tensor([j for j, (_, ss) in enumerate(joining) for _ in ss])
    return slots, source


def _copy_rows(cache: DynamicCache | StaticCache, small: DynamicCache, slots: torch.Tensor, source: torch.Tensor,
               at: int) -> None:
    """`small`'s rows `source` into `cache`'s rows `slots`, from column `at` on."""
    for big, layer in zip(cache.layers, small.layers, strict=True):
        width = layer.keys.shape[2]
        big.keys[slots, :, at:at + width] = layer.keys[source]
        big.values[slots, :, at:at + width] = layer.values[source]


def _copy_columns(cache: StaticCache, old: StaticCache, columns: int) -> None:
    """`old`'s first `columns` columns of every row into `cache`."""
    for big, layer in zip(cache.layers, old.layers, strict=True):
        big.keys[:, :, :columns] = layer.keys[:, :, :columns]
        big.values[:, :, :columns] = layer.values[:, :, :columns]
