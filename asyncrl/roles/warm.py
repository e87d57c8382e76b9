"""Imported by a CPU node's fork server (`cluster.warm_imports`): what the roles load lazily on a
job's first call (the model classes transformers resolves by name, the tokenizer, pyarrow's parquet
writer and the pandas it loads, the config checks' resolved types), loaded once before the workers
fork, so each worker starts with them."""

import pandas  # noqa: F401  (pyarrow's writer imports it with its first table)
import torch.distributed.checkpoint  # noqa: F401
from transformers.models.auto import image_processing_auto, tokenization_auto  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401
from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
from transformers.models.qwen3 import modeling_qwen3  # noqa: F401

from asyncrl.config import RLConfig
from asyncrl.roles import actor  # noqa: F401
from asyncrl.roles.kept_rollouts import warm_up
from asyncrl.rollout import continuous, engine  # noqa: F401  (the roles import them at their first generate)
from asyncrl.single_controller.schema import warm

warm(RLConfig)
warm_up()
