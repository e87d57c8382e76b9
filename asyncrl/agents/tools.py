"""Tool calling: the Hermes / Qwen2.5 format, a tool environment, and the sandboxed Python tool.

A model trained on Qwen2.5's chat template calls a tool by writing

    <tool_call>
    {"name": "python", "arguments": {"code": "print(2**10)"}}
    </tool_call>

`ToolEnvironment` runs every such call in a turn and answers with their results (a tool
message the template renders, for Qwen2.5 inside `<tool_response>` tags); a turn with no call is
the final answer and ends the trajectory. Malformed calls, unknown tools and tools that raise
come back to the model as error text, counted in `tool_errors`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.agents.env import Action, Environment, StepResult
from asyncrl.agents.sandbox import SandboxLimits, run_python
from asyncrl.agents.tasks import LookupEnvironment
from transport.checks import ConfigError

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The well-formed calls in `text`, and an error message for each malformed one."""
    calls, errors = [], []
    for body in TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"error: the tool call is not valid JSON ({e.msg} at char {e.pos})")
            continue
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            errors.append('error: a tool call is {"name": <tool>, "arguments": {...}}')
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls, errors


def function_schema(name: str, description: str, parameters: dict[str, str]) -> dict:
    """An OpenAI-style function description (what chat templates' `tools=` take); every
    parameter a required string described by its value."""
    props = {p: {"type": "string", "description": d} for p, d in parameters.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": list(parameters)}}}


class ToolEnvironment(Environment):
    """Runs the tool calls of each turn with the registered tools (async or plain callables that
    take the call's arguments as keywords and return text)."""

    def __init__(self, tools: dict[str, Callable[..., Any]], schemas: list[dict] | None = None,
                 max_calls_per_turn: int = 4) -> None:
        self.tools, self.schemas, self.max_calls = dict(tools), schemas, max_calls_per_turn

    def tools_schema(self) -> list[dict] | None:
        return self.schemas

    async def step(self, action: Action) -> StepResult:
        calls, errors = parse_tool_calls(action.text)
        if not calls and not errors:  # no tool call: the final answer
            return StepResult(done=True, info={"tool_calls": 0.0, "tool_errors": 0.0, "tool_s": 0.0})
        t0 = time.monotonic()
        outputs = list(errors)
        if len(calls) > self.max_calls:
            outputs.append(f"error: at most {self.max_calls} tool calls per turn; the rest were not run")
        results = await asyncio.gather(*(self._run(c) for c in calls[:self.max_calls]))
        outputs += [text for text, _ in results]
        failed = len(errors) + sum(1 for _, ok in results if not ok) + (len(calls) > self.max_calls)
        info = {"tool_calls": float(len(calls) + len(errors)), "tool_errors": float(failed),
                "tool_s": time.monotonic() - t0}
        return StepResult("\n".join(outputs), info=info)

    async def _run(self, call: ToolCall) -> tuple[str, bool]:
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: no tool named {call.name!r}; the tools are {', '.join(sorted(self.tools))}", False
        try:
            out = fn(**call.arguments)
            if inspect.isawaitable(out):
                out = await out
            return str(out), True
        except TypeError as e:  # wrong or missing arguments
            return f"error: {call.name}: {e}", False
        except Exception as e:  # a tool's failure is the model's observation, not the rollout's crash
            return f"error: {call.name} raised {type(e).__name__}: {e}", False


class PythonToolEnvironment(ToolEnvironment):
    """One tool, `python(code)`: the code runs in `asyncrl.agents.sandbox`; its stdout (or the
    error) comes back. Limits are `SandboxLimits` fields (e.g. env_kwargs.wall_s=5)."""

    def __init__(self, max_calls_per_turn: int = 4, **limits: Any) -> None:
        self.limits = SandboxLimits(**limits)
        schema = function_schema("python", "Run Python code; returns what it prints.",
                                 {"code": "the Python code to run"})
        super().__init__({"python": self.python}, [schema], max_calls_per_turn)

    async def python(self, code: str) -> str:
        result = await run_python(code, self.limits)
        if result.error is not None:
            raise RuntimeError(result.observation().strip())
        return result.observation()


BUILTIN_ENVIRONMENTS: dict[str, Callable[..., Environment]] = {"python_tool": PythonToolEnvironment,
                                                               "lookup": LookupEnvironment}


def load_environment(spec: str, kwargs: dict[str, Any] | None = None) -> type[Environment] | Any:
    """The environment factory `spec` names: a built-in name or `path/to/file.py:Class`."""
    if spec in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[spec]
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise ConfigError(f"rollout.multi_turn.env={spec!r}: not a built-in environment "
                          f"({', '.join(sorted(BUILTIN_ENVIRONMENTS))}) and not path/to/file.py:Class")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"rollout.multi_turn.env={spec!r}: no file {file.resolve()}")
    module_name = f"asyncrl_env_{abs(hash(str(file.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        loader = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module
        loader.loader.exec_module(module)
    factory = getattr(module, name, None)
    if factory is None or not callable(factory):
        raise ConfigError(f"rollout.multi_turn.env={spec!r}: {file} has no class or function {name!r}")
    return factory
