"""thinkcraft: online reinforcement learning with language models in the loop.

Layers (dependencies point downwards only; tests/test_layers.py checks them):
    cli.py -> train/, label/ (jobs) -> rl/, llm/, data/ -> envs/ -> utils/
"""

__version__ = "0.1.0"
