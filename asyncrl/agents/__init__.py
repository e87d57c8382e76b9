"""Multi-turn rollouts: environments, tool calls, the Python sandbox (see docs/agents.md)."""

from asyncrl.agents.env import Action, Environment, StepResult
from asyncrl.agents.sandbox import RunResult, SandboxLimits, run_python
from asyncrl.agents.tools import PythonToolEnvironment, ToolEnvironment, parse_tool_calls

__all__ = ["Action", "Environment", "PythonToolEnvironment", "RunResult", "SandboxLimits", "StepResult",
           "ToolEnvironment", "parse_tool_calls", "run_python"]
