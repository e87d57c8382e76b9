"""Asynchronous RL: the weight bridge between pools, generation ahead of training with bounded
staleness, split placement end to end (and its resume after a killed rollout worker)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from asyncrl.rollout import RolloutEngine, SamplingParams
from asyncrl.train.weight_sync import Relay, TensorSpec, WeightBridge, bridge_plan, buckets, digest
from daemons.proc import kill_group
from tests.helpers import forked
from tests.rl.test_rl import LAUNCH, REPO, SMALL, _env, _launch


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from asyncrl.models.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny", task="sort", hidden=64,
                             layers=2, heads=2, sft_steps=0)


SPECS = [TensorSpec("a", (3, 4), torch.float32), TensorSpec("b", (5,), torch.float32),
         TensorSpec("c", (2,), torch.int64), TensorSpec("d", (40,), torch.float32)]


def test_buckets_close_on_size_and_dtype():
    # 48 B, 20 B (bucket closes at >= 64 B), then an int64 tensor, then a big one alone
    assert buckets(SPECS, 64) == [[0, 1], [2], [3]]
    assert buckets(SPECS, 10) == [[0], [1], [2], [3]]
    assert buckets(SPECS, 1 << 20) == [[0, 1], [2], [3]]
    assert digest(SPECS) != digest(SPECS[:3]) and digest(SPECS) == digest(list(SPECS))


def _member(rank: int, port: int, size: int, q) -> None:
    bridge = WeightBridge(WeightBridge.connect("127.0.0.1", port, size, 30), rank, size, "cpu", 30)
    into = [torch.zeros(s.shape, dtype=s.dtype) for s in SPECS]
    for _ in range(2):  # two versions over the same group
        bridge.receive(SPECS, into, 64)
        q.put([t.tolist() for t in into])
    bridge.close()


def test_bridge_broadcasts_every_tensor_to_every_rollout_rank():
    size = 3
    store = WeightBridge.listen(size, 30)
    ctx = forked.context()  # the ranks fork from the session's pre-imported server
    q = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, store.port, size, q), daemon=True) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        bridge = WeightBridge(store, 0, size, "cpu", 30)
        sent = []
        for version in range(2):
            tensors = [torch.randn(3, 4) + version, torch.randn(5), torch.tensor([7, version]), torch.randn(40)]
            bridge.send(SPECS, iter(tensors), 64)
            sent.append([t.tolist() for t in tensors])
        got = [q.get(timeout=60) for _ in range(4)]
        assert sorted(map(str, got)) == sorted(map(str, sent + sent))
        bridge.close()
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def test_the_bridge_plan_sends_one_copy_to_each_node_without_a_training_rank():
    # rollout ranks 0 on x, 1-3 on y, 4-5 on the training ranks' node t
    receivers, relays = bridge_plan(["x", "y", "y", "y", "t", "t"], {"t"})
    assert receivers == [0, 1, 4, 5]
    assert relays == {1: Relay("1", 0, 3), 2: Relay("1", 1, 3), 3: Relay("1", 2, 3)}
    assert bridge_plan(["a", "b"], {"t"}) == ([0, 1], {})


def _relay_member(store, who: str, index: int, out: dict) -> None:
    """One member of `test_a_node_takes_one_copy...` (a thread): training rank `index` or rollout
    rank `index`, over a source-parallel bridge (2 sources) and a single-source one."""
    from asyncrl.train.delta import apply, encode

    specs = [TensorSpec("a", (4, 3), torch.float32), TensorSpec("b", (6,), torch.float32)]
    rows = [[2, 3], [2, 3]]
    receivers, relays = bridge_plan(["x", "y", "y", "y"], {"t"})
    size = 1 + len(receivers)
    versions = [[torch.arange(12.0).view(4, 3) * v, torch.arange(6.0) + v] for v in (1, 2)]
    if who == "train":
        bridges = [WeightBridge(store, 0, size, "cpu", 30, 2, source=index)]
        if index == 0:
            bridges.append(WeightBridge(dist.PrefixStore("single/", store), 0, size, "cpu", 30))
        mine = [[t[2 * index:2 * index + 2] if t.dim() == 2 else t[3 * index:3 * index + 3] for t in v] for v in versions]
        bridges[0].send_pieces(mine[0])
        bridges[0].send_deltas([encode(s.name, p, b, 2, 1) for s, p, b in zip(specs, mine[1], mine[0], strict=True)])
        if index == 0:
            bridges[1].send(specs, iter(versions[1]), 16)
        out[("sizes", index)] = [b.group.size() for b in bridges]
    else:
        rank = 1 + receivers.index(index) if index in receivers else None
        bridges = [WeightBridge(store, rank, size, "cpu", 30, 2, relay=relays.get(index)),
                   WeightBridge(dist.PrefixStore("single/", store), rank, size, "cpu", 30, relay=relays.get(index))]
        into = [torch.zeros(s.shape) for s in specs]
        bridges[0].receive_pieces(specs, rows, into)
        got = [[t.clone() for t in into]]
        per_source, _ = bridges[0].receive_deltas(specs, rows, 2)
        for i, deltas in enumerate(per_source):
            for t, d in zip(into, deltas, strict=True):
                apply(d, t.narrow(0, 2 * i if t.dim() == 2 else 3 * i, 2 if t.dim() == 2 else 3), 1)
        got.append([t.clone() for t in into])
        single = [torch.zeros(s.shape) for s in specs]
        bridges[1].receive(specs, single, 16)
        got.append(single)
        out[("got", index)] = got
        out[("in_bridge", index)] = bool(bridges[0].groups)
    for b in bridges:
        b.close()


def test_a_node_takes_one_copy_of_an_update_and_relays_it_to_its_other_rollout_ranks():
    """Rollout rank 0 alone on node x, ranks 1-3 on node y: the training ranks' groups hold ranks
    0 and 1 only (3 members), rank 1 hands every piece, delta and bucket on to 2 and 3, and every
    rollout rank ends with the sender's weights (shards, deltas and a single source's buckets)."""
    import threading

    store = WeightBridge.listen(8, 30)
    out: dict = {}
    members = [("train", 0), ("train", 1), *(("rollout", r) for r in range(4))]
    threads = [threading.Thread(target=_relay_member, args=(store if (w, i) == ("train", 0) else
                                                            WeightBridge.connect("127.0.0.1", store.port, 8, 30), w, i, out))
               for w, i in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    want = [[torch.arange(12.0).view(4, 3) * v, torch.arange(6.0) + v] for v in (1, 2)]
    for r in range(4):
        got = out[("got", r)]
        for version, expected in zip(got, [want[0], want[1], want[1]], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(version, expected, strict=True)), (r, version)
    assert out[("sizes", 0)] == [3, 3] and out[("sizes", 1)] == [3]
    assert [out[("in_bridge", r)] for r in range(4)] == [True, True, False, False]


def test_before_step_loads_new_weights_mid_generation(tiny_model):
    """rollout.interrupt_on_update: weights swapped between decode steps change the rest of the
    response (and only the rest), and the hook runs once per decode step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    other = AutoModelForCausalLM.from_pretrained(tiny_model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    engine = RolloutEngine(model, eos_token_id=-1, pad_token_id=0)
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    params = SamplingParams(greedy=True, max_tokens=6)
    plain = engine.generate(ids, mask, params)["responses"]
    steps = []

    def swap(t: int) -> None:
        steps.append(t)
        if t == 1:
            engine.load_weights(other.named_parameters())

    swapped = engine.generate(ids, mask, params, before_step=swap)["responses"]
    assert steps == [0, 1, 2, 3, 4]
    assert torch.equal(swapped[:, :2], plain[:, :2]) and not torch.equal(swapped, plain)


def test_split_placement_runs_ahead_within_the_staleness_bound(tiny_model, tmp_path):
    out = tmp_path / "async"
    res = _launch("grpo", out, tiny_model, ["trainer.placement=split", "trainer.n_workers=1",
                                            "rollout.max_staleness=2", "rollout.interrupt_on_update=true",
                                            "trainer.total_steps=5", "trainer.eval_every=5",
                                            "trainer.loggers=[console,jsonl]", "job.entry=tests/helpers/rl_probe.py:main"])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 5 and sum(summary["policy_gain"]) > 0, summary
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    stale = [r["async/staleness"] for r in steps]
    assert max(stale) == 2 and all(0 <= s <= 2 for s in stale), stale
    # the sync runs beside the next step (trainer.overlap_weight_sync): the step pays only its wait
    assert all(r["perf/weight_sync_s"] > 0 and r["timing/weight_sync_s"] >= 0 for r in steps), steps


@pytest.mark.slow  # ~50 s; tests/rl/test_agents.py covers the batcher's turns in process
def test_multi_turn_trajectories_on_a_rollout_pool_of_their_own(tiny_model, tmp_path):
    """Each turn is a request to the rollout worker's continuous batcher; trajectories generated
    ahead of training carry per-token policy versions (the decoupled objective uses them)."""
    out = tmp_path / "agents"
    res = _launch("grpo", out, tiny_model, ["trainer.placement=split", "trainer.n_workers=1",
                                            "rollout.max_staleness=1", "trainer.total_steps=3", "trainer.eval_every=3",
                                            "rollout.multi_turn.enable=true", "rollout.max_tokens=16",
                                            "rollout.multi_turn.env=tests/helpers/agent_envs.py:CountOnes",
                                            "rollout.multi_turn.max_turn_tokens=4", "trainer.loggers=[console,jsonl]"])
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(steps) == 3 and all(r["agent/num_turns_mean"] == 2.0 for r in steps), steps
    assert max(r["async/staleness"] for r in steps) == 1


def test_config_refuses_what_split_placement_cannot_do(tiny_model, tmp_path):
    for extra, key in ((["rollout.interrupt_on_update=true"], "rollout.interrupt_on_update"),
                       (["trainer.placement=split", "actor.parallel.pp=2"], "actor.parallel.pp"),
                       (["trainer.placement=split", "rollout.n_workers=0"], "rollout.n_workers"),
                       (["rollout.max_staleness=-1"], "rollout.max_staleness"),
                       (["rollout.weight_sync=delta"], "rollout.weight_sync"),  # colocated: nothing to send
                       (["rollout.weight_sync=xor"], "rollout.weight_sync"),
                       (["rollout.engine=vllm", "rollout.decode=compiled"], "rollout.decode")):
        res = _launch("grpo", tmp_path / "bad", tiny_model, extra, timeout=60)
        assert res.returncode == 2 and key in res.stderr, (extra, res.stderr[-2000:])


@pytest.mark.slow  # ~37 s (suite time); test_rl.py's killed run and tests/daemons/test_live_faults.py run by default
def test_killed_rollout_worker_is_named_and_the_run_resumes(tiny_model, tmp_path):
    out = tmp_path / "kill"
    args = [*LAUNCH, "--config-name", "grpo", f"trainer.output_dir={out}", f"model.path={tiny_model}",
            "model.build_tiny=null", *SMALL, "trainer.placement=split", "trainer.n_workers=1",
            "rollout.max_staleness=1", "trainer.total_steps=6", "trainer.save_every=2", "trainer.eval_every=6",
            "trainer.loggers=[console,jsonl]"]
    log = tmp_path / "stderr"
    with log.open("w") as f:
        proc = subprocess.Popen(args, cwd=REPO, env=_env(out), stdout=subprocess.DEVNULL, stderr=f,
                                text=True, start_new_session=True)
    try:
        marker = out / "checkpoints" / "step_2" / "COMPLETE"
        deadline = time.monotonic() + 180
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "no checkpoint at step 2"
        # a warm worker got its environment after it started: found by the launcher's log, not /proc
        rollout = [int(p) for p in re.findall(r"spawned worker rollout-\S+ pid (\d+)", log.read_text())]
        assert rollout, "no rollout worker found"
        os.kill(rollout[0], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        kill_group(proc, grace_s=5)
    err = log.read_text()
    assert proc.returncode not in (0, None)
    assert "rollout" in err and ("died" in err or "killed" in err), err[-3000:]
    assert "Traceback" not in err.split("died")[-1][:200]
    res = forked.run(args, timeout=240, cwd=REPO, env=_env(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["steps"] == 6


def test_continuous_batcher_matches_the_engine_alone_and_across_concurrent_calls(tiny_model):
    """Greedy rows decoded in one continuous batch (prompts of different lengths joining as
    slots free up, two calls at once) come out exactly as the engine decodes each call alone."""
    import threading

    from transformers import AutoModelForCausalLM

    from asyncrl.rollout.continuous import ContinuousBatcher

    class Fixed:
        version, interrupt = 0, False

        def pending(self) -> bool:
            return False

        def apply(self) -> None:
            raise AssertionError("nothing is staged")

    engine = RolloutEngine(AutoModelForCausalLM.from_pretrained(tiny_model), eos_token_id=2, pad_token_id=0)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(5, 20, (4, 7), generator=gen)
    a_mask = torch.ones_like(a)
    a_mask[0, :3] = 0
    a_mask[1, :1] = 0
    b = torch.randint(5, 20, (3, 4), generator=gen)
    params = SamplingParams(greedy=True, max_tokens=9, n=2)
    alone = {"a": engine.generate(a, a_mask, params), "b": engine.generate(b, torch.ones_like(b), params)}
    # 6 slots: rows wait for free slots; 16: both calls' 14 rows decode side by side
    for slots in (6, 16):
        batcher = ContinuousBatcher(engine, slots=slots, weights=Fixed())
        got: dict[str, dict] = {}

        def call(name: str, ids: torch.Tensor, mask: torch.Tensor, batcher: ContinuousBatcher = batcher,
                 got: dict = got) -> None:
            got[name] = batcher.generate(ids, mask, params)

        calls = [threading.Thread(target=call, args=("a", a, a_mask)),
                 threading.Thread(target=call, args=("b", b, torch.ones_like(b)))]
        for t in calls:
            t.start()
        for t in calls:
            t.join(120)
        for k in ("a", "b"):
            ref, out = alone[k], got[k]
            width = ref["responses"].shape[1]
            assert torch.equal(out["responses"][:, :width], ref["responses"]), (slots, k)
            assert torch.equal(out["response_mask"][:, :width], ref["response_mask"]), (slots, k)
            assert torch.allclose(out["rollout_log_probs"][:, :width], ref["rollout_log_probs"], atol=1e-5), (slots, k)
            assert torch.equal(out["position_ids"][:, :ref["position_ids"].shape[1]], ref["position_ids"]), (slots, k)
            assert out["behav_versions"].eq(0).all()
        if slots == 16:
            assert batcher.steps < 2 * 9, batcher.steps  # the two calls shared decode steps


def test_split_sync_is_source_parallel_over_fsdp_ranks(tiny_model, tmp_path):
    """Two FSDP training ranks, two rollout workers: each training rank sends its own shard of
    every weight (none sends more than half the model, plus rounding), and every rollout worker
    ends up generating with exactly the training pool's weights — with the sync overlapping the
    next step (rollout.max_staleness=1: the sends run beside its log-probs, the optimizer waits)."""
    out = tmp_path / "sources"
    res = _launch("grpo", out, tiny_model, ["trainer.placement=split", "trainer.n_workers=2", "rollout.n_workers=2",
                                            "rollout.max_staleness=1",
                                            "cluster.cpu_devices=4", "trainer.total_steps=3", "trainer.eval_every=3",
                                            "trainer.loggers=[jsonl]", "job.entry=tests/helpers/sync_probe.py:main", "cluster.allowed_packages=[tests]"])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    train, rollouts = summary["train_checksum"], summary["rollout_checksums"]
    assert len(rollouts) == 2 and all(r == pytest.approx(train, rel=1e-6) for r in rollouts), (train, rollouts)
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(0.45 < r["perf/weight_sync_max_rank_share"] < 0.56 for r in steps), steps


@pytest.mark.slow  # ~18 s; test_lora.py's split run covers the same sync path by default
def test_split_weight_sync_carries_the_compute_dtype(tiny_model, tmp_path):
    """With model.dtype=bfloat16 a rollout-only replica holds the model in bf16 and the sync
    sends bf16 (half fp32's bytes): after training, every rollout worker generates with exactly
    the training pool's weights cast to bf16."""
    out = tmp_path / "bf16"
    res = _launch("grpo", out, tiny_model, ["trainer.placement=split", "trainer.n_workers=1", "rollout.n_workers=2", "cluster.cpu_devices=3",
                                            "model.dtype=bfloat16", "trainer.total_steps=2", "trainer.eval_every=2",
                                            "job.entry=tests/helpers/sync_probe.py:main", "cluster.allowed_packages=[tests]"])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    train, rollouts = summary["train_checksum"], summary["rollout_checksums"]
    assert len(rollouts) == 2 and all(r == train for r in rollouts), (train, rollouts)
    assert summary["steps"] == 2


def test_split_sync_sends_deltas_that_rebuild_the_weights_bit_for_bit(tiny_model, tmp_path):
    """rollout.weight_sync=delta, two FSDP training ranks (each sends its own shards' deltas), 8
    steps: after every step's sync the rollout worker holds the training pool's weights byte for
    byte, and a rollout worker told after step 4 that it holds another version fails the next delta
    with a DeltaMismatchError and gets that version in full (logged; `perf/weight_sync_fallbacks`
    1). (The byte check replaced a comparison of every step's metrics with a full-sync run's: on a
    loaded machine the split pool's continuous batch takes a step's requests at other moments, its
    batches differ in composition, and a float difference can change a sampled token in either run.)"""
    out = tmp_path / "delta"
    res = _launch("grpo", out, tiny_model, ["trainer.placement=split", "trainer.n_workers=2", "rollout.n_workers=1",
                                            "cluster.cpu_devices=3", "trainer.total_steps=8", "trainer.eval_every=8",
                                            "rollout.weight_sync=delta", "trainer.loggers=[jsonl]",
                                            "job.entry=tests/helpers/delta_probe.py:main",
                                            "cluster.allowed_packages=[tests]"])
    assert res.returncode == 0, res.stderr[-3000:]
    delta = json.loads(res.stdout.strip().splitlines()[-1])
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert delta["steps"] == 8 and delta["steps_differing"] == [], delta
    assert delta["rollout_digests"] == [delta["train_digest"]], delta
    assert delta["held_before_forgetting"] == [4]
    assert "weight sync of version 5" in res.stderr and "sending it in full" in res.stderr
    assert [r["perf/weight_sync_fallbacks"] for r in steps] == [0.0] * 4 + [1.0] * 4, steps
    assert all(0 < r["perf/weight_sync_delta_ratio"] < 1.05 for r in steps), steps


def test_a_version_a_failed_delta_dropped_is_not_applied_by_the_waiting_decode_loop():
    """The decode loop's apply waits for the weights lock while a delta fails (which drops the
    staged version): it then applies nothing, not the half-built copy as version None (a CI run's
    continuous batch crashed on such a None)."""
    import threading

    from asyncrl.config import rl_config
    from asyncrl.roles.pools import PoolWeights

    loaded = []

    class Rollout:
        lora_rank = 0

        def load_weights(self, named):
            loaded.append([n for n, _ in named])

    spec = TensorSpec("w", (2,), torch.float32)
    pool = PoolWeights(rl_config({}), 0, torch.device("cpu"), None, Rollout(), torch.float32, [spec], {}, lambda: 0)
    pool._staged, pool._staged_version = [torch.zeros(2)], 3
    with pool._weights_lock:  # a delta being received
        loop = threading.Thread(target=pool.apply)
        loop.start()
        time.sleep(0.3)  # the loop reaches the lock
        pool._staged_version = pool._held_version = None  # the delta did not rebuild: dropped
    loop.join(10)
    assert loaded == [] and pool.version == 0 and not pool.pending()


def test_a_tensor_parallel_actor_sends_deltas_of_the_gathered_weights(tiny_model, tmp_path):
    """rollout.weight_sync=delta with actor.parallel.tp=2 (the weights gathered, rank 0 sending
    each whole): the deltas rebuild the weights bit for bit on the rollout worker, a worker told it
    holds another version gets that version in full (once), and the deltas are smaller than the
    model (`perf/weight_sync_delta_ratio`)."""
    out = tmp_path / "tp2"
    res = _launch("grpo", out, tiny_model, ["trainer.placement=split", "trainer.n_workers=2", "actor.parallel.tp=2",
                                            "rollout.n_workers=1", "cluster.cpu_devices=3", "trainer.total_steps=6",
                                            "trainer.eval_every=6", "rollout.weight_sync=delta",
                                            "trainer.loggers=[jsonl]", "job.entry=tests/helpers/delta_probe.py:main",
                                            "cluster.allowed_packages=[tests]"])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["rollout_digests"] == [summary["train_digest"]], summary
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["perf/weight_sync_fallbacks"] for r in steps] == [0.0] * 4 + [1.0] * 2, steps
    assert all(0 < r["perf/weight_sync_delta_ratio"] < 1.05 for r in steps), steps
    assert all(r["perf/weight_sync_max_rank_share"] == 1.0 for r in steps), steps  # rank 0 sends it all
