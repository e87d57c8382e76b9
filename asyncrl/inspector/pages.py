"""The inspector's HTML: each view a function of what the run directory holds (no templates, escaped)."""

from __future__ import annotations

import json
import math
from html import escape
from typing import Any
from urllib.parse import urlencode

from asyncrl.inspector.runs import Query, Run, Table

DEFAULT_CURVES = ("critic/score_mean", "val/reward", "response/length_mean", "actor/entropy")
COLUMNS = (("step", "step"), ("rank", "rank"), ("data_source", "source"), ("reward", "reward"),
           ("advantage", "advantage"), ("response_length", "length"), ("finish_reason", "finish"),
           ("staleness", "stale"), ("num_turns", "turns"), ("tool_calls", "tools"))
SORTABLE = {"step": "step", "reward": "reward", "response_length": "length", "advantage": "advantage",
            "staleness": "staleness"}


def page(title: str, body: str, runs: list[Run], live: str = "") -> str:
    """A whole page: the run bar, then `body`; `live` names what the page refreshes as the run grows."""
    nav = " ".join(f'<a href="/runs/{i}/rollouts">{escape(r.name)}</a>' for i, r in enumerate(runs))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)} · asyncrl inspect</title>
<link rel="stylesheet" href="/static/style.css"></head><body data-live="{escape(live)}">
<header><a class="home" href="/">asyncrl inspect</a> <nav>{nav}</nav> <span id="live"></span></header>
<main>{body}</main><script src="/static/app.js"></script></body></html>"""


def problem_page(message: str, runs: list[Run]) -> str:
    return page("problem", f'<h1>Cannot show this</h1><p class="problem" id="problem">{escape(message)}</p>'
                '<p><a href="/">back to the runs</a></p>', runs)


def _num(v: Any, digits: int = 4) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{digits}g}"
    return escape(str(v))


def overview(runs: list[Run], keys: list[str]) -> str:
    """The runs with their state, and the metric curves (any metric, runs overlaid, smoothing)."""
    rows = []
    for i, r in enumerate(runs):
        st = r.status()
        state = (f'<span class="problem">{escape(st["problem"])}</span>' if st["problem"] else
                 "writing" if st["writing"] else "finished or stopped")
        rows.append(f'<tr><td><label><input type="checkbox" class="run" value="{i}" checked> {escape(r.name)}</label></td>'
                    f'<td class="path">{escape(st["path"])}</td><td>{state}</td><td>{st["last_step"]}</td>'
                    f'<td>{st["kept_steps"]}</td><td>{st["evaluations"]}</td>'
                    f'<td><a href="/runs/{i}/rollouts">rollouts</a> · <a href="/runs/{i}/evals">evaluations</a></td></tr>')
    shown = [k for k in DEFAULT_CURVES if k in keys] or keys[:4]
    options = "".join(f'<option value="{escape(k)}">' for k in keys)
    return page("runs", f"""<h1>Runs</h1>
<table class="runs"><tr><th>run</th><th>directory</th><th>state</th><th>last step</th><th>kept steps</th>
<th>evaluations</th><th></th></tr>{''.join(rows)}</table>
<h2>Metrics</h2><div class="controls"><input id="metric" list="metrics" placeholder="add a metric ({len(keys)} logged)">
<datalist id="metrics">{options}</datalist> smoothing <input id="smoothing" type="range" min="0" max="0.99" step="0.01"
value="0.6"> <span id="smoothing-value">0.6</span></div>
<div id="charts" data-keys="{escape(json.dumps(shown))}"></div>""", runs, live="curves")


def rollout_table(runs: list[Run], i: int, q: Query, table: Table, sources: list[str]) -> str:
    """A run's kept rollouts: the filter form, the page of rows, the links to the pages around it."""
    run = runs[i]
    form = _filters(q, sources)
    head = "".join(_sort_header(q, col, label) for col, label in COLUMNS) + "<th>prompt</th><th>response</th>"
    body = "".join(_table_row(i, r) for r in table.rows) or '<tr><td colspan="12" id="empty">no kept rollout matches</td></tr>'
    total = f"{table.total} rows match" if table.total is not None else "newest steps first"
    pages = _pager(q, table)
    notes = "".join(f'<p class="problem">{escape(p)}</p>' for p in table.problems)
    kept = run.rollouts.steps
    span = f"steps {kept[0]}–{kept[-1]} kept" if kept else "no rollouts kept yet (trainer.keep_rollouts)"
    return page(f"{run.name} rollouts", f"""<h1>{escape(run.name)}: rollouts</h1><p>{span} · {total} ·
<a href="/runs/{i}/evals">evaluations</a></p>{notes}{form}
<table class="rollouts" id="rollouts"><tr>{head}</tr>{body}</table>{pages}""", runs,
                live="table" if q.page == 1 and q.sort == "-step" else "")


def _filters(q: Query, sources: list[str]) -> str:
    def field(name: str, value: Any, width: int = 6, label: str = "") -> str:
        v = "" if value is None else escape(str(value))
        return f'{label}<input name="{name}" value="{v}" size="{width}">'

    options = "".join(f'<option {"selected" if s == q.source else ""}>{escape(s)}</option>' for s in sources)
    return f"""<form class="filters" id="filters" method="get">
source <select name="source"><option value="">any</option>{options}</select>
{field("step_min", q.step_min, label="steps ")}–{field("step_max", q.step_max)}
{field("reward_min", q.reward_min, label="reward ")}–{field("reward_max", q.reward_max)}
{field("length_min", q.length_min, label="length ")}–{field("length_max", q.length_max)}
{field("text", q.text, 16, label="text ")}<input type="hidden" name="sort" value="{escape(q.sort)}">
<button type="submit">filter</button></form>"""


def _query_args(q: Query, **changes: Any) -> str:
    args = {k: v for k, v in {**vars(q), **changes}.items()
            if v not in (None, "") and not (k == "per_page" and v == Query.per_page)}
    return urlencode(args)


def _sort_header(q: Query, col: str, label: str) -> str:
    if col not in SORTABLE:
        return f"<th>{label}</th>"
    key = SORTABLE[col]
    now = q.sort.lstrip("-") == key
    nxt = key if now and q.sort.startswith("-") else f"-{key}"
    mark = (" ▼" if q.sort.startswith("-") else " ▲") if now else ""
    return f'<th><a href="?{_query_args(q, sort=nxt, page=1)}">{label}{mark}</a></th>'


def _table_row(i: int, r: dict[str, Any]) -> str:
    link = f'/runs/{i}/rollouts/{r["step"]}/{r["rank"]}/{r["row"]}'
    cells = "".join(f"<td>{_num(r.get(col))}</td>" for col, _ in COLUMNS)
    return (f'<tr class="row" data-href="{link}">{cells}<td class="text">{escape(_clip(r.get("prompt") or ""))}</td>'
            f'<td class="text"><a href="{link}">{escape(_clip(r.get("response") or "") or "(empty)")}</a></td></tr>')


def _clip(text: str, n: int = 120) -> str:
    return text if len(text) <= n else text[:n] + "…"


def _pager(q: Query, table: Table) -> str:
    links = []
    if q.page > 1:
        links.append(f'<a id="prev" href="?{_query_args(q, page=q.page - 1)}">← page {q.page - 1}</a>')
    links.append(f"page {q.page}")
    if table.more:
        links.append(f'<a id="next" href="?{_query_args(q, page=q.page + 1)}">page {q.page + 1} →</a>')
    return f'<p class="pager">{" · ".join(links)}</p>'


def rollout_detail(runs: list[Run], i: int, row: dict[str, Any], pieces: list[str] | None, color: str) -> str:
    """One kept rollout whole: its numbers, prompt, and response token by token, coloured by the
    rollout-vs-trainer log-prob difference or the advantage; a multi-turn one as a conversation."""
    run = runs[i]
    meta = "".join(f"<tr><th>{label}</th><td>{_num(row.get(col), 6)}</td></tr>" for col, label in
                   (*COLUMNS, ("weights_version", "weights version"), ("uid", "uid"), ("tool_errors", "tool errors")))
    parts = json.loads(row.get("reward_parts") or "{}")
    meta += "".join(f"<tr><th>reward: {escape(k)}</th><td>{_num(v, 6)}</td></tr>" for k, v in parts.items())
    base = f'/runs/{i}/rollouts/{row["step"]}/{row["rank"]}/{row["row"]}'
    switch = " · ".join(f'<a href="{base}?color={c}" class="{"on" if c == color else ""}">{label}</a>' for c, label in
                        (("diff", "rollout − trainer log-prob"), ("advantage", "advantage")))
    tokens, turns = token_spans(row, pieces, color)
    worst = _worst_diff(row)
    return page(f"{run.name} step {row['step']}", f"""<h1>{escape(run.name)}: step {row["step"]}, rank {row["rank"]}, row {row["row"]}</h1>
<p><a href="/runs/{i}/rollouts?step_min={row["step"]}&step_max={row["step"]}&sort=step">the step's rollouts</a></p>
<div class="detail"><table class="meta">{meta}<tr><th>largest |log-prob difference|</th><td id="worst">{worst}</td></tr></table>
<div class="texts"><h2>prompt</h2><pre class="prompt" id="prompt">{escape(row.get("prompt") or "")}</pre>
<h2>response <small>colour: {switch}</small></h2>{turns}<div class="tokens" id="tokens">{tokens}</div>
<p class="legend">{_legend(color)}</p></div></div>""", runs)


def _worst_diff(row: dict[str, Any]) -> str:
    a, b = row.get("rollout_log_probs"), row.get("trainer_log_probs")
    if not a or not b:
        return "no trainer log-probs kept for this row"
    diffs = [abs(x - y) for x, y, m in zip(a, b, row.get("model_token") or [1] * len(a), strict=False) if m]
    return f"{max(diffs):.3g}" if diffs else "—"


def _legend(color: str) -> str:
    if color == "advantage":
        return "blue: positive advantage, red: negative (stronger: larger); grey: the environment's tokens"
    return ("red: the rollout's log-prob of the token above the trainer's, blue: below (full colour at 0.5 nats); "
            "grey: the environment's tokens; hover a token for its numbers")


def token_spans(row: dict[str, Any], pieces: list[str] | None, color: str) -> tuple[str, str]:
    """The response's tokens as coloured spans, and (multi-turn) its turns as a conversation."""
    ids = row.get("response_ids") or []
    text = pieces if pieces is not None else [f"[{t}]" for t in ids]
    model = row.get("model_token") or [1] * len(ids)
    roll, train, adv = (row.get(k) or [] for k in ("rollout_log_probs", "trainer_log_probs", "advantages"))
    spans, turns, current, who = [], [], [], None
    for j, piece in enumerate(text):
        mine = bool(model[j]) if j < len(model) else True
        nums = {"rollout": _at(roll, j), "trainer": _at(train, j), "advantage": _at(adv, j)}
        title = " ".join(f"{k} {v:.4g}" for k, v in nums.items() if v is not None)
        style = _colour(nums, color) if mine else "background:#ddd;color:#555"
        spans.append(f'<span class="tok{"" if mine else " env"}" style="{style}" title="{escape(title)}">{escape(piece)}</span>')
        if who is not None and who != mine:
            turns.append((who, "".join(current)))
            current = []
        who = mine
        current.append(piece)
    if current:
        turns.append((who, "".join(current)))
    convo = ""
    if len(turns) > 1:  # a multi-turn trajectory: the model's turns and the environment's answers
        convo = '<div class="conversation" id="conversation">' + "".join(
            f'<div class="turn {"model" if mine else "env"}"><b>{"model" if mine else "environment / tool"}</b>'
            f"<pre>{escape(t)}</pre></div>" for mine, t in turns) + "</div>"
    return "".join(spans), convo


def _at(xs: list[Any], j: int) -> float | None:
    return xs[j] if j < len(xs) and xs[j] is not None else None


def _colour(nums: dict[str, float | None], color: str) -> str:
    if color == "advantage":
        v = nums["advantage"]
        scale = 1.0
    else:
        r, t = nums["rollout"], nums["trainer"]
        v = None if r is None or t is None else r - t
        scale = 0.5
    if v is None:
        return ""
    a = min(1.0, abs(v) / scale)
    rgb = (40, 90, 220) if (v > 0) == (color == "advantage") else (220, 40, 40)
    return f"background:rgba({rgb[0]},{rgb[1]},{rgb[2]},{0.08 + 0.72 * a:.2f})"


def evaluations(runs: list[Run], i: int, keys: list[str], step: int | None) -> str:
    """The held-out evaluations: every evaluation's metrics per source (pass@k over time as a
    curve) and one evaluation's saved completions."""
    run = runs[i]
    eval_keys = [k for k in keys if k.startswith(("val/", "eval/"))]
    steps = sorted(run.samples.by_step)
    pick = step if step in run.samples.by_step else (steps[-1] if steps else None)
    links = " ".join(f'<a href="?step={s}" class="{"on" if s == pick else ""}">{s}</a>' for s in steps)
    rows = "".join(f'<tr><td>{_num(s.get("data_source"))}</td><td>{_num(s.get("score"))}</td>'
                   f'<td class="text"><pre>{escape(s.get("prompt") or "")}</pre></td>'
                   f'<td class="text"><pre>{escape(s.get("response") or "")}</pre></td>'
                   f'<td>{escape(str(s.get("ground_truth", "")))}</td></tr>'
                   for s in run.samples.by_step.get(pick, []))
    table = _eval_table(run, eval_keys)
    return page(f"{run.name} evaluations", f"""<h1>{escape(run.name)}: evaluations</h1>
<p><a href="/runs/{i}/rollouts">rollouts</a></p>
<div class="controls">smoothing <input id="smoothing" type="range" min="0" max="0.99" step="0.01" value="0">
<span id="smoothing-value">0</span></div>
<div id="charts" data-keys="{escape(json.dumps(eval_keys[:12]))}" data-runs="{i}"></div>
<h2>by evaluation</h2>{table}
<h2>held-out completions</h2><p>evaluation at step: {links or "none saved yet (samples.jsonl)"}</p>
<table class="samples" id="samples"><tr><th>source</th><th>score</th><th>prompt</th><th>response</th><th>answer</th></tr>
{rows}</table>""", runs, live="curves")


def _eval_table(run: Run, keys: list[str]) -> str:
    if not keys:
        return "<p>no evaluation metrics logged yet</p>"
    cols = {k: dict(zip(*run.metrics.points(k), strict=True)) for k in keys[:16]}
    steps = sorted({s for c in cols.values() for s in c})
    head = "".join(f"<th>{escape(k)}</th>" for k in cols)
    body = "".join(f"<tr><td>{int(s)}</td>" + "".join(f"<td>{_num(c.get(s))}</td>" for c in cols.values()) + "</tr>"
                   for s in steps[::-1][:200])
    return f'<table class="evals" id="evals"><tr><th>step</th>{head}</tr>{body}</table>'
