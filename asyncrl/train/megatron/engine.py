"""`MegatronEngine`: the `TrainEngine` over megatron-core's `GPTModel` — TP × PP × DP over the
worker group's own ranks (megatron's `parallel_state` built on the group's process group), its DDP,
distributed optimizer (fp32 masters sharded over DP) and 1F1B schedule, asyncrl's loss functions
and LR schedule."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.single_controller.memory import release_host_memory
from asyncrl.single_controller.parallel import ParallelLayout
from asyncrl.train.common import reduce_step_metrics
from asyncrl.train.engine import LossFn
from asyncrl.train.experts import fuse_experts
from asyncrl.train.fsdp import EngineError
from asyncrl.train.megatron.checkpoint import adam_step, load_optimizer, save_optimizer
from asyncrl.train.megatron.convert import (
    GPTShape,
    Reader,
    SafetensorsReader,
    hf_tensors,
    megatron_shard,
)
from asyncrl.train.megatron.cpu import adapt_for_cpu, cuda_on_cpu
from asyncrl.train.megatron.export import export_hf
from asyncrl.train.megatron.model import (
    HFView,
    MegatronRoutes,
    build_gpt,
    keep_padding_row,
    mark_tensor_parallel,
    moe_config,
)
from asyncrl.train.megatron.schedule import run_pipeline
from asyncrl.train.offload import OptimizerOffload
from asyncrl.train.optim import OptimConfig, lr_multiplier
from asyncrl.train.pipeline import all_gather_values, broadcast_value, forward_through

log = logging.getLogger(__name__)


def init_model_parallel(tp: int, pp: int, seed: int, ep: int = 1) -> None:
    """megatron's parallel state over this process group's ranks (p-d-t, TP innermost, as
    `ParallelLayout`; experts split over `ep` of the data-parallel ranks), once per process; the
    TP RNG tracker seeded."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, pp, ep):
            raise EngineError(f"megatron's parallel state is tp={have[0]} pp={have[1]} ep={have[2]} in this process; "
                              f"an engine of tp={tp} pp={pp} ep={ep} cannot share it")
        return
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


@dataclass
class ExpertParallel:
    """A mixture of experts' expert parallelism: `size` ranks (`group`) each hold experts / size of
    the experts, replicated over the ranks of `dp_group` (where the optimizer shards them)."""

    size: int = 1
    rank: int = 0
    group: Any = None
    dp_group: Any = None
    stage_rules: list | None = None  # every EP rank's rules of this stage (made on first use)


class MegatronEngine:
    """An HF decoder trained (or, with `optim=None`, run forward only) as megatron-core's GPTModel,
    over the layout's tp × dp, and pp through megatron's 1F1B schedule (`pipelined`)."""

    def __init__(self, path: str, layout: ParallelLayout, *, optim: OptimConfig | None, device: str | torch.device,
                 dtype: torch.dtype, seed: int = 0, recompute: bool = False, reader: Reader | None = None,
                 value_head: bool = False, ep: int = 1, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 router_replay: bool = False, offload: str = "none") -> None:
        from transformers import AutoConfig

        adapt_for_cpu()
        self.device, self.layout, self.optim_config = torch.device(device), layout, optim
        self.hf_config = AutoConfig.from_pretrained(path, **({"num_labels": 1} if value_head else {}))
        self.shape = replace(GPTShape.from_hf(self.hf_config), value_head=value_head)
        if value_head:  # the export is the value model, as the FSDP2 critic's
            self.hf_config.architectures = [type_name.replace("ForCausalLM", "ForTokenClassification")
                                            for type_name in self.hf_config.architectures or []]
        self.tp, self.pp = layout.size("tp"), layout.size("pp")
        self.shape.check_tp(self.tp, self.pp)
        self.shape.check_pp(self.pp)
        self.shape.check_ep(ep)
        init_model_parallel(self.tp, self.pp, seed, ep)
        self._groups()
        self.steps, self.seed = 0, seed
        moe = moe_config(self.shape, ep, aux_loss_coef, z_loss_coef, replay=router_replay and bool(self.shape.experts))
        with cuda_on_cpu():  # a tied head on its own stage is synchronised from the embedding's
            gpt = build_gpt(self.shape, self.tp, self.pp, dtype, recompute, self.pp_rank, moe)
        routes = self._router_replays(gpt) if moe.get("moe_enable_routing_replay") else None
        self.gpt = gpt.to(self.device)
        keep_padding_row(self.gpt, getattr(self.hf_config, "pad_token_id", None))
        for p in self.gpt.parameters():  # the local spec's torch norms are made in fp32
            p.data = p.data.to(dtype)
        self.rules = list(self.shape.rules(self.pp_rank, self.pp, self.experts.rank, ep))
        mark_tensor_parallel(self.gpt, self.rules)
        self.load_hf(reader or SafetensorsReader(path))
        self.model = HFView(self.gpt, self.shape)
        self.model.routes = routes  # what `asyncrl.roles.routing.start` finds on the model
        self.ddp = self.optimizer = None
        if optim is None:
            self.gpt.requires_grad_(False)
            self.gpt.eval()
        else:
            self._build_optimizer(optim, dtype)
        # actor.offload=optimizer: Adam's state in host memory between its steps (asyncrl.train.offload)
        self.offload = OptimizerOffload([o.optimizer for o in self._optimizers()], offload)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def _router_replays(self, gpt: Any) -> MegatronRoutes:
        """This model's routers' `RouterReplay`s, in layer order (megatron lists every model's in
        one process-wide list; only the actor's are built with replay)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        mine = [m.router_replay for m in gpt.modules() if getattr(m, "router_replay", None) is not None]
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if any(r is m for m in mine)]
        return MegatronRoutes(mine, self.shape, self.tp, self.tp_rank, self.tp_group)

    def _groups(self) -> None:
        from megatron.core import parallel_state as ps

        self.tp_rank, self.tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        self.pp_rank, self.pp_group = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.experts = ExpertParallel(ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
                                      ps.get_expert_model_parallel_group(), ps.get_expert_data_parallel_group())

    lora: dict[str, Any] | None = None  # the megatron backend trains no adapters (asyncrl.engines)

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp - 1

    def _build_optimizer(self, optim: OptimConfig, dtype: torch.dtype) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.gpt.config.finalize_model_grads_func = finalize_model_grads  # what the pipeline schedule calls
        with cuda_on_cpu():
            self.ddp = DistributedDataParallel(self.gpt.config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=True), self.gpt)
            self.optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
                adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.grad_clip if optim.grad_clip > 0 else 0.0,
                bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=True), [self.ddp])

    # weights ----------------------------------------------------------------------------------
    def local_tensors(self) -> dict[str, Tensor]:
        """This rank's Megatron tensors by Megatron name (the tied head is the embedding)."""
        return dict(self.gpt.named_parameters())

    @torch.no_grad()
    def load_hf(self, read: Reader) -> None:
        """Fill this rank's shards from HF tensors (each rank reads the parts it holds)."""
        local = self.local_tensors()
        for rule in self.rules:
            try:
                local[rule.megatron].copy_(megatron_shard(rule, read, self.shape, self.tp, self.tp_rank))
            except KeyError:
                if not rule.megatron.startswith("value_head."):
                    raise
                self._fresh_value_head(local[rule.megatron], rule.megatron.endswith("bias"))

    def _fresh_value_head(self, param: Tensor, bias: bool) -> None:
        """A causal LM's checkpoint has no value head: normal(0, init_std), the same on every rank."""
        if bias:
            param.zero_()
            return
        gen = torch.Generator().manual_seed(self.seed)
        param.copy_(torch.randn(param.shape, generator=gen) * self.shape.init_std)

    def gather_tp(self, t: Tensor, group_ranks: int | None = None) -> list[Tensor]:
        """Every TP rank's shard of a tensor (a collective over the TP group)."""
        if self.tp == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return parts

    def gather_ep(self, index: int, tensors: dict[str, Tensor], stats: Any = None) -> dict[str, Tensor]:
        """Rule `index`'s HF tensors from every expert-parallel rank: an expert rule's are each EP
        rank's own experts (a collective over the EP group), any other rule's are the same
        everywhere. `stats` (a `ReshardStats`) counts the bytes received."""
        rule = self.rules[index]
        ep = self.experts
        if ep.size == 1 or ".local_experts." not in rule.megatron:
            return tensors
        if ep.stage_rules is None:  # every EP rank's rules of this stage, aligned with ours
            ep.stage_rules = [list(self.shape.rules(self.pp_rank, self.pp, r, ep.size)) for r in range(ep.size)]
        out = {}
        for name, t in tensors.items():
            parts = [torch.empty_like(t) for _ in range(ep.size)]
            dist.all_gather(parts, t.contiguous(), group=ep.group)
            if stats is not None:
                stats.bytes_received += (ep.size - 1) * t.numel() * t.element_size()
                stats.collectives += 1
            for r, part in enumerate(parts):
                out[ep.stage_rules[r][index].hf[rule.hf.index(name)]] = part
        return out

    def hf_state(self, index: int, tensor: Tensor) -> dict[str, Tensor]:
        """Rule `index`'s whole HF tensors (checkpoint names) from this rank's shard `tensor` of
        it (a collective over the TP and EP groups)."""
        rule = self.rules[index]
        return self.gather_ep(index, hf_tensors(rule, self.gather_tp(tensor.detach()), self.shape, self.tp))

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, Tensor]:
        """The whole model by HF name (the model's own: experts fused as transformers holds
        them), on CPU (a collective over the TP, EP and PP groups)."""
        local, out = self.local_tensors(), {}
        for i, rule in enumerate(self.rules):
            out.update({name: t.cpu() for name, t in self.hf_state(i, local[rule.megatron]).items()})
        if self.pp > 1:
            out = {k: v for stage in all_gather_values(out, self.pp_group, self.device) for k, v in stage.items()}
        if self.shape.experts:
            fuse_experts(out, None, self.shape.names)
        return {} if rank0_only and self.rank != 0 else out

    def load_full_state_dict(self, sd: dict[str, Tensor], broadcast_from_rank0: bool = False) -> None:
        if broadcast_from_rank0:
            raise EngineError("MegatronEngine.load_full_state_dict needs the whole state dict on every rank")
        from asyncrl.train.experts import per_expert
        from asyncrl.train.megatron.convert import dict_reader
        self.load_hf(dict_reader({n: t for k, v in sd.items() for n, t in per_expert(k, v, self.shape.names)}))

    def generation_buffers(self) -> torch.device:
        """A generation model makes its own rotary tables, on this device."""
        return self.device

    def resharder(self, gen: ParallelLayout, full_model: Any, dtype: torch.dtype, keep_experts: bool = False) -> Any:
        """The 3D-HybridEngine reshard of these TP shards into the generation layout `gen` (with
        `keep_experts`, each rank's own experts only: expert-parallel generation)."""
        from asyncrl.train.megatron.reshard import MegatronResharder

        return MegatronResharder(self, gen, dtype, keep_experts)

    def expert_group(self) -> Any:
        """The ranks that split each MoE layer's experts (megatron's EP group), None when one."""
        return self.experts.group

    def release_unsharded(self) -> None:
        release_host_memory()

    def weights_away(self, keep: list[Tensor]) -> None:
        """actor.offload=all, while the rollout generates: the parameter and gradient buffers (and
        the distributed optimizer's fp32 main shards) to host memory; generation weights that view
        them (`keep`) get their own copies first."""
        main = [p for o in self._optimizers() for group in o.optimizer.param_groups for p in group["params"]]
        self.offload.weights_away([*self.gpt.parameters(), *main], keep, copy_kept=True)

    def weights_back(self) -> None:
        """The buffers on the device again, bit for bit, before the next pass."""
        self.offload.weights_back()

    # training ---------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[Any], loss_fn: LossFn) -> dict[str, float]:
        """Gradients summed over the micro-batches (through the pipeline when pp > 1), averaged
        over DP by megatron's DDP, one step of the distributed optimizer (it clips); the metrics
        averaged over DP, the same on every stage (see `FSDPEngine.train_step`)."""
        if self.optimizer is None:
            raise EngineError("this engine was built with optim=None (inference only)")
        if not micro_batches:
            raise EngineError("train_step needs at least one micro-batch")
        self.gpt.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        results: dict[int, tuple[Tensor, dict[str, Tensor]]] = {}

        def on_output(model: Any, i: int) -> Tensor:
            loss, metrics = loss_fn(model, micro_batches[i])
            results[i] = (loss.detach().float(), {k: torch.as_tensor(v, dtype=torch.float32).detach().to(self.device)
                                                  for k, v in metrics.items()})
            return loss

        if self.pp > 1:
            run_pipeline(self, micro_batches, on_output, train=True)
        else:
            self._accumulate(micro_batches, on_output)
        lr = self._set_lr()
        with cuda_on_cpu(), self.offload.on_device():
            stepped, grad_norm, _ = self.optimizer.step()
        self.steps += 1
        out = self._metrics(results, len(micro_batches)) if self.is_last else None
        if self.pp > 1:
            out = broadcast_value(out, dist.get_global_rank(self.pp_group, self.pp - 1), self.pp_group, self.device)
        return {**out, **self._router_losses(len(micro_batches)), "grad_norm": float(grad_norm or 0.0), "lr": lr,
                "skipped": 0.0 if stepped else 1.0, **self.offload.metrics()}

    def _router_losses(self, micro_batches: int) -> dict[str, float]:
        """A mixture of experts' load-balancing and z-losses of this step (megatron tracks them
        per layer when their coefficients are on), layer and micro-batch means, as `moe/aux_loss`
        and `moe/z_loss` (the FSDP2 path's names); then cleared for the next step."""
        if not self.shape.experts:
            return {}
        from megatron.core.transformer.moe import moe_utils

        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if not tracker:
            return {}
        moe_utils.reduce_aux_losses_tracker_across_ranks()
        names = {"load_balancing_loss": "moe/aux_loss", "z_loss": "moe/z_loss"}
        out = {names.get(k, f"moe/{k}"): float(v["values"].sum()) / (self.shape.layers * micro_batches)
               for k, v in tracker.items()}
        moe_utils.clear_aux_losses_tracker()
        return out

    def _accumulate(self, micro_batches: list[Any], on_output: Any) -> None:
        from megatron.core.distributed import finalize_model_grads

        for i in range(len(micro_batches)):
            on_output(self.model, i).backward()
        finalize_model_grads([self.ddp])

    def _metrics(self, results: dict[int, tuple[Tensor, dict[str, Tensor]]], n: int) -> dict[str, float]:
        """The summed loss and the metrics' means over micro-batches, averaged over DP (`_max`: the largest)."""
        per_micro = {k: [results[i][1][k] for i in range(n)] for k in results[0][1]}
        return reduce_step_metrics(torch.stack([results[i][0] for i in range(n)]).sum(), per_micro, self.dp_group)

    def forward(self, micro_batches: list[Any], fn: Any) -> list[Any] | None:
        """`fn(model, micro_batch)` per micro-batch through the pipeline, without gradients: the
        results on the last stage, None on the others."""
        return forward_through(micro_batches, fn, lambda on_output: run_pipeline(self, micro_batches, on_output, train=False),
                               self.device, self.is_last)

    def _set_lr(self) -> float:
        lr = self.optim_config.lr * lr_multiplier(self.steps, self.optim_config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _optimizers(self) -> list[Any]:
        if self.optimizer is None:
            return []
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    # checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None, *, tokenizer: Any = None,
                        export_dtype: torch.dtype | None = None, asynchronous: bool = False) -> None:
        """The masters and Adam moments in HF space (`megatron/optim/`: resume in any layout), each
        rank's step, layout and `extra` (`megatron/rank{r}.pt`), and the HF export (`hf/`).
        Written synchronously."""
        path = Path(path)
        (path / "megatron").mkdir(parents=True, exist_ok=True)
        state = {"layout": self.layout.to_wire(), "steps": self.steps, "extra": extra}
        if self.optimizer is not None:
            with self.offload.on_device():
                save_optimizer(self, path / "megatron" / "optim")
                state["adam_step"] = adam_step(self)
        torch.save(state, path / "megatron" / f"rank{self.rank}.pt")
        export_hf(self, path / "hf", tokenizer, export_dtype)
        log.info("saved checkpoint %s", path)

    def checkpoint_pending(self) -> bool:
        return False

    def finish_checkpoint(self) -> float:
        return 0.0

    @torch.no_grad()
    def load_checkpoint(self, path: str | Path) -> dict[str, Any] | None:
        """Restore weights, optimizer state and step from `save_checkpoint(path)` of any layout;
        its `extra`: each rank's own in the same layout, else rank 0's (as `FSDPEngine`)."""
        path = Path(path) / "megatron"
        own, first = path / f"rank{self.rank}.pt", path / "rank0.pt"
        if not first.exists() or not (path / "optim").exists():
            raise EngineError(f"{path} holds no megatron checkpoint with optimizer state; start a new run "
                              f"from its HF export (model.path={path.parent / 'hf'})")
        t0 = time.perf_counter()
        state = torch.load(own if own.exists() else first, map_location="cpu", weights_only=False)
        if state["layout"] != self.layout.to_wire():
            state = torch.load(first, map_location="cpu", weights_only=False)
            log.info("resuming a checkpoint of layout %s in %s", state["layout"], self.layout.to_wire())
        with self.offload.on_device():
            load_optimizer(self, path / "optim", state.get("adam_step", 0.0))
        self.steps = int(state["steps"])
        log.info("loaded checkpoint %s in %.1f s", path.parent, time.perf_counter() - t0)
        return state["extra"]
