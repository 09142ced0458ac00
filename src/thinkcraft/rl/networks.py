"""Actor-critic networks (flax.linen), Craftax_Baselines' shapes and initialisation.

Feed-forward: `apply(params, x) -> (pi, value)` over inputs with any leading axes (ActorCritic,
ActorCriticAug). Recurrent: `apply(params, carry (N, W), x (T, N, ...), resets (T, N)) -> (carry, pi,
value)` over a sequence (ActorCriticRNN); rl/ppo.py drives both.
"""

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
    hidden_scale: float = float(np.sqrt(2))
    """Orthogonal init scale of the hidden layers (Baselines: sqrt 2 in ppo.py, 2 in ppo_rnn.py's heads)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.width, kernel_init=orthogonal(self.hidden_scale), bias_init=constant(0.0),
                             dtype=self.dtype)(x))
        return nn.Dense(self.out_dim, kernel_init=orthogonal(self.head_scale), bias_init=constant(0.0),
                        dtype=self.dtype)(x)


def to_compute_dtype(obs: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The observation as the first layer's input: unchanged in float32; in bfloat16 cast and zero-padded."""
    if dtype != jnp.bfloat16:
        return obs
    # bf16 tensor-core GEMMs want the contraction dim a multiple of 8/16; Craftax's 8,268 is not.
    # Zero columns change nothing but the first layer's (unused) extra rows.
    obs = obs.astype(jnp.bfloat16)
    pad = (-obs.shape[-1]) % 16
    if pad:
        obs = jnp.pad(obs, [(0, 0)] * (obs.ndim - 1) + [(0, pad)])
    return obs


def aug_features(x, hidden_proj_dim: int, dtype: jnp.dtype) -> jax.Array:
    """ppo-hidden's policy features from an `rl.hidden.AugInput`: the observation, the hidden state
    projected to `hidden_proj_dim` (tanh; zeroed first where invalid), its age and validity flag.
    Called inside a compact `__call__` (its Dense is the caller's submodule `hidden_proj`)."""
    h = x.hidden * x.valid[..., None]
    z = nn.tanh(nn.Dense(hidden_proj_dim, kernel_init=orthogonal(1.0), bias_init=constant(0.0),
                         dtype=dtype, name="hidden_proj")(h))
    return jnp.concatenate([x.obs, z, x.age[..., None], x.valid[..., None]], axis=-1)


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
        obs = to_compute_dtype(obs, self.dtype)
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
        feats = aug_features(x, self.hidden_proj_dim, self.dtype)
        logits = MLP(self.layer_width, self.num_layers, self.action_dim, 0.01, self.activation, self.dtype)(feats)
        value = MLP(self.layer_width, self.num_layers, 1, 1.0, self.activation, self.dtype)(feats)
        return Categorical(logits.astype(jnp.float32)), value[..., 0].astype(jnp.float32)


class _ResetGRUStep(nn.Module):
    """One GRU step over a batch that first restarts the carry from zeros where `reset` (an episode began)."""

    features: int

    @nn.compact
    def __call__(self, carry: jax.Array, inputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        x, reset = inputs
        carry = jnp.where(reset[:, None], jnp.zeros_like(carry), carry)
        return nn.GRUCell(self.features)(carry, x)


class ResetGRU(nn.Module):
    """A GRU (flax GRUCell: lecun-normal input kernels, orthogonal recurrent kernels, zero biases, zero
    initial carry - what Baselines' ScannedRNN uses) scanned over a (T, N, F) sequence; the carry restarts
    from zeros at the steps where `resets` (T, N) is true. Runs in float32 whatever the layers around it do."""

    features: int

    @nn.compact
    def __call__(self, carry: jax.Array, x: jax.Array, resets: jax.Array) -> tuple[jax.Array, jax.Array]:
        scan = nn.scan(_ResetGRUStep, variable_broadcast="params", split_rngs={"params": False}, in_axes=0, out_axes=0)
        return scan(self.features)(carry, (x.astype(jnp.float32), resets))


class ActorCriticRNN(nn.Module):
    """Craftax_Baselines' `ppo_rnn.py` ActorCriticRNN: Dense(layer_width, orthogonal sqrt 2) + ReLU, a GRU of
    layer_width, then separate actor and critic heads of 2 × Dense(layer_width, orthogonal 2) + ReLU and a
    linear output (actor orthogonal 0.01, critic 1.0). ReLU throughout (Baselines' ppo_rnn.py ignores its
    --activation). With `hidden_proj_dim > 0` the input is ppo-hidden's `AugInput` (aug_features)."""

    action_dim: int
    layer_width: int = 512
    hidden_proj_dim: int = 0
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, carry: jax.Array, x, resets: jax.Array) -> tuple[jax.Array, Categorical, jax.Array]:
        feats = aug_features(x, self.hidden_proj_dim, self.dtype) if self.hidden_proj_dim else x
        feats = to_compute_dtype(feats, self.dtype)
        emb = nn.relu(nn.Dense(self.layer_width, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0),
                               dtype=self.dtype)(feats))
        carry, emb = ResetGRU(self.layer_width)(carry, emb, resets)
        head = dict(width=self.layer_width, num_layers=2, activation="relu", dtype=self.dtype, hidden_scale=2.0)
        logits = MLP(out_dim=self.action_dim, head_scale=0.01, **head)(emb)
        value = MLP(out_dim=1, head_scale=1.0, **head)(emb)
        return carry, Categorical(logits.astype(jnp.float32)), value[..., 0].astype(jnp.float32)
