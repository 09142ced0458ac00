"""A tiny pure-JAX env with VecEnv's interface (reset / step / EpisodeInfo) that needs memory: each episode
shows a cue (one of `num_actions`) on its first step only; the last of its `length` steps pays 1 if the
action taken there names the cue. A memoryless policy earns 1 / num_actions per episode, a recurrent one
up to 1. Compiles in a second, so the PPO kernels (rl/ppo.py, rl/seeds.py) are tested without Craftax."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from thinkcraft.envs.craftax import EpisodeInfo


class CueState(NamedTuple):
    cue: jax.Array  # (N,) int32
    t: jax.Array  # (N,) int32, step within the episode
    episode_returns: jax.Array  # (N,) float32
    episode_lengths: jax.Array  # (N,) int32


@dataclass(frozen=True)
class CueEnv:
    num_envs: int = 4
    num_actions: int = 2
    length: int = 3

    @property
    def obs_dim(self) -> int:
        return self.num_actions + self.length

    def _obs(self, s: CueState) -> jax.Array:
        cue = jax.nn.one_hot(s.cue, self.num_actions) * (s.t == 0)[:, None]
        return jnp.concatenate([cue, jax.nn.one_hot(s.t, self.length)], axis=-1)

    def _fresh(self, rng: jax.Array) -> CueState:
        n = self.num_envs
        cue = jax.random.randint(rng, (n,), 0, self.num_actions)
        return CueState(cue, jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.int32))

    def reset(self, rng: jax.Array) -> tuple[jax.Array, CueState]:
        s = self._fresh(rng)
        return self._obs(s), s

    def step(self, rng: jax.Array, s: CueState, action: jax.Array):
        last = s.t == self.length - 1
        reward = (last & (action == s.cue)).astype(jnp.float32)
        ret, length = s.episode_returns + reward, s.episode_lengths + 1
        achievements = jnp.stack([reward > 0], axis=-1)
        info = EpisodeInfo(last, ret, length, achievements)
        fresh = self._fresh(rng)
        nxt = CueState(jnp.where(last, fresh.cue, s.cue), jnp.where(last, 0, s.t + 1),
                       jnp.where(last, 0.0, ret), jnp.where(last, 0, length))
        return self._obs(nxt), nxt, reward, last, info
