"""Preloaded by the tests' fork server (`tests.helpers.forked.PRELOAD`) when vLLM is installed:
the modules a vLLM rollout worker imports as it builds its first engine (vLLM itself, its CPU
attention backend, the offline engine), ~7 s of CPU a worker on the 2-core machine, paid once a
test session instead. Not the CPU model runner: its import patches torch (`pin_memory`, CUDA
events) for the whole process, which only a worker that runs vLLM may have, as in a job. The
environment variables vLLM sets for itself as it loads are taken back: every forked child takes
its own environment, and the ones after this import should not see vLLM's."""

import importlib
import importlib.util
import os

MODULES = ("vllm", "vllm.v1.attention.backends.cpu_attn", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine",
           "vllm.entrypoints.pooling.offline")

if importlib.util.find_spec("vllm") is not None:
    _saved = dict(os.environ)
    for _name in MODULES:
        importlib.import_module(_name)
    os.environ.clear()
    os.environ.update(_saved)
