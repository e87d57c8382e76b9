"""`asyncrl inspect` (asyncrl.inspector): a run directory read incrementally, its pages, bad input."""

from __future__ import annotations

import json
import os
import time

import pyarrow.parquet as pq
import pytest
from starlette.testclient import TestClient

from asyncrl.inspector.app import build_app
from asyncrl.inspector.runs import Query, open_runs
from benchmarks.inspect import write_run


@pytest.fixture
def run_dir(tmp_path):
    return write_run(tmp_path / "run", steps=40, rows=8)


def client(*paths, token=None) -> TestClient:
    return TestClient(build_app(open_runs([str(p) for p in paths]), token), raise_server_exceptions=False)


def test_metrics_are_read_as_the_run_writes_them(run_dir):
    (run,) = open_runs([str(run_dir)])
    run.refresh()
    assert run.metrics.last_step == 40 and len(run.metrics.points("critic/score_mean")[0]) == 40
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 41, "critic/score_mean": 0.5}) + "\n" + '{"step": 42, "critic/sc')  # mid-write
    run.refresh()
    assert run.metrics.last_step == 41 and not run.metrics.problems  # the half line waits for its newline
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('ore_mean": 0.75}\nnot json\n{"step": 41, "critic/score_mean": 0.25}\n')  # 41 again: a resumed run
    run.refresh()
    steps, values = run.metrics.points("critic/score_mean")
    assert steps[-2:] == [41, 42] and values[-2:] == [0.25, 0.75]
    assert run.metrics.problems == ["metrics.jsonl line 44: not a JSON object with a step; skipped"]


def test_a_steps_rows_come_from_the_newest_file_that_holds_it(run_dir):
    """A resumed run writes steps after its checkpoint again: the newest file's rows are the ones that trained."""
    (run,) = open_runs([str(run_dir)])
    old = run_dir / "rollouts/rank0/steps_0000031-0000040.parquet"
    table = pq.read_table(old).to_pylist()
    redone = [dict(r, reward=9.0) for r in table if r["step"] <= 35]
    import pyarrow as pa

    from asyncrl.roles.kept_rollouts import schema

    newer = run_dir / "rollouts/rank0/steps_0000031-0000035.parquet"
    pq.write_table(pa.Table.from_pylist(redone, schema=schema()), newer)
    os.utime(newer, ns=(time.time_ns() + 10**9,) * 2)
    run.refresh()
    rows = run.rollouts.table(Query(step_min=31, step_max=40, per_page=500)).rows
    rank0 = [r for r in rows if r["rank"] == 0]
    assert len(rank0) == 10 * 4 and len({(r["step"], r["row"]) for r in rank0}) == 40  # no step twice
    assert all((r["reward"] == 9.0) == (r["step"] <= 35) for r in rank0)
    assert run.rollouts.row(33, 0, 1)["reward"] == 9.0 and run.rollouts.row(36, 0, 1)["reward"] != 9.0


def test_filters_sort_and_pages(run_dir):
    (run,) = open_runs([str(run_dir)])
    run.refresh()
    everything = run.rollouts.table(Query(per_page=500)).rows
    assert len(everything) == 40 * 8 and [r["step"] for r in everything[:8]] == [40] * 8
    q = Query(source="synthetic/count", reward_min=0.25, reward_max=0.5, length_min=5, sort="-reward", per_page=7)
    pages, page = [], 1
    while True:
        t = run.rollouts.table(Query(**{**vars(q), "page": page}))
        pages += t.rows
        if not t.more:
            break
        page += 1
    want = [r for r in everything if r["data_source"] == "synthetic/count" and 0.25 <= r["reward"] <= 0.5
            and r["response_length"] >= 5]
    assert len(pages) == len(want) == t.total and page == -(-len(want) // 7)
    assert [r["reward"] for r in pages] == sorted((r["reward"] for r in want), reverse=True)
    assert {(r["step"], r["rank"], r["row"]) for r in pages} == {(r["step"], r["rank"], r["row"]) for r in want}
    found = run.rollouts.table(Query(text=everything[5]["prompt"], per_page=500)).rows
    assert found and all(r["prompt"] == everything[5]["prompt"] for r in found)
    (fresh,) = open_runs([str(run_dir)])
    fresh.refresh()
    newest = fresh.rollouts.table(Query(per_page=10))  # the first page reads the newest files only
    assert newest.more and newest.total is None and len(fresh.rollouts.cache) == 2


def test_every_view_answers_and_says_what_it_shows(run_dir, tmp_path):
    web = client(run_dir)
    assert "critic/score_mean" in web.get("/").text
    table = web.get("/runs/0/rollouts?source=synthetic/sort&sort=-length").text
    assert table.count('class="row"') == 50 and "synthetic/count" not in table.split('id="rollouts"')[1]
    detail = web.get("/runs/0/rollouts/40/1/3").text
    assert detail.count('class="tok') > 3 and "largest |log-prob difference|" in detail
    assert "advantage" in web.get("/runs/0/rollouts/40/1/3?color=advantage").text
    evals = web.get("/runs/0/evals").text
    assert "eval/all/pass@4" in evals and "sort 3 1 2" in evals
    series = web.get("/api/series?key=val/reward").json()
    assert series["runs"][0]["steps"][:2] == [0, 25]
    assert web.get("/api/status").json()["runs"][0]["last_step"] == 40


def test_a_multi_turn_rollout_shows_as_a_conversation(tmp_path):
    web = client(write_run(tmp_path / "agent", steps=10, rows=4, multi_turn=True))
    page = web.get("/runs/0/rollouts/10/0/1").text
    assert 'id="conversation"' in page and page.count('class="turn model"') == 2
    assert 'class="turn env"' in page and 'class="tok env"' in page


@pytest.mark.parametrize("what", ["missing", "not_a_run", "a_file", "corrupt_rollouts", "bad_query", "no_row"])
def test_bad_input_is_a_page_that_says_what_is_wrong_and_the_server_keeps_serving(what, run_dir, tmp_path):
    paths, url = [run_dir], "/runs/0/rollouts"
    if what == "missing":
        paths, url = [tmp_path / "gone"], "/runs/0/rollouts"
    elif what == "not_a_run":
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "notes.txt").write_text("hello")
        paths = [tmp_path / "plain"]
    elif what == "a_file":
        paths = [tmp_path / "notes.txt"]
        paths[0].write_text("hello")
    elif what == "corrupt_rollouts":
        (run_dir / "rollouts/rank1/steps_0000031-0000040.parquet").write_bytes(b"PAR1 not really")
        url = "/runs/0/rollouts?sort=-reward"
    elif what == "bad_query":
        url = "/runs/0/rollouts?reward_min=high"
        for odd, says in (("step_min=-99999999999999999999999", "out of range"), ("reward_max=nan", "finite"),
                          ("per_page=100000", "per_page is 1 to 500"), ("color=<b>x</b>", "")):
            page = client(run_dir).get(("/runs/0/rollouts/40/1/3?" if odd.startswith("color") else "/runs/0/rollouts?") + odd)
            assert page.status_code == 400 and says in page.text and "<b>x" not in page.text, page.text
    else:
        url = "/runs/0/rollouts/7/0/99"
    web = client(*paths)
    answer = web.get(url)
    said = {"missing": "does not exist", "not_a_run": "is not a run directory", "a_file": "is a file",
            "corrupt_rollouts": "steps_0000031-0000040.parquet: unreadable", "bad_query": "reward_min='high' is not a number",
            "no_row": "kept no row 99"}[what]
    assert said in answer.text.replace("&#x27;", "'"), answer.text
    assert answer.status_code == (200 if what == "corrupt_rollouts" else 404 if what == "no_row" else 400)
    assert web.get("/").status_code == 200 and web.get("/api/status").status_code == 200  # still serving


def test_a_token_guards_every_page_when_asked(run_dir):
    web = client(run_dir, token="s3cret")
    assert web.get("/").status_code == 401 and web.get("/api/status").status_code == 401
    assert web.get("/?token=wrong").status_code == 401
    opened = web.get("/runs/0/rollouts?token=s3cret")  # answered with a cookie, then the page without the token
    assert opened.status_code == 200 and "token" not in str(opened.url)
    assert web.get("/api/status").status_code == 200
    assert client(run_dir, token="s3cret").get("/", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_a_port_in_use_is_an_error_that_says_what_to_do(run_dir):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "inspect", str(run_dir), "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "pass --port 0 for any free port" in res.stderr, res.stderr


def test_on_loopback_only_requests_for_this_machine_are_answered(run_dir):
    """A page of another site whose name resolves to 127.0.0.1 (DNS rebinding) reads nothing."""
    import urllib.error
    import urllib.request

    from benchmarks.inspect import start_inspector, stop_inspector

    proc, url = start_inspector([run_dir])
    try:
        assert urllib.request.urlopen(url + "api/status", timeout=30).status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url + "api/status", headers={"Host": "evil.example"}),
                                   timeout=30)
        assert refused.value.code == 400
    finally:
        stop_inspector(proc)
