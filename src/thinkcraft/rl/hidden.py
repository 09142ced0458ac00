"""LLM hidden states as a policy input (ppo-hidden): running normalisation, staleness bookkeeping.

An LLM hidden state of env i describes the observation at the moment it was rendered. Between refreshes
(every `skip_n` steps) the policy keeps using it, so it must know how old it is, and it must never act
on a hidden state of an episode that has ended. Our choice: **mask + age**. Each env carries
`HiddenAux(hidden, age, valid)`; `age` counts env steps since the rendered observation, and `valid`
drops to 0 when the env's episode ends inside the window (the hidden input is then zeroed until the next
refresh). Refreshing mid-window instead would need an LLM call inside the jitted scan.

Hidden states are z-normalised with running statistics over every refresh (the public ppo-hidden attempt
learned nothing until it normalised them): Chan et al.'s parallel mean/variance merge, clipped to ±10.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RunningNorm(NamedTuple):
    count: jax.Array  # () float32
    mean: jax.Array  # (H,)
    var: jax.Array  # (H,)

    @staticmethod
    def create(hidden_size: int) -> "RunningNorm":
        return RunningNorm(jnp.zeros((), jnp.float32), jnp.zeros((hidden_size,), jnp.float32),
                           jnp.ones((hidden_size,), jnp.float32))

    def update(self, x: jax.Array) -> "RunningNorm":
        """Merge a batch (N, H) into the statistics (Chan, Golub & LeVeque parallel algorithm)."""
        x = x.astype(jnp.float32)
        n = jnp.asarray(x.shape[0], jnp.float32)
        b_mean = x.mean(0)
        b_var = x.var(0)
        tot = self.count + n
        delta = b_mean - self.mean
        mean = self.mean + delta * n / tot
        m2 = self.var * self.count + b_var * n + jnp.square(delta) * self.count * n / tot
        return RunningNorm(tot, mean, m2 / tot)

    def normalize(self, x: jax.Array, clip: float = 10.0) -> jax.Array:
        return jnp.clip((x - self.mean) / jnp.sqrt(self.var + 1e-8), -clip, clip)


class HiddenAux(NamedTuple):
    """Per-env hidden-state input carried through the env+policy scan."""

    hidden: jax.Array  # (N, H) normalised hidden state
    age: jax.Array  # (N,) int32: env steps since the observation it describes
    valid: jax.Array  # (N,) bool: still the same episode as that observation


class AugInput(NamedTuple):
    """What ActorCriticAug reads (leading axes (..., N))."""

    obs: jax.Array
    hidden: jax.Array
    age: jax.Array  # float32, age / age_scale, clipped to [0, 4]
    valid: jax.Array  # float32 0/1


def empty_aux(num_envs: int, hidden_size: int) -> HiddenAux:
    return HiddenAux(jnp.zeros((num_envs, hidden_size), jnp.float32), jnp.zeros((num_envs,), jnp.int32),
                     jnp.zeros((num_envs,), bool))


def aux_after_step(aux: HiddenAux, done: jax.Array) -> HiddenAux:
    """One env step later: one step older; invalid where the episode just ended (the next obs is a new world)."""
    return HiddenAux(aux.hidden, aux.age + 1, aux.valid & ~done)


def make_policy_input(age_scale: float):
    def policy_input(obs: jax.Array, aux: HiddenAux) -> AugInput:
        age = jnp.clip(aux.age.astype(jnp.float32) / age_scale, 0.0, 4.0)
        return AugInput(obs, aux.hidden, age, aux.valid.astype(jnp.float32))

    return policy_input


def refresh(norm: RunningNorm, hidden: jax.Array, age: jax.Array, valid: jax.Array) -> tuple[RunningNorm, HiddenAux]:
    """Install new raw hidden states: update the running statistics, normalise."""
    norm = norm.update(hidden)
    return norm, HiddenAux(norm.normalize(hidden), age.astype(jnp.int32), valid)
