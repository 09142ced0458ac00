"""PPO (clipped surrogate, Schulman et al. 2017) as pure JAX functions, PureJaxRL / Craftax_Baselines style.

Pieces, each usable alone (plain PPO and ppo-hidden share all of them):
* `make_rollout`  — `lax.scan` of env+policy steps, returning the trajectory and episode statistics;
* `ppo_loss`      — clipped policy loss + clipped value loss − entropy bonus (Baselines' exact form);
* `ppo_update`    — GAE, then `update_epochs` × `num_minibatches` Adam steps over a shuffled batch;
* `make_train_chunk` — K × (rollout + update) in one `lax.scan`, the unit the outer loop jits and times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from thinkcraft.envs.craftax import EpisodeInfo, VecEnv
from thinkcraft.rl.gae import gae


@dataclass(frozen=True)
class PPOHyper:
    """The loss/update hyperparameters (defaults: Craftax_Baselines `ppo.py`)."""

    gamma: float = 0.99
    gae_lambda: float = 0.8
    clip_eps: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    update_epochs: int = 4
    num_minibatches: int = 8


class Transition(NamedTuple):
    obs: Any  # network input at t (array or pytree), leading axes (T, N)
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    reward: jax.Array
    done: jax.Array


class EpisodeStats(NamedTuple):
    """Sums over finished episodes (exact means are formed on the host over a whole chunk)."""

    count: jax.Array  # ()
    return_sum: jax.Array  # ()
    length_sum: jax.Array  # ()
    achievement_counts: jax.Array  # (A,)

    @staticmethod
    def of(info: EpisodeInfo) -> "EpisodeStats":
        d = info.done.astype(jnp.float32)
        return EpisodeStats(
            d.sum(),
            (info.episode_return * d).sum(),
            (info.episode_length.astype(jnp.float32) * d).sum(),
            (info.achievements.astype(jnp.float32) * d[..., None]).reshape(-1, info.achievements.shape[-1]).sum(0),
        )


class RolloutState(NamedTuple):
    env_state: Any
    obs: jax.Array
    aux: Any  # extra per-env policy inputs carried across steps (ppo-hidden: hidden state + age); None for PPO
    rng: jax.Array


def _identity_policy_input(obs: jax.Array, aux: Any) -> Any:
    return obs


def _keep_aux(aux: Any, done: jax.Array, env_state: Any) -> Any:
    return aux


def make_rollout(
    env: VecEnv,
    apply_fn: Callable,
    num_steps: int,
    policy_input: Callable[[jax.Array, Any], Any] = _identity_policy_input,
    aux_after_step: Callable[[Any, jax.Array, Any], Any] = _keep_aux,
) -> Callable[[Any, RolloutState], tuple[RolloutState, Transition, EpisodeStats]]:
    """`rollout(params, state) -> (state, traj (T, N, ...), episode stats summed over the T steps)`.

    `policy_input(obs, aux)` builds the network input; `aux_after_step(aux, done, env_state)` advances the
    carried extra input after each env step, given the step's new env state (e.g. age a hidden state, mask
    it when its episode ended, or take the hidden state of the world the env reset into).
    """

    def step(carry: tuple[Any, RolloutState], _: None):
        params, rs = carry
        rng, k_act, k_env = jax.random.split(rs.rng, 3)
        x = policy_input(rs.obs, rs.aux)
        pi, value = apply_fn(params, x)
        action = pi.sample(seed=k_act)
        log_prob = pi.log_prob(action)
        obs, env_state, reward, done, info = env.step(k_env, rs.env_state, action)
        aux = aux_after_step(rs.aux, done, env_state)
        tr = Transition(x, action, log_prob, value, reward, done)
        return (params, RolloutState(env_state, obs, aux, rng)), (tr, EpisodeStats.of(info))

    def rollout(params: Any, rs: RolloutState):
        (_, rs), (traj, stats) = jax.lax.scan(step, (params, rs), None, num_steps)
        return rs, traj, jax.tree.map(lambda x: x.sum(0), stats)

    return rollout


def ppo_loss(
    params: Any,
    apply_fn: Callable,
    batch: Transition,
    advantages: jax.Array,
    targets: jax.Array,
    hp: PPOHyper,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Craftax_Baselines' loss: clipped value loss (max of clipped/unclipped, ×0.5), clipped surrogate with
    per-minibatch advantage normalisation, entropy bonus."""
    pi, value = apply_fn(params, batch.obs)
    log_prob = pi.log_prob(batch.action)

    value_clipped = batch.value + (value - batch.value).clip(-hp.clip_eps, hp.clip_eps)
    value_loss = 0.5 * jnp.maximum(jnp.square(value - targets), jnp.square(value_clipped - targets)).mean()

    log_ratio = log_prob - batch.log_prob
    ratio = jnp.exp(log_ratio)
    adv = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - hp.clip_eps, 1.0 + hp.clip_eps) * adv).mean()
    entropy = pi.entropy().mean()

    total = pg_loss + hp.vf_coef * value_loss - hp.ent_coef * entropy
    aux = {
        "losses/total": total,
        "losses/value": value_loss,
        "losses/policy": pg_loss,
        "losses/entropy": entropy,
        # http://joschu.net/blog/kl-approx.html (k3)
        "losses/approx_kl": ((ratio - 1.0) - log_ratio).mean(),
        "losses/clip_frac": (jnp.abs(ratio - 1.0) > hp.clip_eps).mean(),
    }
    return total, aux


def ppo_update(
    train_state: TrainState,
    traj: Transition,
    last_value: jax.Array,
    rng: jax.Array,
    hp: PPOHyper,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """GAE over the (T, N) trajectory, then epochs × minibatches of Adam steps. Returns mean loss metrics."""
    advantages, targets = gae(traj.reward, traj.value, traj.done, last_value, hp.gamma, hp.gae_lambda)
    batch_size = traj.reward.size
    mb_size = batch_size // hp.num_minibatches
    flat = jax.tree.map(lambda x: x.reshape((batch_size,) + x.shape[2:]), (traj, advantages, targets))
    grad_fn = jax.value_and_grad(ppo_loss, has_aux=True)

    def epoch(carry, _):
        ts, rng = carry
        rng, k = jax.random.split(rng)
        perm = jax.random.permutation(k, batch_size)
        mbs = jax.tree.map(
            lambda x: jnp.take(x, perm, axis=0).reshape((hp.num_minibatches, mb_size) + x.shape[1:]), flat
        )

        def minibatch(ts, mb):
            tr, adv, tgt = mb
            (_, aux), grads = grad_fn(ts.params, ts.apply_fn, tr, adv, tgt, hp)
            return ts.apply_gradients(grads=grads), aux

        ts, aux = jax.lax.scan(minibatch, ts, mbs)
        return (ts, rng), aux

    (train_state, _), aux = jax.lax.scan(epoch, (train_state, rng), None, hp.update_epochs)
    return train_state, jax.tree.map(jnp.mean, aux)


def make_optimizer(lr: float, anneal_lr: bool, max_grad_norm: float, num_updates: int, hp: PPOHyper):
    """Adam(eps=1e-5) after global-norm clipping; lr annealed linearly to 0 over `num_updates` updates."""
    steps_per_update = hp.num_minibatches * hp.update_epochs

    def schedule(count):
        frac = 1.0 - (count // steps_per_update) / num_updates
        return lr * frac

    return optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.adam(learning_rate=schedule if anneal_lr else lr, eps=1e-5),
    )


class RunnerState(NamedTuple):
    """Everything a training run carries from one update to the next (what a checkpoint holds)."""

    train_state: TrainState
    rollout: RolloutState
    update: jax.Array  # int32 (), updates done so far


def make_train_chunk(
    env: VecEnv,
    apply_fn: Callable,
    num_steps: int,
    hp: PPOHyper,
    updates_per_chunk: int,
) -> Callable[[RunnerState], tuple[RunnerState, dict[str, jax.Array]]]:
    """`chunk(runner) -> (runner, metrics)`: K × (rollout of num_steps + PPO update) in one scan.

    Metrics: loss means over the K updates; episode sums (`_episodes`, `_return_sum`, `_length_sum`,
    `_achievement_counts`) over all episodes finished in the chunk.
    """
    rollout_fn = make_rollout(env, apply_fn, num_steps)

    def one_update(runner: RunnerState, _: None):
        ts = runner.train_state
        rs, traj, stats = rollout_fn(ts.params, runner.rollout)
        _, last_value = apply_fn(ts.params, rs.obs)
        rng, k = jax.random.split(rs.rng)
        ts, metrics = ppo_update(ts, traj, last_value, k, hp)
        return RunnerState(ts, rs._replace(rng=rng), runner.update + 1), (metrics, stats)

    def chunk(runner: RunnerState):
        runner, (metrics, stats) = jax.lax.scan(one_update, runner, None, updates_per_chunk)
        out = jax.tree.map(jnp.mean, metrics)
        out.update(episode_sums(jax.tree.map(lambda x: x.sum(0), stats)))
        return runner, out

    return chunk


def episode_sums(stats: EpisodeStats) -> dict[str, jax.Array]:
    return {
        "_episodes": stats.count,
        "_return_sum": stats.return_sum,
        "_length_sum": stats.length_sum,
        "_achievement_counts": stats.achievement_counts,
    }


def init_runner_state(
    env: VecEnv, network: Any, tx: optax.GradientTransformation, rng: jax.Array, aux: Any = None,
    sample_input: Any = None,
) -> RunnerState:
    """Fresh parameters, optimizer state and env batch. Pure: `jax.eval_shape` of it gives the checkpoint
    template without running anything."""
    rng, k_net, k_env = jax.random.split(rng, 3)
    obs, env_state = env.reset(k_env)
    params = network.init(k_net, obs[:1] if sample_input is None else sample_input)
    ts = TrainState.create(apply_fn=network.apply, params=params, tx=tx)
    return RunnerState(ts, RolloutState(env_state, obs, aux, rng), jnp.zeros((), jnp.int32))
