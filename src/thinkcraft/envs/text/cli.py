"""`thinkcraft render`: print the text observations of a short random rollout (for prompt work)."""

from __future__ import annotations

from dataclasses import dataclass

from thinkcraft.envs.craftax import env_kind
from thinkcraft.envs.text.render import FORMATS, COMPACT_FORMAT_DOC
from thinkcraft.utils.errors import ConfigError, UserError, check


@dataclass
class RenderConfig:
    env: str = "craftax"
    """Craftax-Symbolic-v1 / Craftax-Classic-Symbolic-v1, or the aliases craftax / craftax-classic."""
    format: str = "compact"
    """Text format: compact (short, for LLMs) or craftax (craftax's own layout, ~1,750 characters)."""
    seed: int = 0
    """Seed of the worlds and of the random actions."""
    steps: int = 20
    """Random steps to take; prints the observation before the first step and after each."""
    num_envs: int = 1
    """Envs rolled out side by side (each printed)."""
    every: int = 1
    """Print every this many steps."""
    show_doc: bool = False
    """Print the compact format's convention (COMPACT_FORMAT_DOC) first."""

    def __post_init__(self) -> None:
        try:
            env_kind(self.env)
        except UserError as e:
            raise ConfigError("env", str(e)) from None
        check(self.format in FORMATS, "format", f"unknown format {self.format!r}; valid: {', '.join(FORMATS)}")
        check(self.steps >= 0, "steps", f"must be >= 0, got {self.steps}")
        check(1 <= self.num_envs <= 4096, "num_envs", f"must be in 1..4096, got {self.num_envs}")
        check(self.every >= 1, "every", f"must be >= 1, got {self.every}")


def run(cfg: RenderConfig) -> int:
    import jax

    from thinkcraft.envs.text import extract, render
    from thinkcraft.envs.text.rollout import random_rollout

    kind = env_kind(cfg.env)
    if cfg.show_doc:
        print(COMPACT_FORMAT_DOC + "\n")
    for step, states in random_rollout(kind, cfg.num_envs, cfg.steps, seed=cfg.seed, every=cfg.every):
        texts = render(jax.device_get(extract(states)), cfg.format, env_kind=kind)
        for i, text in enumerate(texts):
            print(f"=== step {step}" + (f", env {i}" if cfg.num_envs > 1 else "") + " ===")
            print(text.rstrip("\n"))
    return 0
