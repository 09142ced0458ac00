"""The one `lax.scan` of env steps that evaluation, state collection, benchmarks and tests share.

    scan = make_env_scan(env, random_actions(env), num_steps=64, record=lambda s: s.info)
    carry, infos = jax.jit(scan)(EnvCarry(env_state, obs, rng))     # infos: (T, N, ...) per step

Each step splits the carried key three ways, as training's rollout does (`rl.ppo.make_rollout`, which
also carries the policy's extra inputs and builds PPO transitions, so it keeps its own scan body):
`rng, k_act, k_env = split(rng, 3)`; the action comes from `act(obs, k_act)`, the env steps with `k_env`.
`record(EnvStep)` picks what each step returns (default: nothing); it sees the state the action was taken
in as well as the step's results, so a caller can extract features of either. A policy with memory (a
recurrent `train ppo --policy rnn` one) carries it in `EnvCarry.policy_state`: `act(obs, key, state) ->
(action, state)`, and `after_step(state, done)` advances it after the env step (train/evaluate.make_actor).

Not a scan: `envs.text.rollout.random_rollout` steps raw craftax states one jitted step at a time from a
Python loop (envs put on chosen floors, no auto-reset in the compiled step: prompt work and text tests).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from thinkcraft.envs.craftax import EpisodeInfo, VecEnv


class EnvCarry(NamedTuple):
    """What the scan carries from one step to the next."""

    env_state: Any  # VecEnvState
    obs: jax.Array | None
    """(N, obs_dim): the observation the next action is chosen from. None: observations are not carried
    (actions that ignore them, e.g. an env-only timing window; XLA then drops their computation)."""
    rng: jax.Array
    policy_state: Any = None
    """A recurrent policy's memory (then `act` takes and returns it); None for a memoryless `act`."""


class EnvStep(NamedTuple):
    """One step, as `record` sees it."""

    env_state: Any  # the state the action was taken in
    obs: jax.Array  # the observation the action was chosen from
    action: jax.Array  # (N,)
    next_obs: jax.Array
    reward: jax.Array  # (N,) float32
    done: jax.Array  # (N,) bool
    info: EpisodeInfo


Act = Callable[[jax.Array, jax.Array], jax.Array]  # (obs (N, D), key) -> actions (N,)


def random_actions(env: VecEnv) -> Act:
    """Uniformly random actions for every env of the batch."""

    def act(obs: jax.Array, key: jax.Array) -> jax.Array:
        return jax.random.randint(key, (env.num_envs,), 0, env.num_actions)

    return act


def _nothing(step: EnvStep) -> None:
    return None


def make_env_scan(
    env: VecEnv, act: Act, num_steps: int, record: Callable[[EnvStep], Any] = _nothing,
    after_step: Callable[[Any, jax.Array], Any] | None = None,
) -> Callable[[EnvCarry], tuple[EnvCarry, Any]]:
    """`scan(carry) -> (carry after num_steps steps, record of each step stacked on a leading T axis)`.

    Pure (jit it, or call it inside a jitted function); the env's auto-reset and episode logging apply.
    With `carry.policy_state` set, `act(obs, key, state) -> (action, state)` and `after_step(state, done)`.
    """

    def step(carry: EnvCarry, _: None) -> tuple[EnvCarry, Any]:
        rng, k_act, k_env = jax.random.split(carry.rng, 3)
        policy_state = carry.policy_state
        if policy_state is None:
            action = act(carry.obs, k_act)
        else:
            action, policy_state = act(carry.obs, k_act, policy_state)
        obs, env_state, reward, done, info = env.step(k_env, carry.env_state, action)
        if policy_state is not None and after_step is not None:
            policy_state = after_step(policy_state, done)
        out = record(EnvStep(carry.env_state, carry.obs, action, obs, reward, done, info))
        return EnvCarry(env_state, None if carry.obs is None else obs, rng, policy_state), out

    def scan(carry: EnvCarry) -> tuple[EnvCarry, Any]:
        return jax.lax.scan(step, EnvCarry(*carry), None, num_steps)

    return scan
