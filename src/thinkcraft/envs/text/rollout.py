"""Random rollouts for prompt work, tests and benchmarks (not a training path).

Two jitted functions per (env, batch size): a vmapped reset that can start envs on a chosen floor
(Craftax only: the player is put on that floor's up ladder, as `descend` does), and a vmapped step
without auto-reset (world generation inside the step would make its CPU compile ~40% longer);
envs that end are reset on the host with the reset already compiled, back to their start floor.
States are collected every `every` steps by a short Python loop, so the compiled code is one env
step, not a long scan.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from thinkcraft.envs.craftax import env_kind, symbolic_env_name
from thinkcraft.envs.text.names import ACTION_NAMES


@functools.lru_cache(maxsize=None)
def _env_fns(kind: str):
    from craftax.craftax_env import make_craftax_env_from_name

    env = make_craftax_env_from_name(symbolic_env_name(kind), auto_reset=False)
    params = env.default_params

    @jax.jit
    def reset(keys: jax.Array, floors: jax.Array) -> Any:
        _, states = jax.vmap(env.reset, in_axes=(0, None))(keys, params)
        if kind != "craftax":
            return states
        pos = jnp.take_along_axis(states.up_ladders, floors[:, None, None], axis=1)[:, 0]
        on_floor = (floors > 0)[:, None]
        return states.replace(
            player_level=floors.astype(states.player_level.dtype),
            player_position=jnp.where(on_floor, pos, states.player_position).astype(states.player_position.dtype),
        )

    @jax.jit
    def step(keys: jax.Array, states: Any, actions: jax.Array) -> Any:
        _, states, _, done, _ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(keys, states, actions, params)
        return states, done

    return reset, step


def random_rollout(
    env: str,
    num_envs: int,
    num_steps: int,
    seed: int = 0,
    every: int = 1,
    floors: Sequence[int] | None = None,
    policy: Callable[[int, Any], Any] | None = None,
) -> Iterator[tuple[int, Any]]:
    """Yield (step, batched states) at step 0 and every `every` steps of uniformly random play, or of
    `policy(step, states) -> (num_envs,) actions` (render's scripted walk) when given."""
    kind = env_kind(env)
    reset, step = _env_fns(kind)
    floors_a = jnp.asarray(np.zeros(num_envs, np.int32) if floors is None else np.asarray(floors, np.int32))
    if floors_a.shape != (num_envs,):
        raise ValueError(f"floors needs {num_envs} entries, got {floors_a.shape}")
    key = jax.random.PRNGKey(seed)
    key, sub = jax.random.split(key)
    states = reset(jax.random.split(sub, num_envs), floors_a)
    yield 0, states
    num_actions = len(ACTION_NAMES[kind])
    for t in range(1, num_steps + 1):
        key, k_act, k_step, k_reset = jax.random.split(key, 4)
        actions = jax.random.randint(k_act, (num_envs,), 0, num_actions) if policy is None else jnp.asarray(policy(t, states), jnp.int32)
        states, done = step(jax.random.split(k_step, num_envs), states, actions)
        if bool(done.any()):  # rare: replace the ended envs by fresh ones (eager select, no new compile)
            fresh = reset(jax.random.split(k_reset, num_envs), floors_a)
            states = jax.tree_util.tree_map(
                lambda new, old: jnp.where(done.reshape((-1,) + (1,) * (old.ndim - 1)), new, old), fresh, states
            )
        if t % every == 0:
            yield t, states
