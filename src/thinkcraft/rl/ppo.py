"""PPO (clipped surrogate, Schulman et al. 2017) as pure JAX functions, PureJaxRL / Craftax_Baselines style.

Pieces, each usable alone (plain PPO and ppo-hidden share all of them):
* `make_rollout`  — `lax.scan` of env+policy steps, returning the trajectory and episode statistics;
* `ppo_loss`      — clipped policy loss + clipped value loss − entropy bonus (Baselines' exact form);
* `ppo_update`    — GAE, then `update_epochs` × `num_minibatches` Adam steps over a shuffled batch;
* `make_train_chunk` — K × (rollout + update) in one `lax.scan`, the unit the outer loop jits and times.

Feed-forward and recurrent policies share all of them. A recurrent policy (rl.networks.ActorCriticRNN, as
Craftax_Baselines' `ppo_rnn.py`) carries a `Memory` per env in the rollout state: its GRU carry and whether
the next input starts a new episode (the carry restarts from zeros there). Acting is the network's
sequence form at T = 1; the update reruns the whole (T, N) sequence from the memory the rollout started
with, and its minibatches split the envs, keeping each env's sequence whole (`env_minibatches`). The
feed-forward path (memory None) is traced exactly as before the recurrent one existed.
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


class Memory(NamedTuple):
    """A recurrent policy's per-env state between env steps (and across updates)."""

    hidden: jax.Array  # (N, W) GRU carry after the last step
    reset: jax.Array  # (N,) bool: the last step ended an episode, so the next input starts a new one


def initial_memory(num_envs: int, width: int) -> Memory:
    """Zero carry, no reset pending (Baselines: initialize_carry zeros and last_done False)."""
    return Memory(jnp.zeros((num_envs, width), jnp.float32), jnp.zeros((num_envs,), bool))


class RolloutState(NamedTuple):
    env_state: Any
    obs: jax.Array
    aux: Any  # extra per-env policy inputs carried across steps (ppo-hidden: hidden state + age); None for PPO
    rng: jax.Array
    memory: Memory | None = None  # a recurrent policy's memory; None for a feed-forward one


def policy_step(apply_fn: Callable, params: Any, x: Any, memory: Memory | None) -> tuple[Memory | None, Any, jax.Array]:
    """`(memory, pi, value)` of one env step from inputs `x` with leading axis N. Feed-forward (memory None):
    `apply_fn(params, x)`. Recurrent: the sequence form at T = 1 (as Baselines acts); the returned memory
    holds the new carry (its `reset` is set after the env step)."""
    if memory is None:
        pi, value = apply_fn(params, x)
        return None, pi, value
    hidden, pi, value = apply_fn(params, memory.hidden, jax.tree.map(lambda a: a[None], x), memory.reset[None])
    return memory._replace(hidden=hidden), jax.tree.map(lambda a: a[0], pi), value[0]


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
    it when its episode ended, or take the hidden state of the world the env reset into). A recurrent
    policy's memory (`state.memory`) is advanced by the network and reset where `done`.
    """

    def step(carry: tuple[Any, RolloutState], _: None):
        params, rs = carry
        rng, k_act, k_env = jax.random.split(rs.rng, 3)
        x = policy_input(rs.obs, rs.aux)
        memory, pi, value = policy_step(apply_fn, params, x, rs.memory)
        action = pi.sample(seed=k_act)
        log_prob = pi.log_prob(action)
        obs, env_state, reward, done, info = env.step(k_env, rs.env_state, action)
        aux = aux_after_step(rs.aux, done, env_state)
        if memory is not None:
            memory = memory._replace(reset=done)
        tr = Transition(x, action, log_prob, value, reward, done)
        return (params, RolloutState(env_state, obs, aux, rng, memory)), (tr, EpisodeStats.of(info))

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
    axis_name: str | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Craftax_Baselines' loss: clipped value loss (max of clipped/unclipped, ×0.5), clipped surrogate with
    per-minibatch advantage normalisation, entropy bonus. `axis_name` (env shards, rl/shards.py): this
    shard's part of a minibatch; the advantages are normalised with the whole minibatch's mean and std."""
    pi, value = apply_fn(params, batch.obs)
    log_prob = pi.log_prob(batch.action)

    value_clipped = batch.value + (value - batch.value).clip(-hp.clip_eps, hp.clip_eps)
    value_loss = 0.5 * jnp.maximum(jnp.square(value - targets), jnp.square(value_clipped - targets)).mean()

    log_ratio = log_prob - batch.log_prob
    ratio = jnp.exp(log_ratio)
    adv = normalize_advantages(advantages, axis_name)
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


def normalize_advantages(advantages: jax.Array, axis_name: str | None = None) -> jax.Array:
    """(A - mean) / (std + 1e-8) over the minibatch; over all shards' equal parts of it with `axis_name`
    (the population std of the union: the mean of the shards' mean squared deviations from the global mean)."""
    if axis_name is None:
        return (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    mean = jax.lax.pmean(advantages.mean(), axis_name)
    var = jax.lax.pmean(jnp.square(advantages - mean).mean(), axis_name)
    return (advantages - mean) / (jnp.sqrt(var) + 1e-8)


def ppo_update(
    train_state: TrainState,
    traj: Transition,
    last_value: jax.Array,
    rng: jax.Array,
    hp: PPOHyper,
    memory: Memory | None = None,
    axis_name: str | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """GAE over the (T, N) trajectory, then epochs × minibatches of Adam steps. Returns mean loss metrics.

    Feed-forward (memory None): minibatches of (step, env) pairs shuffled over the flattened batch.
    Recurrent: `memory` is the memory the rollout started from; minibatches are whole env sequences
    (`env_minibatches`), rerun from their initial carry with each step's reset flag (Baselines' ppo_rnn).

    `axis_name` (env shards, rl/shards.py): `traj` is this shard's envs; each minibatch takes its equal
    share from every shard, and its gradients (and loss metrics) are averaged over the shards before the
    Adam step, so every shard applies the same update (the parameters stay replicated)."""
    advantages, targets = gae(traj.reward, traj.value, traj.done, last_value, hp.gamma, hp.gae_lambda)
    grad_fn = jax.value_and_grad(ppo_loss, has_aux=True)
    if memory is None:
        batch_size = traj.reward.size
        mb_size = batch_size // hp.num_minibatches
        flat = jax.tree.map(lambda x: x.reshape((batch_size,) + x.shape[2:]), (traj, advantages, targets))

        def split(k):
            perm = jax.random.permutation(k, batch_size)
            return jax.tree.map(
                lambda x: jnp.take(x, perm, axis=0).reshape((hp.num_minibatches, mb_size) + x.shape[1:]), flat
            )

        def loss_inputs(ts, mb):
            return (ts.apply_fn, *mb)
    else:
        seqs = sequence_batch(traj, advantages, targets, memory)

        def split(k):
            return env_minibatches(k, seqs, hp.num_minibatches)

        def loss_inputs(ts, mb):
            tr, adv, tgt, h0 = mb
            return (lambda params, obs: ts.apply_fn(params, h0[0], *obs)[1:]), tr, adv, tgt

    def epoch(carry, _):
        ts, rng = carry
        rng, k = jax.random.split(rng)
        mbs = split(k)

        def minibatch(ts, mb):
            (_, aux), grads = grad_fn(ts.params, *loss_inputs(ts, mb), hp, axis_name)
            if axis_name is not None:  # equal shares: the mean of the shards' means is the minibatch's
                grads, aux = jax.lax.pmean((grads, aux), axis_name)
            return ts.apply_gradients(grads=grads), aux

        ts, aux = jax.lax.scan(minibatch, ts, mbs)
        return (ts, rng), aux

    (train_state, _), aux = jax.lax.scan(epoch, (train_state, rng), None, hp.update_epochs)
    return train_state, jax.tree.map(jnp.mean, aux)


def sequence_batch(traj: Transition, advantages: jax.Array, targets: jax.Array, memory: Memory) -> tuple:
    """A recurrent update's data, every leaf with the env on axis 1: the transitions with `obs` replaced by
    the network's sequence inputs (x, resets), advantages, targets, and the initial carry as (1, N, W).
    The reset flag of step t is the `done` of step t-1 (of the previous rollout's last step for t = 0)."""
    resets = jnp.concatenate([memory.reset[None], traj.done[:-1]], axis=0)
    return traj._replace(obs=(traj.obs, resets)), advantages, targets, memory.hidden[None]


def env_minibatches(rng: jax.Array, data: Any, num_minibatches: int) -> Any:
    """Shuffle the envs (axis 1 of every leaf) and split them into `num_minibatches` groups, each leaf
    (M, T, N / M, ...): every minibatch holds whole sequences, in time order (Baselines' ppo_rnn split)."""
    n = jax.tree.leaves(data)[0].shape[1]
    perm = jax.random.permutation(rng, n)

    def split(x):
        x = jnp.take(x, perm, axis=1)
        return jnp.swapaxes(x.reshape((x.shape[0], num_minibatches, n // num_minibatches) + x.shape[2:]), 0, 1)

    return jax.tree.map(split, data)


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
    axis_name: str | None = None,
) -> Callable[[RunnerState], tuple[RunnerState, dict[str, jax.Array]]]:
    """`chunk(runner) -> (runner, metrics)`: K × (rollout of num_steps + PPO update) in one scan.

    Metrics: loss means over the K updates; episode sums (`_episodes`, `_return_sum`, `_length_sum`,
    `_achievement_counts`) over all episodes finished in the chunk. `axis_name`: one env shard's chunk
    (rl/shards.py; `env` is the shard's envs): the update averages gradients over the shards and the
    metrics are those of all shards.
    """
    rollout_fn = make_rollout(env, apply_fn, num_steps)

    def one_update(runner: RunnerState, _: None):
        ts = runner.train_state
        rs, traj, stats = rollout_fn(ts.params, runner.rollout)
        _, _, last_value = policy_step(apply_fn, ts.params, rs.obs, rs.memory)
        rng, k = jax.random.split(rs.rng)
        ts, metrics = ppo_update(ts, traj, last_value, k, hp, runner.rollout.memory, axis_name)
        return RunnerState(ts, rs._replace(rng=rng), runner.update + 1), (metrics, stats)

    def chunk(runner: RunnerState):
        runner, (metrics, stats) = jax.lax.scan(one_update, runner, None, updates_per_chunk)
        out = jax.tree.map(jnp.mean, metrics)
        stats = jax.tree.map(lambda x: x.sum(0), stats)
        if axis_name is not None:
            stats = jax.lax.psum(stats, axis_name)
        out.update(episode_sums(stats))
        return runner, out

    return chunk


def episode_sums(stats: EpisodeStats) -> dict[str, jax.Array]:
    return {
        "_episodes": stats.count,
        "_return_sum": stats.return_sum,
        "_length_sum": stats.length_sum,
        "_achievement_counts": stats.achievement_counts,
    }


def init_params(network: Any, rng: jax.Array, x: Any, memory: Memory | None = None) -> Any:
    """`network.init` on one env's input `x` (leading axis 1); a recurrent network in its sequence form
    (one step, from `memory`'s first row)."""
    if memory is None:
        return network.init(rng, x)
    return network.init(rng, memory.hidden[:1], jax.tree.map(lambda a: a[None], x), memory.reset[None, :1])


def init_runner_state(
    env: VecEnv, network: Any, tx: optax.GradientTransformation, rng: jax.Array, aux: Any = None,
    sample_input: Any = None, memory: Memory | None = None,
) -> RunnerState:
    """Fresh parameters, optimizer state and env batch; `memory` (a recurrent network's initial memory,
    `initial_memory`) or None. Pure: `jax.eval_shape` of it gives the checkpoint template without running
    anything."""
    rng, k_net, k_env = jax.random.split(rng, 3)
    obs, env_state = env.reset(k_env)
    params = init_params(network, k_net, obs[:1] if sample_input is None else sample_input, memory)
    ts = TrainState.create(apply_fn=network.apply, params=params, tx=tx)
    return RunnerState(ts, RolloutState(env_state, obs, aux, rng, memory), jnp.zeros((), jnp.int32))


RUNNER_AXES = RunnerState(None, 0, None)
"""`over_shards` axes of a RunnerState: the rollout (per env, PRNG key per shard) split, the rest replicated."""


def init_sharded_runner(
    env: VecEnv, network: Any, tx: optax.GradientTransformation, rng: jax.Array, num_shards: int,
    aux: Any = None, sample_input: Any = None, memory: Memory | None = None,
) -> RunnerState:
    """`init_runner_state` for `num_shards` env shards (rl/shards.py): one set of parameters (from the same
    key as a single device's), and per shard its envs (`env` is one shard's) reset with their own key, its
    own rollout key, and `aux` / `memory` (one shard's initial values) repeated: rollout leaves (D, n, ...).
    Pure, like init_runner_state."""
    from thinkcraft.rl.shards import stack_shards

    rng, k_net, k_env = jax.random.split(rng, 3)
    # env resets vmapped over the shards' keys (world generation, no orthogonal init: rl/seeds.py's note)
    obs, env_state = jax.vmap(env.reset)(jax.random.split(k_env, num_shards))
    params = init_params(network, k_net, obs[0, :1] if sample_input is None else sample_input, memory)
    ts = TrainState.create(apply_fn=network.apply, params=params, tx=tx)
    rollout = RolloutState(env_state, obs, stack_shards(aux, num_shards), jax.random.split(rng, num_shards),
                           stack_shards(memory, num_shards))
    return RunnerState(ts, rollout, jnp.zeros((), jnp.int32))
