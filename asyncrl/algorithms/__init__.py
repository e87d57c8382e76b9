"""RL algorithms for LLM post-training; pure numerics live in `asyncrl.algorithms.core`."""
