"""Generalised Advantage Estimation (Schulman et al. 2016) as a reverse `lax.scan`.

Convention (as PureJaxRL / Craftax_Baselines): `dones[t]` is true when the step taken at t ended the
episode, so the bootstrap from t+1 is cut: delta_t = r_t + γ V_{t+1} (1 - d_t) - V_t.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gae(
    rewards: jax.Array,  # (T, N)
    values: jax.Array,  # (T, N)
    dones: jax.Array,  # (T, N) bool/float
    last_value: jax.Array,  # (N,)  V(s_T)
    gamma: float,
    gae_lambda: float,
) -> tuple[jax.Array, jax.Array]:
    """Returns (advantages, value targets), both (T, N)."""
    not_done = 1.0 - dones.astype(jnp.float32)

    def step(carry, xs):
        adv_next, value_next = carry
        r, v, nd = xs
        delta = r + gamma * value_next * nd - v
        adv = delta + gamma * gae_lambda * nd * adv_next
        return (adv, v), adv

    _, adv = jax.lax.scan(
        step, (jnp.zeros_like(last_value), last_value), (rewards, values, not_done), reverse=True
    )
    return adv, adv + values
