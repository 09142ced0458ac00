"""LLM hidden states as a policy input (ppo-hidden): running normalisation, staleness bookkeeping.

An LLM hidden state of env i describes the observation at the moment it was rendered. Between refreshes
(every `skip_n` steps) the policy keeps using it, so it must know how old it is, and it must never act
on a hidden state of an episode that has ended. Each env carries `HiddenAux(hidden, age, valid, ...)`;
`age` counts env steps since the observation the hidden state describes, `valid` says it is of the env's
current episode (an invalid one is zeroed before it reaches the policy). Refreshing mid-window instead
would need an LLM call inside the jitted scan.

**Resets inside a window: a reset pool (the default).** An env whose episode ends mid-window starts a new
world whose observation the LLM has not seen. Decision: the worlds are known in advance. At each refresh
point P fresh worlds are generated for the coming interval (`envs.craftax.ResetPool`), rendered and
encoded in the same engine call as the envs' observations (LLM cost +P/N per refresh), and the interval's
resets walk through them (the k-th reset takes world k mod P). A reset env then acts on its new world's
hidden state at once: `pool_hidden[world]`, age counted from its reset (0 at the reset), valid. With
`--overlap` the pool of interval k+1 is generated at snapshot k and encoded by the same worker call, so
it is ready when interval k+1 starts (`OverlappedRefresh`); an env that reset since the snapshot keeps
its pool world's hidden state rather than taking the snapshot's (which describes its ended episode).
Every hidden input is then valid (`hidden/valid_frac` = 1). Why this and not the alternatives:
  * masking (the old scheme, `--reset-pool-size 0`): in early training most envs reset inside a window
    (valid fraction 0.41 at skip_n 100, 0.85 at skip_n 25, 128 envs): the policy mostly acts without it;
  * encoding each reset's world when it happens needs the LLM inside the jitted scan (a host callback
    per step: the env would wait for the LLM at every reset);
  * a pool of one world per expected reset would cost an LLM pass per reset (+100% and more of the
    LLM's time early in training).
  The price is world diversity: more resets than P in one interval share worlds (the "optimistic" bet
  Craftax_Baselines' optimistic resets already make per step, here per interval; `hidden/pool_draws_per_world`
  reports it), and the env no longer generates worlds inside its steps (N/ratio per step before: the
  env step gets cheaper). P defaults to num_envs / optimistic_reset_ratio (+6% LLM work at ratio 16).

Hidden states are z-normalised with running statistics over every refresh (the public ppo-hidden attempt
learned nothing until it normalised them): Chan et al.'s parallel mean/variance merge, clipped to ±10.
The pool's hidden states are part of each refresh's batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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
    pool_hidden: jax.Array | None = None
    """(P, H) normalised hidden states of the reset pool's worlds (their first observations); None: no
    pool (the masked scheme)."""


class AugInput(NamedTuple):
    """What ActorCriticAug reads (leading axes (..., N))."""

    obs: jax.Array
    hidden: jax.Array
    age: jax.Array  # float32, age / age_scale, clipped to [0, 4]
    valid: jax.Array  # float32 0/1


def empty_aux(num_envs: int, hidden_size: int, pool_size: int = 0) -> HiddenAux:
    pool = jnp.zeros((pool_size, hidden_size), jnp.float32) if pool_size else None
    return HiddenAux(jnp.zeros((num_envs, hidden_size), jnp.float32), jnp.zeros((num_envs,), jnp.int32),
                     jnp.zeros((num_envs,), bool), pool)


def aux_after_step(aux: HiddenAux, done: jax.Array, env_state: Any = None) -> HiddenAux:
    """One env step later: one step older. Where the episode just ended: the pool world's hidden state
    (age 0, valid) if the env reset into a pool world (`env_state.took`, envs.craftax.PooledState),
    else invalid until the next refresh (the next obs is a world the LLM has not seen)."""
    older = aux._replace(age=aux.age + 1, valid=aux.valid & ~done)
    took = getattr(env_state, "took", None)
    if took is None or aux.pool_hidden is None:
        return older
    fresh = took >= 0
    pool_h = aux.pool_hidden[jnp.maximum(took, 0)]
    return older._replace(hidden=jnp.where(fresh[:, None], pool_h, aux.hidden),
                          age=jnp.where(fresh, 0, older.age), valid=older.valid | fresh)


def make_policy_input(age_scale: float):
    def policy_input(obs: jax.Array, aux: HiddenAux) -> AugInput:
        age = jnp.clip(aux.age.astype(jnp.float32) / age_scale, 0.0, 4.0)
        return AugInput(obs, aux.hidden, age, aux.valid.astype(jnp.float32))

    return policy_input


def refresh(norm: RunningNorm, hidden: jax.Array, age: jax.Array, valid: jax.Array,
            pool_hidden: jax.Array | None = None, rows: Any = None) -> tuple[RunningNorm, HiddenAux]:
    """Install new raw hidden states (N, H) and, with a reset pool, its worlds' (P, H): update the running
    statistics over both, normalise. `rows(hidden, pool_hidden)` (env shards, rl/shards.py: every shard
    holds every row) picks the rows this shard installs, after the statistics are updated over all of them
    (so they stay one device's)."""
    norm = norm.update(hidden if pool_hidden is None else jnp.concatenate([hidden, pool_hidden]))
    if rows is not None:
        hidden, pool_hidden = rows(hidden, pool_hidden)
    pool = None if pool_hidden is None else norm.normalize(pool_hidden)
    return norm, HiddenAux(norm.normalize(hidden), age.astype(jnp.int32), valid, pool)
