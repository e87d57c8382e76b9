"""The endpoint's tests share one tiny model (random init: its samples are varied)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from asyncrl.models.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny", task="sort", hidden=64, layers=2, heads=4,
                             sft_steps=0)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval(), AutoTokenizer.from_pretrained(tiny_dir)
