"""Native torch rollout engine for Hugging Face causal LMs: batched sampling over a KV cache.

One `generate` call prefills the left-padded prompts once, repeats the cache `n` times, then
decodes all rows together one token per step until every row has hit EOS / a stop id or
`max_tokens` is reached. No per-row Python work happens inside the decode loop.

Log-prob convention (shared by `generate` and `score`): the log-prob of a token is taken under
`log_softmax(logits / T)` of the *unmodified* logits, where `T` is the sampling temperature (1
when it is 0, i.e. greedy; `greedy=True` with T > 0 reports at T). Top-k / top-p truncation
shapes what is sampled but not the reported log-prob, so a trainer recomputing
`score(..., temperature=T)` gets the same numbers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from asyncrl.data.dataset import positions_from_mask
from asyncrl.data.images import (
    IMAGE_INPUTS,
    ROPE,
    flat_images,
    model_image_kwargs,
    rope_positions,
    vision_token_ids,
)
from asyncrl.rollout import attention, packed
from asyncrl.rollout.params import SamplingParams, WeightLoadError, last_positions, rollout_outputs
from asyncrl.train.moe import NOT_RECORDED, ROUTES, RoutingError, route_dtype, tap_of
from transport import trace

log = logging.getLogger(__name__)
STATIC_WIDTH_STEP = 32  # a compiled decode's KV cache width is a multiple of this (masked columns still cost attention)
STOP_CHECK_EVERY = 8  # a compiled decode reads "all rows finished?" back to the host this often
# a compiled decode's prefill runs the prompts without padding, this many tokens a forward at most
# (attention over a group is block-diagonal but computed whole: its cost grows with the square)
PACKED_PREFILL_TOKENS = 2048


def row_uniforms(generators: Sequence[torch.Generator], steps: int, device: torch.device) -> torch.Tensor:
    """[rows, steps] uniforms, row i drawn from `generators[i]` alone (on its own device, then
    moved): a row's first k draws are the same whatever `steps` is and whatever rows share the call."""
    return torch.stack([torch.rand(steps, generator=g, device=g.device) for g in generators]).to(device)


def candidate_probs(
    scaled_logits: torch.Tensor, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Truncated sampling distribution over candidates: (probs [N, K], vocab ids [N, K] or None).

    Top-k keeps the k best (a cheap partial sort); top-p then keeps the shortest best-first prefix
    whose mass reaches top_p, always at least one token. Dropped candidates get probability 0,
    kept ones are not renormalised (the sampler draws against the total). Ids are None when
    nothing is truncated and candidates are the whole vocabulary in order.
    """
    vocab = scaled_logits.shape[-1]
    if 0 < top_k < vocab:
        cand_logits, cand_ids = torch.topk(scaled_logits, top_k, dim=-1)  # sorted, best first
    elif top_p < 1.0:
        cand_logits, cand_ids = torch.sort(scaled_logits, dim=-1, descending=True)
    else:
        return scaled_logits.softmax(dim=-1), None
    probs = cand_logits.softmax(dim=-1)
    if top_p < 1.0:
        # drop a token once the mass strictly before it already reaches top_p
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        drop[..., 0] = False
        probs = probs.masked_fill(drop, 0.0)
    return probs, cand_ids


def draw(probs: torch.Tensor, generator: torch.Generator | None, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row of unnormalised probs [N, K] by inverse CDF: one uniform per row (about
    8x faster than torch.multinomial on CPU at K=4096, where random numbers dominate), drawn from
    `generator` unless given ([N, 1] `uniforms`)."""
    cdf = probs.cumsum(dim=-1)
    u = (torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype)
         if uniforms is None else uniforms.to(cdf.dtype))
    total = cdf[:, -1:].contiguous()
    idx = torch.searchsorted(cdf, u * total, right=True).squeeze(-1)
    # u * total can round up to total: fall back to the first index whose cdf reaches the total
    # (a token of nonzero probability; a binary search, not another pass over the vocabulary)
    reached = torch.searchsorted(cdf, total).squeeze(-1)
    return torch.where(idx < probs.shape[-1], idx, reached)


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None, banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from float logits [N, V]; return (tokens [N], log-probs [N]).
    `uniforms` [N, 1], when given, are the draws instead of `generator`'s; `banned` token ids are
    never picked (the reported log-probs stay those of the unmodified logits)."""
    logprobs = torch.log_softmax(_scaled(logits, params.logprob_temperature), dim=-1)
    if banned is not None:
        logits = logits.index_fill(-1, banned, float("-inf"))
    if params.is_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs, ids = candidate_probs(_scaled(logits, params.temperature), params.top_k, params.top_p)
        tokens = draw(probs, generator, uniforms)
        if ids is not None:
            tokens = ids.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / temperature`, without a copy at temperature 1."""
    return logits if temperature == 1.0 else logits / temperature


@torch.no_grad()
def score(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs [B, R] of the last `response_len` tokens of `input_ids` under one full forward.

    Uses `log_softmax(logits / temperature)`, the same convention as `generate`'s
    `rollout_log_probs`. Positions past a response's end are not masked here: multiply by the
    response mask. Wrapped in no_grad; a trainer that needs gradients calls the body itself.
    """
    if response_len < 1:
        return input_ids.new_zeros((input_ids.shape[0], 0), dtype=torch.float32)
    # logits at t predict token t+1: keep the R positions that predict the response tokens
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=last_positions(input_ids.shape[1], response_len + 1, input_ids.device),
    )
    logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, -response_len:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class RolloutEngine:
    """Generates responses from a causal LM it holds by reference (shares weights with a trainer
    in the in-process hybrid case; `load_weights` refreshes them otherwise). The model is moved
    to `device` (unless its weights are bound later, as `asyncrl.rollout.tp.GenerationModel`'s
    are), and switched to eval mode only for the duration of a `generate` call."""

    # capabilities (`asyncrl.rollout.base.Rollout`)
    holds_own_weights, step_hooks, sizes_own_batches, continuous_batching, lora_rank = False, True, False, True, 0

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_id: int | list[int],
        pad_token_id: int,
        device: str | torch.device = "cpu",
        decode: str = "eager",
    ) -> None:
        if decode not in ("eager", "compiled"):
            raise ValueError(f"decode must be 'eager' or 'compiled', got {decode!r}")
        self.device = torch.device(device)
        self.decode = decode
        self._compiled_forward: Callable | None = None
        self._packable = False  # its plain linears can run packed (`asyncrl.rollout.packed.install`)
        weightless = any(p.is_meta for p in model.parameters())
        self.model = model if weightless else model.to(self.device)
        self.eos_token_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.pad_token_id = pad_token_id
        # a vision-language model never writes its image placeholders (a trainer's pass would take
        # them for images to fill)
        banned = vision_token_ids(getattr(model, "config", None))
        self.banned = torch.tensor(banned, device=self.device) if banned else None

    @torch.no_grad()
    def load_weights(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> int:
        """Copy named tensors into the model's parameters/buffers in place; return how many."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        count = 0
        for name, tensor in items:
            target = targets.get(name)
            if target is None:
                raise WeightLoadError(
                    f"model has no parameter or buffer {name!r}; send names from the same "
                    f"architecture's named_parameters()/state_dict()"
                )
            if target.shape != tensor.shape:
                raise WeightLoadError(
                    f"shape mismatch for {name!r}: model {tuple(target.shape)}, "
                    f"got {tuple(tensor.shape)}; gather sharded tensors before loading"
                )
            target.copy_(tensor)  # copy_ converts dtype and device
            count += 1
        return count

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache,
        **inputs: torch.Tensor,
    ) -> torch.Tensor:
        """The last position's fp32 logits; `inputs`: the positions (and a prefill's images)."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=last_positions(input_ids.shape[1], 1, input_ids.device),
            **inputs,
        )
        return out.logits[:, -1].float()

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        before_step: Callable[[int], None] | None = None,
        record_routes: bool = False,
        images: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Sample `params.n` responses per left-padded prompt; rows come out as B*n, interleaved.

        `generator`: one for the call, or one per output row (B*n): each row then samples from
        its own alone, the same tokens whichever rows share the call (up to the forward's numerics).

        `before_step(t)` runs before the forward that produces response token t + 1 (e.g. to
        load newer weights mid-generation: the KV cache of earlier tokens is kept).

        Returns prompts, responses (right-padded to the longest response in this call),
        response_mask (1 up to and including the stop token), input_ids, attention_mask,
        position_ids and rollout_log_probs (see the module docstring; 0 where masked); with
        `record_routes` (a mixture-of-experts model) also `routed_experts` [rows, prompt + response,
        layers, k]: the experts each token was sent to (-1 for padding and the last token).

        `images` (a vision-language model): the prompts' image columns (`asyncrl.data.images`),
        carried to the outputs with every token's 3-D `rope_position_ids`; decoded eagerly.
        """
        dev = self.device
        input_ids = input_ids.to(dev)
        attention_mask = attention_mask.to(dev).long()
        n, max_tokens = params.n, params.max_tokens
        prompt_len = input_ids.shape[1]
        generator, noise = self._randomness(params, generator, input_ids.shape[0] * n)
        stop_ids = torch.tensor(
            self.eos_token_ids + list(params.stop_token_ids), dtype=torch.long, device=dev
        )

        routes = _Routes(self.model, input_ids, attention_mask, n, max_tokens) if record_routes else None
        vision = None if images is None else _ImagePrompts(self.model, input_ids, attention_mask, images)
        was_training = self.model.training
        self.model.eval()
        try:
            with self._packed_linears(routes is not None or vision is not None):
                responses, log_probs, full_mask, steps = self._decode(input_ids, attention_mask, params, generator,
                                                                      noise, stop_ids, before_step, routes, vision)
        finally:
            self.model.train(was_training)
            if routes is not None:
                routes.tap.stop()

        # trimmed copies, not views: callers may edit one output without touching another
        full_mask = full_mask[:, : prompt_len + steps].contiguous()
        out = rollout_outputs(input_ids.repeat_interleave(n, dim=0), full_mask,
                              responses[:, :steps].contiguous(), log_probs[:, :steps].contiguous())
        if routes is not None:
            out[ROUTES] = routes.table[:, :prompt_len + steps].contiguous()
        if vision is not None:
            out.update(vision.outputs(n, steps))
        return out

    def _randomness(self, params: SamplingParams, generator: torch.Generator | Sequence[torch.Generator] | None,
                    rows: int) -> tuple[torch.Generator | None, torch.Tensor | None]:
        """The call's generator (seeded from `params` when none is given), or with one generator
        a row, none and each row's uniforms [rows, max_tokens] drawn up front."""
        if generator is None and params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if generator is None or isinstance(generator, torch.Generator):
            return generator, None
        if len(generator) != rows:
            raise ValueError(f"{len(generator)} generators for {rows} rows: pass one per output row (B*n)")
        return None, None if params.is_greedy else row_uniforms(generator, params.max_tokens, self.device)

    def _decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None, noise: torch.Tensor | None, stop_ids: torch.Tensor,
                before_step: Callable[[int], None] | None, routes: _Routes | None,
                vision: _ImagePrompts | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Prefill, then sample a token per row per step: responses, their log-probs, the full
        attention mask (prompt + max_tokens columns or more) and the steps taken."""
        dev, n, max_tokens = self.device, params.n, params.max_tokens
        rows, prompt_len = input_ids.shape[0] * n, input_ids.shape[1]
        logits, static, forward, next_pos = self._prefill(input_ids, attention_mask, n, max_tokens, routes, vision)
        check_every, width = (1, prompt_len + max_tokens) if static is None else (STOP_CHECK_EVERY, static.width)

        # one preallocated mask for the whole call; step t attends to its first P+t+1 columns
        full_mask = attention_mask.new_zeros((rows, width))
        full_mask[:, :prompt_len] = attention_mask.repeat_interleave(n, dim=0)
        responses = input_ids.new_full((rows, max_tokens), self.pad_token_id)
        log_probs = torch.zeros((rows, max_tokens), dtype=torch.float32, device=dev)
        finished = torch.zeros(rows, dtype=torch.bool, device=dev)
        steps, draws = 0, _Draws(generator if check_every > 1 and not params.is_greedy else None)
        with trace.span("decode", "compute", rows=rows, compiled=static is not None), self._decode_attention(static):
            for t in range(max_tokens):
                draws.mark(t)
                tokens, token_lp = sample_tokens(logits, params, generator, None if noise is None else noise[:, t:t + 1],
                                                 self.banned)
                alive = ~finished
                tokens = torch.where(alive, tokens, self.pad_token_id)
                responses[:, t] = tokens
                log_probs[:, t] = torch.where(alive, token_lp, 0.0)
                full_mask[:, prompt_len + t] = alive
                finished |= torch.isin(tokens, stop_ids)
                steps = t + 1
                # a host sync to stop early: every step eager (cheap next to a forward), every few compiled
                if steps == max_tokens or (steps % check_every == 0 and bool(finished.all())):
                    break
                if before_step is not None:
                    before_step(t)
                logits = forward(tokens.unsqueeze(-1), full_mask, prompt_len + t + 1, next_pos)
                if routes is not None:
                    routes.decoded(t, alive)
                next_pos = next_pos + 1
        if check_every > 1:  # steps run after every row had finished made only padding: drop them
            alive = full_mask[:, prompt_len:prompt_len + steps].any(0).nonzero()
            steps = int(alive.max()) + 1 if alive.numel() else steps
            draws.rewind(steps)
        return responses, log_probs, full_mask, steps

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int, max_tokens: int,
                 routes: _Routes | None, vision: _ImagePrompts | None
                 ) -> tuple[torch.Tensor, _StaticDecode | None, Callable, torch.Tensor]:
        """The prompts' last logits (fanned out to B*n rows), the compiled decode's state (None:
        eager), the decode step and each row's next position [B*n, 1]."""
        prompt_len = input_ids.shape[1]
        position_ids = positions_from_mask(attention_mask)
        plain = routes is None and vision is None
        static = self._static_decode(n, prompt_len + max_tokens) if plain else None
        with trace.span("prefill", "compute", rows=input_ids.shape[0], prompt=prompt_len, packed=static is not None):
            if static is not None:
                logits = static.prefill(input_ids, attention_mask)
            else:
                cache = _new_cache(self.model)
                inputs = {"position_ids": position_ids} if vision is None else vision.prefill_inputs()
                logits = self._forward(input_ids, attention_mask, cache=cache, **inputs)
        if routes is not None:
            routes.prefilled()
        if static is not None:
            forward = static.step
        else:
            if n > 1:  # prefill once per prompt, then fan out the cache: cheaper than n prefills
                cache.batch_repeat_interleave(n)
            forward = self._dynamic_step(cache)
        logits = logits.repeat_interleave(n, dim=0) if n > 1 else logits
        next_pos = position_ids[:, -1:] + 1 if vision is None else vision.next_positions
        return logits, static, forward, next_pos.repeat_interleave(n, dim=0)

    def _dynamic_step(self, cache: DynamicCache) -> Callable:
        def forward(tokens: torch.Tensor, mask: torch.Tensor, columns: int, positions: torch.Tensor) -> torch.Tensor:
            return self._forward(tokens, mask[:, :columns], cache, position_ids=positions)
        return forward

    def _static_decode(self, n: int, columns: int) -> _StaticDecode | None:
        """With decode=compiled: a preallocated KV cache for the call (its prefill packed) and the
        compiled step that writes into it; None with decode=eager or where the model's cache is
        not all full-attention layers (sliding windows decode eagerly, logged once)."""
        if self.decode != "compiled":
            return None
        width = -(-columns // STATIC_WIDTH_STEP) * STATIC_WIDTH_STEP
        cache = self.static_cache(width)
        return None if cache is None else _StaticDecode(cache, n, width, self.model, self.compiled_step())

    def static_cache(self, width: int) -> StaticCache | None:
        """A KV cache of `width` columns a row for the compiled step; None (and decode=eager from
        now on, logged once) where the model has sliding-window or other non-static layers."""
        cache = StaticCache(config=self.model.config, max_cache_len=width)
        if all(type(layer) is StaticLayer for layer in cache.layers):
            return cache
        log.warning("rollout.decode=compiled: this model's KV cache has sliding-window or other "
                    "non-static layers; decoding eagerly")
        self.decode = "eager"
        return None

    def compiled_step(self) -> Callable:
        """The compiled decode step `(model, tokens, mask, positions, static cache) -> fp32 logits`
        every caller of this engine shares (a second width or row count: one dynamic graph)."""
        if self._compiled_forward is None:
            # no CUDA graphs: a KV cache per call and weights rebound every step would give them new
            # static addresses each call, which torch re-records without bound (nor counts)
            self._compiled_forward = torch.compile(_static_forward)
        return self._compiled_forward

    def _decode_attention(self, static: _StaticDecode | None) -> contextlib.AbstractContextManager:
        """A compiled decode on CPU: attention by matmuls (`asyncrl.rollout.attention`)."""
        if static is None or self.device.type != "cpu":
            return contextlib.nullcontext()
        return attention.decoding(self.model)

    def _packed_linears(self, eager: bool) -> contextlib.AbstractContextManager:
        """decode=compiled on CPU: the call's linears on oneDNN-packed weights (`asyncrl.rollout.packed`);
        not for a call that decodes eagerly (routes recorded, image prompts)."""
        if eager or not self._packs():
            return contextlib.nullcontext()
        if not self._packable:
            packed.install(self.model)
            self._packable = True
        return packed.active()

    def keeping_packs(self) -> contextlib.AbstractContextManager:
        """Around calls with the same weights (a multi-turn rollout's waves): a compiled CPU decode
        packs each linear once for all of them, not once a call (`asyncrl.rollout.packed.kept`)."""
        return packed.kept() if self._packs() else contextlib.nullcontext()

    def _packs(self) -> bool:
        """Whether a compiled decode's linears run packed here (decode=compiled, CPU, oneDNN)."""
        return self.decode == "compiled" and self.device.type == "cpu" and packed.available()

    @contextlib.contextmanager
    def compiled_decoding(self) -> Iterator[None]:
        """Where the compiled step runs on CPU: packed linears and attention by matmuls."""
        with self._packed_linears(False), (attention.decoding(self.model) if self.device.type == "cpu"
                                           else contextlib.nullcontext()):
            yield


def _static_forward(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                    cache: StaticCache) -> torch.Tensor:
    out = model(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()


class _StaticDecode:
    """One call's preallocated KV cache (rows x `width` columns, the prompts' keys and values in
    the first columns, left-padded) and the compiled forward of one decode step over it: every
    step has the same shapes, so a graph is compiled once per (rows, width) and weights updated
    in place or rebound reuse it."""

    def __init__(self, cache: StaticCache, n: int, width: int, model: torch.nn.Module, compiled: Callable) -> None:
        self.cache, self.n, self.width, self.model, self.compiled = cache, n, width, model, compiled

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The prompts without their padding, packed in groups of up to PACKED_PREFILL_TOKENS
        tokens (a block-diagonal causal mask each); their keys and values go to each row's
        columns (fanned out to `n` samples a prompt). Returns each prompt's last logits (fp32)."""
        lengths, total = attention_mask.sum(-1), input_ids.shape[0] * self.n
        groups = [slice(r.start, r.stop) for r in token_groups(lengths.tolist(), PACKED_PREFILL_TOKENS)]
        logits = [self._prefill_group(input_ids[g], attention_mask[g].bool(), lengths[g], g.start, total)
                  for g in groups]
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(input_ids.shape[1])
        return torch.cat(logits)

    def _prefill_group(self, input_ids: torch.Tensor, real: torch.Tensor, lengths: torch.Tensor, first: int,
                       total: int) -> torch.Tensor:
        logits, packed_cache = prefill_packed(self.model, input_ids[real], lengths)
        columns = real.nonzero()[:, 1]  # each token's column in its left-padded row, in packing order
        segment = torch.repeat_interleave(torch.arange(len(lengths), device=input_ids.device), lengths)
        rows = (first + segment) * self.n
        for layer, source in zip(self.cache.layers, packed_cache.layers, strict=True):
            if not layer.is_initialized:  # from the shapes only: every row x kv heads x dim
                layer.lazy_initialization(*(t.expand(total, -1, -1, -1) for t in (source.keys, source.values)))
            keys, values = source.keys[0].transpose(0, 1), source.values[0].transpose(0, 1)  # [tokens, kv heads, dim]
            for sample in range(self.n):
                layer.keys[rows + sample, :, columns] = keys
                layer.values[rows + sample, :, columns] = values
        return logits

    def step(self, tokens: torch.Tensor, mask: torch.Tensor, columns: int, positions: torch.Tensor) -> torch.Tensor:
        return self.compiled(self.model, tokens, mask, positions, self.cache)


def prefill_packed(model: torch.nn.Module, tokens: torch.Tensor, lengths: torch.Tensor
                   ) -> tuple[torch.Tensor, DynamicCache]:
    """One forward over prompts laid end to end (`tokens`, `lengths` tokens each) with a
    block-diagonal causal mask: each prompt's last logits (fp32) and a cache of every token's
    keys and values in that order ([1, kv heads, tokens, dim] a layer)."""
    dev = tokens.device
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lengths)
    ends = lengths.cumsum(0)
    order = torch.arange(segment.numel(), device=dev)
    positions = order - (ends - lengths)[segment]  # each token's place in its own prompt
    causal = (segment[:, None] == segment[None, :]) & (order[:, None] >= order[None, :])
    cache = _new_cache(model)
    # on CPU attention runs prompt by prompt (`asyncrl.rollout.attention`), not over the whole mask
    by_prompt = dev.type == "cpu"
    bounds = {"cu_seq_lens_q": torch.cat([ends.new_zeros(1), ends])} if by_prompt else {}
    with attention.decoding(model) if by_prompt else contextlib.nullcontext():
        out = model(input_ids=tokens[None], attention_mask=causal[None, None], position_ids=positions[None],
                    past_key_values=cache, use_cache=True, logits_to_keep=ends - 1, **bounds)
    return out.logits[0].float(), cache


def token_groups(lengths: list[int], budget: int) -> list[range]:
    """Consecutive rows whose lengths add up to at most `budget` (a longer row alone)."""
    groups: list[range] = []
    start, total = 0, 0
    for i, length in enumerate(lengths):
        if i > start and total + length > budget:
            groups.append(range(start, i))
            start, total = i, 0
        total += length
    groups.append(range(start, len(lengths)))
    return groups


class _Draws:
    """A shared generator's state before each step since the last stop check: the steps a
    compiled decode runs after every row has finished give their random numbers back, so the
    generator continues as after an eager decode."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator, self.states = generator, {}

    def mark(self, t: int) -> None:
        if self.generator is not None:
            if t % STOP_CHECK_EVERY == 0:
                self.states.clear()
            self.states[t] = self.generator.get_state()

    def rewind(self, steps: int) -> None:
        if self.generator is not None and steps in self.states:
            self.generator.set_state(self.states[steps])


class _ImagePrompts:
    """One call's image inputs: what the prefill adds to its forward, and each prompt's 3-D rope
    positions (the response's text tokens go on from the prompt's largest, all three alike)."""

    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 images: Mapping[str, torch.Tensor]) -> None:
        self.columns = {name: images[name].to(input_ids.device) for name in IMAGE_INPUTS}
        self.grid = flat_images(self.columns)[1]
        self.positions = rope_positions(model, input_ids, attention_mask, self.grid)  # [B, 3, P]
        self.next_positions = self.positions.amax(dim=(1, 2))[:, None] + 1

    def prefill_inputs(self) -> dict[str, torch.Tensor]:
        return model_image_kwargs({**self.columns, ROPE: self.positions})

    def outputs(self, n: int, steps: int) -> dict[str, torch.Tensor]:
        """The B*n output rows' image columns and `rope_position_ids` [rows, 3, prompt + steps]."""
        response = self.next_positions.repeat_interleave(n, dim=0) + torch.arange(steps, device=self.grid.device)
        rope = torch.cat([self.positions.repeat_interleave(n, dim=0), response[:, None].expand(-1, 3, -1)], dim=2)
        return {ROPE: rope, **{name: t.repeat_interleave(n, dim=0) for name, t in self.columns.items()}}


class _Routes:
    """The experts a mixture-of-experts model's routers chose for each token of one `generate`
    call: the prompts' from the prefill, each response token's from the decode step that reads it."""

    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 n: int, max_tokens: int) -> None:
        tap = tap_of(model)
        if tap is None:
            raise RoutingError("record_routes=True needs a mixture-of-experts model; this one has no routers")
        self.tap, self.n, self.mask = tap, n, attention_mask
        self.prompt_len = input_ids.shape[1]
        rows = input_ids.shape[0] * n
        self.table = torch.full((rows, self.prompt_len + max_tokens, tap.layers, tap.top_k), NOT_RECORDED,
                                dtype=route_dtype(tap.num_experts), device=input_ids.device)
        tap.start(record=True)

    def prefilled(self) -> None:
        batch = self.mask.shape[0]
        chosen = self.tap.chosen().reshape(batch, self.prompt_len, self.tap.layers, self.tap.top_k)
        chosen = chosen.masked_fill(~self.mask.bool()[:, :, None, None], NOT_RECORDED)
        self.table[:, :self.prompt_len] = chosen.repeat_interleave(self.n, dim=0)

    def decoded(self, t: int, alive: torch.Tensor) -> None:
        chosen = self.tap.chosen().reshape(len(alive), self.tap.layers, self.tap.top_k)
        self.table[:, self.prompt_len + t] = chosen.masked_fill(~alive[:, None, None], NOT_RECORDED)


def _new_cache(model: torch.nn.Module) -> DynamicCache:
    # with the config the cache builds the right layer kinds (sliding-window, linear attention)
    config = getattr(model, "config", None)
    return DynamicCache(config=config) if config is not None else DynamicCache()
