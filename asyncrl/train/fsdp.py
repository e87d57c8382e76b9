"""Training backend: PyTorch FSDP2 (`fully_shard`) over torch.distributed.

Parallelism is applied by plain functions before the engine is built, torchtitan style
(`asyncrl.train.parallelize` runs `apply_tp` over the tp dim, then `apply_fsdp` over dp):

    layout = ParallelLayout.from_config(cfg.parallel, world_size)
    model = parallelize(model, layout, mixed_precision_policy(device))
    engine = FSDPEngine(model, layout, optim=OptimConfig(...))

gloo on CPU, NCCL on GPU. Every method of `FSDPEngine` except `rng_state`/`set_rng_state` is a
collective: all ranks of the mesh must call it, in the same order, with the same number of
micro-batches, or the job hangs.
"""

from __future__ import annotations

import logging
import os
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from asyncrl.single_controller.config import COLLECTIVE_TIMEOUT_ENV
from asyncrl.single_controller.memory import release_host_memory, spare_bytes
from asyncrl.single_controller.parallel import ParallelLayout, pure_dp
from asyncrl.single_controller.peers import open_group as open_peer_group
from asyncrl.train.common import EngineError, find_blocks, local_tensor, start_step_metrics
from asyncrl.train.engine import LossFn
from asyncrl.train.export import export_full, export_streamed
from asyncrl.train.lora import is_lora_param, plain_name
from asyncrl.train.offload import OptimizerOffload
from asyncrl.train.optim import OptimConfig, lr_multiplier
from transport import trace

log = logging.getLogger(__name__)

# Optimizer state keyed by parameter name (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`), not
# by param-group index: pipeline stages hold different parameters in their "group 0", and DCP
# would otherwise keep one rank's group for all.
OPTIM_STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
ADAPTER_STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)  # LoRA: no base weights


# HF Llama/Qwen2 names of the token embedding and the LM head, one tensor when tied
TIED_PAIR = ("model.embed_tokens.weight", "lm_head.weight")


def init_distributed(backend: str | None = None) -> None:
    """Join the default process group from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; idempotent.

    The backend defaults to gloo on CPU-only hosts and to `cpu:gloo,cuda:nccl` when CUDA is
    present (NCCL for tensors on the GPU, gloo for CPU tensors). WORLD_SIZE=1 without
    MASTER_ADDR needs no rendezvous.
    """
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():  # one visible GPU (asyncrl's placement) is cuda:0
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local if torch.cuda.device_count() > 1 else 0)
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    timeout = collective_timeout()
    if timeout is not None:
        # every group made later (`new_group`, device meshes) takes torch's module default, which
        # this is: a hung collective raises after worker.collective_timeout_s instead of 30 min
        import torch.distributed.distributed_c10d as c10d

        c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise EngineError(
                f"WORLD_SIZE={world_size} but {', '.join(missing)} is not set; start the worker "
                "through the node daemon (it sets the rendezvous env) or export them yourself"
            )
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    open_peer_group()  # the group `group.apply` functions sum over (asyncrl.single_controller.peers)
    log.info("process group up: rank %d of %d, backend %s", rank, world_size, backend)


def collective_timeout() -> timedelta | None:
    """worker.collective_timeout_s as the driver passed it to this worker (None: torch's default)."""
    value = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    return timedelta(seconds=float(value)) if value else None


def compute_dtype(device: str | torch.device, dtype: str = "auto") -> torch.dtype:
    """`model.dtype` on `device`: "auto" is bfloat16 on a GPU and float32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, dtype)


def warn_if_bf16_is_slow(device: str | torch.device, dtype: str = "auto") -> None:
    """Log a warning where bf16 compute runs on a CPU without native bf16 matrix kernels (no
    AVX512-BF16 or AMX): its backward matmuls there run tens of times slower than fp32."""
    if compute_dtype(device, dtype) != torch.bfloat16 or torch.device(device).type != "cpu":
        return
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native = True  # cannot tell: say nothing
    if not native:
        log.warning("model.dtype=bfloat16 on a CPU without native bf16 kernels (no AVX512-BF16/AMX): "
                    "training matmuls run tens of times slower than in float32 here; use "
                    "model.dtype=float32 on this machine (bf16 is for GPUs and bf16-capable CPUs)")


def mixed_precision_policy(device: str | torch.device, enabled: bool = True, dtype: str = "auto") -> MixedPrecisionPolicy:
    """Compute in `model.dtype` (bf16 on a GPU by default) with fp32 gradient reduction, the
    parameters kept as they are stored (fp32 master weights); fp32 throughout when not `enabled`."""
    if enabled and compute_dtype(device, dtype) == torch.bfloat16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


# Models at most this large are sharded as one FSDP unit and accumulate micro-batches unsharded:
# per-block units buy peak memory at the cost of a collective per block per pass, and below this
# size the memory is noise (gathered params and full grads, twice the model) while the
# collectives were 37 % of the quickstart's update on 2 gloo ranks (81.9 -> 64.4 ms a step)
ONE_UNIT_MAX_BYTES = 64 * 2**20
# Above it, a step of several micro-batches still keeps the gathered parameters and their
# unreduced gradients across its micro-batches (one reduction a step, not one per micro-batch)
# when this many times what that holds at once (the parameters and their gradients, unsharded,
# at 4 bytes each: an upper bound) is spare on the device: the 0.5B shape on 2 cores, in
# micro-batches of 2 rows, 23.6 -> 22.0 s an update (`python -m benchmarks.training`)
UNSHARDED_ROOM = 2.0


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None,
               reshard_after_forward: bool = True, unit: str = "auto") -> nn.Module:
    """Shard `model` with FSDP2 over `mesh` (the layout's dp sub-mesh): `unit="block"` shards
    each decoder block, then the root (which also holds tied embeddings); `"model"` the root
    alone; `"auto"` picks "model" up to ONE_UNIT_MAX_BYTES of parameters. Moves the parameters
    to the mesh's device.

    Build the model in fp32: FSDP keeps the sharded parameters (and so AdamW state and the
    exported weights) in the dtype they arrive in.
    """
    if unit not in ("auto", "block", "model"):
        raise EngineError(f"apply_fsdp(unit={unit!r}): use 'auto', 'block' or 'model'")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    if unit == "auto":
        unit = "model" if parameter_bytes(model) <= ONE_UNIT_MAX_BYTES else "block"
    blocks = find_blocks(model) if unit == "block" else []
    if unit == "block" and not blocks:
        log.warning("no ModuleList of blocks in %s; sharding the root only", type(model).__name__)
    for i, block in enumerate(blocks):
        # the last block and the root are the backward's first: gathered again at once, so kept
        # (torchtitan's choice: two fewer all-gathers a micro-batch, the same peak)
        last = i == len(blocks) - 1
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward and not last, mp_policy=mp_policy)
    # the root (alone: the whole model) is the backward's first too
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy)
    log.info("sharded %s: %s over %d ranks, %s", type(model).__name__,
             f"{len(blocks)} blocks" if blocks else "one unit", mesh.size(),
             "bf16 params / fp32 reduce" if mp_policy.param_dtype is not None else "fp32")
    return model


def sparse_tied_embedding(model: nn.Module) -> bool:
    """Have a trained input embedding tied to the LM head hand autograd a sparse gradient (the
    rows of the tokens seen), which autograd adds into the head's dense one: no [vocab, hidden]
    zeros and sum each micro-batch (on 2 cores, 0.4 + 0.5 s a micro-batch of the 0.5B shape
    before the allocator kept its pages). Untied, a sparse gradient would reach FSDP, so only a
    tied one; returns whether it did."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(emb, nn.Embedding) or emb.weight is not getattr(head, "weight", None):
        return False
    emb.sparse = emb.weight.requires_grad
    return emb.sparse


def parameter_bytes(model: nn.Module) -> int:
    """The bytes of `model`'s parameters (global shapes; a tied tensor once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def one_unit(model: nn.Module) -> bool:
    """Whether `model` is sharded as a single FSDP unit (no FSDP module below its root)."""
    return isinstance(model, FSDPModule) and not any(
        isinstance(m, FSDPModule) for name, m in model.named_modules() if name)


def tied_parameter_names(model: nn.Module) -> set[str]:
    """Names that alias an earlier parameter (tied embeddings)."""
    seen: set[int] = set()
    tied: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.add(id(p))
    return tied


class FSDPEngine:
    """An already-parallelised model (see `parallelize`) with AdamW over its local shards, the
    train step, and checkpoints. Gradients and metrics are averaged over `layout`'s dp
    sub-mesh: the ranks of one TP group see the same rows and hold the same metrics.

    With `optim=None` the engine is inference-only (e.g. a reference model): parameters are
    frozen and no optimizer state is allocated.

    Tied input/output embeddings work (both live in the root's FSDP group); the HF export
    writes the tied tensor once, as `save_pretrained` does. With a bf16 mixed-precision policy
    the model's outputs are bf16, so upcast logits in the loss.

    Layouts with pp > 1 need `asyncrl.train.pipeline.PipelineEngine` over the stage that
    `parallelize` returns.
    """

    pipelined = False  # whether this engine runs a pipeline over the layout's pp dim

    def __init__(
        self,
        model: nn.Module,
        layout: ParallelLayout,
        *,
        optim: OptimConfig | None,
        device: str | None = None,
        accumulate_unsharded: bool | None = None,
        offload: str = "none",
    ) -> None:
        if not dist.is_initialized():
            raise EngineError("call asyncrl.train.init_distributed() before building a FSDPEngine")
        if layout.size("pp") > 1 and not self.pipelined:
            raise EngineError(f"layout {layout.describe()} has pipeline stages: build "
                              "asyncrl.train.PipelineEngine(parallelize(model, layout), layout, ...) "
                              "instead of FSDPEngine")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.layout = layout
        self.mesh = layout.submesh("dp", self.device.type)
        self.rank = dist.get_rank()
        self.optim_config = optim
        # the HF export writes each tied tensor once
        self._tied_names = tied_parameter_names(model)
        self._pending_save: Any = None  # an asynchronous save's future (save_checkpoint)
        self.lora: dict[str, Any] | None = None  # LoRA settings for the adapter export (rank, alpha, ...)
        self._checkpoint_group: dist.ProcessGroup | None = None

        if optim is None:
            model.requires_grad_(False)
            model.eval()
        elif self.device.type == "cpu" and layout.size("tp") == 1:  # a GPU writes the dense one at its bandwidth
            sparse_tied_embedding(model)
        self.model = model
        # None: always for one unit, else by the spare memory at each step (`_accumulates_unsharded`)
        self.accumulate_unsharded = True if accumulate_unsharded is None and one_unit(model) else accumulate_unsharded

        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if optim is not None:
            self._params = [p for p in model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(
                self._params,
                lr=optim.lr,
                betas=optim.betas,
                eps=optim.eps,
                weight_decay=optim.weight_decay,
                # one fused kernel per step (CPU and CUDA); foreach's multi-tensor ops each went
                # through DTensor dispatch: 6-7 ms a step on the quickstart's CPU ranks, fused 2-3.5
                fused=True,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda step: lr_multiplier(step, optim)
            )
        # actor.offload: AdamW's state in host memory between its steps, with `all` the weights during the
        # rollout too (asyncrl.train.offload)
        self.offload = OptimizerOffload([self.optimizer] if self.optimizer else [], offload)

    # -- training ---------------------------------------------------------------------------

    def train_step(self, micro_batches: list[Any], loss_fn: LossFn) -> dict[str, float]:
        """Accumulate gradients over `micro_batches`, clip, step AdamW and the lr schedule.

        `loss_fn(model, micro_batch)` returns `(loss, metrics)`. The loss must already be scaled
        for this micro-batch: gradients are summed over micro-batches and then *averaged* over
        the dp ranks by FSDP, so with equal rows per dp rank scale a per-micro-batch mean by
        `micro_rows / rank_rows` (for a global token mean with unequal counts per rank, scale a
        token sum by `dp_size / global_tokens`). All ranks must pass the same number of
        micro-batches and return the same metric names; the ranks of one TP group must pass the
        same rows.

        Returns the summed scaled loss (`loss`, i.e. the rank's objective), the metrics averaged
        over micro-batches, all averaged over dp ranks, plus the pre-clip `grad_norm`, the `lr`
        used and `skipped` (1.0 when a non-finite grad norm skipped the update).
        """
        if self.optimizer is None or self.scheduler is None or self.optim_config is None:
            raise EngineError("this engine was built with optim=None (inference only)")
        if not micro_batches:
            raise EngineError("train_step needs at least one micro-batch")
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        per_micro: dict[str, list[Tensor]] = {}  # a sequence-parallel turn this rank does not own logs nothing
        accumulate = len(micro_batches) > 1 and self._accumulates_unsharded()
        for i, micro_batch in enumerate(micro_batches):
            if accumulate:  # gathered params kept, grads reduced once, after the last micro-batch
                last = i == len(micro_batches) - 1
                self.model.set_requires_gradient_sync(last)
                self.model.set_reshard_after_backward(last)
            with trace.span("forward", "compute", micro_batch=i):
                loss, metrics = loss_fn(self.model, micro_batch)
            with trace.span("backward", "compute", micro_batch=i):
                loss.backward()
            loss_sum += loss.detach().float()
            for k, v in metrics.items():
                per_micro.setdefault(k, []).append(torch.as_tensor(v, dtype=torch.float32).detach().to(self.device))

        # TP peers hold equal values, so reducing over dp suffices; reduced while the optimizer steps
        metrics_done = start_step_metrics(loss_sum, per_micro, self.mesh.get_group())
        with trace.span("optimizer step", "compute"):
            grad_norm, lr, finite = self._optimizer_step()
        with trace.span("all_reduce metrics", "collective"):
            out = metrics_done()
        out.update(grad_norm=grad_norm.item(), lr=float(lr), skipped=0.0 if finite else 1.0)
        return {**out, **self.offload.metrics()}

    def state_on_device(self) -> Any:
        """A block in which the optimizer's state is on the device (it may live in host memory
        between steps: actor.offload)."""
        return self.offload.on_device()

    def weights_away(self, keep: list[Tensor]) -> None:
        """actor.offload=all, while the rollout generates: the weight shards to host memory (but
        those `keep` shares: generation weights that are the training shards themselves)."""
        self.offload.weights_away(self.model.parameters(), keep)

    def weights_back(self) -> None:
        """The weight shards on the device again (before a pass that reads them)."""
        self.offload.weights_back()

    def _accumulates_unsharded(self) -> bool:
        """Whether this step's micro-batches accumulate unsharded: as set, or (None) when
        UNSHARDED_ROOM times the unsharded parameters and gradients are spare now on every rank
        of the dp group (whose collectives must match)."""
        if self.accumulate_unsharded is not None:
            return self.accumulate_unsharded
        fits = spare_bytes(str(self.device)) >= UNSHARDED_ROOM * 2 * parameter_bytes(self.model)
        if self.mesh.size() == 1:
            return fits
        every = torch.tensor([int(fits)], device=self.device)
        dist.all_reduce(every, op=dist.ReduceOp.MIN, group=self.mesh.get_group())
        return bool(every.item())

    def _optimizer_step(self) -> tuple[Tensor, float, bool]:
        """Clip the accumulated grads, step AdamW and the lr schedule unless the grad norm is
        non-finite, zero the grads; returns (pre-clip grad norm, lr used, whether it stepped)."""
        grad_norm = self._clip_grads(self.optim_config.grad_clip)
        lr = float(self.optimizer.param_groups[0]["lr"])
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            with self.state_on_device():
                self.optimizer.step()
            self.scheduler.step()
        else:
            log.warning("non-finite grad norm %s: skipping this optimizer step", grad_norm.item())
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr, finite

    def _clip_grads(self, max_norm: float) -> Tensor:
        """Global L2 norm of the sharded grads (a collective), clipped to `max_norm` if finite."""
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        total = global_grad_norm(grads).to(self.device)
        if max_norm > 0 and torch.isfinite(total):
            # torch's clip_grads_with_norm_ formula, applied to the local shards in place
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            with torch.no_grad():
                torch._foreach_mul_([local_tensor(g) for g in grads], coef)
        return total

    # -- generation weights ----------------------------------------------------------------------

    def generation_buffers(self) -> nn.Module:
        """Where a generation model takes its buffers (rotary tables) from: this model's own."""
        return self.model

    def resharder(self, gen: ParallelLayout, full_model: nn.Module, dtype: torch.dtype, keep_experts: bool = False) -> Any:
        """The 3D-HybridEngine reshard of this engine's shards into the generation layout `gen` (with
        `keep_experts`, each rank's FSDP block of experts only: expert-parallel generation)."""
        from asyncrl.train.reshard import Resharder

        return Resharder(self.model, self.layout, gen, full_model=full_model, dtype=dtype, keep_experts=keep_experts)

    def expert_group(self) -> Any:
        """The ranks that split each MoE layer's experts: FSDP2 shards them over the dp ranks."""
        return self.mesh.get_group()

    # -- state dicts and checkpoints -----------------------------------------------------------

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, Tensor]:
        """The unsharded model state dict on CPU; with rank0_only the other ranks get {}."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
        sd = get_model_state_dict(self.model, options=opts)
        if not rank0_only:
            sd = {k: v.cpu() for k, v in sd.items()}
        return sd

    def release_unsharded(self) -> None:
        """Free the parameters a forward-only pass left gathered (FSDP2 reshards them in the
        backward, which a no-grad pass never runs) and give freed host memory back to the OS."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        release_host_memory()

    def load_full_state_dict(self, sd: dict[str, Tensor], broadcast_from_rank0: bool = False) -> None:
        """Load an unsharded state dict; with broadcast_from_rank0 only rank 0 needs to hold it."""
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0)
        # set_model_state_dict rewrites the dict it is given (values become this rank's shards).
        set_model_state_dict(self.model, dict(sd), options=opts)

    def save_checkpoint(
        self, path: str | Path, extra: dict[str, Any] | None = None, *, tokenizer: Any = None,
        export_dtype: torch.dtype | None = None, asynchronous: bool = False,
    ) -> None:
        """Write a resumable checkpoint under `path`, plus an HF export in `path/hf` (rank 0).

        Layout: `dcp/` (torch.distributed.checkpoint: sharded model + optimizer; every rank
        writes its shards, rank 0 the metadata, so `path` must be on a filesystem all ranks
        share when they span nodes), `rank{r}.pt` (the parallel layout, scheduler state and
        `extra`, per rank, so per-rank RNG state round-trips), `hf/` (config,
        model.safetensors or shards of at most `EXPORT_SHARD_BYTES` with their index, in
        `export_dtype` when given, tokenizer). `extra` must hold tensors and plain Python
        containers/scalars (loaded weights_only).

        `asynchronous`: the sharded state is copied to host memory and `dcp/` written by a
        background thread while training goes on (`torch.distributed.checkpoint.async_save`, over
        a gloo group of its own); `finish_checkpoint()` waits for it, and the next save or load
        does first. The other parts are written before this returns.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.finish_checkpoint()
        with self.state_on_device():  # an asynchronous save copies it to host memory before it returns
            if asynchronous:
                if self._checkpoint_group is None:  # the background thread's collectives: never on the training group
                    self._checkpoint_group = dist.new_group(backend="gloo")
                self._pending_save = dcp.async_save(self._sharded_state(), checkpoint_id=path / "dcp",
                                                    process_group=self._checkpoint_group)
            else:
                dcp.save(self._sharded_state(), checkpoint_id=path / "dcp")
        torch.save(
            {
                "layout": self.layout.to_wire(),
                "tied": bool(self._tied_names),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "extra": extra,
            },
            path / f"rank{self.rank}.pt",
        )
        if self.pipelined:  # the stages' dicts meet on rank 0
            full = self.full_state_dict(rank0_only=True)
            if self.rank == 0:
                export_full(self.model, path / "hf", full, self._tied_names, tokenizer, export_dtype)
        else:
            export_streamed(self.model, path / "hf", self._tied_names, tokenizer, export_dtype, lora=self.lora)
        dist.barrier()  # the default group is the layout's ranks (ParallelLayout.device_mesh)
        log.info("saved checkpoint %s", path)

    def checkpoint_pending(self) -> bool:
        """Whether an asynchronous save is still writing (no wait)."""
        return self._pending_save is not None and not self._pending_save.done()

    def finish_checkpoint(self) -> float:
        """Wait for an asynchronous save's background write; returns the seconds waited (0 when
        none is pending). A failed write raises here."""
        if self._pending_save is None:
            return 0.0
        t0 = time.perf_counter()
        pending, self._pending_save = self._pending_save, None
        pending.result()
        return time.perf_counter() - t0

    def load_checkpoint(self, path: str | Path) -> dict[str, Any] | None:
        """Restore model, optimizer and scheduler from `save_checkpoint(path)`; return its extra.

        The checkpoint may come from another layout (tp/dp split, even world size): DCP
        reshards the model and optimizer onto this one. The per-rank part (scheduler and
        `extra`, e.g. RNG states) is each rank's own only when the layout is the same; otherwise
        every rank gets rank 0's, so ranks that must agree (a TP group's shuffles) do, and
        per-rank RNG streams are not restored.
        """
        path = Path(path)
        self.finish_checkpoint()
        meta = self._read_meta(path)
        if meta.get("tied") is False and self._tied_names:
            raise EngineError(
                f"checkpoint {path} trained the token embedding and the LM head as two weights "
                "(pipeline stages untie them), but this model ties them, so one trained weight "
                "would be lost; resume with the same actor.parallel.pp > 1, or start a new run "
                f"from its export (model.path={path / 'hf'}), which loads untied")
        with self.state_on_device():
            self._load_sharded(path)
        if self.scheduler is not None and meta["scheduler"] is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        log.info("loaded checkpoint %s", path)
        return meta["extra"]

    def _load_sharded(self, path: Path) -> None:
        """Model and optimizer shards from `path/dcp` (resharded onto this layout)."""
        state = self._sharded_state()
        copies = _alias_tied_keys(state, path / "dcp")
        dcp.load(state, checkpoint_id=path / "dcp")
        for sub, key, twin, kept in copies:  # weights this model keeps apart, from the tied one
            if kept is None:
                state[sub][key] = state[sub].pop(twin)
            elif isinstance(kept, Tensor):
                kept.copy_(state[sub][twin])
                state[sub][key] = kept
            else:
                state[sub][key] = state[sub][twin]
        if self.optimizer is not None:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=OPTIM_STATE_OPTIONS if self.lora is None else ADAPTER_STATE_OPTIONS,
            )
        else:
            set_model_state_dict(self.model, state["model"])

    def _read_meta(self, path: Path) -> dict[str, Any]:
        """This rank's `rank{r}.pt` when `path` was saved in this layout, else rank 0's."""
        first = path / "rank0.pt"
        if not first.exists():
            raise EngineError(f"no {first}: not a checkpoint written by FSDPEngine.save_checkpoint")
        meta = torch.load(first, weights_only=True)
        # checkpoints from before layouts were recorded are pure-DP ones of `world_size` ranks
        saved = ParallelLayout.from_wire(meta["layout"]) if "layout" in meta else pure_dp(meta["world_size"])
        if saved == self.layout:
            return meta if self.rank == 0 else torch.load(path / f"rank{self.rank}.pt", weights_only=True)
        if self.rank == 0:
            log.warning("checkpoint %s was saved in layout %s, this job is %s: resharding the model "
                        "and optimizer; every rank resumes rank 0's scheduler and extra state "
                        "(per-rank RNG is not restored)", path, saved.describe(), self.layout.describe())
        return meta

    def _sharded_state(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        # Note: on a fresh optimizer this initialises AdamW state with a zero-grad, lr=0 step
        # (needed so dcp.load has tensors to fill), which sets its step counter to 1.
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=OPTIM_STATE_OPTIONS)
        if self.lora is not None:  # the adapters, the trained parameters and their optimizer state: the base is model.path's
            trained = {plain_name(n) for n, p in self.model.named_parameters() if p.requires_grad or is_lora_param(n)}
            model_sd = {k: v for k, v in model_sd.items() if k in trained}
        return {"model": model_sd, "optim": optim_sd}

    # -- RNG (per process; not collective) ----------------------------------------------------

    @staticmethod
    def rng_state() -> dict[str, Any]:
        return rng_state()

    @staticmethod
    def set_rng_state(state: dict[str, Any]) -> None:
        set_rng_state(state)


def global_grad_norm(grads: list[Tensor]) -> Tensor:
    """The L2 norm of `grads`, DTensors that may live on different meshes (FSDP+TP puts matrices
    on ('dp', 'tp') and norms on ('dp',)); a collective whose result every rank shares.

    Each local shard's sum of squares is summed over the mesh dims its tensor is split along,
    not those it is replicated on. (torch's get_total_norm stacks per-tensor norms, which
    needs one mesh.)
    """
    groups: dict[str, dist.ProcessGroup] = {}
    split_over: list[frozenset[str]] = []
    squares: list[Tensor] = []
    for g in grads:
        names: set[str] = set()
        if isinstance(g, DTensor):
            if any(p.is_partial() for p in g.placements):
                g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
            for dim, placement in enumerate(g.placements):
                if not placement.is_replicate():  # Shard or FSDP's _StridedShard
                    group = g.device_mesh.get_group(dim)
                    groups[group.group_name] = group
                    names.add(group.group_name)
        split_over.append(frozenset(names))
        squares.append(torch.linalg.vector_norm(local_tensor(g), dtype=torch.float32).square())
    # one collective per process group over the stacked sums of squares of those split over it
    sums = torch.stack(squares)
    for name, group in groups.items():
        mask = torch.tensor([name in s for s in split_over], device=sums.device)
        part = torch.where(mask, sums, 0.0)
        dist.all_reduce(part, group=group)
        sums = torch.where(mask, part, sums)
    return sums.sum().sqrt()


def _twin(key: str) -> str | None:
    """`key` with the embedding's name swapped for the LM head's (or back); None if neither."""
    embed, head = TIED_PAIR
    if embed in key:
        return key.replace(embed, head)
    if head in key:
        return key.replace(head, embed)
    return None


def _alias_tied_keys(state: dict[str, Any], checkpoint: Path) -> list[tuple[str, str, str, Any]]:
    """Let an untied model (pipeline stages) load a checkpoint written tied, where only one of
    the embedding / LM head entries exists: each missing key is read from its twin. Returns
    (section, key, twin, the key's own value if the twin is also this model's, else None) for
    putting them back after `dcp.load`."""
    saved = set(dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    saved_prefixes = {k.rsplit(".", 1)[0] for k in saved}
    copies = []
    for sub, entries in state.items():
        for key in list(entries):
            full = f"{sub}.{key}"
            twin = _twin(key)
            if twin is None or full in saved or any(s.startswith(full + ".") for s in saved_prefixes | saved):
                continue
            if f"{sub}.{twin}" not in saved and not any(s.startswith(f"{sub}.{twin}.") for s in saved):
                continue
            own = entries.pop(key)
            if twin in entries:
                copies.append((sub, key, twin, own))
            else:
                entries[twin] = own
                copies.append((sub, key, twin, None))
    return copies


def rng_state() -> dict[str, Any]:
    """torch CPU (+CUDA), python `random` and numpy RNG state, as torch.load(weights_only)-safe
    values."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` returned."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
