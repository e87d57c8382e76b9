"""Counted budgets of a quickstart GRPO step (the README's command and model, built here): the RPC
round trips and bytes the driver sends and receives, the collectives every rank makes, the
threads and processes alive. Counts, not times: one more call per step fails here on any machine.
The same run traces one step and checks the trace file.

Step 1 is not counted against the steady budget (it also reads the workers' memory, every
trainer.stats_every steps); steps 2-4 are, together: each sends the next step's generation
behind its update (rollout.launch_next_early; not step 4, as step 5 is traced), so a step's
window holds its calls but its generation, plus the next step's generation, and the workers
may run that generation while the counters are read between steps. Step 1 ends with nothing
launched and step 4 too, so the three steps' sums are exact. Step 5 is traced.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.helpers import forked

REPO = Path(__file__).resolve().parents[2]
STEPS, TRACED = 5, 5

# The driver's requests per step. Group calls go to both ranks (2 requests each): generate,
# reward, advantage (where the rows live), update. The token balance reads one int column of
# the generation outputs without a pull: a batch's one-number-per-row columns travel inside
# their refs (`distbatch.SMALL_COLUMN_BYTES`; it was 2 pulls). Nothing else: no metric
# reductions, no memory reads (those run every trainer.stats_every steps), no weight sync call
# (colocated: the reshard runs inside generate).
STEADY_REQUESTS = {"call_instance": 8}
EVERY_STATS_STEP = {"call_instance": 4}  # memory_stats and pulled_bytes on both ranks
# Bytes through the driver per step: requests carry refs and plans (~7.7 KB) and the step's 32
# prompts, made by the driver (~17 KB: each rank's rows inside its generate request, not pulled
# from the driver's store a round trip later, `DRIVER_INLINE_BYTES`), and the update's rows'
# one-number columns inside their refs (~1.5 KB); replies refs, meta and scalar metrics
# (~4.3 KB) plus the 256 rows' one-number columns inside the refs of the generation and reward
# outputs (~4 KB: the token counts the balance reads, the scores). A budget with ~20 %
# headroom: a tensor or a per-row list sneaking through the driver is larger.
REQUEST_BYTES, REPLY_BYTES = 32_000, 10_000
# Collectives per rank per step (gloo, 2 ranks; the tiny model, 0.5 MB, is one FSDP unit, below
# asyncrl.train.fsdp.ONE_UNIT_MAX_BYTES; the update runs 2 micro-batches of 64 rows per rank,
# accumulated unsharded). A failure names the callers.
# - all_gather_single: FSDP's parameter all-gather, once in the first forward (the unit stays
#   gathered through both micro-batches; per block it was 8), and 1 for the reshard into
#   generation weights (the model in one bucket of the 1 MB staging floor);
# - reduce_scatter_single: gradients, once after the last micro-batch (per block: 3 units x 2);
# - all_reduce: the grad norm, the update's metrics (a sum and a max, started before the
#   optimizer step and waited for after it);
# - all_gather: the advantage's group statistics (`Peers.gather`: each rank's pickled group sums
#   in one fixed-size buffer; torch's all_gather_object made two collectives and a torch.save
#   per tensor) and its metrics, one each.
STEADY_COLLECTIVES = {"all_gather_single": 2, "reduce_scatter_single": 1, "all_reduce": 3, "all_gather": 2}


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("budget")
    out = tmp / "run"
    args = [sys.executable, "-m", "asyncrl.launch", "--config-name", "quickstart", f"trainer.output_dir={out}",
            f"model.path={tmp / 'model'}", f"trainer.total_steps={STEPS}", "trainer.eval_every=100",
            "trainer.save_every=100", "trainer.loggers=[jsonl]", f"trainer.trace=[{TRACED}]",
            "job.entry=tests/helpers/budget_probe.py:main"]
    env = {**os.environ, "ASYNCRL_STATE_DIR": str(tmp / "state"), "PYTHONPATH": str(REPO)}
    res = forked.run(args, timeout=300, cwd=REPO, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    return {"steps": {s["step"]: s for s in summary["budget"]}, "out": out}


def _calls(requests: dict[str, int]) -> dict[str, int]:
    """The step's own requests: not the tracing's, not the frees (sent as the driver drops a
    step's outputs, in whichever step's window that falls; one `free_many` per owner store for
    what was dropped in one turn of the driver's loop)."""
    return {k: v for k, v in requests.items() if not k.startswith("trace_") and k not in ("free", "free_many")}


COUNTED = range(2, TRACED)


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


def test_a_step_makes_its_budgeted_round_trips_and_moves_few_bytes(budget_run):
    steps = budget_run["steps"]
    assert sorted(steps) == list(range(1, STEPS + 1))
    k = len(COUNTED)
    assert _summed([_calls(steps[n]["requests"]) for n in COUNTED]) == {
        m: k * v for m, v in STEADY_REQUESTS.items()}, [steps[n]["requests"] for n in COUNTED]
    assert sum(steps[n]["request_bytes"] for n in COUNTED) <= k * REQUEST_BYTES, [steps[n] for n in COUNTED]
    assert sum(steps[n]["reply_bytes"] for n in COUNTED) <= k * REPLY_BYTES, [steps[n] for n in COUNTED]
    # the next step's generation went out in steps 2 and 3 (in step 3, not 4, it is step 3's own)
    assert [_calls(steps[n]["requests"])["call_instance"] for n in COUNTED] == [10, 8, 6]
    assert _calls(steps[1]["requests"]) == {
        "call_instance": STEADY_REQUESTS["call_instance"] + EVERY_STATS_STEP["call_instance"]}, steps[1]["requests"]
    assert _calls(steps[TRACED]["requests"]) == STEADY_REQUESTS  # tracing adds its own calls, no others
    # each step leaves at most its 6 stored outputs to free (generate, reward, advantage on 2
    # ranks), the first also the held-out evaluation's
    assert sum(s["requests"].get("free", 0) for s in steps.values()) <= 6 * STEPS + 8


def test_every_rank_makes_its_budgeted_collectives(budget_run):
    steps = budget_run["steps"]
    for rank in range(2):
        counts = _summed([steps[n]["collectives"][rank] for n in COUNTED])
        assert counts == {k: len(COUNTED) * v for k, v in STEADY_COLLECTIVES.items()}, (
            rank, counts, [steps[n]["collective_callers"][rank] for n in COUNTED])
        assert steps[TRACED]["collectives"][rank] == STEADY_COLLECTIVES, steps[TRACED]["collective_callers"][rank]


def test_no_thread_or_process_is_started_per_step(budget_run):
    steps = [budget_run["steps"][n] for n in range(2, STEPS + 1)]
    for key in ("worker_children", "driver_children"):
        assert len({json.dumps(s[key]) for s in steps}) == 1, (key, [s[key] for s in steps])
    assert all(c == 0 for c in steps[0]["worker_children"])
    # threads may vary by an executor's idle workers (a loaded machine overlapped two of a worker's
    # calls once: [21, 19] then [21, 20]), never grow step after step
    assert steps[-1]["driver_threads"] <= steps[0]["driver_threads"] + 2
    for rank in range(2):
        assert steps[-1]["worker_threads"][rank] <= steps[0]["worker_threads"][rank] + 2, [s["worker_threads"] for s in steps]


def test_a_traced_step_loads_as_a_trace_with_every_rank_nested_and_ordered(budget_run):
    path = budget_run["out"] / "trace" / f"step_{TRACED}.json"
    body = json.loads(path.read_text())
    events = body["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(names) and len(names) == 3  # the controller and 2 ranks
    assert names[0].startswith("controller") and sorted(v.split()[1] for k, v in names.items() if k) == ["0", "1"]
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)  # ordered
    for e in spans:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0
    lanes: dict[tuple[int, int], list[dict]] = {}
    for e in spans:
        lanes.setdefault((e["pid"], e["tid"]), []).append(e)
    for lane in lanes.values():  # within a lane every two spans are nested or disjoint
        open_ends: list[float] = []
        for e in lane:
            while open_ends and open_ends[-1] <= e["ts"] + 1e-3:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1] + 1e-3, e
            open_ends.append(e["ts"] + e["dur"])
    step = [e for e in spans if e["pid"] == 0 and e["name"] == f"step {TRACED}"]
    assert len(step) == 1
    t0, t1 = step[0]["ts"], step[0]["ts"] + step[0]["dur"]
    for pid in (1, 2):  # each rank's work of the step, inside the step on the controller's clock
        own = {e["name"] for e in spans if e["pid"] == pid}
        assert {"generate_sequences", "update_actor", "pull", "decode", "forward", "backward",
                "optimizer step"} <= own, own
        work = [e for e in spans if e["pid"] == pid and e["name"] == "update_actor"]
        assert t0 <= work[0]["ts"] and work[0]["ts"] + work[0]["dur"] <= t1
    assert any(e["cat"] == "collective" for e in spans)


def test_a_trace_renders_as_a_picture(budget_run, tmp_path):
    from asyncrl.single_controller.trace import render_png

    png = tmp_path / "step.png"
    render_png(budget_run["out"] / "trace" / f"step_{TRACED}.json", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
