"""`thinkcraft demo`: the README's first command — a short run of the default job on CPU.

Craftax-Classic, a few envs, a small network: compiles in about a minute on a 2-core CPU and trains for a
couple of minutes, leaving runs/demo/{metrics.jsonl, checkpoint/, curve.png}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DemoConfig:
    total_timesteps: int = 49_152
    """Environment steps (the demo's length)."""
    num_envs: int = 16
    """Parallel environments."""
    run_name: str = "demo"
    """Run directory name under runs/ (replaced if it exists)."""
    runs_dir: str = "runs"
    """Where run directories go."""


def run(cfg: DemoConfig) -> dict[str, Any]:
    from thinkcraft.train.ppo import PPOConfig
    from thinkcraft.train.ppo import run as run_ppo

    return run_ppo(PPOConfig(
        env_name="Craftax-Classic-Symbolic-v1", total_timesteps=cfg.total_timesteps, num_envs=cfg.num_envs,
        num_steps=64, layer_width=128, num_minibatches=4, optimistic_reset_ratio=4, updates_per_chunk=4,
        run_name=cfg.run_name, runs_dir=cfg.runs_dir, overwrite=True, lr=5e-4,
    ))
