"""A vision-language model as a critic: its body (vision tower and language model) with a
one-output token head, the layout `AutoModelForTokenClassification` gives a text model (which
transformers has no class for when the config is a vision-language one)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


def vision_value_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """The value model of a vision-language `config` (a `vision_config`): `model` (the body,
    named as the image-text-to-text checkpoint names it) and `score` [1, hidden]; its forward
    takes what the body takes (images, 3-D positions, packed rows) and gives `logits` [B, L, 1]."""
    return _value_class(type(config))(config).to(dtype)


@functools.cache
def _value_class(config_class: type) -> type:
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import TokenClassifierOutput
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    body = MODEL_MAPPING[config_class]
    base = next(c for c in body.__mro__ if issubclass(c, PreTrainedModel) and c is not body)

    def __init__(self, config: Any) -> None:
        base.__init__(self, config)
        self.model = body(config)
        self.score = nn.Linear(config.get_text_config().hidden_size, 1)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs: Any) -> TokenClassifierOutput:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            **kwargs).last_hidden_state
        return TokenClassifierOutput(logits=self.score(hidden))

    return type(f"{body.__name__.removesuffix('Model')}ForTokenValue", (base,),
                {"__init__": __init__, "forward": forward, "__module__": __name__})
