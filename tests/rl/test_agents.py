"""Multi-turn rollouts (`asyncrl.agents`): the sandbox under attack, tool calls, token-in-token-out
trajectories whose masks and log-probs reach the trainer intact."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from asyncrl.agents.config import MultiTurnConfig
from asyncrl.agents.env import Action
from asyncrl.agents.rollout import (
    MultiTurnRollout,
    ObservationRenderer,
    WaveGenerator,
    trajectories_to_tensors,
)
from asyncrl.agents.sandbox import SandboxLimits, run_python
from asyncrl.agents.tools import PythonToolEnvironment, ToolEnvironment, parse_tool_calls

ENVS = Path(__file__).resolve().parents[1] / "helpers" / "agent_envs.py"

# -- the sandbox, attacked ---------------------------------------------------------------------------
ATTACKS = {
    "infinite loop": "while True: pass",
    "sleep past the wall limit": "import time; time.sleep(60)",
    "fork bomb": "import os\nwhile True: os.fork()",
    "memory bomb": "x = [bytearray(1 << 26) for _ in range(1000)]",
    "write outside": "open('/tmp/asyncrl-sandbox-escape.txt', 'w').write('x')",
    "delete outside": "import os; os.remove('/etc/hostname')",
    "socket connect": "import _socket; s = _socket.socket(); s.connect(('127.0.0.1', 22))",
    "subprocess": "import os; os.system('touch /tmp/asyncrl-sandbox-escape.txt')",
    "output flood": "while True: print('x' * 10000)",
    "kill the parent": "import os; os.kill(os.getppid(), 9)",
    "ctypes": "import ctypes; ctypes.CDLL(None).system(b'touch /tmp/asyncrl-sandbox-escape.txt')",
    "chroot out": "import os; os.mkdir('x'); os.chroot('x'); os.chdir('../../..'); os.chroot('.')",
}


@pytest.fixture(scope="module")
def attacked(tmp_path_factory) -> tuple[dict, float, Path]:
    """The attacks' results, their wall time, and the temporary directory their sandboxes made
    their work directories in (this test's own, so another test's sandboxes are not counted)."""
    limits = SandboxLimits(wall_s=3, cpu_s=2, memory_mb=256, output_bytes=4096)

    async def all_of_them():
        t0 = time.monotonic()
        results = await asyncio.gather(*(run_python(code, limits) for code in ATTACKS.values()))
        return dict(zip(ATTACKS, results, strict=True)), time.monotonic() - t0

    tmp, tempfile.tempdir = tempfile.tempdir, str(tmp_path_factory.mktemp("attacks"))
    try:
        return *asyncio.run(all_of_them()), Path(tempfile.tempdir)
    finally:
        tempfile.tempdir = tmp


@pytest.mark.parametrize("name", list(ATTACKS))
def test_an_attack_comes_back_as_an_error_and_harms_nothing(attacked, name):
    results, seconds, tmp = attacked
    r = results[name]
    assert r.error is not None, (name, r)
    assert r.observation()  # the model is told what happened
    assert len(r.stdout) <= 4096 and len(r.stderr) <= 4096 + 200
    assert seconds < 20  # in parallel, each cut off by its own limits
    assert not Path("/tmp/asyncrl-sandbox-escape.txt").exists()
    assert os.path.exists("/etc/hostname") or not os.path.exists("/etc")
    assert not list(tmp.glob("asyncrl-sandbox-*"))  # work dirs removed


def test_model_code_cannot_read_the_hosts_files_or_processes(tmp_path):
    """A root of its own: a world-readable file outside (a dataset's answers), /tmp, /home, the job's
    output directory, another process's command line and /dev/shm come back as errors or empty."""
    import tempfile

    outside = Path(tempfile.mkdtemp(prefix="asyncrl-test-readable-"))
    try:
        outside.chmod(0o755)
        (outside / "train.jsonl").write_text("the answer is 4217\n")
        (outside / "train.jsonl").chmod(0o644)
        reads = {"a world-readable file": f"print(open({str(outside / 'train.jsonl')!r}).read())",
                 "/tmp": "import os; print(os.listdir('/tmp'))",
                 "/home": "import os; print(os.listdir('/home'))",
                 "the job's output directory": f"import os; print(os.listdir({str(outside)!r}))",
                 "another process": f"print(open('/proc/{os.getpid()}/cmdline', 'rb').read())",
                 "/dev/shm": "import os; print(os.listdir('/dev/shm'))"}
        results = {name: asyncio.run(run_python(code)) for name, code in reads.items()}
    finally:
        shutil.rmtree(outside)
    if not results["/tmp"].own_filesystem:
        pytest.skip("the kernel gave the sandbox no mount namespace (not root, no user namespaces)")
    for name, r in results.items():  # /tmp and /home may hold the interpreter's own path (a venv there)
        assert r.error is not None or name in ("/tmp", "/home"), (name, r)
        assert "4217" not in r.stdout and outside.name not in r.stdout and "pytest" not in r.stdout, (name, r)


def test_the_sandbox_runs_ordinary_code_and_keeps_its_own_files():
    code = "import math, fractions\nopen('n.txt', 'w').write(str(math.comb(10, 3)))\nprint(open('n.txt').read(), fractions.Fraction(2, 6))"
    r = asyncio.run(run_python(code))
    assert r.error is None and r.stdout == "120 1/3\n", r
    assert r.isolated_network or os.getuid() != 0  # as root a network namespace is always possible


def test_sandbox_limits_are_checked():
    with pytest.raises(ValueError, match="wall_s"):
        SandboxLimits(wall_s=0)


# -- tool calls ----------------------------------------------------------------------------------------
def test_hermes_tool_calls_are_parsed_and_malformed_ones_reported():
    text = ('think <tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call> and '
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(2)\\"}"}</tool_call>'
            '<tool_call>{not json}</tool_call><tool_call>{"arguments": {}}</tool_call>')
    calls, errors = parse_tool_calls(text)
    assert [c.arguments["code"] for c in calls] == ["print(1)", "print(2)"]
    assert len(errors) == 2 and "not valid JSON" in errors[0]


def test_tool_environment_reports_errors_to_the_model_and_counts_them():
    def boom(x: str) -> str:
        raise ValueError("bad x")

    env = ToolEnvironment({"echo": lambda x: x.upper(), "boom": boom})
    text = ('<tool_call>{"name": "echo", "arguments": {"x": "hi"}}</tool_call>'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "boom", "arguments": {"x": "1"}}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"y": "1"}}</tool_call>')
    out = asyncio.run(env.step(Action((), text)))
    assert not out.done and out.observation.splitlines()[0] == "HI"
    assert "no tool named 'nope'" in out.observation and "ValueError: bad x" in out.observation
    assert out.info["tool_calls"] == 4 and out.info["tool_errors"] == 3
    final = asyncio.run(env.step(Action((), "the answer is 3")))
    assert final.done


def test_the_python_tool_runs_code_in_the_sandbox():
    env = PythonToolEnvironment(wall_s=5)
    out = asyncio.run(env.step(Action((), '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>')))
    assert out.observation.strip() == "42" and out.info["tool_errors"] == 0
    bad = asyncio.run(env.step(Action((), '<tool_call>{"name": "python", "arguments": {"code": "1/0"}}</tool_call>')))
    assert "ZeroDivisionError" in bad.observation and bad.info["tool_errors"] == 1
    assert env.tools_schema()[0]["function"]["name"] == "python"


# -- token in, token out -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models.tiny import ensure_tiny_model

    path = ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny", task="sort", hidden=32, layers=1,
                             heads=2, sft_steps=0)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _rollout(tiny, monkeypatch, latency_s=0.0, turns=3, budget=40, n=2, lockstep=False, env="Countdown"):
    from asyncrl.rollout import RolloutEngine, SamplingParams

    model, tok = tiny
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    generated: list[list[int]] = []  # every turn's ids as the engine produced them
    real = engine.generate

    def spy(ids, mask, params, generator=None, **kw):
        out = real(ids, mask, params, generator=generator, **kw)
        for row in range(out["responses"].shape[0]):
            generated.append(out["responses"][row, :int(out["response_mask"][row].sum())].tolist())
        return out

    monkeypatch.setattr(engine, "generate", spy)
    kwargs = {"turns": turns, "latency_s": latency_s} if env == "Countdown" else {}
    cfg = MultiTurnConfig(enable=True, env=f"{ENVS}:{env}", env_kwargs=kwargs,
                          max_turns=turns, max_turn_tokens=8)
    agent = MultiTurnRollout(cfg, tok)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"sort {i} 2"}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for i in range(3)]
    wave = WaveGenerator(engine, SamplingParams(temperature=1.0, max_tokens=8), torch.Generator().manual_seed(0),
                         lockstep=lockstep)
    t0 = time.monotonic()
    trajs = agent.rollout(prompts, [{"i": i} for i in range(3)], n, wave, budget)
    agent.close()
    return trajs, prompts, generated, agent, wave, time.monotonic() - t0


def test_trajectories_hold_exactly_the_engines_ids_and_the_rendered_observations(tiny, monkeypatch):
    trajs, prompts, generated, agent, _, _ = _rollout(tiny, monkeypatch)
    _, tok = tiny
    assert len(trajs) == 6 and all(t.prompt == prompts[i // 2] for i, t in enumerate(trajs))
    turns_seen = []
    for t in trajs:
        at, turn = 0, []
        while at < len(t.tokens):  # split into runs of equal mask
            end = at
            while end < len(t.tokens) and t.mask[end] == t.mask[at]:
                end += 1
            turn.append((t.mask[at], t.tokens[at:end]))
            at = end
        model_runs = [ids for m, ids in turn if m == 1]
        obs_runs = [ids for m, ids in turn if m == 0]
        turns_seen += model_runs
        assert t.counts["num_turns"] == len(model_runs) >= 1
        render = ObservationRenderer(tok, 256)
        for k, ids in enumerate(obs_runs):  # what the template renders after the model's turn, exactly
            assert ids == render(f"sort {2 - k} {2 - k}", "user")
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask, strict=True) if m == 0)
    assert sorted(map(tuple, turns_seen)) == sorted(map(tuple, generated))  # never decoded and re-encoded
    # the test means something: some model turn does not survive decode -> encode
    assert any(tok.encode(tok.decode(ids, skip_special_tokens=True), add_special_tokens=False) != ids
               for ids in generated if ids)


def test_the_trainers_log_probs_of_the_model_tokens_equal_the_rollouts(tiny, monkeypatch):
    from asyncrl.rollout.engine import score

    trajs, prompts, *_ = _rollout(tiny, monkeypatch)
    model, tok = tiny
    width = 40
    p = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (p - len(q)) + q for q in prompts])
    mask = torch.tensor([[0] * (p - len(q)) + [1] * len(q) for q in prompts])
    out = trajectories_to_tensors(trajs, ids, mask, width, tok.pad_token_id)
    assert out["response_mask"].shape == (6, width) and (out["response_mask"] <= out["attention_mask"][:, p:]).all()
    holes = [(r, c) for r in range(6) for c in range(1, width) if out["response_mask"][r, c - 1] == 0
             and out["response_mask"][r, c] == 1]
    assert holes  # observations sit between model turns
    logp = score(model, out["input_ids"], out["attention_mask"], out["position_ids"], width)
    m = out["response_mask"].bool()
    assert torch.allclose(logp[m], out["rollout_log_probs"][m], atol=1e-5)
    assert out["num_turns"].tolist() == [t.counts["num_turns"] for t in trajs]
    for t, reward in zip(trajs, out["env_reward"].tolist(), strict=True):  # given at the end only
        assert reward == 1.0 if t.counts["num_turns"] == 3 else math.isnan(reward)


def test_a_trajectory_waiting_on_its_environment_does_not_hold_the_others(tiny, monkeypatch):
    """Six trajectories of three turns, 0.2 s per environment step: per-trajectory concurrency
    costs about three latencies, not eighteen."""
    _, _, _, _, wave, seconds = _rollout(tiny, monkeypatch, latency_s=0.2)
    assert seconds < 0.2 * 18 / 2, seconds
    assert wave.waves <= 3 * 6 / 2  # turns of different trajectories share decodes


def test_turns_on_the_continuous_batcher_keep_the_engines_ids_and_versions(tiny):
    """A rollout pool of its own: each turn is a request to the continuous batcher; the tokens,
    log-probs and per-token versions come back as the batcher produced them."""
    from asyncrl.agents.rollout import BatcherGenerator
    from asyncrl.rollout import RolloutEngine, SamplingParams
    from asyncrl.rollout.continuous import ContinuousBatcher
    from asyncrl.rollout.engine import score

    class Weights:
        version, interrupt = 7, False

        def pending(self):
            return False

    model, tok = tiny
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = MultiTurnConfig(enable=True, env=f"{ENVS}:Countdown", env_kwargs={"turns": 2, "latency_s": 0.05},
                          max_turns=2, max_turn_tokens=6)
    agent = MultiTurnRollout(cfg, tok)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"sort {i} 1"}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for i in range(3)]
    turns = BatcherGenerator(ContinuousBatcher(engine, slots=4, weights=Weights()),
                             SamplingParams(temperature=1.0, max_tokens=6), torch.Generator().manual_seed(0))
    trajs = agent.rollout(prompts, [{"i": i} for i in range(3)], 2, turns, 30)
    agent.close()
    assert len(trajs) == 6 and all(t.counts["num_turns"] == 2 for t in trajs)
    assert all(v == 7 for t in trajs for v in t.versions)
    p = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (p - len(q)) + q for q in prompts])
    mask = torch.tensor([[0] * (p - len(q)) + [1] * len(q) for q in prompts])
    out = trajectories_to_tensors(trajs, ids, mask, 30, tok.pad_token_id)
    m = out["response_mask"].bool()
    logp = score(model, out["input_ids"], out["attention_mask"], out["position_ids"], 30)
    assert torch.allclose(logp[m], out["rollout_log_probs"][m], atol=1e-5)


def test_a_seeded_rollout_samples_the_same_tokens_however_its_turns_are_grouped_into_decodes(tiny):
    """Waves of six rows (lock-step) against waves of at most two (two trajectories at a time):
    with a seed each trajectory's turns sample from streams of their own, so the tokens agree;
    without one, the rows share one stream and which rows a decode holds changes them."""
    from asyncrl.rollout import RolloutEngine, SamplingParams

    model, tok = tiny
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"sort {i} 2"}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for i in range(3)]

    def run(concurrency: int, seed: int | None) -> tuple[list[list[int]], int]:
        cfg = MultiTurnConfig(enable=True, env=f"{ENVS}:Countdown", env_kwargs={"turns": 3}, max_turns=3,
                              max_turn_tokens=8, concurrency=concurrency)
        agent = MultiTurnRollout(cfg, tok)
        wave = WaveGenerator(engine, SamplingParams(temperature=1.0, max_tokens=8), torch.Generator().manual_seed(0),
                             lockstep=concurrency == 6)
        trajs = agent.rollout(prompts, [{"i": i} for i in range(3)], 2, wave, 40, seed=seed)
        agent.close()
        return [t.tokens for t in trajs], wave.waves

    (together, waves_6), (apart, waves_2) = run(6, seed=11), run(2, seed=11)
    assert waves_6 == 3 and waves_2 >= 9  # the same turns, grouped otherwise
    assert together == apart
    assert run(6, seed=12)[0] != together  # the seed is what they sample from
    assert run(6, seed=None)[0] != run(2, seed=None)[0]  # a shared stream: the grouping shows


def test_a_wave_takes_at_most_max_rows(tiny):
    """Held-out rollouts of many trajectories: each decode takes at most the budget's rows."""
    from asyncrl.rollout import RolloutEngine, SamplingParams

    model, tok = tiny
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    widths = []
    real = engine.generate

    def spy(ids, mask, params, generator=None, **kw):
        widths.append(ids.shape[0])
        return real(ids, mask, params, generator=generator, **kw)

    engine.generate = spy
    cfg = MultiTurnConfig(enable=True, env=f"{ENVS}:Countdown", env_kwargs={"turns": 2}, max_turns=2, max_turn_tokens=4)
    agent = MultiTurnRollout(cfg, tok)
    prompts = [tok.encode(f"sort {i % 9} 1", add_special_tokens=False) for i in range(10)]
    wave = WaveGenerator(engine, SamplingParams(temperature=1.0, max_tokens=4), torch.Generator().manual_seed(0),
                         max_rows=3)
    trajs = agent.rollout(prompts, [{"i": i} for i in range(10)], 1, wave, 20, seed=0)
    agent.close()
    assert len(trajs) == 10 and max(widths) == 3 and sum(widths) == 20, widths


def test_lockstep_decodes_every_trajectorys_turn_together(tiny, monkeypatch):
    trajs, _, generated, _, wave, _ = _rollout(tiny, monkeypatch, lockstep=True)
    assert all(t.counts["num_turns"] == 3 for t in trajs)
    assert wave.waves == 3 and len(generated) == 18  # three decodes of all six rows


def test_an_environment_that_raises_ends_that_trajectory_not_the_rollout(tiny, monkeypatch, caplog):
    trajs, *_ = _rollout(tiny, monkeypatch, env="Flaky")
    broken = [t for t in trajs if t.error]
    assert len(broken) == 3 and all("ValueError: cannot parse" in t.error for t in broken)
    assert all(t.counts["env_errors"] == 1 and math.isnan(t.env_reward) for t in broken)
    assert all(t.env_reward == 1.0 for t in trajs if not t.error)
    assert "Flaky.step raised ValueError" in caplog.text


def test_an_environment_that_always_raises_is_reported_as_broken(tiny, monkeypatch):
    from asyncrl.agents.rollout import EnvironmentStepError

    with pytest.raises(EnvironmentStepError, match="every trajectory's step raised .first: KeyError"):
        _rollout(tiny, monkeypatch, env="Broken")


def test_pipeline_handles_holes_in_the_response_mask():
    from asyncrl.algorithms.core import response_span
    from asyncrl.roles.forward import decode_responses
    from asyncrl.roles.update import trim_padding
    from asyncrl.single_controller.batch import Batch

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    responses = torch.tensor([[5, 6, 7, 8, 0, 0], [5, 6, 0, 0, 0, 0]])
    resp_mask = torch.tensor([[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
    attn = torch.cat([torch.ones(2, 2, dtype=torch.long), torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])], 1)
    b = Batch({"responses": responses, "response_mask": resp_mask, "attention_mask": attn,
               "input_ids": torch.cat([torch.ones(2, 2, dtype=torch.long), responses], 1)})
    assert response_span(b).tolist() == [4, 2]
    assert decode_responses(Tok(), b) == ["5 6 7 8", "5 6"]  # the observation (6, 7) is in the text
    assert trim_padding(b)["responses"].shape[1] == 4  # the last trained column is 3, not sum(mask) = 2


def test_multi_turn_config_is_checked():
    from asyncrl.config import rl_config
    from transport.checks import ConfigError

    with pytest.raises(ConfigError, match="parallel.tp=1"):
        rl_config({"rollout": {"multi_turn": {"enable": True}, "parallel": {"tp": 2}},
                   "actor": {"parallel": {"tp": 2}}, "trainer": {"n_workers": 2}})
    with pytest.raises(ConfigError, match="max_turns"):
        rl_config({"rollout": {"multi_turn": {"max_turns": 0}}})


def test_a_bad_environment_name_says_what_to_write(tmp_path):
    from asyncrl.agents.tools import load_environment
    from transport.checks import ConfigError

    with pytest.raises(ConfigError, match="python_tool"):
        load_environment("pyhton_tool")
    with pytest.raises(ConfigError, match="no file"):
        load_environment(str(tmp_path / "missing.py") + ":Env")
    (tmp_path / "envs.py").write_text("class Env: pass\n")
    with pytest.raises(ConfigError, match="no class or function 'Other'"):
        load_environment(str(tmp_path / "envs.py") + ":Other")
    assert load_environment(str(tmp_path / "envs.py") + ":Env").__name__ == "Env"


@pytest.mark.timeout(700)
def test_the_tiny_model_learns_to_call_the_tool(tmp_path):
    """`--config-name tool_quickstart`: a guess is right one time in ten, and the warm-started
    model seldom calls the tool; GRPO over two-turn trajectories must make it call and answer
    with the tool's digit in 40 steps (about 20 s).

    Spread on the 2-core machine, 16 runs (run seeds 0-9 on the recipe's warm start, warm-start
    seeds 1-6 standing in for other machines' kernels; a run repeats itself exactly): held-out
    greedy success 0.070-0.133 at step 0 and 1.000 in every run at step 40 (already at step
    20); tool calls per trajectory 0.012-0.047 at step 1 and 0.867-0.953 at step 40. With the
    advantage zeroed the run ends at 0.117 and 0.047 (it fails)."""
    import json

    from omegaconf import OmegaConf

    from asyncrl.launch import load_config
    from asyncrl.models.tiny import ensure_tiny_model
    from tests.rl.test_rl import _launch

    recipe = OmegaConf.to_container(load_config("tool_quickstart", []).model.build_tiny)
    model = ensure_tiny_model(tmp_path / "model", **recipe)  # the recipe's warm-started model
    out = tmp_path / "tool"
    res = _launch("tool_quickstart", out, model, ["trainer.total_steps=40", "trainer.eval_every=20",
                                                                "trainer.loggers=[console,jsonl]"],
                  small=False, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["val_reward_start"] <= 0.2 and summary["val_reward_end"] >= 0.8, summary
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert steps[0]["agent/tool_calls_mean"] < 0.15 < 0.75 < steps[-1]["agent/tool_calls_mean"], steps


def test_environment_arguments_from_the_command_line():
    from asyncrl.config import rl_config
    from asyncrl.launch import load_config
    from transport.checks import ConfigError

    cfg = rl_config(load_config("tool_quickstart", ["+rollout.multi_turn.env_kwargs.latency_ms=100"]))
    assert cfg.rollout.multi_turn.env_kwargs == {"latency_ms": 100}
    with pytest.raises(ConfigError, match=r"free-form mapping: add a key with \+rollout.multi_turn.env_kwargs.latency_ms"):
        load_config("tool_quickstart", ["rollout.multi_turn.env_kwargs={latency_ms: 100}"])


def test_the_environments_tools_reach_the_prompt_through_the_chat_template():
    from asyncrl.agents.config import MultiTurnConfig
    from asyncrl.data.dataset import PromptDataset
    from asyncrl.models.tiny import CHAT_TEMPLATE, build_tokenizer
    from asyncrl.run_data import environment_tools

    tools = environment_tools(MultiTurnConfig(enable=True, env="python_tool"))
    assert [t["function"]["name"] for t in tools] == ["python"]
    assert environment_tools(MultiTurnConfig(enable=False)) is None
    tok = build_tokenizer()  # a template that lists the tools in a system turn, as Qwen2.5's does
    tok.chat_template = "{% if tools %}{{ '<|system|> ' + tools[0]['function']['name'] + ' <eos> ' }}{% endif %}" + CHAT_TEMPLATE
    row = {"prompt": [{"role": "user", "content": "sort 1 2"}], "reward_model": {"ground_truth": "1 2"}}
    with_tools = PromptDataset([row], tok, 64, tools=tools).items[0].raw_prompt
    plain = PromptDataset([row], tok, 64).items[0].raw_prompt
    assert "<|system|> python <eos>" in with_tools and "<|system|>" not in plain
