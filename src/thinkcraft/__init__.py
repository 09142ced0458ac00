"""thinkcraft: online reinforcement learning with language models in the loop.

Layers (dependencies point downwards only; see DESIGN.md):
    cli.py   -> train/ (loops) -> rl/ (maths) -> envs/, llm/, data/ -> utils/
"""

__version__ = "0.1.0"
