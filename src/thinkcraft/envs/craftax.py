"""Craftax environments, batched, with episode logging and (optimistic) auto-reset, in one wrapper.

`make_env("Craftax-Symbolic-v1", num_envs=1024, reset_ratio=16)` returns a `VecEnv` whose `reset` and
`step` are pure functions of (rng, state, action) over a batch, ready for `jax.lax.scan` (`envs.scan` holds
the one scan of env steps the tools share; training's rollout is `rl.ppo.make_rollout`).

This module is also the one place for Craftax's names: the env-name table (`ENV_NAMES`, `ALIASES`,
`ENV_KINDS`; `canonical_env_name`, `env_kind`, `symbolic_env_name`) and the state unwrapper
(`unwrap_env_state`).

Reset schemes (`reset_ratio`):
* `1`  — plain auto-reset: a fresh world is generated for every env at every step and selected where the
  episode ended (what craftax's `EnvironmentAutoReset` does). Exact, but world generation costs a lot.
* `r > 1` — optimistic resets (Craftax_Baselines' `OptimisticResetVecEnvWrapper`): only `num_envs / r`
  fresh worlds per step. Baselines assigns them with `jax.random.choice(p=done, replace=False)`, whose
  result is undefined when fewer than `num_envs / r` envs are done (zero-probability picks, NaN when none
  is). Here the assignment is explicit: done envs are ranked (starting at a random offset, so no env index
  is favoured) and the k-th done env takes fresh world k. Only if more than `num_envs / r` envs end in the
  same step do the extra ones share a fresh world with another (the "optimistic" bet; still a valid start).

* a reset pool (`PooledState`, ppo-hidden) — the fresh worlds for a stretch of steps are generated ahead,
  once (`VecEnv.make_pool`), so that something slow (an LLM encoding their observations) can see them
  before any env resets into them. The k-th reset since the pool was made takes world k mod P (a shared
  world beyond P resets: the same optimistic bet). No world is generated inside a step. rl/hidden.py's
  docstring says why ppo-hidden uses it.

Episode statistics live in the state (PureJaxRL's LogWrapper idea) so logging never leaves the graph.
Timeouts and deaths both end an episode (`done`), as in craftax and Craftax_Baselines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from craftax.craftax.craftax_state import EnvState as CraftaxState
from craftax.craftax_classic.envs.craftax_state import EnvState as ClassicState
from flax import struct

from thinkcraft.envs.unroll import UnrollSetting, resolve_unroll_env_scans, unroll_env_scans
from thinkcraft.utils.errors import UserError

ENV_NAMES: tuple[str, ...] = (
    "Craftax-Symbolic-v1",
    "Craftax-Classic-Symbolic-v1",
    "Craftax-Pixels-v1",
    "Craftax-Classic-Pixels-v1",
)
ALIASES = {
    "craftax": "Craftax-Symbolic-v1",
    "craftax-classic": "Craftax-Classic-Symbolic-v1",
    "classic": "Craftax-Classic-Symbolic-v1",
}
ENV_KINDS: tuple[str, ...] = ("craftax", "craftax-classic")
"""The two games (the text package's renderers and action tables are per kind; pixels and symbolic
observations of a game share its states). A kind is also an alias of the game's symbolic env."""


def canonical_env_name(name: str) -> str:
    """An env name or alias (case-insensitive) -> its name in ENV_NAMES; a clear error otherwise."""
    n = ALIASES.get(name.lower(), name)
    if n not in ENV_NAMES:
        raise UserError(
            f"unknown env {name!r}; valid names: {', '.join(ENV_NAMES)} (aliases: {', '.join(ALIASES)})"
        )
    return n


def env_kind(name: str) -> str:
    """'craftax' or 'craftax-classic' for an env name, alias or kind."""
    return "craftax-classic" if "Classic" in canonical_env_name(name) else "craftax"


def symbolic_env_name(name: str) -> str:
    """The symbolic env of a name, alias or kind's game (what text envs and random rollouts build)."""
    return ALIASES[env_kind(name)]


def unwrap_env_state(state: Any) -> Any:
    """Follow `.env_state` (VecEnvState, LogWrapper, nested wrappers) down to the craftax EnvState."""
    for _ in range(32):
        if isinstance(state, (CraftaxState, ClassicState)) or not hasattr(state, "env_state"):
            break
        state = state.env_state
    return state


def achievement_names(name: str) -> tuple[str, ...]:
    if env_kind(name) == "craftax-classic":
        from craftax.craftax_classic.constants import Achievement
    else:
        from craftax.craftax.constants import Achievement
    return tuple(a.name.lower() for a in sorted(Achievement, key=lambda a: a.value))


def achievement_weights(name: str) -> tuple[float, ...]:
    """Reward weight of each achievement (Craftax: 1/3/5/8 by difficulty; Classic: all 1)."""
    if env_kind(name) == "craftax-classic":
        return tuple(1.0 for _ in achievement_names(name))
    from craftax.craftax.constants import ACHIEVEMENT_REWARD_MAP, Achievement

    return tuple(float(ACHIEVEMENT_REWARD_MAP[a.value]) for a in sorted(Achievement, key=lambda a: a.value))


class EpisodeInfo(NamedTuple):
    """Per env, per step. Fields other than `done` are meaningful only where `done` is true."""

    done: jax.Array  # bool (N,)
    episode_return: jax.Array  # float32 (N,): return of the episode that just ended
    episode_length: jax.Array  # int32 (N,)
    achievements: jax.Array  # bool (N, A): achievements unlocked in the episode that just ended


@struct.dataclass
class VecEnvState:
    env_state: Any
    """Batched craftax EnvState (leading axis = env). The text package finds it by this name."""
    episode_returns: jax.Array
    episode_lengths: jax.Array


class ResetPool(NamedTuple):
    """Fresh worlds generated ahead of the resets that will take them (leading axis P = pool size)."""

    obs: jax.Array  # (P, obs_dim): each world's first observation
    env_state: Any  # batched craftax EnvState (P, ...)
    cursor: jax.Array  # int32 (): resets that drew from this pool so far (the next takes world cursor mod P)


@struct.dataclass
class PooledState:
    """A VecEnvState whose resets draw from a `ResetPool` instead of worlds generated at each step."""

    env_state: VecEnvState
    """The envs (named like VecEnvState's field, so `unwrap_env_state` and the text package find them)."""
    pool: ResetPool
    took: jax.Array
    """(N,) int32: the pool world each env reset into at the last step; -1 where it did not reset."""


@dataclass(frozen=True)
class VecEnv:
    """A batch of `num_envs` Craftax environments with logging and auto-reset (see module doc)."""

    name: str
    num_envs: int
    reset_ratio: int
    base: Any  # the craftax NoAutoReset environment
    params: Any
    unroll_env_scans: bool = False
    """Trace craftax's own short `lax.scan`s (mob / projectile / plant slots, world-generation rooms and
    ores: 2-10 iterations each) and jax.random.choice's binary searches fully unrolled. Same results;
    no host-driven GPU loop iterations inside a step (envs/unroll.py)."""

    @property
    def num_actions(self) -> int:
        return int(self.base.num_actions)

    @property
    def obs_dim(self) -> int:
        """Observations are flattened to (num_envs, obs_dim) (pixels too: the networks are MLPs)."""
        return int(np.prod(self.base.observation_space(self.params).shape))

    @property
    def num_resets_per_step(self) -> int:
        return self.num_envs // self.reset_ratio

    def _reset_batch(self, rng: jax.Array, n: int) -> tuple[jax.Array, Any]:
        with unroll_env_scans(self.unroll_env_scans):
            obs, st = jax.vmap(self.base.reset_env, in_axes=(0, None))(jax.random.split(rng, n), self.params)
        # craftax's world generation leaves some leaves weakly typed; after one step they are strong. Make
        # them strong now so a jitted function sees one type signature (no second compile after update 1).
        return obs.reshape(n, -1), jax.tree.map(lambda x: x.astype(x.dtype), st)

    def reset(self, rng: jax.Array) -> tuple[jax.Array, VecEnvState]:
        obs, env_state = self._reset_batch(rng, self.num_envs)
        zeros = jnp.zeros((self.num_envs,), jnp.float32)
        return obs, VecEnvState(env_state, zeros, jnp.zeros((self.num_envs,), jnp.int32))

    def make_pool(self, rng: jax.Array, size: int) -> ResetPool:
        """`size` fresh worlds for the resets of the steps ahead (cursor 0)."""
        obs, env_state = self._reset_batch(rng, size)
        return ResetPool(obs, env_state, jnp.zeros((), jnp.int32))

    def with_pool(self, state: VecEnvState, pool: ResetPool) -> PooledState:
        """`state` whose resets draw from `pool` from now on."""
        return PooledState(state, pool, jnp.full((self.num_envs,), -1, jnp.int32))

    def step(
        self, rng: jax.Array, state: VecEnvState | PooledState, action: jax.Array
    ) -> tuple[jax.Array, Any, jax.Array, jax.Array, EpisodeInfo]:
        """One step of every env; envs whose episode ends start a fresh world (module doc: reset schemes).
        A `PooledState` draws the fresh worlds from its pool (and returns a PooledState)."""
        rng_step, rng_reset, rng_rank = jax.random.split(rng, 3)
        vec = state.env_state if isinstance(state, PooledState) else state
        with unroll_env_scans(self.unroll_env_scans):
            obs_st, env_st, reward, done, _ = jax.vmap(self.base.step_env, in_axes=(0, 0, 0, None))(
                jax.random.split(rng_step, self.num_envs), vec.env_state, action, self.params
            )
        obs_st = obs_st.reshape(self.num_envs, -1)
        reward = reward.astype(jnp.float32)
        ep_ret = vec.episode_returns + reward
        ep_len = vec.episode_lengths + 1
        info = EpisodeInfo(done, ep_ret, ep_len, env_st.achievements.astype(bool))

        if isinstance(state, PooledState):
            pool = state.pool
            idx = pool_world_index(done, pool.cursor, pool.obs.shape[0])
            obs_re, env_re = pool.obs[idx], jax.tree.map(lambda x: x[idx], pool.env_state)
        else:
            obs_re, env_re = self._reset_batch(rng_reset, self.num_resets_per_step)
            if self.reset_ratio > 1:
                idx = fresh_world_index(done, self.num_resets_per_step, rng_rank)
                obs_re = obs_re[idx]
                env_re = jax.tree.map(lambda x: x[idx], env_re)

        def pick(fresh: jax.Array, cont: jax.Array) -> jax.Array:
            d = done.reshape(done.shape + (1,) * (cont.ndim - 1))
            return jnp.where(d, fresh, cont)

        env_state = jax.tree.map(pick, env_re, env_st)
        obs = pick(obs_re, obs_st)
        not_done = 1 - done.astype(jnp.int32)
        new_state = VecEnvState(env_state, ep_ret * not_done, ep_len * not_done)
        if isinstance(state, PooledState):
            cursor = state.pool.cursor + done.sum(dtype=jnp.int32)
            new_state = PooledState(new_state, state.pool._replace(cursor=cursor),
                                    jnp.where(done, idx, -1).astype(jnp.int32))
        return obs, new_state, reward, done, info


def pool_world_index(done: jax.Array, cursor: jax.Array, pool_size: int) -> jax.Array:
    """Which pool world each env would take if it were done: (N,) int32. The done envs of a step, in index
    order, take the next worlds of the pool's walk: (cursor + rank) mod pool_size (the walk wraps around:
    beyond pool_size resets, worlds are shared)."""
    rank = jnp.cumsum(done.astype(jnp.int32)) - 1
    return jnp.where(done, (cursor + rank) % pool_size, 0).astype(jnp.int32)


def fresh_world_index(done: jax.Array, num_fresh: int, rng: jax.Array) -> jax.Array:
    """Which of `num_fresh` fresh worlds each env would take if it were done: (N,) int32.

    Done envs are ranked in index order starting from a random offset; the k-th takes world k (unique for
    the first `num_fresh`; beyond that, world k mod num_fresh — shared). Deterministic given `rng`, no
    reliance on `jax.random.choice` behaviour with zero-probability entries.
    """
    n = done.shape[0]
    offset = jax.random.randint(rng, (), 0, n)
    rolled = jnp.roll(done.astype(jnp.int32), -offset)
    rank_rolled = jnp.cumsum(rolled) - 1
    rank = jnp.roll(rank_rolled, offset)
    return jnp.where(done, rank % num_fresh, 0).astype(jnp.int32)


def make_env(name: str, num_envs: int = 1, reset_ratio: int = 1,
             unroll_env_scans: UnrollSetting | bool = False) -> VecEnv:
    """Build a batched Craftax env. `reset_ratio` must divide `num_envs` (1 = fresh world every step);
    `unroll_env_scans`: a bool or auto/on/off (envs/unroll.py)."""
    name = canonical_env_name(name)
    if num_envs < 1:
        raise UserError(f"num_envs must be >= 1, got {num_envs}")
    if reset_ratio < 1 or num_envs % reset_ratio != 0:
        raise UserError(
            f"optimistic reset ratio {reset_ratio} must be >= 1 and divide num_envs={num_envs} "
            f"(Craftax_Baselines uses min(16, num_envs))"
        )
    from craftax.craftax_env import make_craftax_env_from_name

    base = make_craftax_env_from_name(name, auto_reset=False)
    return VecEnv(name=name, num_envs=num_envs, reset_ratio=reset_ratio, base=base, params=base.default_params,
                  unroll_env_scans=resolve_unroll_env_scans(unroll_env_scans))
