"""Bad input ends in one paragraph (exit 2 for configuration and data files) or a clear stop
(a reward function returning NaN), never in a traceback or silence; and what a GPU run would hit
(tensors on the worker's device, physical GPU ids), checked on CPU where the logic allows."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from asyncrl import config as C
from asyncrl.errors import TrainingError
from asyncrl.launch import main
from asyncrl.metrics import json_line
from asyncrl.rewards import NonFiniteRewardError, checked_score
from asyncrl.single_controller.batch import Batch
from daemons.errors import PlacementError
from daemons.node import gpu_env
from tests.helpers import forked
from transport.checks import ConfigError

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "asyncrl.launch"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "ASYNCRL_STATE_DIR": str(tmp / "state"), "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from asyncrl.models.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny", task="sort", hidden=32, layers=1,
                             heads=2, sft_steps=0)


def _one_paragraph(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# configuration values: checked before anything starts -------------------------------------------------
@pytest.mark.parametrize("override,key", [
    ("actor.micro_batch_size=-1", "actor.micro_batch_size"),  # was clamped to 1 silently
    ("rollout.n=0", "rollout.n"),
    ("model.path=/no/such/model", "model.path"),  # checked before the cluster starts
    ("trainer.n_workers=-2", "trainer.n_workers"),
    ("model.path=", "model.path"),  # was "model.path= is a directory" (the working directory)
    ("data.train_files=", "data.train_files"),  # was the synthetic task, silently
    ("data.val_files=held_out.parquet", "data.train_files"),  # was ignored for the synthetic task
    ("actor.ppo_mini_batches=1000", "actor.ppo_mini_batches"),  # was clamped to the rows per rank
    ("cluster.coordinator=10.0.0.1", "cluster.coordinator"),  # no port
    ("cluster.log_dir=/dev/null", "cluster.log_dir"),  # a file: was a FileExistsError traceback
    ("actor.optim.warmup_steps=100", "actor.optim.warmup_steps"),  # beyond total_steps: lr never peaked
    ("critic.model_path=/no/such/critic", "critic.model_path"),  # ppo: was a traceback in the worker
    ("cost_model.path=/no/such/cost", "cost_model.path"),  # safe_rlhf with a cost model
    ("actor.backend=megatron-core", "actor.backend"),
    ("actor.moe.router_replay=rollout", "actor.moe.router_replay"),  # a dense model has no experts to replay
    ("actor.moe.router_replay=always", "actor.moe.router_replay"),
    ("actor.policy_loss=gspo", "actor.loss_agg_mode"),  # gspo is defined at sequence level
    ("actor.rollout_correction.mode=sometimes", "actor.rollout_correction.mode"),
    ("actor.rollout_correction.high=3", "actor.rollout_correction.high"),  # no mode: it would do nothing
    ("actor.cispo.weight_high=0.5", "actor.cispo.weight_high"),
])
def test_bad_values_exit_2_naming_the_key(override, key, tiny_model, tmp_path, capsys):
    out = tmp_path / "out"
    config = {"critic": "ppo", "cost_model": "safe_rlhf"}.get(key.split(".")[0], "grpo")
    extra = ["cost_model.enable=true", "reward.cost_fn=null"] if config == "safe_rlhf" else []
    extra += ["actor.optim.total_steps=10"] if "warmup" in key else []
    model = [] if key == "model.path" else [f"model.path={tiny_model}", "model.build_tiny=null"]
    assert main(["--config-name", config, f"trainer.output_dir={out}", *model, *extra, override]) == 2
    assert key in _one_paragraph(capsys.readouterr().err)
    assert not out.exists()


def test_mini_batches_are_checked_against_rows_per_data_parallel_rank():
    C.rl_config({"actor": {"ppo_mini_batches": 8}, "data": {"batch_size": 4}, "rollout": {"n": 4}})  # 8 per rank
    with pytest.raises(ConfigError, match=r"actor.ppo_mini_batches=9.*2 data-parallel ranks.*8 rows"):
        C.rl_config({"actor": {"ppo_mini_batches": 9}, "data": {"batch_size": 4}, "rollout": {"n": 4}})
    with pytest.raises(ConfigError, match="critic.ppo_mini_batches"):
        C.rl_config({"algorithm": {"name": "ppo"}, "critic": {"ppo_mini_batches": 999}})
    C.rl_config({"critic": {"ppo_mini_batches": 999}})  # grpo trains no critic


def test_the_config_check_reads_the_algorithm_table():
    """One table: a name registered there is a valid algorithm.name, its needs_critic checks critic.*."""
    from asyncrl.algorithms.registry import ALGORITHMS, register_algorithm

    with pytest.raises(ConfigError, match="algorithm.name"):
        C.rl_config({"algorithm": {"name": "mine"}})
    register_algorithm("mine", "asyncrl.algorithms.grpo:grpo_step", needs_critic=True)
    try:
        with pytest.raises(ConfigError, match="critic.ppo_mini_batches"):
            C.rl_config({"algorithm": {"name": "mine"}, "critic": {"ppo_mini_batches": 999}})
    finally:
        del ALGORITHMS["mine"]


# data files: one paragraph naming the file and the expected columns ------------------------------------
def _data_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the message must say)."""
    cases = {"missing": (tmp / "missing.parquet", "does not exist"),
             "csv": (tmp / "rows.csv", "use .parquet or .jsonl"),
             "not_parquet": (tmp / "fake.parquet", "not a readable parquet file"),
             "columns": (tmp / "columns.parquet", "has columns answer, question"),
             "no_truth": (tmp / "no_truth.jsonl", "has columns data_source, prompt"),
             "empty": (tmp / "empty.jsonl", "holds no rows"),
             "directory": (tmp / "dir.parquet", "is a directory"),
             "images": (tmp / "geo3k.parquet", "has an image column 'images'")}
    cases["csv"][0].write_text("prompt,answer\nx,1\n")
    cases["not_parquet"][0].write_text("hello, not parquet")
    pq.write_table(pa.table({"question": ["a"], "answer": ["1"]}), cases["columns"][0])
    cases["no_truth"][0].write_text(json.dumps({"prompt": "x", "data_source": "s"}) + "\n")
    cases["empty"][0].write_text("\n")
    cases["directory"][0].mkdir()
    pq.write_table(pa.table({  # verl's multimodal layout (geo3k): placeholders in the prompt, image bytes beside it
        "prompt": [[{"role": "user", "content": "<image>What is the angle at B?"}]],
        "images": [[{"bytes": b"\x89PNG\r\n\x1a\n", "path": None}]],
        "reward_model": [{"ground_truth": "30", "style": "rule"}]}), cases["images"][0])
    return cases


CASES = ["missing", "csv", "not_parquet", "columns", "no_truth", "empty", "directory", "images"]


@pytest.mark.parametrize("case", CASES)
def test_data_file_problems_exit_2_naming_the_file_and_columns(case, tiny_model, tmp_path, capsys):
    path, reason = _data_files(tmp_path)[case]
    out = tmp_path / "out"
    assert main(["--config-name", "grpo", f"trainer.output_dir={out}", f"model.path={tiny_model}",
                 f"data.train_files={path}"]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert f"data.train_files={path}" in err and reason in err, err
    if case in ("columns", "no_truth", "csv"):
        assert "prompt" in err and "reward_model.ground_truth" in err, err
    if case == "images":
        assert "text-only" in err and "drop the column" in err, err
    assert not out.exists()


def test_launch_with_wrong_columns_exits_2_with_one_line(tiny_model, tmp_path):
    """As a user runs it: ~45 lines of traceback before; now one line, before any daemon starts."""
    path, _ = _data_files(tmp_path)["columns"]
    res = forked.run([*LAUNCH, "--config-name", "grpo", f"trainer.output_dir={tmp_path / 'out'}",
                          f"model.path={tiny_model}",
                          f"data.train_files={path}"], timeout=120,
                         cwd=tmp_path, env=_env(tmp_path))
    assert res.returncode == 2
    line = _one_paragraph(res.stderr)
    assert str(path) in line and "prompt" in line and "ground_truth" in line


def test_a_bad_row_inside_the_file_names_file_row_and_columns(tiny_model, tmp_path):
    """Rows past the first are read when the trainer tokenises them: still a ConfigError."""
    from asyncrl.run_data import RunData

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "sort 2 1", "ground_truth": "1 2"}) + "\n"
                    + json.dumps({"question": "sort 3 1", "ground_truth": "1 3"}) + "\n")
    cfg = C.rl_config({"model": {"path": str(tiny_model)}, "data": {"train_files": str(data), "batch_size": 1}})
    with pytest.raises(ConfigError, match=rf"data.train_files={data}: row 1 has no 'prompt' field.*ground_truth"):
        RunData(None, cfg).load()


@pytest.mark.parametrize("row", [
    {"prompt": "sort 3 1", "ground_truth": "1 3", "images": [{"bytes": b"\x89PNG", "path": None}]},
    {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "sort 3 1"}]}],
     "ground_truth": "1 3"},
    {"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}],
     "ground_truth": "1 3"}], ids=["images_column", "image_part", "image_url_part"])
def test_a_row_with_images_is_refused_naming_it(row, tiny_model, tmp_path):
    """A later row's images (verl's column, or a chat message's image part) would be dropped by a
    text-only model: the run stops at start, naming the row, instead of training on the text alone."""
    from asyncrl.run_data import RunData

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "sort 2 1", "ground_truth": "1 2"}) + "\n"
                    + json.dumps(row, default=lambda b: b.decode("latin-1")) + "\n")
    cfg = C.rl_config({"model": {"path": str(tiny_model)}, "data": {"train_files": str(data), "batch_size": 1}})
    with pytest.raises(ConfigError, match=rf"data.train_files={data}: row 1 .*image.*text-only"):
        RunData(None, cfg).load()


# NaN rewards stop the run, naming the function and the row --------------------------------------------
def test_checked_score_names_the_function_and_the_row():
    assert checked_score(1, "reward.fn=m:f", {}) == 1.0
    for value, shown in ((float("nan"), "returned nan"), (float("inf"), "returned inf"),
                         (None, "returned None (a NoneType, not a number)")):
        with pytest.raises(NonFiniteRewardError) as e:
            checked_score(value, "reward.fn=m:f", {"row": 3, "ground_truth": "1 2", "response": "x" * 500})
        assert f"reward.fn=m:f {shown} for row=3, ground_truth='1 2', response='xxx" in str(e.value)
        assert len(str(e.value)) < 600  # long fields are cut


def _responses(device: str = "cpu") -> Batch:
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    return Batch({"responses": ids, "response_mask": (ids != 0).long()},
                 {"data_source": ["asyncrl/sort", "asyncrl/sort"], "ground_truth": ["1 2", "3"],
                  "extra_info": [{}, {}]}).to(device)


def test_rule_reward_worker_stops_on_a_nan_reward(tiny_model, tmp_path):
    from asyncrl.roles.reward import RuleRewardWorker

    (tmp_path / "rw.py").write_text("def reward(source, text, truth, extra=None):\n"
                                    "    return float('nan') if truth == '3' else 1.0\n")
    spec = f"{tmp_path / 'rw.py'}:reward"
    worker = RuleRewardWorker(C.to_dict(C.rl_config({"model": {"path": str(tiny_model)}, "reward": {"fn": spec}})))
    with pytest.raises(NonFiniteRewardError, match=rf"reward.fn={spec} returned nan for row=1, "
                                                     r"data_source='asyncrl/sort', ground_truth='3'"):
        worker.compute_reward(_responses())


def test_rule_reward_scores_stay_on_the_batch_device(tiny_model):
    """A Batch mixing CPU scores with CUDA token scores is refused by the store: `meta` stands
    in for CUDA here (mixing it with CPU fails the same way)."""
    from asyncrl.roles.reward import RuleRewardWorker

    worker = RuleRewardWorker(C.rl_config({"model": {"path": str(tiny_model)}}))
    out = worker.compute_reward(_responses())
    assert {t.device.type for t in out.tensors.values()} == {"cpu"}
    scores, extras = worker._score(lambda *a: {"score": 0.5, "acc": 1}, "test", ["a", "b"], _responses().to("meta"))
    assert scores.device.type == "meta" and {t.device.type for t in extras.values()} == {"meta"}


def test_the_trainer_reports_a_worker_nan_reward_without_a_traceback():
    from asyncrl.single_controller.group import WorkerCallError
    from asyncrl.trainer import reward_fault
    from transport import RemoteError

    remote = RemoteError("asyncrl.rewards.rules.NonFiniteRewardError", "reward.fn=m:f returned nan for row=0",
                         "Traceback (most recent call last):\n  ...")
    err = reward_fault(WorkerCallError("reward", "compute_reward", 1, remote), step=4)
    assert isinstance(err, NonFiniteRewardError) and isinstance(err, TrainingError)  # the launcher: one line
    assert "reward.fn=m:f returned nan for row=0" in str(err) and "after 4 training steps" in str(err)
    assert "Traceback" not in str(err)
    other = WorkerCallError("actor", "update_actor", 0, RemoteError("builtins.RuntimeError", "boom", "tb"))
    assert reward_fault(other, step=4) is None


def test_the_summary_line_is_strict_json():
    line = json_line({"val_reward_start": float("nan"), "tail": [float("inf"), 1.5], "path": Path("/x")})
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in {line}")) == {
        "val_reward_start": None, "tail": [None, 1.5], "path": "/x"}


# devices -----------------------------------------------------------------------------------------------
def _generated(rows: int, width: int, device: str) -> dict[str, torch.Tensor]:
    ones = torch.ones((rows, width), dtype=torch.long, device=device)
    return {"responses": ones, "response_mask": ones, "rollout_log_probs": ones.float(),
            "input_ids": ones, "attention_mask": ones, "position_ids": ones.cumsum(1)}


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])])
def test_padding_early_stopped_responses_stays_on_their_device(device):
    """All rows stopped before the budget: the pad used to add a CPU arange to the positions."""
    from asyncrl.roles.actor import _pad_responses

    out = _pad_responses(_generated(2, 3, device), width=5, pad_id=0)
    assert out["position_ids"].shape == (2, 5) and out["position_ids"].device.type == device
    if device != "meta":
        assert out["position_ids"][0].tolist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])])
def test_behaviour_versions_are_on_the_responses_device(device):
    """Seen on the first GPU run: the per-token policy versions were a CPU tensor beside CUDA
    responses, and publishing the generated batch failed ("tensors must be on one device")."""
    from asyncrl.roles.actor import _token_versions

    responses = torch.ones((3, 4), dtype=torch.long, device=device)
    versions = _token_versions([7, 7, 8, 9, 9], responses.shape, responses.device)
    assert versions.shape == (3, 4) and versions.device.type == device
    if device != "meta":
        assert versions[2].tolist() == [7, 7, 8, 9]


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda:0", marks=[pytest.mark.gpu, cuda])])
def test_pulled_batches_move_to_the_worker_device_once(device):
    """`meta` stands in for a GPU on CPU-only machines."""
    from asyncrl.single_controller.transfer import to_device
    from asyncrl.single_controller.worker import Worker

    batch = _responses()
    assert to_device(batch, "cpu:0") is batch  # a CPU worker copies nothing
    moved = to_device({"a": [batch]}, device)
    assert moved["a"][0]["responses"].device.type == device[:4] and moved["a"][0]["ground_truth"] == ["1 2", "3"]

    runtime = SimpleNamespace(rank=0, world_size=1, local_rank=0, device=device, node_id="n", store=None)
    worker = Worker.create_hosted(runtime)
    seen = {}

    def method(b: Batch, other: int) -> int:
        seen["device"], seen["other"] = b["responses"].device.type, other
        return 1

    assert asyncio.run(worker._run(method, True, [batch], {"other": 2}))[0] == 1
    assert seen == {"device": device[:4], "other": 2}


@pytest.mark.parametrize("device,visible,want", [
    ("cuda:1", "4,5,6,7", "5"),  # SLURM gave this node GPUs 4-7: its second is physical GPU 5
    ("cuda:0", "4,5,6,7", "4"),
    ("cuda:2", None, "2"),  # the node sees every GPU
    ("cuda:1", "GPU-aaaa, GPU-bbbb", "GPU-bbbb"),  # UUIDs pass through
])
def test_workers_get_the_physical_gpu_id(device, visible, want):
    assert gpu_env(device, visible) == {"CUDA_VISIBLE_DEVICES": want, "ASYNCRL_DEVICE": "cuda:0"}


def test_cpu_devices_get_no_gpu_env_and_unknown_gpus_are_refused():
    assert gpu_env("cpu:1", "4,5") == {}
    with pytest.raises(PlacementError, match="CUDA_VISIBLE_DEVICES='4,5'"):
        gpu_env("cuda:2", "4,5")


@pytest.mark.gpu
@cuda
def test_reward_workers_run_on_the_gpu(tiny_model, monkeypatch):
    from asyncrl.roles.reward import RewardModelWorker, RuleRewardWorker

    monkeypatch.setenv("ASYNCRL_DEVICE", "cuda:0")
    cfg = C.rl_config({"model": {"path": str(tiny_model)}})
    out = RuleRewardWorker(cfg).compute_reward(_responses("cuda"))
    assert {t.device.type for t in out.tensors.values()} == {"cuda"}
    model = RewardModelWorker(cfg, "costs")
    assert next(model.model.parameters()).device.type == "cuda"


def test_the_node_daemon_spawns_a_gpu_worker_on_its_physical_gpu(tmp_path, monkeypatch):
    """SLURM gave the node GPUs 4-7; the coordinator placed a worker on the node's cuda:1."""
    import daemons.node as node_mod
    from daemons.messages import WorkerSpec

    seen = {}

    class FakePopen:
        pid = 4242

        def __init__(self, cmd, env, **kw):
            seen.update(env)

    monkeypatch.setattr(node_mod.subprocess, "Popen", FakePopen)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")

    async def spawn() -> int:
        node = node_mod.NodeDaemon("tcp://127.0.0.1:1", insecure=True, log_dir=tmp_path)
        try:
            return await node.spawn_worker(WorkerSpec("w-1", {"ASYNCRL_DEVICE": "cuda:1", "RANK": "1"}))
        finally:
            node.children.clear()  # nothing was started
            await node.close()

    assert asyncio.run(spawn()) == 4242
    assert seen["CUDA_VISIBLE_DEVICES"] == "5" and seen["ASYNCRL_DEVICE"] == "cuda:0" and seen["RANK"] == "1"


def test_a_non_finite_loss_stops_the_run_and_metrics_stay_strict_json(tmp_path):
    """A NaN training loss ends the run with one paragraph (step, metric, what to try), no
    checkpoint after it, and metrics.jsonl parses with a strict JSON parser (null, not NaN)."""
    from asyncrl.models.tiny import ensure_tiny_model
    from tests.rl.test_rl import REPO, SMALL, _env

    model = ensure_tiny_model(tmp_path / "tiny", task="sort", hidden=64, layers=2, heads=2, sft_steps=0)
    out = tmp_path / "nan"
    res = forked.run([sys.executable, "-m", "asyncrl.launch", "--config-name", "grpo", f"trainer.output_dir={out}",
                          f"model.path={model}", "model.build_tiny=null", *SMALL, "trainer.total_steps=4",
                          "trainer.save_every=1", "trainer.eval_every=4", "trainer.loggers=[console,jsonl]",
                          "job.entry=tests/helpers/nan_probe.py:main"],
                         timeout=240, cwd=REPO, env=_env(out))
    assert res.returncode != 0
    assert "training diverged at step 2: actor/pg_loss not finite" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr

    def strict(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    rows = [json.loads(line, parse_constant=strict) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and rows[-1]["actor/pg_loss"] is None
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]


def test_a_worker_names_its_node_and_the_paths_it_lacks(tmp_path):
    """A multi-node job whose files are missing on one node: the worker there says which, at once."""
    import socket

    from asyncrl.roles.process import check_node_paths

    model = tmp_path / "model"
    model.mkdir()
    check_node_paths(C.rl_config({"model": {"path": str(model)}}))  # all there: nothing to say
    cfg = C.rl_config({"model": {"path": str(tmp_path / "elsewhere")}, "reward": {"fn": f"{tmp_path}/r.py:score"}})
    with pytest.raises(C.ConfigError) as e:
        check_node_paths(cfg)
    assert f"on node {socket.gethostname()}" in str(e.value)
    assert "model.path=" in str(e.value) and "reward.fn=" in str(e.value) and "same path" in str(e.value)


def test_an_unsupported_vllm_version_is_refused_with_the_range(monkeypatch):
    from asyncrl.rollout.vllm_engine import (
        VLLMUnavailableError,
        _check_vllm_version,
        supported_vllm,
    )

    wanted = supported_vllm()
    assert wanted and ">=" in wanted  # pyproject's `vllm` extra, read from the installed metadata
    _check_vllm_version("0.32.0")
    with pytest.raises(VLLMUnavailableError, match="ASYNCRL_ANY_VLLM=1"):
        _check_vllm_version("0.9.2")
    monkeypatch.setenv("ASYNCRL_ANY_VLLM", "1")
    _check_vllm_version("0.9.2")
