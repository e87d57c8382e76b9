"""asyncrl: RL post-training of LLMs on an asyncio actor-message system (no Ray)."""

__version__ = "0.1.0"
