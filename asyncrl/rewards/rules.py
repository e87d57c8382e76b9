"""Rule-based rewards: `fn(data_source, solution_str, ground_truth, extra_info) -> float in [0, 1]`."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import re
import string
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.data.preprocess import last_boxed as last_boxed
from asyncrl.data.synthetic import score_answer
from asyncrl.errors import TrainingError
from asyncrl.rewards.reasoning_gym import reasoning_gym_score

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str, Any, "dict | None"], "float | dict"]
REWARD_EXTRA = "reward_extra_"  # batch columns of a dict-returning reward's extra numbers, logged as reward/<key>


class RewardFnError(ValueError):
    """A reward function spec that cannot be resolved (the message says what to fix)."""


class NonFiniteRewardError(TrainingError, ValueError):
    """A reward (or cost) function returned NaN, an infinity or no number at all; the message
    names the function and the row, so the run stops instead of training on NaN."""


def checked_score(value: Any, fn_name: str, row: dict[str, Any]) -> float:
    """`value` (what reward function `fn_name` returned for `row`) as a finite float, or a
    `NonFiniteRewardError` that names the function and the row (its fields, long ones cut)."""
    try:
        score = float(value)
    except (TypeError, ValueError):
        score, what = None, f"{value!r} (a {type(value).__name__}, not a number)"
    else:
        what = repr(value) if math.isfinite(score) else str(score)
    if score is not None and math.isfinite(score):
        return score
    fields = ", ".join(f"{k}={_short(v)}" for k, v in row.items())
    raise NonFiniteRewardError(f"{fn_name} returned {what} for {fields}; a reward must be a finite number, "
                               "so the run stopped instead of training on it: fix the function (e.g. return "
                               "0.0 for a response it cannot score)")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


# ---- GSM8K --------------------------------------------------------------------------------------

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_GSM8K_TAIL_CHARS = 300  # long responses: only the end can hold the final answer


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer: after the last '#### ' (strict), or the last number (flexible)."""
    text = solution_str[-_GSM8K_TAIL_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        if not found:
            return None
        answer = found[-1]
    elif method == "flexible":
        found = [m for m in _NUMBER.findall(text) if m not in ("", ".", ",")]
        if not found:
            return None
        answer = found[-1]
    else:
        raise ValueError(f"method must be 'strict' or 'flexible', not {method!r}")
    answer = answer.replace(",", "").replace("$", "").rstrip(".")
    return answer or None


def _same_number(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def gsm8k(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` for the right answer, `format_score` for a wrong answer in the right format, else 0."""
    info = extra_info or {}
    method = info.get("method", method)
    format_score = float(info.get("format_score", format_score))
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    gold = str(ground_truth).replace(",", "").strip()
    gold = gold.split("####")[-1].strip() if "####" in gold else gold
    return score if _same_number(answer, gold) else format_score


# ---- exact match --------------------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def normalize_answer(text: str) -> str:
    """Lower-case, unbox \\boxed{...}, drop punctuation at the ends, collapse whitespace."""
    boxed = _BOXED.findall(text)
    if boxed:
        text = boxed[-1]
    text = " ".join(str(text).lower().split())
    return text.strip(string.punctuation + " ")


def exact_match(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """1.0 when the normalised response equals the (or any listed) normalised ground truth."""
    golds = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    pred = normalize_answer(solution_str)
    return float(any(pred == normalize_answer(str(g)) for g in golds))


# ---- synthetic tasks ----------------------------------------------------------------------------


def synthetic(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """Fraction of answer symbols in the right position (asyncrl's built-in tasks)."""
    return score_answer(solution_str, str(ground_truth))


# ---- MATH (Hendrycks et al.): the last \boxed{} of the response against the reference -----------

_MATH_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "$", "^\\circ", "^{\\circ}", "\\%", "%")


def normalize_math(answer: str) -> str:
    r"""A light canonical form: no spacing commands, \left/\right, dollar signs, degree or
    percent signs, \text{} wrappers or spaces; \dfrac/\tfrac as \frac; no trailing period."""
    s = answer.strip()
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    for token in _MATH_DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


def math_boxed(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    r"""1.0 when the response's last \boxed{} answer equals the reference after normalisation."""
    pred = last_boxed(solution_str[-_GSM8K_TAIL_CHARS * 4:])
    if pred is None:
        return 0.0
    golds = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    return float(any(normalize_math(pred) == normalize_math(str(g)) for g in golds))


# ---- dispatch -----------------------------------------------------------------------------------

REWARD_FNS: dict[str, RewardFn] = {
    "openai/gsm8k": gsm8k,
    "gsm8k": gsm8k,
    "hendrycks/math": math_boxed,
    "math": math_boxed,
    "DigitalLearningGmbH/MATH-lighteval": math_boxed,
}
# families of data_sources by prefix: the synthetic tasks, reasoning-gym's tasks (their own scorers)
REWARD_PREFIXES: dict[str, RewardFn] = {"asyncrl/": synthetic, "reasoning_gym/": reasoning_gym_score}
_warned: set[str] = set()


def default_reward(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """Score by data_source: gsm8k, MATH, asyncrl/* synthetic tasks, reasoning_gym/* tasks, else
    normalised exact match."""
    fn = REWARD_FNS.get(data_source) or next(
        (f for prefix, f in REWARD_PREFIXES.items() if data_source.startswith(prefix)), None)
    if fn is None:
        if data_source not in _warned:
            _warned.add(data_source)
            log.warning("no rule for data_source %r; scoring it by exact match "
                        "(pass reward.fn=module:fn for a custom reward)", data_source)
        fn = exact_match
    return float(fn(data_source, solution_str, ground_truth, extra_info))


def _load_module_from_file(path: Path):
    name = f"asyncrl_reward_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardFnError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise RewardFnError(f"importing reward file {path} failed: {type(e).__name__}: {e}") from e
    return module


def load_reward_fn(spec: str | None) -> RewardFn:
    """Resolve 'package.module:fn' or 'path/to/file.py:fn'; None gives `default_reward`."""
    if spec is None or spec == "":
        return default_reward
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise RewardFnError(
            f"reward function {spec!r} must look like 'package.module:function' or "
            "'path/to/file.py:function'"
        )
    if target.endswith(".py") or "/" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise RewardFnError(f"reward file {path} does not exist (from {spec!r})")
        module = _load_module_from_file(path)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise RewardFnError(
                f"cannot import module {target!r} for reward function {spec!r}: {e}; "
                "check the name and that it is on PYTHONPATH"
            ) from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardFnError(f"module {target!r} has no function {attr!r} (from {spec!r})")
    if not callable(fn):
        raise RewardFnError(f"{spec!r} is a {type(fn).__name__}, not a function")
    return fn
