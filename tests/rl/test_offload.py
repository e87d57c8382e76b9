"""actor.offload=optimizer (asyncrl.train.offload): AdamW's state in host memory between its steps,
bit for bit, on 2 gloo CPU ranks (the mechanics; what it saves is a device's, priced by the planner)."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncrl.train.offload import HostCopy
from tests.helpers.gloo_ranks import run_ranks
from tests.rl.test_fsdp_engine import (
    OPTIM,
    STEPS,
    build_engine,
    loss_fn,
    rank_rows,
    split,
    step_batch,
    tiny_model,
)


def test_storages_go_to_host_buffers_and_come_back_bit_for_bit():
    base = torch.randn(64)
    view, other = base[8:24], torch.randn(3, 5)  # a view shares its base's storage: moved once
    before = [base.clone(), other.clone()]
    copy = HostCopy()
    assert copy.away([base, view, other]) == (64 + 15) * 4
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0  # freed while away
    assert copy.away([base]) == 0  # already away
    copy.back()
    assert torch.equal(base, before[0]) and torch.equal(other, before[1]) and torch.equal(view, before[0][8:24])
    held = copy.host
    copy.away([base, other])
    assert all(a is b for a, b in zip(copy.host, held, strict=True))  # host buffers kept between moves


def _job(rank: int, world_size: int, out_dir: Path) -> dict:
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed
    from asyncrl.train.common import local_tensor
    from asyncrl.train.offload import optimizer_tensors

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(), world_size)
    res: dict = {}
    for mode in ("none", "optimizer", "all"):
        engine = build_engine(tiny_model(0), OPTIM, layout)
        engine.offload.enabled, engine.offload.weights = mode != "none", mode == "all"
        metrics, held, weights_held = [], [], []
        for s in range(STEPS):
            metrics.append(engine.train_step(split(rank_rows(step_batch(s), rank, world_size), 2), loss_fn))
            held.append(sum(local_tensor(t).untyped_storage().nbytes() for t in optimizer_tensors([engine.optimizer])))
            engine.weights_away([])  # the rollout's turn (all: the weights leave the device)
            weights_held.append(sum(local_tensor(p).untyped_storage().nbytes() for p in engine.model.parameters()))
            engine.weights_back()
        res.setdefault("weights_held", {})[mode] = weights_held
        # offloaded: asynchronously (the state leaves for host memory while the save's thread writes its copy)
        engine.save_checkpoint(out_dir / f"ckpt-{mode}", asynchronous=mode == "optimizer")
        engine.finish_checkpoint()
        res[mode] = {"sd": engine.full_state_dict(), "metrics": metrics, "held": held}
        resumed = build_engine(tiny_model(1), OPTIM, layout)
        resumed.offload.enabled = mode != "none"
        resumed.load_checkpoint(out_dir / f"ckpt-{mode}")
        res[mode]["resumed_held"] = sum(local_tensor(t).untyped_storage().nbytes() for t in optimizer_tensors([resumed.optimizer]))
        after = split(rank_rows(step_batch(STEPS), rank, world_size), 2)
        res[mode]["next"] = (engine.train_step(after, loss_fn)["loss"], resumed.train_step(after, loss_fn)["loss"])
        res[mode]["next_sd"] = (engine.full_state_dict(), resumed.full_state_dict())
    return res


def test_an_offloaded_optimizer_trains_and_resumes_bit_for_bit(tmp_path):
    """Three steps with the state in host memory between them (and with offload=all the weights too,
    sent away and back between steps as around a rollout) equal three without, bit for bit;
    between steps the state holds no bytes where it lives (a device, there); a checkpoint (written
    asynchronously while the state goes back to host memory) saves and loads it; the next step of
    the resumed engine equals the continuing one's."""
    rank0, _ = run_ranks(_job, 2, tmp_path)
    plain, moved, both = rank0["none"], rank0["optimizer"], rank0["all"]
    assert all(torch.equal(plain["sd"][k], moved["sd"][k]) and torch.equal(plain["sd"][k], both["sd"][k])
               for k in plain["sd"])
    assert [m["loss"] for m in plain["metrics"]] == [m["loss"] for m in both["metrics"]]
    # offload=all: between a step and the next pass the weight shards hold no bytes where they live
    assert rank0["weights_held"]["all"] == [0] * STEPS and all(h > 0 for h in rank0["weights_held"]["none"])
    assert both["held"] == [0] * STEPS and both["metrics"][-1]["perf/offload_host_gib"] > moved["metrics"][-1][
        "perf/offload_host_gib"]
    assert [m["loss"] for m in plain["metrics"]] == [m["loss"] for m in moved["metrics"]]
    assert all(h > 0 for h in plain["held"]) and moved["held"] == [0] * STEPS
    assert moved["metrics"][-1]["perf/offload_host_gib"] * 2**30 == plain["held"][-1]
    assert moved["metrics"][-1]["perf/offload_s"] > 0 and "perf/offload_s" not in plain["metrics"][-1]
    assert moved["resumed_held"] == 0  # loaded, then moved to host memory
    for mode in (plain, moved):
        assert mode["next"][0] == mode["next"][1]
        continuing, resumed = mode["next_sd"]
        assert all(torch.equal(continuing[k], resumed[k]) for k in continuing)


def _megatron_job(rank: int, world_size: int, out_dir: Path) -> dict:
    from asyncrl.single_controller.parallel import ParallelConfig, ParallelLayout
    from asyncrl.train import init_distributed
    from asyncrl.train.megatron.engine import MegatronEngine
    from asyncrl.train.offload import optimizer_tensors
    from tests.rl.test_megatron import OPTIM as MEGATRON_OPTIM
    from tests.rl.test_megatron import lm_loss, step_rows

    init_distributed()
    layout = ParallelLayout.from_config(ParallelConfig(tp=2), world_size)  # Megatron TP 2: each rank its shard's state

    def engine(offload: str) -> MegatronEngine:
        return MegatronEngine(str(out_dir / "model"), layout, optim=MEGATRON_OPTIM, device="cpu", dtype=torch.float32,
                              seed=0, offload=offload)

    def held(e: MegatronEngine) -> int:
        return sum(t.untyped_storage().nbytes() for t in optimizer_tensors([o.optimizer for o in e._optimizers()]))

    def buffers(e: MegatronEngine) -> int:  # the parameter and gradient buffers' bytes where they live
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for p in e.gpt.parameters()
                    for t in (p, p.main_grad)}
        return sum(storages.values())

    res: dict = {}
    for mode in ("none", "optimizer", "all"):
        e = engine(mode)
        metrics, bytes_held, away = [], [], []
        for s in range(STEPS):
            metrics.append(e.train_step([step_rows(s, 64)], lm_loss))
            bytes_held.append(held(e))
            # the rollout's turn, its generation weights viewing the buffers (as a tp = tg reshard's do)
            generation = [p.detach()[:2] for p in e.gpt.parameters()]
            copies = [g.clone() for g in generation]
            e.weights_away(generation)
            away.append(buffers(e))
            res.setdefault("kept", []).append(all(torch.equal(g, c) for g, c in zip(generation, copies, strict=True)))
            e.weights_back()
        res.setdefault("away", {})[mode] = away
        e.save_checkpoint(out_dir / f"megatron-{mode}", extra={}, export_dtype=torch.float32)
        resumed = engine(mode)
        resumed.load_checkpoint(out_dir / f"megatron-{mode}")
        res[mode] = {"metrics": metrics, "held": bytes_held, "resumed_held": held(resumed),
                     "next": (e.train_step([step_rows(STEPS, 64)], lm_loss)["loss"],
                              resumed.train_step([step_rows(STEPS, 64)], lm_loss)["loss"]),
                     "sd": e.full_state_dict(rank0_only=False)}
    return res


def test_megatrons_offloaded_optimizer_trains_and_resumes_bit_for_bit(tmp_path):
    """The same on megatron's distributed optimizer (TP 2 on two gloo ranks): its Adam state in host
    memory between steps (and with offload=all its parameter and gradient buffers around each
    rollout), the steps and weights equal to the state kept, a checkpoint that resumes the same
    next step."""
    import pytest

    pytest.importorskip("megatron.core")
    from tests.rl.test_megatron import hf_model

    hf_model("qwen3").save_pretrained(tmp_path / "model")
    rank0, _ = run_ranks(_megatron_job, 2, tmp_path, timeout_s=240)
    plain, moved, both = rank0["none"], rank0["optimizer"], rank0["all"]
    assert [m["loss"] for m in plain["metrics"]] == [m["loss"] for m in moved["metrics"]] == [
        m["loss"] for m in both["metrics"]]
    assert all(torch.equal(plain["sd"][k], moved["sd"][k]) and torch.equal(plain["sd"][k], both["sd"][k])
               for k in plain["sd"])
    # offload=all: while the rollout runs the buffers hold no bytes where they live, and the
    # generation weights that viewed them read as they were (their own copies)
    assert rank0["away"]["all"] == [0] * STEPS and all(b > 0 for b in rank0["away"]["optimizer"])
    assert all(rank0["kept"]) and both["metrics"][-1]["perf/offload_host_gib"] > moved["metrics"][-1][
        "perf/offload_host_gib"]
    assert all(h > 0 for h in plain["held"]) and moved["held"] == [0] * STEPS
    assert moved["metrics"][-1]["perf/offload_host_gib"] * 2**30 == plain["held"][-1]
    assert moved["resumed_held"] == 0
    for mode in (plain, moved, both):
        assert mode["next"][0] == mode["next"][1]
