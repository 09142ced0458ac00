"""Actor-critic networks (flax.linen), Craftax_Baselines' shapes and initialisation."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.initializers import constant, orthogonal

from thinkcraft.rl.distributions import Categorical

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {"tanh": nn.tanh, "relu": nn.relu}


class MLP(nn.Module):
    """`num_layers` Dense+activation layers of `width`, then a linear head of `out_dim`."""

    width: int
    num_layers: int
    out_dim: int
    head_scale: float
    activation: str = "tanh"
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.width, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0),
                             dtype=self.dtype)(x))
        return nn.Dense(self.out_dim, kernel_init=orthogonal(self.head_scale), bias_init=constant(0.0),
                        dtype=self.dtype)(x)


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs (3 × 512 tanh by default), orthogonal init: actor head 0.01,
    critic head 1.0 — exactly Craftax_Baselines' `ActorCritic`. `dtype` is the compute dtype (params
    stay float32); float32 matches Baselines, bfloat16 halves the matmul time on tensor cores."""

    action_dim: int
    layer_width: int = 512
    num_layers: int = 3
    activation: str = "tanh"
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[Categorical, jax.Array]:
        if self.dtype == jnp.bfloat16:
            # bf16 tensor-core GEMMs want the contraction dim a multiple of 8/16; Craftax's 8,268 is not.
            # Zero columns change nothing but the first layer's (unused) extra rows.
            obs = obs.astype(jnp.bfloat16)
            pad = (-obs.shape[-1]) % 16
            if pad:
                obs = jnp.pad(obs, [(0, 0)] * (obs.ndim - 1) + [(0, pad)])
        logits = MLP(self.layer_width, self.num_layers, self.action_dim, 0.01, self.activation, self.dtype)(obs)
        value = MLP(self.layer_width, self.num_layers, 1, 1.0, self.activation, self.dtype)(obs)
        return Categorical(logits.astype(jnp.float32)), value[..., 0].astype(jnp.float32)


class ActorCriticAug(nn.Module):
    """ActorCritic whose input also holds a (normalised) LLM hidden state, its age and a validity flag.

    The hidden state (H ≈ 576–2560) is projected to `hidden_proj_dim` (tanh) once and concatenated to the
    symbolic observation, the age and the flag, feeding the same actor and critic MLPs as ActorCritic.
    An invalid hidden state (its episode ended) is zeroed before the projection."""

    action_dim: int
    layer_width: int = 512
    num_layers: int = 3
    hidden_proj_dim: int = 64
    activation: str = "tanh"
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x) -> tuple[Categorical, jax.Array]:  # x: rl.hidden.AugInput
        h = x.hidden * x.valid[..., None]
        z = nn.tanh(nn.Dense(self.hidden_proj_dim, kernel_init=orthogonal(1.0), bias_init=constant(0.0),
                             dtype=self.dtype, name="hidden_proj")(h))
        feats = jnp.concatenate([x.obs, z, x.age[..., None], x.valid[..., None]], axis=-1)
        logits = MLP(self.layer_width, self.num_layers, self.action_dim, 0.01, self.activation, self.dtype)(feats)
        value = MLP(self.layer_width, self.num_layers, 1, 1.0, self.activation, self.dtype)(feats)
        return Categorical(logits.astype(jnp.float32)), value[..., 0].astype(jnp.float32)
