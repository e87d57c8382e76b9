"""A reward function for tests that must hold a run between steps: while the file named by
$ASYNCRL_TEST_GATE exists, scoring waits (then it is the built-in reward)."""

import os
import time
from pathlib import Path

from asyncrl.rewards.rules import default_reward


def score(data_source, solution_str, ground_truth, extra_info=None):
    gate = os.environ.get("ASYNCRL_TEST_GATE")
    while gate and Path(gate).exists():
        time.sleep(0.05)
    return default_reward(data_source, solution_str, ground_truth, extra_info)
