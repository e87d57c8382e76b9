"""The reward of reasoning-gym rows (`data_source` = `reasoning_gym/<task>`, made by
`data.source=reasoning_gym:<task>`): the task's own scorer, `score_answer(answer, entry)`, on the
answer the response states."""

from __future__ import annotations

import logging
import re
from typing import Any

from asyncrl.data.reasoning_gym import DATA_SOURCE_PREFIX, dataset, generated_entry

log = logging.getLogger(__name__)

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_warned: set[tuple[str, str]] = set()


def stated_answer(response: str) -> str:
    """What the scorer sees: the last <answer>...</answer> of the response when it has one
    (reasoning-gym's system prompts ask for it), else what follows the last </think> (a thinking
    model's reasoning is not its answer), stripped. Responses arrive decoded without special
    tokens, so end-of-turn markers (<|im_end|>, <eos>) are already gone."""
    tagged = _ANSWER.findall(response)
    if tagged:
        return tagged[-1].strip()
    return response.rpartition("</think>")[2].strip()


def reasoning_gym_score(data_source: str, solution_str: str, ground_truth: Any,
                        extra_info: dict | None = None) -> float:
    """The task's score of the response's stated answer, in [0, 1]. A scorer that raises on a
    malformed answer (some parse it with json or eval) scores it 0: a wrong answer must not stop
    the run."""
    info = (extra_info or {}).get("reasoning_gym")
    if info is None:
        raise ValueError(f"a {data_source} row without extra_info.reasoning_gym: the built-in reward scores "
                         "rows made by data.source=reasoning_gym:<task>; for rows of your own pass reward.fn")
    task = data_source.removeprefix(DATA_SOURCE_PREFIX)
    scorer = dataset(task, info["settings"])
    try:
        return float(scorer.score_answer(answer=stated_answer(solution_str), entry=_entry(task, info)))
    except Exception as e:  # noqa: BLE001 - any scorer failure on an answer is that answer's fault
        _warn_once(task, "reasoning-gym's %s scorer raised %s on a response; scored 0", task, repr(e)[:200])
        return 0.0


def _entry(task: str, info: dict) -> dict:
    """The row's entry as its generator makes it (some scorers compare tuples, which the JSON copy
    holds as lists); the JSON copy when the generator no longer gives the row's question back
    (another reasoning-gym version)."""
    made = generated_entry(task, info["settings"], info["index"])
    if made["question"] == info["entry"]["question"]:
        return made
    _warn_once(task, "reasoning-gym's %s generator made another question for row %d than the row holds (another "
               "reasoning-gym version?); scoring against the row's own copy", task, info["index"])
    return info["entry"]


def _warn_once(task: str, msg: str, *args: Any) -> None:
    if (task, msg) not in _warned:
        _warned.add((task, msg))
        log.warning(msg, *args)
