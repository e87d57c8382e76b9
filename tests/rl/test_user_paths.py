"""Documented paths a new user takes, run as the user runs them (the installed commands, their own
files): the planner's printed command, a null ground truth, a prompt and response longer than the
model's context, and the JSON summary as the terminal's last line. The refusals at start run
`asyncrl-launch` forked from the session's pre-imported server (tests/helpers/forked.py: what it
prints and exits with, without a fresh interpreter's imports and fork server)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import forked
from tests.rl.test_rl import tiny_model  # noqa: F401  (a module-scoped fixture)

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _run(argv: list[str], cwd: Path, stderr: int = subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(cwd / "state")}
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=240, cwd=cwd, env=env)


def _launch(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`asyncrl-launch *argv`, forked."""
    return forked.launch(argv, env={**os.environ, "ASYNCRL_STATE_DIR": str(cwd / "state"), "PYTHONPATH": str(REPO)},
                         cwd=cwd, timeout=240)


def test_the_planners_printed_command_runs_as_printed(tmp_path):
    """`asyncrl-plan --config-dir examples/configs ...` prints an asyncrl-launch command that
    keeps the config directory; pasted (here with `--cfg job`: compose it, run nothing) from
    another directory, it finds the config."""
    plan = _run([str(BIN / "asyncrl-plan"), "--config-dir", "examples/configs", "--config-name",
                 "grpo_gsm8k_qwen0.5b", "cluster.gpus_per_node=8", "plan.device=h100",
                 "model.path=Qwen/Qwen2.5-0.5B-Instruct"], REPO)
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.strip().splitlines()
    command = lines[lines.index("run the best plan with:") + 1].strip()
    argv = shlex.split(command)
    assert argv[0] == "asyncrl-launch" and argv[argv.index("--config-dir") + 1] == str(REPO / "examples" / "configs")
    launched = _run([str(BIN / argv[0]), *argv[1:], "--cfg", "job"], tmp_path)
    assert launched.returncode == 0, launched.stderr
    assert "grpo_gsm8k_qwen0.5b" in launched.stdout and "n_workers" in launched.stdout


def _data(tmp_path: Path, truth: object) -> Path:
    from asyncrl.data.synthetic import disjoint_splits, write_rows

    rows, _ = disjoint_splits("sort", 8, 1, seed=3)
    rows[5] = {**rows[5], "reward_model": {"style": "rule", "ground_truth": truth}}
    write_rows(rows, tmp_path / "train.parquet")
    return tmp_path / "train.parquet"


def test_a_null_ground_truth_is_refused_naming_the_row(tmp_path, tiny_model):  # noqa: F811
    """`reward_model: {style: rule, ground_truth: null}` is refused before training, as a missing
    reward_model is: exit 2, the file and the row named."""
    data = _data(tmp_path, None)
    r = _launch(["--config-name", "grpo", f"model.path={tiny_model}", f"data.train_files={data}", "data.batch_size=4",
                 "trainer.total_steps=2"], tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"data.train_files={data}: row 5 has a null reward_model.ground_truth" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("engine, exits", [("vllm", 2), ("native", None)])
def test_a_context_too_long_for_the_model_is_named_at_start(tmp_path, tiny_model, engine, exits):  # noqa: F811
    """data.max_prompt_len + rollout.max_tokens past the model's max_position_embeddings (the
    tiny model's 256): vLLM would refuse it in every worker, so the run exits 2 at start naming the
    keys; the native engine runs and says so once."""
    # the native case: the same check, with a short generation (the prompt budget is what is long)
    lengths = ["rollout.max_tokens=250"] if engine == "vllm" else ["rollout.max_tokens=8", "data.max_prompt_len=250"]
    r = _launch(["--config-name", "eval", f"model.path={tiny_model}", "rollout.n=1", "evaluation.ks=[1]",
                 f"rollout.engine={engine}", "data.synthetic.n_val=2", *lengths], tmp_path)
    said = "more than the model's context of 256 (max_position_embeddings"
    if exits:
        assert r.returncode == exits and said in r.stderr and "rollout.max_tokens" in r.stderr, r.stderr[-3000:]
        assert "Traceback" not in r.stderr
    else:
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stderr.count(said) == 1


def test_the_json_summary_is_the_terminals_last_line(tmp_path, tiny_model):  # noqa: F811
    """stdout and stderr on one terminal: the summary comes after the workers' exit lines. The
    command as installed: its CPU workers fork from the launcher's own fork (`daemons.forking`)."""
    r = _run([str(BIN / "asyncrl-launch"), "--config-name", "eval", f"model.path={tiny_model}", "rollout.n=1",
              "evaluation.ks=[1]", "rollout.max_tokens=4", "data.synthetic.n_val=2"], tmp_path,
             stderr=subprocess.STDOUT)
    assert r.returncode == 0, r.stdout[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["mode"] == "eval"
    assert "event loop was blocked" not in r.stdout  # the driver's imports ran before the loop
    # its CPU workers forked from a fork of the launcher, which had imported torch and the driver
    assert "fork server is this launcher, forked" in r.stdout and "forked from the fork server" in r.stdout


def test_a_null_ground_truth_is_fine_when_a_reward_model_scores(tiny_model):  # noqa: F811
    from transformers import AutoTokenizer

    from asyncrl.data.dataset import DatasetError, PromptDataset

    rows = [{"prompt": "sort 2 1", "reward_model": {"style": "model", "ground_truth": None}}]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert PromptDataset(rows, tok, 32, require_answer=False).items[0].ground_truth is None
    with pytest.raises(DatasetError, match="null reward_model.ground_truth"):
        PromptDataset(rows, tok, 32)


@pytest.mark.parametrize("override, hint", [("sed=3", "did you mean seed?"), ("actr.optim.lr=1", "did you mean actor?")])
def test_a_typo_in_a_top_level_key_gets_the_closest_key(tmp_path, override, hint):
    r = _launch(["--config-name", "grpo", override], tmp_path)
    assert r.returncode == 2 and hint in r.stderr, r.stderr


def test_workers_that_cannot_fit_the_nodes_memory_are_refused_at_start(tmp_path, tiny_model, monkeypatch):  # noqa: F811
    """The preflight's memory estimate against the node's memory (made small here)."""
    from asyncrl import preflight
    from asyncrl.config import rl_config
    from transport.checks import ConfigError

    cfg = rl_config({"model": {"path": str(tiny_model)}, "trainer": {"n_workers": 2}})
    preflight.check_memory(cfg)  # the tiny model fits
    monkeypatch.setattr("objectstore.memory.node_memory_bytes", lambda: 1 << 20)
    with pytest.raises(ConfigError, match=r"(?s)the 2 workers on this node need about .* GiB together.*trainer.n_workers"):
        preflight.check_memory(cfg)
