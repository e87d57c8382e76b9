"""An OpenAI-compatible endpoint over asyncrl's rollout engines, recording what it generated
token by token (see docs/serve.md)."""

from asyncrl.serve.backend import Backend, ChoiceRecord, Recorder, Sampling
from asyncrl.serve.http import Limits
from asyncrl.serve.server import OpenAIServer

__all__ = ["Backend", "ChoiceRecord", "Limits", "OpenAIServer", "Recorder", "Sampling"]
