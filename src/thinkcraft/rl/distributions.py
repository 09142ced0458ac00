"""Categorical distribution over logits in plain JAX (distrax no longer imports under current JAX)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Categorical:
    logits: jax.Array  # (..., A), unnormalised

    @property
    def log_probs(self) -> jax.Array:
        return jax.nn.log_softmax(self.logits, axis=-1)

    def sample(self, seed: jax.Array) -> jax.Array:
        return jax.random.categorical(seed, self.logits, axis=-1)

    def log_prob(self, action: jax.Array) -> jax.Array:
        lp = self.log_probs
        return jnp.take_along_axis(lp, action[..., None].astype(jnp.int32), axis=-1)[..., 0]

    def entropy(self) -> jax.Array:
        lp = self.log_probs
        # p * log p with p = 0 contributes 0 (exp(-inf) * -inf would be nan)
        return -jnp.sum(jnp.where(jnp.isfinite(lp), jnp.exp(lp) * lp, 0.0), axis=-1)

    def mode(self) -> jax.Array:
        return jnp.argmax(self.logits, axis=-1)
