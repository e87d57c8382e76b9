"""Configuration: the typed schema checks every YAML file and override, Hydra's command line
works, and a run never touches what it did not create."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
import yaml

from asyncrl import config as C
from asyncrl.launch import load_config, main, shipped_config_dir
from asyncrl.single_controller.schema import schemas, validate
from tests.helpers import forked
from transport.checks import ConfigError

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "asyncrl.launch"]  # forked.run forks it from the pre-imported server; subprocess.run starts it
SHIPPED = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if p.stem != "rl_defaults")


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "ASYNCRL_STATE_DIR": str(tmp / "state"), "PYTHONPATH": str(REPO)}


# the schema ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_composes_and_checks(name):
    cfg = load_config(name, [])
    assert cfg.job.name == name or name == "cluster"


def _leaves(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _schema_default(schema: type, key: str) -> object:
    node: object = schema()
    for part in key.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("name", [*SHIPPED, "rl_defaults"])
def test_yaml_files_set_only_what_differs_from_the_schema(name):
    """One source of truth for defaults: a YAML value equal to the schema's default is a copy."""
    raw = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    raw.pop("defaults", None)
    raw.pop("hydra", None)
    schema = schemas()[{"cluster": "launch_schema", "smoke": "smoke_schema"}.get(name, "rl_schema")].config
    copies = []
    for key, value in _leaves(raw).items():
        try:
            default = _schema_default(schema, key)
        except AttributeError:
            continue  # a None-default section set to a value (model.build_tiny)
        if not is_dataclass(default) and default == value and key not in ("job.name",):
            copies.append(key)
    assert not copies, f"{name}.yaml repeats schema defaults: {copies}"


def test_schema_defaults_pass_their_own_checks():
    for schema in schemas().values():
        validate(schema.config())  # every section's `check`: raises on an out-of-range default
    assert {f.name for f in fields(C.RLConfig)} >= {"cluster", "job", "model", "data", "rollout", "actor",
                                                     "critic", "reward", "cost_model", "algorithm", "trainer"}


def test_typed_view_checks_values_and_keys():
    cfg = C.rl_config({"actor": {"optim": {"lr": 0.5}}, "rollout": {"n": 3}})
    assert cfg.actor.optim.lr == 0.5 and cfg.rollout.n == 3 and cfg.critic.optim.lr == 1e-3
    with pytest.raises(ConfigError, match="actor.ppo_epochs"):
        C.rl_config({"actor": {"ppo_epochs": 0}})
    with pytest.raises(ConfigError, match="did you mean rollout.temperature"):
        C.rl_config({"rollout": {"temperatur": 0.5}})
    with pytest.raises(ConfigError, match="algorithm.name"):
        C.rl_config({"algorithm": {"name": "dpo"}})


def _worker_setup_loads(model: str, wire: dict, out: object) -> None:
    """Forked from the session's fork server: a worker's set-up steps that load code or resolve
    types lazily; what they loaded anew goes to `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.roles.kept_rollouts import warm_up
    from asyncrl.single_controller import schema

    before, hints, defaults = set(sys.modules), schema._plain_hints.cache_info(), schema._defaults.cache_info()
    warm_up()
    AutoTokenizer.from_pretrained(model)
    AutoModelForCausalLM.from_pretrained(model)
    C.rl_config(wire)
    out.put((sorted(set(sys.modules) - before), schema._plain_hints.cache_info().misses - hints.misses,
             schema._defaults.cache_info().misses - defaults.misses))


def test_the_rl_configs_fork_server_loads_what_a_worker_would_load_on_its_first_job(tmp_path):
    """The RL configs' `cluster.warm_imports` (asyncrl.roles.warm): a CPU worker forked from the
    server finds pyarrow's parquet writer and the pandas it loads, the tokenizer and model classes
    transformers resolves by name, and the config check's resolved types already there (each a
    0.2-1 s of CPU in every worker of every job before)."""
    from asyncrl.models.tiny import ensure_tiny_model

    assert load_config("grpo", []).cluster.warm_imports == ["asyncrl.roles.warm"]
    assert "asyncrl.roles.warm" in forked.PRELOAD  # the suite's server imports it as a node's would
    model = ensure_tiny_model(tmp_path / "model")
    wire = C.to_dict(C.rl_config(load_config("grpo", [f"model.path={model}"])))
    ctx = forked.context()
    out = ctx.SimpleQueue()
    proc = ctx.Process(target=_worker_setup_loads, args=(str(model), wire, out))
    proc.start()
    loaded, hint_misses, default_misses = out.get()
    proc.join(60)
    lazy = [m for m in loaded if m.split(".")[0] in ("pandas", "pyarrow")
            or m.startswith(("transformers.models.", "asyncrl."))]
    assert lazy == [] and hint_misses == 0 and default_misses == 0, (lazy, hint_misses, default_misses)


def test_a_keys_choices_are_its_type_checked_for_every_section():
    """A field typed `Annotated[str, Literal[...]]` is checked by the schema alone (no `check`
    repeats it) and the config reference lists its values."""
    import typing

    from asyncrl.config_reference import rows
    from asyncrl.single_controller.schema import choices_of

    declared = {}

    def walk(cls: type, prefix: str = "") -> None:
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in fields(cls):
            if is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            elif choices_of(hints[f.name]) is not None:
                declared[prefix + f.name] = choices_of(hints[f.name])

    walk(C.RLConfig)
    assert {"trainer.placement", "trainer.mode", "actor.loss_agg_mode", "actor.kl_loss_type", "algorithm.kl_penalty",
            "algorithm.kl_ctrl.type", "actor.rollout_correction.mode", "rollout.multi_turn.schedule"} <= set(declared)
    reference = {key: kind for key, kind, _, _ in rows(C.RLConfig)}
    for key, allowed in declared.items():
        with pytest.raises(ConfigError, match=rf"{key}='not-a-choice': must be one of {', '.join(allowed)}"):
            C.rl_config(_nested(key, "not-a-choice"))
        assert reference[key] == " | ".join(repr(v) for v in allowed)


def _nested(key: str, value: object) -> dict:
    out: dict = {}
    node = out
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def test_a_typo_inside_a_user_yaml_exits_2_naming_key_file_and_closest(tmp_path, capsys):
    text = (REPO / "configs" / "grpo.yaml").read_text().replace("use_kl_loss:", "use_kl_los:")
    (tmp_path / "grpo.yaml").write_text(text)
    assert main(["--config-dir", str(tmp_path), "--config-name", "grpo"]) == 2
    err = capsys.readouterr().err
    assert "actor.use_kl_los" in err and str(tmp_path / "grpo.yaml") in err
    assert "did you mean actor.use_kl_loss" in err


def test_a_typo_in_an_inherited_shipped_file_names_that_file(tmp_path, capsys):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - rl_defaults\n  - _self_\ntrainer:\n  totl_steps: 3\n")
    assert main(["--config-dir", str(tmp_path), "--config-name", "mine"]) == 2
    err = capsys.readouterr().err
    assert "trainer.totl_steps" in err and "mine.yaml" in err and "trainer.total_steps" in err


@pytest.mark.parametrize("override,key", [
    ("trainer.total_steps=abc", "trainer.total_steps"),
    ("trainer.total_step=3", "trainer.total_steps"),  # the closest key is named
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("actor.loss_agg_mode=mean", "loss_agg_mode"),
    ("cluster.node_rank=3", "cluster.node_rank"),
    ("++trainer.totl_steps=1", "trainer.total_steps"),  # Hydra's "add" syntax is checked too
    ("+actor.optim.foo=1", "actor.optim.foo"),
    ("actor.optim.betas=[0.9]", "actor.optim.betas"),
    ("algorithm.kl_ctrl.target_kl=-1", "algorithm.kl_ctrl.target_kl"),
    ("cost_model.enable=true", "reward.cost_fn"),  # on safe_rlhf, beside its rule cost
    # fields of a section that is null in grpo (an OmegaConf traceback before, seen on the GPU run)
    ("model.build_tiny.hidden=1024", "model.build_tiny is null"),
    ("model.build_tiny={task: sort, hidden: 1024}", "model.build_tiny is null"),
])
def test_bad_overrides_exit_2_naming_the_key(override, key, capsys):
    config = "safe_rlhf" if override.startswith("cost_model") else "grpo"  # its rule cost and a model cost
    assert main(["--config-name", config, override]) == 2
    assert key in capsys.readouterr().err


def test_user_config_dirs_inherit_the_shipped_defaults(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - rl_defaults\n  - _self_\ntrainer:\n  total_steps: 7\n")
    cfg = load_config("mine", ["rollout.n=3"], str(tmp_path))
    typed = C.rl_config(cfg)
    assert typed.trainer.total_steps == 7 and typed.rollout.n == 3 and typed.job.entry == "asyncrl.trainer:main"


def test_unknown_config_name_lists_the_available_ones():
    with pytest.raises(ConfigError, match="available: .*grpo"):
        load_config("nope", [])


# Hydra's command line ---------------------------------------------------------------------------------
def test_cfg_job_prints_the_composed_config(tmp_path):
    res = forked.run([*LAUNCH, "--config-name", "grpo", "--cfg", "job", "rollout.n=3"],
                         timeout=60, cwd=tmp_path, env=_env(tmp_path))
    assert res.returncode == 0, res.stderr
    cfg = yaml.safe_load(res.stdout)
    assert cfg["rollout"]["n"] == 3 and cfg["actor"]["use_kl_loss"] is True and cfg["algorithm"]["name"] == "grpo"
    assert not list(tmp_path.glob("outputs")), "--cfg must not start a run"


def test_info_and_help_exit_0(tmp_path):
    for flag in ("--info", "--help"):
        res = forked.run([*LAUNCH, "--config-name", "grpo", flag],
                             timeout=60, cwd=tmp_path, env=_env(tmp_path))
        assert res.returncode == 0, res.stderr


def test_multirun_sweeps_one_job_after_another_into_the_sweep_dir(tmp_path):
    sweep = tmp_path / "sweep"
    res = forked.run([*LAUNCH, "--config-name", "smoke", "-m", "smoke.rows=64,128", "smoke.cols=8",
                          f"hydra.sweep.dir={sweep}", "cluster.insecure=true"],
                         timeout=120, cwd=tmp_path, env=_env(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    results = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    # a typo in any job of a sweep stops it before anything runs
    bad = forked.run([*LAUNCH, "--config-name", "smoke", "-m", "smoke.rows=64,128", "smoke.colz=8"],
                         timeout=60, cwd=tmp_path, env=_env(tmp_path))
    assert bad.returncode == 2 and "smoke.colz" in bad.stderr


def test_configs_ship_in_the_wheel(tmp_path):
    """A non-editable install finds its configs (`pip install .`)."""
    import shutil

    src = tmp_path / "src"  # build from a copy: the build leaves build/ and *.egg-info behind
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "outputs", "build", "*.egg-info",
                                                             "__pycache__", ".*_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(tmp_path / "wheel")], check=True, timeout=300, capture_output=True)
    wheel = next((tmp_path / "wheel").glob("asyncrl-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, timeout=300, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    res = subprocess.run([sys.executable, "-c", "import asyncrl.launch as L; print(L.shipped_config_dir())"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    shipped = Path(res.stdout.strip())
    assert str(shipped).startswith(str(tmp_path / "site")) and (shipped / "quickstart.yaml").exists()
    assert shipped_config_dir() == REPO / "configs"  # a checkout uses its own configs/


# a run never touches what it did not create -------------------------------------------------------------
def test_output_dir_with_user_files_exits_2_before_anything_is_created(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("x")
    for flag in (f"trainer.output_dir={out}", f"hydra.run.dir={out}"):
        assert main(["--config-name", "grpo", flag]) == 2
        assert "did not write" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_model_path_that_is_not_a_model_exits_2_and_is_left_alone(tmp_path):
    user = tmp_path / "my-model"
    user.mkdir()
    (user / "README.md").write_text("my notes")
    for config in ("grpo", "quickstart"):  # quickstart builds a tiny model: not over someone's directory
        res = forked.run([*LAUNCH, "--config-name", config, f"model.path={user}",
                              f"trainer.output_dir={tmp_path / config}"],
                             timeout=120, cwd=tmp_path, env=_env(tmp_path))
        assert res.returncode == 2, (config, res.stderr[-2000:])
        assert str(user) in res.stderr
        assert sorted(p.name for p in user.iterdir()) == ["README.md"]
        assert (user / "README.md").read_text() == "my notes"


def test_hub_name_without_a_cache_exits_2_without_creating_anything(tmp_path):
    res = subprocess.run([*LAUNCH, "--config-name", "grpo", "model.path=Qwen/Qwen2.5-0.5B-Instruct",
                          f"trainer.output_dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={**_env(tmp_path), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert res.returncode == 2 and "local Hugging Face cache" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "Qwen").exists()


def test_tiny_cli_refuses_an_existing_model_directory(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    res = subprocess.run([sys.executable, "-m", "asyncrl.models.tiny", str(tmp_path / "m")], capture_output=True,
                         text=True, timeout=60, env=_env(tmp_path))
    assert res.returncode != 0 and "not a tiny model built by asyncrl" in res.stderr
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json"]


def test_tiny_builder_refuses_a_directory_it_did_not_build(tmp_path):
    from asyncrl.models.tiny import ensure_tiny_model

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "weights.bin").write_bytes(b"precious")
    with pytest.raises(ConfigError, match="not a tiny model built by asyncrl"):
        ensure_tiny_model(tmp_path / "x", task="sort", hidden=16, layers=1, heads=2)
    assert (tmp_path / "x" / "weights.bin").read_bytes() == b"precious"


def _rl(tmp_path: Path, **trainer) -> C.RLConfig:
    return C.rl_config({"trainer": {"output_dir": str(tmp_path / "run"), **trainer}})


def _fake_checkpoint(run: Path, step: int) -> Path:
    ckpt = run / "checkpoints" / f"step_{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
    (ckpt / "COMPLETE").write_text("")
    return ckpt


def _claim(cfg: C.RLConfig):
    from asyncrl.rundir import RunDir

    run = RunDir(cfg)
    try:
        start = run.claim()
        run.record_config()
        return start
    finally:
        run.release()


def test_run_dir_rules(tmp_path):
    from asyncrl.rundir import RunDir

    run = tmp_path / "run"
    run.mkdir()
    (run / "thesis.tex").write_text("mine")
    with pytest.raises(ConfigError, match="did not write"):
        _claim(_rl(tmp_path))
    assert sorted(p.name for p in run.iterdir()) == ["thesis.tex"]  # nothing was changed
    (run / "thesis.tex").unlink()

    assert _claim(_rl(tmp_path)) is None  # fresh: records the composed config
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["trainer"]["output_dir"] == str(run)
    ckpt = _fake_checkpoint(run, 2)
    assert _claim(_rl(tmp_path, total_steps=300)) == ckpt  # more steps: resumable
    with pytest.raises(ConfigError, match="rollout.n"):  # what is trained changed: refused
        _claim(C.rl_config({"trainer": {"output_dir": str(run)}, "rollout": {"n": 2}}))
    # the same directory named another way (relative vs absolute) is the same run
    rel = os.path.relpath(run)
    assert _claim(C.rl_config({"trainer": {"output_dir": rel, "total_steps": 300}})).resolve() == ckpt.resolve()

    # while one run holds the directory, a second is refused
    holder = RunDir(_rl(tmp_path, total_steps=300))
    holder.claim()
    try:
        with pytest.raises(ConfigError, match="in use by a running job"):
            _claim(_rl(tmp_path, total_steps=300))
    finally:
        holder.release()

    assert _claim(_rl(tmp_path, resume="none")) is None  # starts clean, old run kept aside
    aside = [p for p in run.iterdir() if p.name.startswith("previous-")]
    assert len(aside) == 1 and (aside[0] / "checkpoints" / "step_2" / "COMPLETE").exists()
    assert not (run / "checkpoints").exists()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # a run killed before its first checkpoint
    (run / "tensorboard").mkdir()
    assert _claim(_rl(tmp_path)) is None  # ... starts over, its outputs moved aside (no step twice)
    assert not (run / "metrics.jsonl").exists() and not (run / "tensorboard").exists()
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        _claim(_rl(tmp_path, resume=str(tmp_path)))


def test_config_changes_names_each_key():
    from asyncrl.rundir import config_changes

    assert config_changes({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 4}) == {"a.c": "2 → 3",
                                                                                         "d": "None → 4"}


def test_a_run_directory_of_an_older_asyncrl_resumes(tmp_path):
    """Its config.yaml lacks keys added since (algorithm.filter_groups) and has keys since
    removed (trainer.tensorboard): neither blocks the resume; a real change still does."""
    from asyncrl.config import to_dict
    from asyncrl.rundir import RunDir

    cfg = C.rl_config({"trainer": {"output_dir": str(tmp_path)}})
    old = to_dict(cfg)
    del old["algorithm"]["filter_groups"]
    old["trainer"]["tensorboard"] = True
    RunDir(cfg)._compare(old)
    old["actor"]["optim"]["lr"] = 0.5
    with pytest.raises(ConfigError, match="actor.optim.lr"):
        RunDir(cfg)._compare(old)


def test_group_baselines_need_two_samples_per_prompt():
    """GRPO/RLOO with one sample per prompt would train on zero advantages: exit 2 instead."""
    with pytest.raises(ConfigError, match=r"rollout.n=1: grpo compares each prompt's samples"):
        C.rl_config({"rollout": {"n": 1}})
    assert C.rl_config({"rollout": {"n": 1}, "algorithm": {"name": "remax"}}).rollout.n == 1


def test_failover_refuses_what_it_does_not_cover_naming_each_key():
    """trainer.failover.enable: the defaults' early launch of the next step's generation is named
    with the fix; so is every other setting a re-formed pool would not restore."""
    ok = {"trainer": {"failover": {"enable": True}}, "rollout": {"launch_next_early": False}}
    assert C.rl_config(ok).trainer.failover.enable
    with pytest.raises(ConfigError, match=r"trainer.failover.enable=True: does not cover rollout.launch_next_early"):
        C.rl_config({"trainer": {"failover": {"enable": True}}})
    for extra, named in ((("rollout", "engine", "vllm"), "rollout.engine=vllm"),
                         (("algorithm", "name", "ppo"), "trains a critic"),
                         (("trainer", "placement", "split"), "trainer.placement=split"),
                         (("rollout", "max_staleness", 1), "rollout.max_staleness=1")):
        section, key, value = extra
        bad = {**ok, section: {**ok.get(section, {}), key: value}}
        if section == "trainer":
            bad["trainer"] = {"failover": {"enable": True}, key: value}
        with pytest.raises(ConfigError, match=named):
            C.rl_config(bad)
    with pytest.raises(ConfigError, match="actor.parallel tp=2"):
        C.rl_config({**ok, "actor": {"parallel": {"tp": 2}}, "trainer": {"failover": {"enable": True}, "n_workers": 2}})
    with pytest.raises(ConfigError, match="actor.offload=optimizer"):
        C.rl_config({**ok, "actor": {"offload": "optimizer"}})


def test_an_optimizer_offload_is_refused_where_the_backend_does_not_move_it(monkeypatch):
    import dataclasses

    from asyncrl.engines import BACKENDS

    for name in ("fsdp2", "megatron"):
        assert C.rl_config({"actor": {"offload": "optimizer", "backend": name}}).actor.offload == "optimizer"
    monkeypatch.setitem(BACKENDS, "stateful", dataclasses.replace(BACKENDS["fsdp2"], offload=False))
    with pytest.raises(ConfigError, match=r"actor.offload.*does not move to host memory on actor.backend=stateful"):
        C.rl_config({"actor": {"offload": "optimizer", "backend": "stateful"}})
    with pytest.raises(ConfigError, match="actor.offload"):
        C.rl_config({"actor": {"offload": "params"}})
    for name in ("fsdp2", "megatron"):  # the weights too
        assert C.rl_config({"actor": {"offload": "all", "backend": name}}).actor.offload == "all"
    monkeypatch.setitem(BACKENDS, "pinned", dataclasses.replace(BACKENDS["fsdp2"], offload_weights=False))
    for bad, says in (({"actor": {"offload": "all", "backend": "pinned"}}, "weights do not move.*actor.offload=optimizer"),
                      ({"actor": {"offload": "all", "lora": {"rank": 4}}}, "LoRA's frozen base"),
                      ({"actor": {"offload": "all"}, "trainer": {"placement": "split"}}, "trainer.placement=colocated")):
        with pytest.raises(ConfigError, match=says):
            C.rl_config(bad)
