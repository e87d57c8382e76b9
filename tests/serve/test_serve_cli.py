"""`asyncrl serve` as a user runs it: it prints its URL and a generated key, answers the openai
client, and exits on SIGINT leaving no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the endpoint's client: pip install openai")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def serve_process(tiny_dir):
    env = {k: v for k, v in os.environ.items() if k != "ASYNCRL_API_KEY"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "serve", str(tiny_dir), "--port", "0",
                             "--slots", "4"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _printed(proc: subprocess.Popen, pattern: str, timeout_s: float = 60) -> re.Match:
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if found := re.search(pattern, line):
            return found
    raise AssertionError(f"no {pattern!r} in {seen}; stderr: {proc.stderr.read()[-2000:] if proc.poll() else ''}")


async def test_asyncrl_serve_answers_the_openai_client_and_stops_on_sigint(serve_process, tiny_dir):
    url = _printed(serve_process, r"at (http://127\.0\.0\.1:\d+/v1)")[1]
    key = _printed(serve_process, r"API key .*: (\S+)")[1]
    name = Path(tiny_dir).name
    async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as client:
        assert [m.id for m in (await client.models.list()).data] == [name]
        resp = await client.chat.completions.create(model=name, messages=[{"role": "user", "content": "sort 2 1"}],
                                                    max_tokens=4, logprobs=True)
        assert 1 <= len(resp.to_dict()["choices"][0]["token_ids"]) <= 4
    async with openai.AsyncOpenAI(base_url=url, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()
    serve_process.send_signal(signal.SIGINT)
    assert serve_process.wait(30) == 0
    with pytest.raises(ProcessLookupError):  # nothing of its group is left
        os.killpg(serve_process.pid, 0)


def test_a_run_or_a_checkpoint_resolves_to_its_hf_export(tmp_path):
    from asyncrl.model_server import model_dir, served_name

    for step in (100, 200, 300):
        export = tmp_path / "run" / "checkpoints" / f"step_{step}" / "actor" / "hf"
        export.mkdir(parents=True)
        (export / "config.json").write_text("{}")
        if step < 300:  # the last one is incomplete: never picked
            (export.parents[1] / "COMPLETE").write_text("")
    step_200 = tmp_path / "run" / "checkpoints" / "step_200"
    for given in (tmp_path / "run", step_200, step_200 / "actor", step_200 / "actor" / "hf"):
        assert model_dir(given) == step_200 / "actor" / "hf"
    assert served_name(model_dir(tmp_path / "run")) == ("run/step_200", 200)
    assert served_name(tmp_path) == (tmp_path.name, 0)
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        model_dir(tmp_path)
