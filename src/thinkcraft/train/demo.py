"""`thinkcraft demo`: the README's first command — a short run of the default job on CPU.

ppo-hidden on Craftax-Classic: a few envs whose policy reads the bundled SmolLM2-135M-Instruct's hidden
state of the compact text observation, refreshed every 32 steps. About 5 minutes on a 2-core CPU (the
first run also converts the bundled model once, ~40 s); leaves runs/demo/{metrics.jsonl, checkpoint/,
curve.png}. `--plain` runs plain PPO instead (no LLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DemoConfig:
    total_timesteps: int = 4_096
    """Environment steps (the demo's length)."""
    num_envs: int = 4
    """Parallel environments (each gets an LLM call per refresh)."""
    skip_n: int = 32
    """Refresh the LLM hidden states every skip_n steps."""
    layer: int = 12
    """LLM layer to read (of 30; middle layers cost less on a CPU and carry more semantics)."""
    plain: bool = False
    """Run plain PPO (no LLM) instead."""
    run_name: str = "demo"
    """Run directory name under runs/ (replaced if it exists)."""
    runs_dir: str = "runs"
    """Where run directories go."""


def run(cfg: DemoConfig) -> dict[str, Any]:
    common = dict(env_name="Craftax-Classic-Symbolic-v1", total_timesteps=cfg.total_timesteps,
                  num_envs=cfg.num_envs, num_steps=64, layer_width=128, num_minibatches=4,
                  optimistic_reset_ratio=cfg.num_envs, run_name=cfg.run_name, runs_dir=cfg.runs_dir,
                  overwrite=True, lr=5e-4)
    if cfg.plain:
        from thinkcraft.train.ppo import PPOConfig
        from thinkcraft.train.ppo import run as run_ppo

        return run_ppo(PPOConfig(**common, updates_per_chunk=4))
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig
    from thinkcraft.train.ppo_hidden import run as run_hidden

    return run_hidden(PPOHiddenConfig(**common, skip_n=cfg.skip_n, layer=cfg.layer, engine="hf:default",
                                      hidden_proj_dim=32, engine_device="cpu"))
